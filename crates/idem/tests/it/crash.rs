//! `idem serve` killed and restarted, on the SQLite and PostgreSQL stores: completed keys
//! survive `kill -9`; SIGTERM drains a running request and records it; a request whose gateway
//! was killed mid-call is protected by its lease, then taken over as attempt 2. And a store that
//! goes away: `/healthz` fails and requests get 503 until it is back.

use crate::common;

use std::time::{Duration, Instant};

use std::net::SocketAddr;

use common::{
    HttpClient, Process, Seen, calls, client, free_addr, idem, send, start_gateway, start_upstream, try_send,
};
use idempotency_testkit::TcpProxy;

/// A proxy in front of the test server, and the server's URL through it (the same credentials
/// and database, the proxy's address).
async fn postgres_through_a_proxy() -> (TcpProxy, String) {
    TcpProxy::in_front_of(&common::database_url()).await.unwrap()
}

/// A key no other run uses (the PostgreSQL table is shared).
fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{name}-{}-{nanos}", std::process::id())
}

/// One scenario's upstream process, gateway address, client and key.
struct Run {
    _upstream: Process,
    upstream: SocketAddr,
    addr: SocketAddr,
    client: HttpClient,
    key: String,
    store: String,
    args: Vec<String>,
}

impl Run {
    /// A run whose gateways use `store` and `extra` flags.
    fn new(name: &str, store: &str, extra: &[&str]) -> Self {
        let (process, upstream) = start_upstream();
        let mut args: Vec<String> = ["--upstream", &format!("http://{upstream}"), "--store", store]
            .iter()
            .map(|a| (*a).to_owned())
            .collect();
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        Self {
            _upstream: process,
            upstream,
            addr: free_addr(),
            client: client(),
            key: unique(name),
            store: store.to_owned(),
            args,
        }
    }

    /// Starts (or restarts) the gateway.
    async fn gateway(&self) -> Process {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        start_gateway(self.addr, &args, true).await
    }

    async fn post(&self, path: &str) -> Seen {
        send(
            &self.client,
            self.addr,
            "POST",
            path,
            &[("idempotency-key", &self.key)],
            b"pay",
        )
        .await
    }

    /// Sends in the background; `None` if the connection is lost.
    fn post_in_background(&self, path: &'static str) -> tokio::task::JoinHandle<Option<Seen>> {
        let (client, addr, key) = (self.client.clone(), self.addr, self.key.clone());
        tokio::spawn(async move {
            try_send(&client, addr, "POST", path, &[("idempotency-key", &key)], b"pay").await
        })
    }

    async fn upstream_calls(&self) -> u32 {
        calls(&self.client, self.upstream, &self.key).await
    }
}

/// A completed key survives `kill -9` and a restart: the retry replays.
async fn completed_keys_survive_kill_9(store: &str) {
    let run = Run::new("done", store, &[]);
    let mut gateway = run.gateway().await;
    let first = run.post("/echo").await;
    assert_eq!(first.status, 201);
    gateway.kill9();
    let _gateway = run.gateway().await;
    let replay = run.post("/echo").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, first.body);
    assert_eq!(run.upstream_calls().await, 1);
}

/// SIGTERM during a slow (3 s) upstream call: the gateway stops accepting, lets the call finish,
/// records it and exits; after a restart the retry replays, and the upstream ran once.
async fn sigterm_drains_and_records(store: &str) {
    let run = Run::new("drain", store, &[]);
    let mut gateway = run.gateway().await;
    let running = run.post_in_background("/slow?ms=3000");
    // A second client gives up after 200 ms: its request goes on without it.
    let abandoned = unique("abandoned");
    let gone = {
        let (client, addr, key) = (run.client.clone(), run.addr, abandoned.clone());
        tokio::spawn(async move {
            tokio::time::timeout(
                Duration::from_millis(200),
                try_send(
                    &client,
                    addr,
                    "POST",
                    "/slow?ms=3000",
                    &[("idempotency-key", &key)],
                    b"pay",
                ),
            )
            .await
        })
    };
    assert!(gone.await.unwrap().is_err(), "the second client gave up");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let status = tokio::task::spawn_blocking(move || {
        let status = gateway.terminate(Duration::from_secs(15));
        (status, gateway)
    });
    // It stops accepting new connections while the running request is still in progress.
    let deadline = Instant::now() + Duration::from_secs(2);
    while tokio::net::TcpStream::connect(run.addr).await.is_ok() {
        assert!(
            Instant::now() < deadline,
            "the gateway kept accepting after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !running.is_finished(),
        "the running request must still be in progress"
    );
    let first = running
        .await
        .unwrap()
        .expect("the in-flight request got its response");
    assert_eq!(
        first.status, 201,
        "the in-flight request finished during the drain"
    );
    let (status, _gateway) = status.await.unwrap();
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "the gateway exits cleanly after draining"
    );
    let _gateway = run.gateway().await;
    let replay = run.post("/slow?ms=3000").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, first.body);
    assert_eq!(run.upstream_calls().await, 1);
    // The abandoned request was recorded before the exit too: its retry replays.
    let retry = send(
        &run.client,
        run.addr,
        "POST",
        "/slow?ms=3000",
        &[("idempotency-key", &abandoned)],
        b"pay",
    )
    .await;
    assert_eq!(
        retry.header("idempotent-replayed"),
        Some("true"),
        "the abandoned request was not recorded"
    );
    assert_eq!(calls(&run.client, run.upstream, &abandoned).await, 1);
}

/// `kill -9` mid-call: a retry inside the lease gets 409; once the lease has run out, a retry
/// takes over, and the upstream sees `Idempotency-Attempt: 2`.
async fn kill_9_mid_call_then_takeover(store: &str) {
    let run = Run::new("takeover", store, &["--lease", "8s"]);
    let mut gateway = run.gateway().await;
    let doomed = run.post_in_background("/slow?ms=600");
    // Killed once the upstream has the call (a fixed sleep raced a loaded machine: the gateway
    // could die before forwarding it).
    let deadline = Instant::now() + Duration::from_secs(10);
    while run.upstream_calls().await == 0 {
        assert!(Instant::now() < deadline, "the upstream never got the first call");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    gateway.kill9();
    assert!(doomed.await.unwrap().is_none(), "the client lost its connection");
    let _gateway = run.gateway().await;
    // The killed attempt's record is in flight with its lease still running...
    let (code, record, err) = idem(&["keys", "get", &run.key, "--store", &run.store, "--json"]);
    assert_eq!(code, 0, "{err}");
    let record: serde_json::Value = serde_json::from_str(&record).unwrap();
    assert_eq!(record["state"], "in_flight", "{record}");
    assert_eq!(record["lease_expired"], false, "{record}");
    // ...so a retry gets 409: the first attempt may still be running.
    let retry = run.post("/slow?ms=600").await;
    assert_eq!(retry.status, 409);
    let deadline = Instant::now() + Duration::from_secs(20);
    let taken_over = loop {
        let seen = run.post("/slow?ms=600").await;
        if seen.status != 409 || Instant::now() > deadline {
            break seen;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(taken_over.status, 201);
    assert_eq!(taken_over.json()["attempt"], "2");
    // The killed attempt's upstream call started (the gateway died, not the upstream), and so
    // did the takeover's: the upstream can tell them apart by the attempt number.
    assert_eq!(run.upstream_calls().await, 2);
    let replay = run.post("/slow?ms=600").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_completed_keys_survive_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    completed_keys_survive_kill_9(&common::sqlite_url(dir.path())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_sigterm_drains_and_records() {
    let dir = tempfile::tempdir().unwrap();
    sigterm_drains_and_records(&common::sqlite_url(dir.path())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_kill_9_mid_call_then_takeover() {
    let dir = tempfile::tempdir().unwrap();
    kill_9_mid_call_then_takeover(&common::sqlite_url(dir.path())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_completed_keys_survive_kill_9() {
    completed_keys_survive_kill_9(&common::database_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sigterm_drains_and_records() {
    sigterm_drains_and_records(&common::database_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_kill_9_mid_call_then_takeover() {
    kill_9_mid_call_then_takeover(&common::database_url()).await;
}

fn mysql_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_completed_keys_survive_kill_9() {
    completed_keys_survive_kill_9(&mysql_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_sigterm_drains_and_records() {
    sigterm_drains_and_records(&mysql_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_kill_9_mid_call_then_takeover() {
    kill_9_mid_call_then_takeover(&mysql_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_store_fails_health_and_requests_then_recovers() {
    let (proxy, url) = postgres_through_a_proxy().await;
    // A password given as a query parameter (sqlx takes it; the server here trusts anyway) must
    // appear in no health answer.
    let then = if url.contains('?') { '&' } else { '?' };
    let store = format!("{url}{then}password=hunter2-in-the-query");
    let no_secret = |body: &[u8]| {
        let text = String::from_utf8_lossy(body);
        assert!(!text.contains("hunter2"), "the store's password leaked: {text}");
    };

    let run = Run::new("outage", &store, &[]);
    let _gateway = run.gateway().await;
    let (client, addr) = (&run.client, run.addr);

    proxy.set_down(true);
    proxy.cut();
    let health = send(client, addr, "GET", "/_idem/healthz", &[], b"").await;
    assert_eq!(health.status, 503);
    assert_eq!(health.json()["type"], "urn:idempotency:problem:store-unavailable");
    no_secret(&health.body);
    let refused = run.post("/echo").await;
    assert_eq!(refused.status, 503, "fail closed: {:?}", refused.json());
    assert!(refused.header("retry-after").is_some());
    assert_eq!(
        run.upstream_calls().await,
        0,
        "nothing ran while the store was away"
    );

    proxy.set_down(false);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let health = send(client, addr, "GET", "/_idem/healthz", &[], b"").await;
        no_secret(&health.body);
        if health.status == 200 {
            assert_eq!(health.json()["store"], "postgres");
            break;
        }
        assert!(Instant::now() < deadline, "the gateway did not recover");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut accepted = run.post("/echo").await;
    // A pooled connection that died in the cut may fail one more request before it is replaced.
    if accepted.status == 503 {
        accepted = run.post("/echo").await;
    }
    assert_eq!(accepted.status, 201);
    assert_eq!(run.upstream_calls().await, 1);
}

/// The heartbeat storm: PostgreSQL 80 ms away (a round trip through the latency proxy), two
/// gateway processes with `--lease 2s`, a 6 s upstream, and 256 clients (8 on each of 32 keys)
/// that retry 50 ms after every 409 or 503. The retries' `begin` calls must not starve the
/// running requests' heartbeats: every key runs exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_storm_on_a_distant_store_runs_each_key_once() {
    let (proxy, store) = postgres_through_a_proxy().await;
    proxy.set_latency(Duration::from_millis(40));

    let run = Run::new("storm", &store, &["--lease", "2s"]);
    let _a = run.gateway().await;
    let b = free_addr();
    let args: Vec<&str> = run.args.iter().map(String::as_str).collect();
    let _b = start_gateway(b, &args, true).await;

    let keys: Vec<String> = (0..32).map(|n| format!("{}-{n}", run.key)).collect();
    let clients: Vec<_> = (0..256)
        .map(|n| {
            let (client, key) = (run.client.clone(), keys[n % keys.len()].clone());
            let addr = if n % 2 == 0 { run.addr } else { b };
            tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(120);
                let mut answers = std::collections::BTreeMap::<u16, u32>::new();
                loop {
                    assert!(
                        Instant::now() < deadline,
                        "{key}: no answer after 120 s: {answers:?}"
                    );
                    let seen = try_send(
                        &client,
                        addr,
                        "POST",
                        "/slow?ms=6000",
                        &[("idempotency-key", &key)],
                        b"pay",
                    )
                    .await;
                    match seen {
                        Some(seen) if seen.status == 201 => return answers,
                        Some(seen) => *answers.entry(seen.status).or_default() += 1,
                        None => *answers.entry(0).or_default() += 1,
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        })
        .collect();
    let mut refused = std::collections::BTreeMap::<u16, u32>::new();
    for client in clients {
        for (status, n) in client.await.unwrap() {
            *refused.entry(status).or_default() += n;
        }
    }
    let mut runs = Vec::new();
    for key in &keys {
        runs.push(calls(&run.client, run.upstream, key).await);
    }
    assert!(
        runs.iter().all(|&n| n == 1),
        "runs per key: {runs:?}; answers before the 201s: {refused:?}"
    );
}

/// `idem serve --retention 2s --purge-every 1s`: expired records disappear from the store with
/// no CLI involved, and the purge never takes a live one: 16 concurrent copies of each of 8
/// slow requests, racing while the purge runs, run each key once.
async fn expired_records_are_purged_by_the_gateway(store: &str) {
    let tenant = unique("purge-tenant");
    let run = Run::new(
        "purge",
        store,
        &[
            "--retention",
            "2s",
            "--purge-every",
            "1s",
            "--scope-header",
            "x-tenant",
        ],
    );
    let _gateway = run.gateway().await;
    let keys: Vec<String> = (0..8).map(|n| format!("{}-{n}", run.key)).collect();
    let racers: Vec<_> = keys
        .iter()
        .flat_map(|key| std::iter::repeat_n(key.clone(), 16))
        .map(|key| {
            let (client, addr, tenant) = (run.client.clone(), run.addr, tenant.clone());
            tokio::spawn(async move {
                let headers = [("idempotency-key", key.as_str()), ("x-tenant", tenant.as_str())];
                send(&client, addr, "POST", "/slow?ms=1200", &headers, b"pay").await
            })
        })
        .collect();
    let mut forwarded = std::collections::BTreeSet::new();
    for racer in racers {
        let seen = racer.await.unwrap();
        assert!(matches!(seen.status, 201 | 409), "{seen:?}");
        if seen.status == 201 {
            forwarded.insert(seen.json()["key"].as_str().unwrap().to_owned());
        }
    }
    assert_eq!(forwarded.len(), keys.len(), "{forwarded:?}");
    for key in &forwarded {
        assert_eq!(calls(&run.client, run.upstream, key).await, 1, "{key}");
    }
    let scope = forwarded.first().unwrap().split_once(':').unwrap().0.to_owned();

    // Two seconds after completion the records expire; the next purge deletes them. (Whether
    // they are still there when first looked at depends on how fast the machine is: the 201s
    // above are what shows they were recorded, and this gateway's purger counts what it
    // deleted, which on SQLite's file of the test's own is these eight and nothing else.)
    common::metric_at_least(run.addr, "idempotency_purged_total", &[], 8.0).await;
    let stats = || {
        let (code, out, err) = idem(&[
            "keys", "stats", "--scope", &scope, "--store", &run.store, "--json",
        ]);
        assert_eq!(code, 0, "{err}");
        let stats: serde_json::Value = serde_json::from_str(&out).unwrap();
        ["completed", "in_flight", "expired"].map(|field| stats[field].as_u64().unwrap())
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut left = stats();
    while left != [0, 0, 0] && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        left = stats();
    }
    assert_eq!(left, [0, 0, 0], "completed, in flight, expired rows left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_expired_records_are_purged_by_the_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::sqlite_url(dir.path());
    expired_records_are_purged_by_the_gateway(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_expired_records_are_purged_by_the_gateway() {
    expired_records_are_purged_by_the_gateway(&common::database_url()).await;
}

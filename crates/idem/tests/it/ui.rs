//! The dashboard (`--ui`) in a real browser: headless Chromium driven over WebDriver
//! (chromedriver), against `idem serve` and `idem consume` as processes of their own. Each page
//! is saved as a screenshot under `IDEM_UI_SCREENSHOTS` (default: this test's target
//! directory); `docs/images/ui-*.png` are those files.
//!
//! Needs Debian's `chromium` and `chromium-driver` (`scripts/services browser` installs them);
//! `CHROMIUM` and `CHROMEDRIVER` name other binaries. Without them the tests fail.

use crate::common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::Process;
use common::consume::{Ledger, count_at_least, start_handler, until};
use fantoccini::{Client, ClientBuilder, Locator};
use idempotency::Key;
use idempotency::postgres::sqlx::{self, AssertSqlSafe};

const TOKEN: &str = "ui-test-token-0123456789abcdef";

/// chromedriver on a port of its own, and a headless Chromium session through it.
struct Browser {
    client: Client,
    _driver: Process,
}

impl Browser {
    async fn start() -> Self {
        let driver_path = std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "/usr/bin/chromedriver".into());
        let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
        let port = common::free_addr().port();
        let driver = Process {
            child: Command::new(&driver_path)
                .arg(format!("--port={port}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!("{driver_path}: {e}; the browser tests need Debian's chromium-driver (scripts/services browser)")
                }),
        };
        let url = format!("http://127.0.0.1:{port}");
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,900"],
            }),
        );
        let mut last = None;
        for _ in 0..200 {
            match ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
                .capabilities(capabilities.clone())
                .connect(&url)
                .await
            {
                Ok(client) => {
                    return Self {
                        client,
                        _driver: driver,
                    };
                }
                Err(error) => last = Some(error),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("no WebDriver session through {driver_path} with {chromium}: {last:?}");
    }

    async fn goto(&self, url: &str) {
        self.client.goto(url).await.unwrap();
    }

    /// The element `css` finds, waiting up to 20 s for it (a click on a submit button returns
    /// before the next page has loaded); panics with the page's source when there is none.
    async fn find(&self, css: &str) -> fantoccini::elements::Element {
        let found = self
            .client
            .wait()
            .at_most(Duration::from_secs(20))
            .for_element(Locator::Css(css))
            .await;
        match found {
            Ok(element) => element,
            Err(e) => panic!("`{css}` on the page: {e}\n{}", self.source().await),
        }
    }

    async fn text(&self, css: &str) -> String {
        self.find(css).await.text().await.unwrap()
    }

    async fn has(&self, css: &str) -> bool {
        !self.client.find_all(Locator::Css(css)).await.unwrap().is_empty()
    }

    async fn click(&self, css: &str) {
        self.find(css).await.click().await.unwrap();
    }

    async fn source(&self) -> String {
        self.client.source().await.unwrap_or_default()
    }

    async fn title(&self) -> String {
        self.client.title().await.unwrap()
    }

    /// Saves the page as `ui-NAME.png`.
    async fn screenshot(&self, name: &str) {
        let dir = std::env::var_os("IDEM_UI_SCREENSHOTS").map_or_else(
            || PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ui-screenshots"),
            PathBuf::from,
        );
        std::fs::create_dir_all(&dir).unwrap();
        let png = self.client.screenshot().await.unwrap();
        assert!(png.starts_with(b"\x89PNG"), "a PNG");
        std::fs::write(dir.join(format!("ui-{name}.png")), png).unwrap();
    }

    async fn close(self) {
        self.client.close().await.unwrap();
    }
}

/// The gateway's dashboard: the login (a wrong token gets no page), the overview after a
/// client storm, a key stuck in flight by an upstream killed mid-request, released from the In
/// flight page so that the next retry runs as attempt 2 at the restarted upstream, the key
/// lookup, and the refusals: no CSRF token, a wrong bearer token, no session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_dashboard_shows_the_storm_and_releases_a_stuck_key() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let (mut upstream, upstream_addr) = common::start_upstream();
    let store = common::sqlite_url(dir.path());
    let addrs = common::free_addrs(2);
    let (listen, admin) = (addrs[0], addrs[1]);
    let (database, schema) = boxes_with_dead_rows().await;
    let gateway = common::spawn_idem(
        &[
            "serve",
            "--ui-database",
            &database,
            "--ui-schema",
            &schema,
            "--listen",
            &listen.to_string(),
            "--admin-listen",
            &admin.to_string(),
            "--upstream",
            &format!("http://{upstream_addr}"),
            "--store",
            &store,
            "--lease",
            "10m",
            "--ui",
        ],
        &[("IDEM_ADMIN_TOKEN_FILE", token_file.display().to_string())],
        "warn",
        false,
    );
    let _gateway = common::ready_on(gateway, admin, "/healthz", "idem serve --ui").await;
    let client = common::client();

    // A storm: 12 copies of one request at once (one runs, the rest are refused as in flight),
    // then 8 retries after it completed (replayed).
    let storm = Key::generate().to_string();
    let copies: Vec<_> = (0..12)
        .map(|_| {
            let (client, storm) = (client.clone(), storm.clone());
            tokio::spawn(async move {
                let headers = [("idempotency-key", storm.as_str())];
                let seen = common::send(&client, listen, "POST", "/slow?ms=1500", &headers, b"{}").await;
                (seen.status, seen.header("idempotent-replayed").is_some())
            })
        })
        .collect();
    let mut answers = Vec::new();
    for copy in copies {
        answers.push(copy.await.unwrap());
    }
    // One copy runs; those that arrive while it runs are refused as in flight (the slow
    // upstream keeps it running for 1.5 s), any later one is replayed.
    let executed = answers.iter().filter(|a| **a == (201, false)).count();
    let conflicts = answers.iter().filter(|a| a.0 == 409).count();
    let replayed = answers.iter().filter(|a| **a == (201, true)).count();
    assert_eq!((executed, conflicts + replayed), (1, 11), "{answers:?}");
    assert!(conflicts > 0, "{answers:?}");
    for _ in 0..8 {
        let headers = [("idempotency-key", storm.as_str())];
        let seen = common::send(&client, listen, "POST", "/slow?ms=1500", &headers, b"{}").await;
        assert_eq!(seen.header("idempotent-replayed"), Some("true"));
    }

    // A key stuck in flight: its upstream is killed while the request runs.
    let stuck = format!("stuck-{}", Key::generate());
    let running = {
        let (client, stuck) = (client.clone(), stuck.clone());
        tokio::spawn(async move {
            let headers = [("idempotency-key", stuck.as_str()), ("x-delay-ms", "600000")];
            common::send(&client, listen, "POST", "/slow?ms=10", &headers, b"{}")
                .await
                .status
        })
    };
    idempotency_testkit::eventually(
        Duration::from_secs(30),
        "the upstream got the request",
        async || common::calls(&client, upstream_addr, &stuck).await == 1,
    )
    .await;
    upstream.kill9();
    let lost = running.await.unwrap();
    assert_eq!(lost, 502, "the answer was lost");
    let retry_headers = [("idempotency-key", stuck.as_str())];
    let (_upstream, _) = common::start_upstream_at(Some(upstream_addr));
    let before = common::send(&client, listen, "POST", "/slow?ms=10", &retry_headers, b"{}").await;
    assert_eq!(
        before.status, 409,
        "the key stays in flight: its outcome is unknown"
    );

    let browser = Browser::start().await;
    let base = format!("http://{admin}");

    // No session: the login form. A wrong token gets no page.
    browser.goto(&format!("{base}/ui")).await;
    assert!(browser.has("#token").await, "{}", browser.source().await);
    browser.screenshot("login").await;
    let field = browser.find("#token").await;
    field.send_keys("not-the-token-at-all").await.unwrap();
    browser.click("#login").await;
    assert_eq!(browser.text("#error").await, "That is not the admin token.");
    assert!(!browser.has("#decisions").await);
    browser.goto(&format!("{base}/ui/inflight")).await;
    assert!(browser.has("#token").await, "still no page");

    // The right token: the overview counts the storm.
    let field = browser.find("#token").await;
    field.send_keys(TOKEN).await.unwrap();
    browser.click("#login").await;
    browser.find("#decisions").await;
    assert_eq!(browser.title().await, "Overview · idem serve");
    let count = |decision: &'static str| {
        let browser = &browser;
        async move {
            browser
                .text(&format!("tr[data-decision='{decision}'] td.count"))
                .await
                .parse::<u64>()
                .unwrap()
        }
    };
    assert_eq!(count("replayed").await, 8 + replayed as u64);
    // The storm's conflicts and the stuck key's retry.
    assert_eq!(count("in flight (409)").await, conflicts as u64 + 1);
    assert!(count("executed").await >= 2);
    assert!(
        browser
            .text("#store-health")
            .await
            .starts_with("The store answers")
    );
    assert!(browser.has("figure.chart svg").await);
    browser.screenshot("overview").await;

    // In flight: the stuck key, attempt 1.
    browser.goto(&format!("{base}/ui/inflight?older_than=0s")).await;
    let row = format!("tr[data-key='{stuck}']");
    assert_eq!(browser.text(&format!("{row} td.num")).await, "1");
    browser.screenshot("inflight").await;

    // A POST without its CSRF token changes nothing.
    browser
        .client
        .execute(
            "document.querySelectorAll(\"input[name='csrf']\").forEach(e => e.remove());",
            vec![],
        )
        .await
        .unwrap();
    browser.click(&format!("{row} button.release")).await;
    assert!(
        browser.text("#refused").await.contains("CSRF token"),
        "{}",
        browser.source().await
    );
    browser.goto(&format!("{base}/ui/inflight?older_than=0s")).await;
    assert!(browser.has(&row).await, "nothing was released");

    // Release, confirmed: the next retry runs as attempt 2.
    browser.click(&format!("{row} button.release")).await;
    assert!(browser.text("#question").await.contains("attempt 1"));
    browser.screenshot("release-confirm").await;
    browser.click("#confirm").await;
    let done = browser.text("#message").await;
    assert!(
        done.starts_with(&format!("released key {stuck}: attempt 1's lease ended")),
        "{done}"
    );
    let retry = common::send(&client, listen, "POST", "/slow?ms=10", &retry_headers, b"{}").await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.json()["attempt"], "2", "the upstream saw attempt 2");
    assert_eq!(retry.json()["calls"], 1, "the restarted upstream ran it once");

    // Key lookup: the stored response.
    browser.goto(&format!("{base}/ui/key?key={stuck}")).await;
    assert_eq!(browser.text("#status").await, "HTTP 201");
    assert!(browser.text("#body").await.contains("\"attempt\":\"2\""));
    browser.screenshot("key").await;

    // Inbox / outbox: the counts, and the dead inbox row replayed.
    browser.goto(&format!("{base}/ui/boxes")).await;
    assert_eq!(browser.text("#outbox td.pending").await, "1");
    assert_eq!(browser.text("#outbox td.dead").await, "1");
    assert_eq!(browser.text("#inbox td.pending").await, "0");
    assert_eq!(browser.text("#inbox td.dead").await, "1");
    browser.screenshot("boxes").await;
    browser.click("#replay-inbox").await;
    assert!(
        browser
            .text("#question")
            .await
            .contains(&format!("{schema}.idempotency_inbox"))
    );
    browser.click("#confirm").await;
    assert_eq!(
        browser.text("#message").await,
        "1 dead message(s) back to pending"
    );
    browser.goto(&format!("{base}/ui/boxes")).await;
    assert_eq!(browser.text("#inbox td.pending").await, "1");
    assert_eq!(browser.text("#inbox td.dead").await, "0");
    let pool = sqlx::PgPool::connect(&database).await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&pool)
        .await
        .unwrap();

    // Outside the browser: a wrong bearer token and a POST without a session are refused.
    let wrong = [("authorization", "Bearer wrong-token-0123456789")];
    let seen = common::send(&client, admin, "GET", "/ui", &wrong, b"").await;
    assert_eq!(seen.status, 401);
    assert!(!String::from_utf8_lossy(&seen.body).contains("decisions"));
    let right = format!("Bearer {TOKEN}");
    let seen = common::send(
        &client,
        admin,
        "GET",
        "/ui",
        &[("authorization", right.as_str())],
        b"",
    )
    .await;
    assert_eq!(seen.status, 200);
    // With a trailing slash, the same page by a redirect.
    let slash = common::send(&client, admin, "GET", "/ui/", &[], b"").await;
    assert_eq!(slash.status, 308);
    assert_eq!(slash.header("location"), Some("/ui"));
    let form = [
        ("authorization", right.as_str()),
        ("content-type", "application/x-www-form-urlencoded"),
    ];
    let body = format!("key={stuck}&scope=&confirm=yes");
    let seen = common::send(
        &client,
        admin,
        "POST",
        "/ui/inflight/release",
        &form,
        body.as_bytes(),
    )
    .await;
    assert_eq!(seen.status, 403, "no CSRF token");
    let anonymous = [("content-type", "application/x-www-form-urlencoded")];
    let seen = common::send(
        &client,
        admin,
        "POST",
        "/ui/inflight/release",
        &anonymous,
        body.as_bytes(),
    )
    .await;
    assert_eq!(seen.status, 401, "no session");
    browser.close().await;
}

/// An inbox and an outbox in a schema of the test's own: one pending and one dead outbox row,
/// one dead inbox row. Returns the database's URL and the schema.
async fn boxes_with_dead_rows() -> (String, String) {
    let database = common::database_url();
    let schema = format!("idem_ui_{}", Key::generate().as_str().replace('-', "_"));
    let (code, out, err) = common::idem(&["inbox", "migrate", "--database", &database, "--schema", &schema]);
    assert_eq!(code, 0, "{out}{err}");
    let pool = sqlx::PgPool::connect(&database)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {database} is needed for this test: {e}"));
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {schema}.idempotency_outbox (destination, ordering_key, payload) VALUES ('amqp://events', 'order-1', '\\x7b7d');
         INSERT INTO {schema}.idempotency_outbox (destination, ordering_key, payload, attempts, last_error, dead_at)
             VALUES ('amqp://events', 'order-2', '\\x7b7d', 10, 'no route', now());
         INSERT INTO {schema}.idempotency_inbox (consumer, key, fingerprint, payload, state, attempts, last_error, finished_at)
             VALUES ('billing', 'invoice-7', 'f', '\\x7b7d', 'dead', 5, 'the tax service answered 503', now());"
    )))
    .execute(&pool)
    .await
    .unwrap();
    (database, schema)
}

/// A RabbitMQ queue of the test's own, declared as `idem consume` declares it.
async fn rabbit_queue() -> (lapin::Connection, lapin::Channel, String) {
    let url = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let connection = lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("RabbitMQ at {url} is needed for this test: {e}"));
    let channel = connection.create_channel().await.unwrap();
    let queue = format!("idem-ui-{}", Key::generate());
    idempotency_amqp::Topology::for_queue(&queue)
        .declare(&channel)
        .await
        .unwrap();
    (connection, channel, format!("{url}?queue={queue}"))
}

/// `idem consume`'s dashboard, on loopback without a token: a dead-lettered message appears
/// under its reason, and Replay (confirmed) makes it run once more, successfully.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumers_dashboard_replays_a_dead_letter() {
    let (_connection, channel, from) = rabbit_queue().await;
    let queue = from.rsplit("queue=").next().unwrap().to_owned();
    let ledger = Ledger::default();
    let key = format!("order-{}", Key::generate());
    ledger.script(&key, vec![(422, "card expired")]);
    let handler = start_handler(ledger.clone()).await;
    let admin = common::free_addr();
    let consumer = common::spawn_idem(
        &[
            "consume",
            "--from",
            &from,
            "--to",
            &format!("http://{handler}/messages"),
            "--admin-listen",
            &admin.to_string(),
            "--store",
            "memory://",
            "--ui",
        ],
        &[],
        "warn",
        false,
    );
    let _consumer = common::ready(consumer, admin, "idem consume --ui").await;
    idempotency_amqp::publish(&channel, "", &queue, &Key::new(&key).unwrap(), b"{\"amount\": 5}")
        .await
        .unwrap();
    count_at_least(admin, "dead_lettered", 1.0).await;

    let browser = Browser::start().await;
    let base = format!("http://{admin}");
    // No token on loopback: no login.
    browser.goto(&format!("{base}/ui")).await;
    assert_eq!(browser.title().await, "Overview · idem consume");
    assert_eq!(
        browser.text("tr[data-decision='dead-lettered'] td.count").await,
        "1"
    );
    browser.goto(&format!("{base}/ui/dead-letters")).await;
    let row = "#reasons tbody tr";
    idempotency_testkit::eventually(Duration::from_secs(30), "the dead letter listed", async || {
        browser.goto(&format!("{base}/ui/dead-letters")).await;
        browser.has(row).await
    })
    .await;
    let reason = browser.text(&format!("{row} td.reason")).await;
    assert!(
        reason.contains("422") && reason.contains("card expired"),
        "{reason}"
    );
    assert_eq!(browser.text(&format!("{row} td.num")).await, "1");
    browser.screenshot("dead-letters").await;
    browser.click(&format!("{row} button.replay")).await;
    let question = browser.text("#question").await;
    assert!(question.starts_with("Replay the 1 dead letter(s)"), "{question}");
    browser.click("#confirm").await;
    let done = browser.text("#message").await;
    assert!(done.ends_with("replayed 1 dead letters"), "{done}");
    until("the replayed message ran", || ledger.calls(&key).len() == 2).await;
    assert_eq!(ledger.calls(&key), vec![1, 2], "it ran once more");
    count_at_least(admin, "executed", 1.0).await;
    browser.goto(&format!("{base}/ui/dead-letters")).await;
    assert!(browser.text("#summary").await.contains(": 0 dead letter(s)"));
    browser.close().await;
}

/// The CSRF token of the first form on `html`.
fn csrf_of(html: &str) -> String {
    let field = "name=\"csrf\" value=\"";
    let at = html.find(field).expect("a form with a CSRF token") + field.len();
    html[at..].split('"').next().unwrap().to_owned()
}

/// A gateway whose store role may only read: the dashboard shows the stuck key, and Release is
/// refused with the server's reason on the page; the record stays as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_store_role_is_refused_on_the_page() {
    use idempotency::{BeginRequest, Claim, Fingerprint, Scope};

    let url = common::database_url();
    let store = idempotency::open(&url).await.unwrap();
    let key = format!("read-only-{}", Key::generate());
    let request = BeginRequest::new(
        Scope::global(),
        Key::new(&key).unwrap(),
        Fingerprint::of_bytes(b"{}"),
    )
    .lease(Duration::from_secs(600));
    assert!(matches!(store.begin(&request).await.unwrap(), Claim::Acquired(_)));
    let before = store
        .get(&Scope::global(), &Key::new(&key).unwrap())
        .await
        .unwrap();

    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let reader = common::ReadOnlyRole::create(&pool, &url, "ui_reader").await;
    let addrs = common::free_addrs(2);
    let gateway = common::spawn_idem(
        &[
            "serve",
            "--listen",
            &addrs[0].to_string(),
            "--admin-listen",
            &addrs[1].to_string(),
            "--upstream",
            "http://127.0.0.1:9",
            "--store",
            &reader.url,
            "--no-migrate",
            "--purge-every",
            "off",
            "--ui",
        ],
        &[("IDEM_ADMIN_TOKEN", TOKEN.to_owned())],
        "warn",
        false,
    );
    let gateway = common::ready_on(gateway, addrs[1], "/healthz", "idem serve --ui, read-only").await;
    let client = common::client();
    let bearer = format!("Bearer {TOKEN}");
    let page = common::send(
        &client,
        addrs[1],
        "GET",
        "/ui/inflight?older_than=0s",
        &[("authorization", bearer.as_str())],
        b"",
    )
    .await;
    let html = String::from_utf8_lossy(&page.body).into_owned();
    assert!(html.contains(&key), "the key is listed: {html}");
    let form = [
        ("authorization", bearer.as_str()),
        ("content-type", "application/x-www-form-urlencoded"),
    ];
    let body = format!("csrf={}&scope=&key={key}&confirm=yes", csrf_of(&html));
    let refused = common::send(
        &client,
        addrs[1],
        "POST",
        "/ui/inflight/release",
        &form,
        body.as_bytes(),
    )
    .await;
    drop(gateway);
    reader.drop(&pool).await;

    let text = String::from_utf8_lossy(&refused.body);
    assert_eq!(refused.status, 409, "{text}");
    assert!(
        text.contains("The store refused the change, so nothing was changed"),
        "{text}"
    );
    assert!(text.contains("permission denied"), "the server's reason: {text}");
    let after = store
        .get(&Scope::global(), &Key::new(&key).unwrap())
        .await
        .unwrap();
    assert_eq!(after, before, "the record is unchanged");
}

/// The dashboard's settings are checked before anything starts.
#[test]
fn the_dashboard_refuses_to_start_unprotected_or_without_its_listener() {
    let cases: [(&[&str], &str); 4] = [
        (&["--ui"], "--ui needs --admin-listen"),
        (
            &["--ui", "--admin-listen", "0.0.0.0:0"],
            "without --admin-token (or IDEM_ADMIN_TOKEN_FILE) the dashboard listens on a loopback address only",
        ),
        (
            &["--ui", "--admin-listen", "127.0.0.1:0", "--admin-token", "short"],
            "at least 16 are needed",
        ),
        (
            &[
                "--ui",
                "--admin-listen",
                "127.0.0.1:0",
                "--admin-token",
                "has a space in it!",
            ],
            "may not hold spaces",
        ),
    ];
    for (flags, says) in cases {
        let mut args = vec![
            "serve",
            "--upstream",
            "http://127.0.0.1:9",
            "--store",
            "memory://",
        ];
        args.extend_from_slice(flags);
        let (code, out, err) = common::idem(&args);
        assert_ne!(code, 0, "{flags:?}: {out}");
        assert!(err.contains(says), "{flags:?}: {err}");
        assert!(
            !err.contains("has a space in it") && !err.contains("short\n"),
            "the token is not echoed: {err}"
        );
    }
}

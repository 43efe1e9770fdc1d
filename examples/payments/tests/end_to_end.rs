//! The payments example end to end, against the real PostgreSQL and RabbitMQ: a client retry
//! storm on the API (concurrent duplicates, retries, clients that give up, two tenants with the
//! same keys), broker redeliveries (a worker's connection cut with deliveries in flight, a
//! gateway that times out after charging, a replay of already-processed messages) — and the
//! charges table ends with exactly one row per payment.

#[path = "../../../crates/idempotency-postgres/tests/it/common/mod.rs"]
mod common;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idempotency_amqp::{Topology, Worker};
use idempotency_core::Key;
use idempotency_postgres::sqlx::{self, AssertSqlSafe};
use idempotency_testkit::TcpProxy;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};
use payments_example::{Charger, Gateway, Payment, Publisher};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

const TENANTS: [&str; 2] = ["Bearer alice", "Bearer bob"];
const KEYS_PER_TENANT: usize = 20;

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The same URL with its host and port replaced by `addr`.
fn through(url: &str, addr: SocketAddr) -> String {
    let (head, rest) = url.split_once("://").unwrap();
    let (credentials, rest) = rest.rsplit_once('@').unwrap_or(("", rest));
    let (_, vhost) = rest.split_once('/').unwrap_or((rest, ""));
    let at = if credentials.is_empty() { "" } else { "@" };
    format!("{head}://{credentials}{at}{addr}/{vhost}")
}

async fn broker_addr(url: &str) -> SocketAddr {
    let rest = url.split_once("://").unwrap().1;
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let authority = rest.split_once('/').map_or(rest, |(a, _)| a);
    tokio::net::lookup_host(authority).await.unwrap().next().unwrap()
}

async fn ready(channel: &Channel, queue: &str) -> u32 {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .unwrap()
        .message_count()
}

struct Response {
    status: u16,
    replayed: bool,
    json: serde_json::Value,
}

async fn post(client: &HttpClient, addr: SocketAddr, tenant: &str, key: &str, body: &str) -> Response {
    let request = http::Request::post(format!("http://{addr}/payments"))
        .header("authorization", tenant)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let status = response.status().as_u16();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Response {
        status,
        replayed,
        json: serde_json::from_slice(&body).unwrap_or_default(),
    }
}

/// Waits up to `limit` for `done`.
async fn until<F: Future<Output = bool>>(mut done: impl FnMut() -> F, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if done().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_storm_and_redeliveries_leave_one_charge_row_per_payment() {
    // PostgreSQL: the records (API and consumer share the table, in their own scopes) and the
    // charges, in throwaway tables.
    let store = common::fresh_store().await;
    let charges = format!(
        "{}.p_{}",
        common::SCHEMA,
        store.table().split_once("t_").unwrap().1
    );
    payments_example::create_charges_table(store.pool(), &charges)
        .await
        .unwrap();
    let rows = |sql: String| {
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql))
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };

    // RabbitMQ: a queue of the test's own; the API publishes on a confirm-mode channel.
    let broker = amqp_url();
    let connection = Connection::connect(&broker, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("RabbitMQ at {broker} is needed for this test: {e}"));
    let channel = connection.create_channel().await.unwrap();
    let topology =
        Topology::for_queue(&format!("payments-e2e-{}", Key::generate())).expires(Duration::from_secs(600));
    topology.declare(&channel).await.unwrap();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let api = payments_example::api(
        store.clone(),
        idempotency_core::ScopeSecret::generate(),
        Publisher {
            channel: channel.clone(),
            queue: topology.queue.clone(),
        },
    );
    tokio::spawn(async move { axum::serve(listener, api).await.unwrap() });

    // The client storm. Per payment: a client that gives up after 1 ms, four concurrent
    // copies (whitespace and member order differ; the fingerprint is canonical JSON), then two
    // sequential retries. Both tenants use the same key names.
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let mut storm = Vec::new();
    for tenant in TENANTS {
        for i in 0..KEYS_PER_TENANT {
            let client = client.clone();
            storm.push(tokio::spawn(async move {
                let key = format!("pay-{i}");
                let body = format!(
                    r#"{{"account":"acct-{i}","amount_cents":{},"currency":"EUR"}}"#,
                    1000 + i
                );
                let reordered = format!(
                    r#"{{ "currency": "EUR", "amount_cents": {}, "account": "acct-{i}" }}"#,
                    1000 + i
                );
                let _ =
                    tokio::time::timeout(Duration::from_millis(1), post(&client, addr, tenant, &key, &body))
                        .await;
                let racing: Vec<_> = (0..4)
                    .map(|copy| {
                        let (client, key) = (client.clone(), key.clone());
                        let body = if copy % 2 == 0 {
                            body.clone()
                        } else {
                            reordered.clone()
                        };
                        tokio::spawn(async move { post(&client, addr, tenant, &key, &body).await })
                    })
                    .collect();
                let mut seen = Vec::new();
                for copy in racing {
                    seen.push(copy.await.unwrap());
                }
                for _retry in 0..2 {
                    let retry = post(&client, addr, tenant, &key, &reordered).await;
                    assert!(
                        retry.replayed,
                        "a sequential retry must be a replay: {} {}",
                        retry.status, retry.json
                    );
                    seen.push(retry);
                }
                let ids: HashSet<String> = seen
                    .iter()
                    .map(|r| {
                        assert_eq!(r.status, 202, "{}", r.json);
                        r.json["payment_id"].as_str().unwrap().to_owned()
                    })
                    .collect();
                assert_eq!(ids.len(), 1, "one payment per key: {ids:?}");
                ids.into_iter().next().unwrap()
            }));
        }
    }
    let mut payment_ids = HashSet::new();
    for payment in storm {
        payment_ids.insert(payment.await.unwrap());
    }
    let payments = TENANTS.len() * KEYS_PER_TENANT;
    assert_eq!(
        payment_ids.len(),
        payments,
        "the tenants' equal keys are separate payments"
    );
    // The same key with another payment is refused, and publishes nothing.
    let reused = post(
        &client,
        addr,
        TENANTS[0],
        "pay-0",
        r#"{"account":"acct-0","amount_cents":999999,"currency":"EUR"}"#,
    )
    .await;
    assert_eq!(reused.status, 422);

    // The charger: a gateway that times out after charging on every 7th call, one worker
    // reaching the broker through a proxy that is cut with deliveries in flight, then two more.
    let gateway = Arc::new(Gateway::new(Duration::from_millis(30)).timing_out(7, true));
    let consumer = Arc::new(payments_example::charger(
        store.clone(),
        Charger::new(Arc::clone(&gateway), &charges),
    ));
    let proxy = TcpProxy::start(broker_addr(&broker).await).await.unwrap();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let start = |url: String| {
        let worker = Worker::new(url, topology.clone(), Arc::clone(&consumer)).prefetch(4);
        let mut stopped = stopped.clone();
        tokio::spawn(async move {
            worker
                .run_until(async move {
                    let _ = stopped.wait_for(|stop| *stop).await;
                })
                .await
        })
    };
    let mut workers = vec![start(through(&broker, proxy.addr()))];
    let count_rows = || rows(format!("SELECT count(*) FROM {charges}"));
    assert!(until(|| async { count_rows().await >= 8 }, Duration::from_secs(20)).await);
    proxy.set_down(true);
    proxy.cut();
    workers.push(start(broker.clone()));
    workers.push(start(broker.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.set_down(false);

    let settled = || async {
        rows(format!("SELECT count(DISTINCT payment_key) FROM {charges}")).await == payments as i64
            && ready(&channel, &topology.queue).await == 0
            && ready(&channel, &topology.retry_queue).await == 0
    };
    assert!(
        until(settled, Duration::from_secs(60)).await,
        "{} of {payments} payments charged",
        count_rows().await
    );

    // A replay of already-processed messages (a dead-letter queue replayed days later).
    for id in payment_ids.iter().take(10) {
        let key = Key::new(id).unwrap();
        let n: i64 = id.rsplit('-').next().unwrap().parse().unwrap();
        let payment = Payment {
            account: format!("acct-{n}"),
            amount_cents: 1000 + n,
            currency: "EUR".into(),
        };
        idempotency_amqp::publish(&channel, "", &topology.queue, &key, &payment.to_message(id))
            .await
            .unwrap();
    }
    assert!(until(settled, Duration::from_secs(30)).await);
    // A settlement in flight on the cut connection is given up only after the worker's settle
    // timeout (10 s), and the session ends once its handlers have: the reconnection may come
    // after that and a backoff step, later on a loaded machine.
    assert!(
        until(|| async { proxy.accepted() >= 2 }, Duration::from_secs(60)).await,
        "the cut worker did not reconnect"
    );
    let _ = stop.send(true);
    for worker in workers {
        worker.await.unwrap().unwrap();
    }

    let total = count_rows().await;
    let doubled = rows(format!(
        "SELECT count(*) FROM (SELECT payment_key FROM {charges} GROUP BY payment_key HAVING count(*) > 1) d"
    ))
    .await;
    assert_eq!(doubled, 0, "a payment was charged twice");
    assert_eq!(total, payments as i64, "one charge row per payment");
    assert_eq!(gateway.charges(), payments, "one gateway charge per payment");
    assert!(
        gateway.calls() > payments as u64,
        "the gateway's timeouts were retried"
    );
    assert_eq!(
        ready(&channel, &topology.dead_queue).await,
        0,
        "nothing was dead-lettered"
    );
    let keyed: HashMap<String, i64> = sqlx::query_as::<_, (String, i64)>(AssertSqlSafe(format!(
        "SELECT payment_key, count(*) FROM {charges} GROUP BY payment_key"
    )))
    .fetch_all(store.pool())
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert_eq!(
        keyed.keys().cloned().collect::<HashSet<_>>(),
        payment_ids,
        "the charged keys are the API's payment ids"
    );

    for queue in [&topology.queue, &topology.retry_queue, &topology.dead_queue] {
        let _ = channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = connection.close(200, "done".into()).await;
}

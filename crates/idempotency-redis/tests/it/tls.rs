//! The store over TLS to a TLS-only Redis (`scripts/services redis-tls`, port 6390): `rediss://`
//! with the store's `ca`, `cert` and `key` parameters, verified against the test CA; and each
//! way verification must fail, failing with its cause.

use idempotency_core::{ErrorKind, StoreError};
use idempotency_redis::RedisStore;
use idempotency_testkit::tls::{self, file};

/// The TLS-only server, named as its certificate names it.
fn tls_url() -> String {
    std::env::var("REDIS_TLS_URL").unwrap_or_else(|_| "rediss://localhost:6390".into())
}

async fn connect(url: &str) -> Result<RedisStore, StoreError> {
    RedisStore::connect(url).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_test_ca_and_a_client_certificate_run_the_protocol_over_tls() {
    let url = format!(
        "{}?ca={}&cert={}&key={}",
        tls_url(),
        file("ca.pem"),
        file("client.pem"),
        file("client.key")
    );
    let store = connect(&url).await.unwrap_or_else(|e| {
        panic!(
            "Redis with TLS at {} is needed (scripts/services redis-tls): {e}",
            tls_url()
        )
    });
    tls::runs_and_replays(&store).await;
}

/// Without `ca`, the system's trust store decides, and it does not know the test CA: verification
/// is on by default. Another CA, another name and a plain client fail too, each with its cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_ca_a_wrong_name_and_a_plain_client_are_refused_with_the_cause() {
    tls::refused(connect(&tls_url()).await, ErrorKind::Unavailable, "UnknownIssuer");
    let other_ca = format!("{}?ca={}", tls_url(), file("other-ca.pem"));
    tls::refused(connect(&other_ca).await, ErrorKind::Unavailable, "UnknownIssuer");
    let by_address = format!("rediss://127.0.0.1:6390?ca={}", file("ca.pem"));
    tls::refused(
        connect(&by_address).await,
        ErrorKind::Unavailable,
        "not valid for name",
    );
    tls::refused(
        connect("redis://localhost:6390").await,
        ErrorKind::Unavailable,
        "",
    );
    let half = format!("{}?cert={}", tls_url(), file("client.pem"));
    tls::refused(
        connect(&half).await,
        ErrorKind::InvalidConfig,
        "needs both `cert` and `key`",
    );
    let missing = format!("{}?ca=/nonexistent/ca.pem", tls_url());
    tls::refused(
        connect(&missing).await,
        ErrorKind::InvalidConfig,
        "`ca` /nonexistent/ca.pem: No such file",
    );
}

/// The TLS-only cluster (`scripts/services redis-cluster-tls`, 7100-7102), whose nodes announce
/// themselves as `localhost`.
fn cluster_tls_url() -> String {
    std::env::var("REDIS_CLUSTER_TLS_URL")
        .unwrap_or_else(|_| "rediss-cluster://localhost:7100,localhost:7101,localhost:7102".into())
}

async fn open(url: &str) -> Result<idempotency_core::DynStore, StoreError> {
    (idempotency_redis::KIND.open)(url.to_owned(), idempotency_core::Access::Create).await
}

/// `rediss-cluster://` with the CA runs keys on every node over TLS (the slots spread them);
/// another CA and a plain client are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_over_tls_runs_the_protocol_on_every_node_and_another_ca_is_refused() {
    let url = format!(
        "{}?ca={}&cert={}&key={}",
        cluster_tls_url(),
        file("ca.pem"),
        file("client.pem"),
        file("client.key")
    );
    let store = open(&url).await.unwrap_or_else(|e| {
        panic!(
            "a Redis Cluster with TLS at {} is needed (scripts/services redis-cluster-tls): {e}",
            cluster_tls_url()
        )
    });
    // Random keys: that 48 of them all miss one of the three masters has a chance of
    // 3 × (2/3)^48, below one in a billion.
    for _ in 0..48 {
        tls::runs_and_replays(&store).await;
    }
    // The operators' reads scan every master, each through a connection made as the cluster's
    // are (over TLS, with the URL's files), never in plain text to a TLS port.
    let scope = idempotency_core::Scope::new("tls").unwrap();
    let listed = store
        .list(&idempotency_core::ListFilter::default().scope(scope))
        .await
        .expect("every master scanned over TLS");
    assert!(listed.len() >= 48, "{} records listed", listed.len());
    let other_ca = format!("{}?ca={}", cluster_tls_url(), file("other-ca.pem"));
    tls::refused(open(&other_ca).await, ErrorKind::Unavailable, "UnknownIssuer");
    let plain = cluster_tls_url().replacen("rediss-cluster", "redis-cluster", 1);
    tls::refused(open(&plain).await, ErrorKind::Unavailable, "");
    tls::refused(
        open(&format!("{}?batch=on", cluster_tls_url())).await,
        ErrorKind::InvalidConfig,
        "takes only the TLS parameters",
    );
}

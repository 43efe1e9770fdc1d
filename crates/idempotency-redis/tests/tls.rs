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

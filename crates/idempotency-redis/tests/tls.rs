//! The store over TLS to a TLS-only Redis (`scripts/services redis-tls`, port 6390): `rediss://`
//! with the store's `ca`, `cert` and `key` parameters, verified against the test CA; and each
//! way verification must fail, failing with its cause.

use idempotency_core::{BeginRequest, Claim, ErrorKind, Fingerprint, Key, Scope, Store, StoreError};
use idempotency_redis::RedisStore;
use idempotency_testkit::tls::file;

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
    let request = BeginRequest::new(
        Scope::new("tls").unwrap(),
        Key::generate(),
        Fingerprint::of_bytes(b"pay"),
    );
    idempotency_testkit::completed(&store, &request, "charged").await;
    assert!(matches!(store.begin(&request).await.unwrap(), Claim::Replay(_)));
}

/// Without `ca`, the system's trust store decides, and it does not know the test CA: verification
/// is on by default. Another CA, another name and a plain client fail too, each with its cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_ca_a_wrong_name_and_a_plain_client_are_refused_with_the_cause() {
    let system = connect(&tls_url()).await.unwrap_err();
    assert_eq!(system.kind(), ErrorKind::Unavailable, "{system}");
    assert!(system.to_string().contains("UnknownIssuer"), "{system}");

    let other = connect(&format!("{}?ca={}", tls_url(), file("other-ca.pem")))
        .await
        .unwrap_err();
    assert!(other.to_string().contains("UnknownIssuer"), "{other}");

    let name = connect(&format!("rediss://127.0.0.1:6390?ca={}", file("ca.pem")))
        .await
        .unwrap_err();
    assert!(name.to_string().contains("not valid for name"), "{name}");

    let plain = connect("redis://localhost:6390").await.unwrap_err();
    assert_eq!(plain.kind(), ErrorKind::Unavailable, "{plain}");

    let half = connect(&format!("{}?cert={}", tls_url(), file("client.pem")))
        .await
        .unwrap_err();
    assert_eq!(half.kind(), ErrorKind::InvalidConfig, "{half}");
    assert!(half.to_string().contains("needs both `cert` and `key`"), "{half}");

    let missing = connect(&format!("{}?ca=/nonexistent/ca.pem", tls_url()))
        .await
        .unwrap_err();
    assert_eq!(missing.kind(), ErrorKind::InvalidConfig, "{missing}");
    assert!(
        missing
            .to_string()
            .contains("`ca` /nonexistent/ca.pem: No such file"),
        "{missing}"
    );
}

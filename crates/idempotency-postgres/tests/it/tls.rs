//! The store over TLS to a TLS-only PostgreSQL (`scripts/services postgres-tls`, port 5433) with
//! libpq's parameters in the URL, verified against the test CA; and each way verification must
//! fail, failing with its cause.

use idempotency_core::ErrorKind;
use idempotency_postgres::PostgresStore;
use idempotency_postgres::sqlx;
use idempotency_testkit::tls::{self, file};

/// The TLS-only server, named as its certificate names it.
fn tls_url() -> String {
    std::env::var("DATABASE_TLS_URL").unwrap_or_else(|_| "postgres://postgres@localhost:5433/test".into())
}

async fn connect(params: &str) -> Result<PostgresStore, idempotency_core::StoreError> {
    PostgresStore::connect(&format!("{}?{params}", tls_url())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_with_the_ca_runs_the_protocol_over_tls_and_presents_the_client_certificate() {
    let params = format!(
        "sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
        file("ca.pem"),
        file("client.pem"),
        file("client.key")
    );
    let store = connect(&params).await.unwrap_or_else(|e| {
        panic!(
            "PostgreSQL with TLS at {} is needed (scripts/services postgres-tls): {e}",
            tls_url()
        )
    });
    tls::runs_and_replays(&store).await;
    let (ssl, client): (bool, Option<String>) =
        sqlx::query_as("SELECT ssl, client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert!(ssl, "the server saw a plain connection");
    assert_eq!(client.as_deref(), Some("/CN=idem-client"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_ca_checks_the_ca_but_not_the_name() {
    let url = format!(
        "postgres://postgres@127.0.0.1:5433/test?sslmode=verify-ca&sslrootcert={}",
        file("ca.pem")
    );
    let store = PostgresStore::connect(&url).await.unwrap();
    tls::runs_and_replays(&store).await;
}

/// Each refusal names its cause, and none falls back to a plain connection (the server only
/// accepts TLS: a plain attempt would be refused with "no encryption", which none of these
/// says).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_a_wrong_name_and_a_plain_client_are_refused_with_the_cause() {
    let other_ca = format!("sslmode=verify-full&sslrootcert={}", file("other-ca.pem"));
    let wrong_ca = tls::refused(connect(&other_ca).await, ErrorKind::Unavailable, "UnknownIssuer");
    let by_address = format!(
        "postgres://postgres@127.0.0.1:5433/test?sslmode=verify-full&sslrootcert={}",
        file("ca.pem")
    );
    let wrong_name = tls::refused(
        PostgresStore::connect(&by_address).await,
        ErrorKind::Unavailable,
        "not valid for name",
    );
    for refused in [&wrong_ca, &wrong_name] {
        assert!(!refused.to_string().contains("no encryption"), "{refused}");
    }
    tls::refused(
        connect("sslmode=disable").await,
        ErrorKind::InvalidConfig,
        "no encryption",
    );
    tls::refused(
        connect("sslmode=verify-full&sslrootcert=/nonexistent/ca.pem").await,
        ErrorKind::InvalidConfig,
        "`sslrootcert` /nonexistent/ca.pem: No such file",
    );
}

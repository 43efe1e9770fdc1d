//! The store over TLS to a MariaDB that requires it (`scripts/services mariadb-tls`, port 3307),
//! with sqlx's MySQL parameters in the URL, verified against the test CA; and each way
//! verification must fail, failing with its cause.

use idempotency_core::ErrorKind;
use idempotency_mysql::MysqlStore;
use idempotency_mysql::sqlx;
use idempotency_testkit::tls::{self, file};

/// The server that requires TLS, named as its certificate names it.
fn tls_url() -> String {
    std::env::var("MYSQL_TLS_URL").unwrap_or_else(|_| "mysql://root@localhost:3307/test".into())
}

async fn connect(params: &str) -> Result<MysqlStore, idempotency_core::StoreError> {
    MysqlStore::connect(&format!("{}?{params}", tls_url())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_identity_with_the_ca_runs_the_protocol_over_tls() {
    let params = format!(
        "ssl-mode=VERIFY_IDENTITY&ssl-ca={}&ssl-cert={}&ssl-key={}",
        file("ca.pem"),
        file("client.pem"),
        file("client.key")
    );
    let store = connect(&params).await.unwrap_or_else(|e| {
        panic!(
            "MariaDB with TLS at {} is needed (scripts/services mariadb-tls): {e}",
            tls_url()
        )
    });
    tls::runs_and_replays(&store).await;
    let version: String = sqlx::query_scalar(
        "SELECT VARIABLE_VALUE FROM information_schema.SESSION_STATUS WHERE VARIABLE_NAME = 'SSL_VERSION'",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert!(version.starts_with("TLS"), "the server saw {version:?}");
}

/// Each refusal names its cause; the server refuses a plain client outright.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_a_wrong_name_and_a_plain_client_are_refused_with_the_cause() {
    let other_ca = format!("ssl-mode=VERIFY_IDENTITY&ssl-ca={}", file("other-ca.pem"));
    tls::refused(connect(&other_ca).await, ErrorKind::Unavailable, "UnknownIssuer");
    let by_address = format!(
        "mysql://root@127.0.0.1:3307/test?ssl-mode=VERIFY_IDENTITY&ssl-ca={}",
        file("ca.pem")
    );
    tls::refused(
        MysqlStore::connect(&by_address).await,
        ErrorKind::Unavailable,
        "not valid for name",
    );
    // The server requires TLS: a plain client is turned away at authentication.
    tls::refused(
        connect("ssl-mode=DISABLED").await,
        ErrorKind::InvalidConfig,
        "Access denied",
    );
    tls::refused(
        connect("ssl-mode=VERIFY_CA&ssl-ca=/nonexistent/ca.pem").await,
        ErrorKind::InvalidConfig,
        "`ssl-ca` /nonexistent/ca.pem: No such file",
    );
}

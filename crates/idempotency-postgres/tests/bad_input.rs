//! Bad input gets a clear, typed error: malformed URLs, a missing database, a role the server
//! does not know, an unreachable server, unsafe table names, a table from a newer version.

mod common;

use std::time::Duration;

use idempotency_core::ErrorKind;
use idempotency_postgres::{PostgresOptions, PostgresStore};

async fn connect_err(options: PostgresOptions) -> idempotency_core::StoreError {
    PostgresStore::connect_with(options.acquire_timeout(Duration::from_secs(3)))
        .await
        .expect_err("connecting must fail")
}

/// The test server's URL with another database or user.
fn url_with(user: &str, database: &str) -> String {
    let base = common::database_url();
    let options = PostgresOptions::from_url(&base).unwrap();
    format!(
        "postgres://{user}@{}:{}/{database}",
        options.connect.get_host(),
        options.connect.get_port()
    )
}

#[tokio::test]
async fn malformed_urls_are_invalid_config() {
    for url in [
        "",
        "postgres//127.0.0.1/test",
        "redis://127.0.0.1:6379",
        "postgres://user:pw@127.0.0.1:port/test",
        "postgres://127.0.0.1/test?sslmode=sometimes",
    ] {
        let error = PostgresStore::connect(url).await.expect_err(url);
        assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{url}: {error}");
        assert!(!error.is_retryable(), "{url}");
        assert!(!error.to_string().contains("pw@"), "password echoed: {error}");
    }
}

#[tokio::test]
async fn a_missing_database_is_named() {
    let error =
        connect_err(PostgresOptions::from_url(&url_with("postgres", "no_such_database_idem")).unwrap()).await;
    assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{error}");
    assert!(error.to_string().contains("no_such_database_idem"), "{error}");
    assert!(error.to_string().contains("3D000"), "{error}");
}

#[tokio::test]
async fn unknown_credentials_are_rejected() {
    let error = connect_err(PostgresOptions::from_url(&url_with("no_such_role_idem", "test")).unwrap()).await;
    assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{error}");
    assert!(error.to_string().contains("no_such_role_idem"), "{error}");
    assert!(!error.is_retryable());
}

#[tokio::test]
async fn an_unreachable_server_is_retryable() {
    // Port 1 on loopback: nothing listens there.
    let error = connect_err(PostgresOptions::from_url("postgres://postgres@127.0.0.1:1/test").unwrap()).await;
    assert!(error.is_retryable(), "{error}");
    assert!(
        matches!(error.kind(), ErrorKind::Unavailable | ErrorKind::Timeout),
        "{error}"
    );
}

#[tokio::test]
async fn unsafe_table_and_schema_names_are_refused_before_any_sql() {
    let options = PostgresOptions::from_url(&common::database_url()).unwrap();
    for bad in [
        "records; DROP TABLE users",
        "Records",
        "1records",
        "",
        "public.records",
        "r\"ecords",
    ] {
        let error = options.clone().table(bad).map(|_| ()).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{bad:?}");
        assert!(
            error.to_string().contains("unsafe SQL identifier"),
            "{bad:?}: {error}"
        );
        let error = options.clone().schema(bad).map(|_| ()).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{bad:?}");
    }
}

#[tokio::test]
async fn a_table_from_another_version_is_refused() {
    let store = common::fresh_store().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "COMMENT ON TABLE {} IS 'idempotency records v99'",
        store.table()
    )))
    .execute(store.pool())
    .await
    .unwrap();
    let error = store.migrate().await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Schema, "{error}");
    assert!(error.to_string().contains("v99"), "{error}");
}

#[tokio::test]
async fn a_missing_table_without_migration_is_a_schema_error() {
    let options = PostgresOptions::from_url(&common::database_url())
        .unwrap()
        .schema(common::SCHEMA)
        .unwrap()
        .table("never_created_idem")
        .unwrap()
        .migrate(false);
    let store = PostgresStore::connect_with(options).await.unwrap();
    let request = idempotency_core::BeginRequest::new(
        idempotency_core::Scope::global(),
        idempotency_core::Key::new("k").unwrap(),
        idempotency_core::Fingerprint::of_bytes(b""),
    );
    let error = idempotency_core::Store::begin(&store, &request)
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Schema, "{error}");
    assert!(error.to_string().contains("never_created_idem"), "{error}");
}

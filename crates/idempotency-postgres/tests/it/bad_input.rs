//! Bad input gets a clear, typed error: malformed URLs, a missing database, a role the server
//! does not know, an unreachable server, unsafe table names, a table from a newer version.

use crate::common;

use std::time::Duration;

use idempotency_core::ErrorKind;
use idempotency_postgres::{PostgresOptions, PostgresStore};
use idempotency_testkit::refusals;

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
    let urls = [
        "",
        "postgres//127.0.0.1/test",
        "redis://127.0.0.1:6379",
        "postgres://user:s3cretpw@127.0.0.1:port/test",
        "postgres://127.0.0.1/test?sslmode=sometimes",
    ];
    refusals::malformed_urls(&urls, "s3cretpw", PostgresStore::connect).await;
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
    let options = PostgresOptions::from_url("postgres://postgres@127.0.0.1:1/test").unwrap();
    refusals::unreachable(&connect_err(options).await);
}

#[tokio::test]
async fn unsafe_table_and_schema_names_are_refused_before_any_sql() {
    let options = PostgresOptions::from_url(&common::database_url()).unwrap();
    refusals::unsafe_identifiers("public.records", '"', |bad| options.clone().table(bad).map(drop));
    refusals::unsafe_identifiers("public.records", '"', |bad| options.clone().schema(bad).map(drop));
}

#[tokio::test]
async fn a_table_from_another_version_is_refused() {
    let store = common::fresh_store().await;
    let mark = format!("COMMENT ON TABLE {} IS 'idempotency records v99'", store.table());
    sqlx::raw_sql(sqlx::AssertSqlSafe(mark))
        .execute(store.pool())
        .await
        .unwrap();
    let error = store.migrate().await.unwrap_err();
    refusals::newer_version(&error, "v99");
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
    refusals::missing_table(&store, "never_created_idem").await;
}

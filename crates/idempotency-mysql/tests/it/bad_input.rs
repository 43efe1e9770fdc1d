//! Bad input gets a clear, typed error: malformed URLs (the password never echoed), an unknown
//! database, a wrong password, an unreachable server, unsafe table names, a table from a newer
//! version or another application under the configured name.

use crate::common;

use std::time::Duration;

use idempotency_core::{Access, BeginRequest, ErrorKind, Fingerprint, Key, Scope, Store, StoreError};
use idempotency_mysql::sqlx::{self, AssertSqlSafe};
use idempotency_mysql::{MysqlOptions, MysqlStore};
use idempotency_testkit::refusals;

async fn connect_err(options: MysqlOptions) -> StoreError {
    MysqlStore::connect_with(options.acquire_timeout(Duration::from_secs(3)))
        .await
        .expect_err("connecting must fail")
}

/// The options of a store on `table` of the test server's database.
fn on(table: &str) -> MysqlOptions {
    MysqlOptions::from_url(&common::database_url())
        .unwrap()
        .table(table)
        .unwrap()
}

/// Connecting to `table` with each of `accesses` is a schema error that says `saying`.
async fn schema_refused(table: &str, accesses: &[Access], saying: &str) {
    for access in accesses {
        let error = connect_err(on(table).access(*access)).await;
        assert_eq!(error.kind(), ErrorKind::Schema, "{access:?}: {error}");
        assert!(error.to_string().contains(saying), "{error}");
    }
}

/// The test server's URL with another user, password and database.
fn url_with(user: &str, password: Option<&str>, database: &str) -> String {
    let options = MysqlOptions::from_url(&common::database_url()).unwrap();
    let credentials = match password {
        Some(password) => format!("{user}:{password}"),
        None => user.to_owned(),
    };
    format!(
        "mysql://{credentials}@{}:{}/{database}",
        options.connect.get_host(),
        options.connect.get_port()
    )
}

#[tokio::test]
async fn malformed_urls_are_invalid_config_and_never_echo_the_password() {
    let urls = [
        "",
        "mysql//127.0.0.1/test",
        "postgres://app:s3cretpw@127.0.0.1/test",
        "mysql://app:s3cretpw@127.0.0.1:port/test",
        "mysql://app:s3cretpw@127.0.0.1:3306",
        "mysql://app:s3cretpw@127.0.0.1/test?ssl-mode=sometimes",
        "mysql://app:s3cretpw@[::1/test",
    ];
    refusals::malformed_urls(&urls, "s3cretpw", MysqlStore::connect).await;
}

#[tokio::test]
async fn an_unknown_database_is_named() {
    let error =
        connect_err(MysqlOptions::from_url(&url_with("root", None, "no_such_database_idem")).unwrap()).await;
    assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{error}");
    assert!(error.to_string().contains("no_such_database_idem"), "{error}");
    assert!(error.to_string().contains("1049"), "{error}");
}

#[tokio::test]
async fn a_wrong_password_is_rejected_and_not_echoed() {
    let error =
        connect_err(MysqlOptions::from_url(&url_with("root", Some("wr0ngpassw0rd"), "test")).unwrap()).await;
    assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{error}");
    assert!(error.to_string().contains("1045"), "{error}");
    assert!(!error.is_retryable());
    assert!(
        !error.to_string().contains("wr0ngpassw0rd"),
        "password echoed: {error}"
    );
    let error =
        connect_err(MysqlOptions::from_url(&url_with("no_such_user_idem", None, "test")).unwrap()).await;
    assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{error}");
    assert!(error.to_string().contains("no_such_user_idem"), "{error}");
}

#[tokio::test]
async fn an_unreachable_server_is_retryable() {
    // Port 1 on loopback: nothing listens there.
    refusals::unreachable(
        &connect_err(MysqlOptions::from_url("mysql://root@127.0.0.1:1/test").unwrap()).await,
    );
}

#[tokio::test]
async fn unsafe_table_names_are_refused_before_any_sql() {
    let options = MysqlOptions::from_url(&common::database_url()).unwrap();
    refusals::unsafe_identifiers("test.records", '`', |bad| options.clone().table(bad).map(drop));
}

#[tokio::test]
async fn a_table_from_another_version_is_refused() {
    let store = common::fresh_store().await;
    let mark = format!(
        "ALTER TABLE {} COMMENT = 'idempotency records v99'",
        store.table()
    );
    sqlx::raw_sql(AssertSqlSafe(mark))
        .execute(store.pool())
        .await
        .unwrap();
    refusals::newer_version(&store.migrate().await.unwrap_err(), "v99");
}

#[tokio::test]
async fn a_foreign_table_under_the_configured_name_is_refused_and_left_alone() {
    let table = idempotency_testkit::sql::fresh_table("t");
    let admin = common::fresh_store().await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {table} (id INT PRIMARY KEY, name TEXT); INSERT INTO {table} VALUES (1, 'kept')"
    )))
    .execute(admin.pool())
    .await
    .unwrap();
    let every = [Access::Create, Access::Existing, Access::ReadOnly];
    schema_refused(&table, &every, &table).await;
    let kept: String = sqlx::query_scalar(AssertSqlSafe(format!("SELECT name FROM {table} WHERE id = 1")))
        .fetch_one(admin.pool())
        .await
        .unwrap();
    assert_eq!(kept, "kept", "the foreign table must not be touched");
}

#[tokio::test]
async fn a_missing_table_is_not_created_without_create_access() {
    let table = idempotency_testkit::sql::fresh_table("t");
    schema_refused(
        &table,
        &[Access::Existing, Access::ReadOnly],
        "nothing was created",
    )
    .await;
    // Without migration the first operation names the missing table.
    let store = MysqlStore::connect_with(on(&table).migrate(false)).await.unwrap();
    refusals::missing_table(&store, &table).await;
}

#[tokio::test]
async fn a_read_only_store_refuses_to_write() {
    let store = common::fresh_store().await;
    let reader = MysqlStore::connect_with(on(store.table()).access(Access::ReadOnly))
        .await
        .unwrap();
    let request = BeginRequest::new(
        Scope::global(),
        Key::new("k").unwrap(),
        Fingerprint::of_bytes(b""),
    );
    let error = reader.begin(&request).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::ReadOnly, "{error}");
    assert_eq!(
        reader
            .get(&Scope::global(), &Key::new("k").unwrap())
            .await
            .unwrap(),
        None
    );
}

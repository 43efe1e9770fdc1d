//! Bad input gets a typed, clear error and loses nothing: malformed URLs, missing directories,
//! files that are not (healthy) databases, read-only files, schemas we do not own.

use std::os::unix::fs::PermissionsExt;

use idempotency_core::{BeginRequest, Claim, ErrorKind, Fingerprint, Held, Key, Outcome, Scope, Store};
use idempotency_sqlite::{SqliteOptions, SqliteStore};
use idempotency_testkit::refusals;

fn url(path: &std::path::Path) -> String {
    format!("sqlite://{}", path.display())
}

async fn open_err(url: &str) -> idempotency_core::StoreError {
    SqliteStore::open(url).await.expect_err("opening must fail")
}

#[tokio::test]
async fn malformed_urls_are_invalid_config() {
    let urls = [
        "",
        "sqlite://",
        "mysql://root:s3cretpw@localhost/test",
        "sqlite://x.db?synchronous=maybe",
    ];
    refusals::malformed_urls(&urls, "s3cretpw", SqliteStore::open).await;
}

#[tokio::test]
async fn a_missing_directory_is_named() {
    let error = open_err("sqlite:///nonexistent-dir-for-idem/idem.db").await;
    assert_eq!(error.kind(), ErrorKind::InvalidConfig);
    assert!(
        error
            .to_string()
            .contains("/nonexistent-dir-for-idem does not exist"),
        "{error}"
    );
}

#[tokio::test]
async fn a_directory_is_not_a_database() {
    let dir = tempfile::tempdir().unwrap();
    let error = open_err(&url(dir.path())).await;
    assert_eq!(error.kind(), ErrorKind::InvalidConfig);
    assert!(error.to_string().contains("is a directory"), "{error}");
}

#[tokio::test]
async fn a_file_of_garbage_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("garbage.db");
    let garbage: Vec<u8> = (0..8192u32)
        .map(|i| i.wrapping_mul(2_654_435_761).to_be_bytes()[0])
        .collect();
    std::fs::write(&path, &garbage).unwrap();
    let error = open_err(&url(&path)).await;
    assert_eq!(error.kind(), ErrorKind::Corrupt, "{error}");
    assert!(
        error.to_string().contains("not a healthy SQLite database"),
        "{error}"
    );
    assert_eq!(
        std::fs::read(&path).unwrap(),
        garbage,
        "the file must be left as it was"
    );
}

#[tokio::test]
async fn a_database_with_damaged_pages_reports_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("damaged.db");
    {
        let store = SqliteStore::open(&url(&path)).await.unwrap();
        for i in 0..500 {
            let request = BeginRequest::new(
                Scope::global(),
                Key::new(format!("k{i}")).unwrap(),
                Fingerprint::of_bytes(b"x"),
            );
            let Claim::Acquired(Held { token, .. }) = store.begin(&request).await.unwrap() else {
                panic!()
            };
            let _ = store
                .complete(
                    &idempotency_testkit::held(&request.scope, &request.key, token),
                    Outcome::new(vec![7u8; 200]),
                    request.retention,
                )
                .await
                .unwrap();
        }
        // Fold the WAL into the main file so the damage below hits the records.
        store
            .with_connection(|c| c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)"))
            .await
            .unwrap()
            .unwrap();
    }
    let mut bytes = std::fs::read(&path).unwrap();
    assert!(bytes.len() > 8 * 4096);
    for byte in &mut bytes[2 * 4096..8 * 4096] {
        *byte = 0xA5;
    }
    std::fs::write(&path, &bytes).unwrap();

    // Depending on which pages the damage hit, SQLite notices at open or at the first read of a
    // damaged page; either way the answer must be a Corrupt error, never a wrong answer.
    let result = async {
        let store = SqliteStore::open(&url(&path)).await?;
        for i in 0..500 {
            let request = BeginRequest::new(
                Scope::global(),
                Key::new(format!("k{i}")).unwrap(),
                Fingerprint::of_bytes(b"x"),
            );
            match store.begin(&request).await? {
                Claim::Replay(_) => {}
                other => panic!("damaged database gave a wrong answer for k{i}: {other:?}"),
            }
        }
        Ok::<(), idempotency_core::StoreError>(())
    }
    .await;
    let error = result.expect_err("damage must be detected");
    assert_eq!(error.kind(), ErrorKind::Corrupt, "{error}");
}

#[tokio::test]
async fn a_read_only_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("readonly.db");
    drop(SqliteStore::open(&url(&path)).await.unwrap());
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).unwrap();
    let error = open_err(&url(&path)).await;
    assert_eq!(error.kind(), ErrorKind::ReadOnly, "{error}");
    assert!(error.to_string().contains("is read-only"), "{error}");
    assert!(!error.is_retryable());
}

#[tokio::test]
async fn a_newer_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("newer.db");
    let store = SqliteStore::open(&url(&path)).await.unwrap();
    store
        .with_connection(|c| c.execute_batch("PRAGMA user_version = 99"))
        .await
        .unwrap()
        .unwrap();
    drop(store);
    refusals::newer_version(&open_err(&url(&path)).await, "schema version 99");
}

#[tokio::test]
async fn another_applications_database_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("other.db");
    let other = rusqlite::Connection::open(&path).unwrap();
    other
        .execute_batch("CREATE TABLE invoices (id INTEGER PRIMARY KEY); PRAGMA user_version = 3;")
        .unwrap();
    drop(other);
    let error = open_err(&url(&path)).await;
    assert_eq!(error.kind(), ErrorKind::Schema);
    assert!(error.to_string().contains("another application"), "{error}");
}

#[tokio::test]
async fn a_busy_write_lock_is_a_retryable_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("busy.db");
    let store =
        SqliteStore::open_with(SqliteOptions::file(&path).busy_timeout(std::time::Duration::from_millis(50)))
            .await
            .unwrap();
    // Another process holds the write lock.
    let holder = rusqlite::Connection::open(&path).unwrap();
    holder.execute_batch("BEGIN IMMEDIATE").unwrap();
    let request = BeginRequest::new(
        Scope::global(),
        Key::new("k").unwrap(),
        Fingerprint::of_bytes(b"x"),
    );
    let error = store.begin(&request).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Timeout, "{error}");
    assert!(error.is_retryable());
    holder.execute_batch("ROLLBACK").unwrap();
    assert!(
        matches!(store.begin(&request).await.unwrap(), Claim::Acquired(_)),
        "the store recovers"
    );
}

#[tokio::test]
async fn a_panicking_job_does_not_stop_the_store() {
    let store = SqliteStore::in_memory().await.unwrap();
    let error = store
        .with_connection(|c| -> () {
            c.execute_batch("BEGIN IMMEDIATE").unwrap();
            panic!("a bug in a maintenance closure");
        })
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    // The transaction the closure left open was rolled back, and the worker still serves.
    let request = BeginRequest::new(
        Scope::global(),
        Key::new("k").unwrap(),
        Fingerprint::of_bytes(b"x"),
    );
    assert!(matches!(store.begin(&request).await.unwrap(), Claim::Acquired(_)));
}

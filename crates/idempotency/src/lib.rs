//! Effectively-once side effects on at-least-once infrastructure.
//!
//! HTTP clients retry, brokers redeliver, dead-letter queues get replayed: the same request
//! arrives more than once. This crate makes its side effect happen once: the first arrival runs
//! under a lease, duplicates get the stored outcome, a different payload under the same key is
//! rejected, and a crashed attempt's lease expires so a retry can take over — fenced, so the
//! crashed worker can never overwrite the newer result.
//!
//! This facade re-exports [`idempotency_core`] (keys, fingerprints, the record state machine,
//! [`Guard`], [`MemoryStore`]) and, behind features, the stores:
//!
//! | feature | what |
//! |---|---|
//! | `sqlite` | [`sqlite::SqliteStore`], the embedded durable store (`sqlite://` URLs) |
//! | `postgres` | [`postgres::PostgresStore`] (`postgres://` URLs), with same-transaction mode |
//! | `redis` | [`redis::RedisStore`] (`redis://`, `rediss://`, `redis-cluster://` URLs) |
//! | `testkit` | [`testkit`], the conformance suite and a fault-injecting store |
//!
//! ```
//! use idempotency::{Decision, Execution, Fingerprint, Guard, Key, Outcome, Scope};
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let store = idempotency::open("memory://").await?;
//! let guard = Guard::new(store);
//! let run = guard
//!     .run(
//!         Scope::new("tenant-7")?,
//!         Key::new("order-1234-payment")?,
//!         Fingerprint::of_canonical_json(br#"{"amount": 1000, "currency": "EUR"}"#)?,
//!         |charge_id: &String| Decision::Complete(Outcome::new(charge_id.clone())),
//!         |_attempt| async { "ch_1".to_string() /* charge the card here */ },
//!     )
//!     .await?;
//! assert!(matches!(run, Execution::Executed { .. }));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

use std::sync::Arc;

pub use idempotency_core::*;

#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use idempotency_sqlite as sqlite;

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use idempotency_postgres as postgres;

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use idempotency_redis as redis;

#[cfg(feature = "testkit")]
#[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
pub use idempotency_testkit as testkit;

/// A store chosen at run time, as the `idem` binary and configuration files need.
pub type DynStore = Arc<dyn StoreAdmin>;

/// Opens the store a URL names:
///
/// * `memory://` — a [`MemoryStore`] (nothing survives the process);
/// * `sqlite://PATH`, `sqlite::memory:` — the SQLite store (feature `sqlite`);
/// * `postgres://…`, `postgresql://…` — the PostgreSQL store on its default table, created if
///   missing (feature `postgres`);
/// * `redis://host:port`, `rediss://…` — the Redis store on one server; `redis-cluster://h1:p1,h2:p2`
///   — on a Redis Cluster, through any of the listed nodes (feature `redis`).
///
/// # Errors
///
/// [`ErrorKind::InvalidConfig`] for an unknown scheme, a scheme whose store is not compiled in,
/// or a malformed URL; otherwise the store's own error when opening fails.
pub async fn open(url: &str) -> Result<DynStore, StoreError> {
    let scheme = url.split_once(':').map(|(scheme, _)| scheme).unwrap_or_default();
    match scheme {
        "memory" => {
            if url != "memory://" && url != "memory:" {
                return Err(StoreError::new(
                    ErrorKind::InvalidConfig,
                    format!("`{url}`: the memory store takes no path or options (use `memory://`)"),
                ));
            }
            Ok(Arc::new(MemoryStore::new()))
        }
        #[cfg(feature = "sqlite")]
        "sqlite" => Ok(Arc::new(sqlite::SqliteStore::open(url).await?)),
        #[cfg(not(feature = "sqlite"))]
        "sqlite" => Err(not_compiled_in("sqlite")),
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => Ok(Arc::new(postgres::PostgresStore::connect(url).await?)),
        #[cfg(not(feature = "postgres"))]
        "postgres" | "postgresql" => Err(not_compiled_in("postgres")),
        #[cfg(feature = "redis")]
        "redis" | "rediss" => Ok(Arc::new(redis::RedisStore::connect(url).await?)),
        #[cfg(feature = "redis")]
        "redis-cluster" => {
            let nodes: Vec<String> = url
                .trim_start_matches("redis-cluster://")
                .split(',')
                .filter(|node| !node.is_empty())
                .map(|node| format!("redis://{node}"))
                .collect();
            Ok(Arc::new(redis::RedisStore::connect_cluster(&nodes).await?))
        }
        #[cfg(not(feature = "redis"))]
        "redis" | "rediss" | "redis-cluster" => Err(not_compiled_in("redis")),
        "mysql" | "mariadb" => Err(StoreError::new(
            ErrorKind::InvalidConfig,
            format!(
                "there is no `{scheme}` store in this version yet (available: memory://, sqlite://, postgres://, redis://)"
            ),
        )),
        "" => Err(StoreError::new(
            ErrorKind::InvalidConfig,
            // Without a scheme a password may still be in there (`user:pass@host`).
            format!(
                "`{}` is not a store URL (expected memory://, sqlite://PATH, postgres://… or redis://…)",
                redact_url(url)
            ),
        )),
        other => Err(StoreError::new(
            ErrorKind::InvalidConfig,
            format!(
                "unknown store URL scheme `{other}` (expected memory://, sqlite://PATH, postgres://… or redis://…)"
            ),
        )),
    }
}

#[cfg(not(all(feature = "sqlite", feature = "postgres", feature = "redis")))]
fn not_compiled_in(feature: &str) -> StoreError {
    StoreError::new(
        ErrorKind::InvalidConfig,
        format!(
            "this build has no `{feature}` store: enable the `{feature}` feature of the `idempotency` crate"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn opens_the_memory_store() {
        let store = open("memory://").await.unwrap();
        assert_eq!(store.stats(None).await.unwrap(), Stats::default());
    }

    #[tokio::test]
    async fn rejects_bad_urls_with_the_reason() {
        let cases = [
            ("", "is not a store URL"),
            ("idem.db", "is not a store URL"),
            ("admin:s3cret@db/app", "unknown store URL scheme `admin`"),
            ("memory://extra", "takes no path"),
            ("ftp://host/x", "unknown store URL scheme `ftp`"),
            ("mysql://root@localhost/test", "no `mysql` store in this version"),
        ];
        for (url, expected) in cases {
            let error = open(url).await.map(|_| ()).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{url}");
            assert!(error.to_string().contains(expected), "{url}: {error}");
            assert!(!error.to_string().contains("s3cret"), "password echoed: {error}");
        }
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn opens_the_sqlite_store_by_url() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/idem.db", dir.path().display());
        let store = open(&url).await.unwrap();
        let request = BeginRequest::new(
            Scope::global(),
            Key::new("k").unwrap(),
            Fingerprint::of_bytes(b""),
        );
        assert!(matches!(
            store.begin(&request).await.unwrap(),
            Claim::Acquired { .. }
        ));
        assert!(dir.path().join("idem.db").exists());
        let error = open("sqlite://x.db?bogus=1").await.map(|_| ()).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidConfig);
    }

    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn opens_the_postgres_store_by_url() {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let store = open(&url)
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {url} is needed for this test: {e}"));
        let key = Key::generate();
        let request = BeginRequest::new(
            Scope::new("facade-test").unwrap(),
            key,
            Fingerprint::of_bytes(b""),
        );
        assert!(matches!(
            store.begin(&request).await.unwrap(),
            Claim::Acquired { .. }
        ));
        let _ = store
            .release(&request.scope, &request.key, request.token)
            .await
            .unwrap();
    }

    #[cfg(feature = "redis")]
    #[tokio::test]
    async fn opens_the_redis_stores_by_url() {
        let single = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let cluster = "redis-cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002";
        for url in [single.as_str(), cluster] {
            let store = open(url)
                .await
                .unwrap_or_else(|e| panic!("Redis at {url} is needed for this test: {e}"));
            let request = BeginRequest::new(
                Scope::new("facade-test").unwrap(),
                Key::generate(),
                Fingerprint::of_bytes(b""),
            );
            assert!(
                matches!(store.begin(&request).await.unwrap(), Claim::Acquired { .. }),
                "{url}"
            );
            let _ = store
                .release(&request.scope, &request.key, request.token)
                .await
                .unwrap();
        }
        let error = open("redis-cluster://").await.map(|_| ()).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{error}");
    }

    #[cfg(not(feature = "sqlite"))]
    #[tokio::test]
    async fn names_the_missing_feature() {
        let error = open("sqlite://x.db").await.map(|_| ()).unwrap_err();
        assert!(
            error.to_string().contains("enable the `sqlite` feature"),
            "{error}"
        );
    }
}

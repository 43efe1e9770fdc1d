//! Effectively-once side effects on at-least-once infrastructure.
//!
//! HTTP clients retry, brokers redeliver, dead-letter queues get replayed: the same request
//! arrives more than once. This crate makes its side effect happen once: the first arrival runs
//! under a lease, duplicates get the stored outcome, a different payload under the same key is
//! rejected, and a crashed attempt's lease expires so a retry can take over — fenced, so the
//! crashed worker can never overwrite the newer result.
//!
//! This facade re-exports [`idempotency_core`] by name (keys, fingerprints, the record state
//! machine, [`Guard`], [`MemoryStore`]) and, behind features, the stores, each of which declares
//! its own URL schemes ([`registry`]):
//!
//! | feature | what |
//! |---|---|
//! | `sqlite` | [`sqlite::SqliteStore`], the embedded durable store (`sqlite://` URLs) |
//! | `postgres` | [`postgres::PostgresStore`] (`postgres://` URLs), with same-transaction mode |
//! | `mysql` | [`mysql::MysqlStore`] (`mysql://`, `mariadb://` URLs), with same-transaction mode |
//! | `redis` | [`redis::RedisStore`] (`redis://`, `rediss://`, `redis-cluster://` URLs) |
//! | `kafka` | [`kafka`], idempotent Kafka consumption (builds the bundled librdkafka) |
//! | `outbox` | [`outbox`], the inbox and the transactional outbox on PostgreSQL (with `mysql`, the outbox on MySQL too) |
//! | `dynamodb` | [`dynamodb::DynamoDbStore`] (`dynamodb://` URLs; builds the AWS SDK, rustls on ring) |
//! | `sqs` | [`sqs`], idempotent Amazon SQS consumers (builds the AWS SDK, rustls on ring) |
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

use std::sync::LazyLock;

/// The benchmarks (`docs/BENCHMARKS.md`): every figure the README gives, measured side by side
/// with a baseline in one run, with the command that reproduces it.
#[doc = include_str!("../../../docs/BENCHMARKS.md")]
pub mod benchmarks {}

/// The storage-neutral core, under its own name (everything below is also re-exported here).
pub use idempotency_core as core;
pub use idempotency_core::{
    Access, Attempt, Backoff, BeginRequest, Claim, Claimed, ClaimedRun, Clock, Completed, Completion,
    DEFAULT_CONSUMER_RETENTION, DEFAULT_LEASE, DEFAULT_RETENTION, Decision, DecodeError, DynStore, ErrorKind,
    Execution, Fenced, Fingerprint, FingerprintBuilder, FingerprintError, FingerprintMode, Guard, Held,
    IDEMPOTENCY_KEY_HEADER, InTransaction, JsonPointer, Key, KeyError, KeyLog, Lanes, ListFilter, LoggedKey,
    MAX_DURATION, MAX_KEY_LEN, ManualClock, MemoryStore, Outcome, OutcomePolicy, Purger, Record, RecordParts,
    RecordState, RecordSummary, Recorded, Redacted, Registry, RunLease, Scope, ScopeSecret, SecretError,
    StateFilter, Stats, Store, StoreAdmin, StoreError, StoreKind, SummaryState, SystemClock, Timestamp,
    Token, TransactionalStore, TxFuture, TxOperation, Watched, WriteFailure, WriteHealth, redact_url,
    stored_millis,
};

#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use idempotency_sqlite as sqlite;

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use idempotency_postgres as postgres;

#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use idempotency_mysql as mysql;

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use idempotency_redis as redis;

#[cfg(feature = "testkit")]
#[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
pub use idempotency_testkit as testkit;

#[cfg(feature = "amqp")]
#[cfg_attr(docsrs, doc(cfg(feature = "amqp")))]
pub use idempotency_amqp as amqp;
#[cfg(feature = "consumer")]
#[cfg_attr(docsrs, doc(cfg(feature = "consumer")))]
pub use idempotency_consumer as consumer;
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use idempotency_kafka as kafka;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub use idempotency_nats as nats;

#[cfg(feature = "outbox")]
#[cfg_attr(docsrs, doc(cfg(feature = "outbox")))]
pub use idempotency_outbox as outbox;

#[cfg(feature = "dynamodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "dynamodb")))]
pub use idempotency_dynamodb as dynamodb;

#[cfg(feature = "sqs")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqs")))]
pub use idempotency_sqs as sqs;

/// The reason a URL for a store whose feature is off cannot be opened. (With every store
/// feature on, only the tests use it.)
#[cfg_attr(
    all(
        feature = "sqlite",
        feature = "postgres",
        feature = "mysql",
        feature = "redis",
        feature = "dynamodb"
    ),
    allow(unused_macros)
)]
macro_rules! not_built {
    ($feature:literal) => {
        concat!(
            "this build has no `",
            $feature,
            "` store: enable the `",
            $feature,
            "` feature of the `idempotency` crate"
        )
    };
}

/// The stores this build opens by URL: the memory store, and one [`StoreKind`] per enabled
/// store feature. Schemes of stores whose feature is off are named, so that a URL for one gets
/// "enable the feature" rather than "unknown scheme".
pub fn registry() -> &'static Registry {
    static REGISTRY: LazyLock<Registry> = LazyLock::new(|| {
        let registry = Registry::new().with(MemoryStore::KIND);
        #[cfg(feature = "sqlite")]
        let registry = registry.with(sqlite::KIND);
        #[cfg(not(feature = "sqlite"))]
        let registry = registry.unavailable(&["sqlite"], not_built!("sqlite"));
        #[cfg(feature = "postgres")]
        let registry = registry.with(postgres::KIND);
        #[cfg(not(feature = "postgres"))]
        let registry = registry.unavailable(&["postgres", "postgresql"], not_built!("postgres"));
        #[cfg(feature = "redis")]
        let registry = registry.with(redis::KIND);
        #[cfg(not(feature = "redis"))]
        let registry = registry.unavailable(&["redis", "rediss", "redis-cluster"], not_built!("redis"));
        #[cfg(feature = "dynamodb")]
        let registry = registry.with(dynamodb::KIND);
        #[cfg(not(feature = "dynamodb"))]
        let registry = registry.unavailable(&["dynamodb"], not_built!("dynamodb"));
        #[cfg(feature = "mysql")]
        let registry = registry.with(mysql::KIND);
        #[cfg(not(feature = "mysql"))]
        let registry = registry.unavailable(&["mysql", "mariadb"], not_built!("mysql"));
        registry
    });
    &REGISTRY
}

/// The reason a URL for a broker whose feature is off cannot be consumed from.
#[cfg(feature = "consumer")]
#[cfg_attr(
    all(feature = "amqp", feature = "nats", feature = "kafka", feature = "sqs"),
    allow(unused_macros)
)]
macro_rules! no_source {
    ($feature:literal) => {
        concat!(
            "this build has no ",
            $feature,
            ":// sources: enable the `",
            $feature,
            "` feature (for idem: cargo install --path crates/idem --features ",
            $feature,
            ")"
        )
    };
}

/// The message sources this build consumes from by URL: one
/// [`SourceKind`](consumer::source::SourceKind) per enabled broker feature (`amqp`, `nats`,
/// `kafka`, `sqs`). Schemes of brokers whose feature is off are named, so that a URL for one
/// gets "enable the feature" rather than "unknown scheme".
#[cfg(feature = "consumer")]
#[cfg_attr(docsrs, doc(cfg(feature = "consumer")))]
pub fn sources() -> &'static consumer::source::Sources {
    static SOURCES: LazyLock<consumer::source::Sources> = LazyLock::new(|| {
        let sources = consumer::source::Sources::new();
        #[cfg(feature = "amqp")]
        let sources = sources.with(amqp::SOURCE);
        #[cfg(not(feature = "amqp"))]
        let sources = sources.unavailable(&["amqp", "amqps"], no_source!("amqp"));
        #[cfg(feature = "nats")]
        let sources = sources.with(nats::SOURCE);
        #[cfg(not(feature = "nats"))]
        let sources = sources.unavailable(&["nats"], no_source!("nats"));
        #[cfg(feature = "kafka")]
        let sources = sources.with(kafka::SOURCE);
        #[cfg(not(feature = "kafka"))]
        let sources = sources.unavailable(&["kafka"], no_source!("kafka"));
        #[cfg(feature = "sqs")]
        let sources = sources.with(sqs::SOURCE);
        #[cfg(not(feature = "sqs"))]
        let sources = sources.unavailable(&["sqs"], no_source!("sqs"));
        sources
    });
    &SOURCES
}

/// Opens the store a URL names, through [`registry`]:
///
/// * `memory://` — a [`MemoryStore`] (nothing survives the process);
/// * `sqlite://PATH`, `sqlite::memory:` — the SQLite store (feature `sqlite`);
/// * `postgres://…`, `postgresql://…` — the PostgreSQL store on its default table, created if
///   missing (feature `postgres`);
/// * `mysql://USER:PASSWORD@HOST:PORT/DATABASE`, `mariadb://…` — the MySQL/MariaDB store on its
///   default table in that database, created if missing (feature `mysql`);
/// * `redis://host:port`, `rediss://…` — the Redis store on one server (`?batch=on`: concurrent
///   `begin`s and `complete`s share script calls); `redis-cluster://h1:p1,h2:p2` — on a Redis
///   Cluster, through any of the listed nodes (feature `redis`);
/// * `dynamodb://TABLE?region=…&endpoint=…` — the DynamoDB store on that table, created with
///   on-demand billing if missing; credentials from the usual AWS environment (feature
///   `dynamodb`).
///
/// # Errors
///
/// [`ErrorKind::InvalidConfig`] for an unknown scheme, a scheme whose store is not compiled in,
/// or a malformed URL; otherwise the store's own error when opening fails.
pub async fn open(url: &str) -> Result<DynStore, StoreError> {
    registry().open(url).await
}

/// Opens the store `url` names, doing no more to it than `access` allows: the operations
/// commands inspect with [`Access::ReadOnly`] and purge with [`Access::Existing`], and neither
/// ever creates a file, a table or a schema.
///
/// # Errors
///
/// As [`open`], and a missing store or one that is not an idempotency store.
pub async fn open_with(url: &str, access: Access) -> Result<DynStore, StoreError> {
    registry().open_with(url, access).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opens the store `url` names (`server` is what a failure says is missing), claims a new
    /// key in it and releases the claim.
    #[cfg(any(
        feature = "postgres",
        feature = "mysql",
        feature = "redis",
        feature = "dynamodb"
    ))]
    async fn claims_and_releases(url: &str, server: &str) {
        let store = open(url)
            .await
            .unwrap_or_else(|e| panic!("{server} at {url} is needed for this test: {e}"));
        let request = BeginRequest::new(
            Scope::new("facade-test").unwrap(),
            Key::generate(),
            Fingerprint::of_bytes(b""),
        );
        let claim = store.begin(&request).await.unwrap();
        let Claim::Acquired(held) = claim else {
            panic!("{url}: expected Acquired, got {claim:?}")
        };
        let _ = store.release(&held).await.unwrap();
    }

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
            (
                "cassandra://root@localhost/test",
                "unknown store URL scheme `cassandra`",
            ),
            // Found by the store_url fuzz target: no `://`, and the text before the first `:`
            // is no scheme but a query with a password in it.
            ("db?user=app&password=s3cret&x=a:b", "is not a store URL"),
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
        assert!(matches!(store.begin(&request).await.unwrap(), Claim::Acquired(_)));
        assert!(dir.path().join("idem.db").exists());
        let error = open("sqlite://x.db?bogus=1").await.map(|_| ()).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidConfig);
    }

    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn opens_the_postgres_store_by_url() {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        claims_and_releases(&url, "PostgreSQL").await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test]
    async fn opens_the_mysql_store_by_url() {
        let url = std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
        let mariadb = url.replacen("mysql://", "mariadb://", 1);
        for url in [url.as_str(), mariadb.as_str()] {
            claims_and_releases(url, "MySQL/MariaDB").await;
        }
    }

    #[cfg(feature = "redis")]
    #[tokio::test]
    async fn opens_the_redis_stores_by_url() {
        let single = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let cluster = "redis-cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002";
        for url in [single.as_str(), cluster] {
            claims_and_releases(url, "Redis").await;
        }
        let error = open("redis-cluster://").await.map(|_| ()).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{error}");
    }

    #[cfg(feature = "dynamodb")]
    #[tokio::test]
    async fn opens_the_dynamodb_store_by_url_and_inspection_never_creates_a_table() {
        let endpoint = std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:5000".into());
        assert!(
            std::env::var_os("AWS_ACCESS_KEY_ID").is_some(),
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (any value for the local server), as scripts/test does"
        );
        let table = format!("facade_{}", Key::generate().as_str().replace('-', ""));
        let url = format!("dynamodb://{table}?region=us-east-1&endpoint={endpoint}");
        let missing = open_with(&url, Access::ReadOnly).await.map(|_| ()).unwrap_err();
        assert!(
            missing
                .to_string()
                .contains("does not exist: create it with `idem migrate`"),
            "{missing}"
        );
        claims_and_releases(&url, "the local AWS server").await;
        open_with(&url, Access::ReadOnly).await.unwrap();
    }

    /// Runs in every build: a registry in which a store is declared but not built names the
    /// feature to enable (the facade's own registry does this for each feature that is off).
    #[tokio::test]
    async fn names_the_missing_feature() {
        let registry = Registry::new()
            .with(MemoryStore::KIND)
            .unavailable(&["sqlite"], not_built!("sqlite"));
        let error = registry.open("sqlite://x.db").await.map(|_| ()).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidConfig);
        assert!(
            error.to_string().contains("enable the `sqlite` feature"),
            "{error}"
        );
        assert!(error.to_string().contains("available: memory://"), "{error}");
    }
}

//! Business rows beside a sqlx-based store's records, written once for every SQL server
//! (feature `sql`): the table of charges the [`same_transaction`](crate::same_transaction) suite
//! and the [`outage`] runs write in the record's transaction, in each server's
//! SQL. A store crate's tests implement [`Dialect`] on a type of their own (its placeholders,
//! its id column, how it names and kills a connection) and use [`Charges`].
//!
//! Also the one rule for naming the tables tests create on a shared server and for dropping
//! those a crashed run left behind: [`fresh_table`], [`outdated`], [`drop_outdated`].

use std::marker::PhantomData;
use std::sync::Arc;

use idempotency_core::sql::admin::{Engine, Param};
use idempotency_core::{
    Attempt, BeginRequest, Claim, Fingerprint, Key, Scope, Store, TransactionalStore, TxFuture,
};
use sqlx::{Connection, Database, Pool};

use crate::TcpProxy;
use crate::outage::{self, BoxError};
use crate::same_transaction::Business;

/// What differs between SQL servers in the tests' business rows.
pub trait Dialect: Send + Sync + 'static {
    /// The sqlx database.
    type Database: Engine;

    /// The store, whose transactions are the database's.
    type Store: TransactionalStore<Transaction = sqlx::Transaction<'static, Self::Database>>
        + Clone
        + Send
        + Sync
        + 'static;

    /// The server the tests use (their variable, or the loopback default).
    fn url() -> String;

    /// The store's pool.
    fn pool(store: &Self::Store) -> &Pool<Self::Database>;

    /// The store's records table, as its SQL names it (with its schema, if any).
    fn records_table(store: &Self::Store) -> String;

    /// Placeholder `n` (from 1) of a statement.
    fn placeholder(n: usize) -> String;

    /// The column definition of an id the server assigns, and primary key.
    const ID_COLUMN: &'static str;

    /// What an `INSERT` appends to select the new row's id, or `""` when
    /// [`INSERTED_ID`](Self::INSERTED_ID) reads it after.
    const RETURNING_ID: &'static str;

    /// Selects the id of the row the connection inserted last (`BIGINT`), when the `INSERT`
    /// selects none.
    const INSERTED_ID: &'static str;

    /// Selects the connection's id on the server (`BIGINT`).
    const CONNECTION_ID: &'static str;

    /// Ends connection `id` from another connection; a row, if any, is 1 when it did.
    fn kill(id: i64) -> String;

    /// The records table's `key` column as a statement names it (quoted where the word is
    /// reserved).
    const KEY_COLUMN: &'static str;
}

/// A `begin` of scope `reads` and `key`, leased for ten minutes.
fn read_request(key: &str, payload: &[u8]) -> BeginRequest {
    BeginRequest::new(
        Scope::new("reads").expect("a scope"),
        Key::new(key).expect("a key"),
        Fingerprint::of_bytes(payload),
    )
    .lease(std::time::Duration::from_secs(600))
}

/// Records `done` (completed) and `running` (in flight) in scope `reads` of `store`, for
/// [`reads_answer_while_the_rows_are_locked`] and a store's own checks of what its reads
/// write.
///
/// # Panics
///
/// When the store fails.
pub async fn record_done_and_running(store: &impl Store) {
    crate::completed(store, &read_request("done", b"a"), "charged").await;
    assert!(matches!(
        store.begin(&read_request("running", b"a")).await.unwrap(),
        Claim::Acquired(_)
    ));
}

/// The three `begin`s that change nothing, on the records of [`record_done_and_running`]: a
/// replay, a key in flight and another payload; checks each answer.
///
/// # Panics
///
/// When the store fails or an answer is another.
pub async fn ask_without_writing(store: &impl Store) {
    let replay = store.begin(&read_request("done", b"a")).await.unwrap();
    let in_flight = store.begin(&read_request("running", b"a")).await.unwrap();
    let mismatch = store.begin(&read_request("done", b"other")).await.unwrap();
    assert!(matches!(replay, Claim::Replay(_)), "{replay:?}");
    assert!(matches!(in_flight, Claim::InFlight { .. }), "{in_flight:?}");
    assert_eq!(mismatch, Claim::Mismatch);
}

/// A `begin` that finds a completed record, a live in-flight one or another payload reads and
/// writes nothing: it answers while another transaction holds both rows locked (`FOR
/// UPDATE`), as a long transaction or a claiming upsert would. A store whose `begin` wrote (or
/// locked) first would wait for the lock; the case gives it ten seconds.
///
/// # Panics
///
/// When the server is unreachable, or a `begin` waited for the lock.
pub async fn reads_answer_while_the_rows_are_locked<D: Dialect>(store: &D::Store) {
    record_done_and_running(store).await;
    let mut locker = <D::Database as Database>::Connection::connect(&D::url())
        .await
        .unwrap_or_else(|e| {
            let url = idempotency_core::redact_url(&D::url());
            panic!("the server at {url} is needed for this test: {e}")
        });
    D::Database::execute(&mut locker, "BEGIN".into(), &[], &[])
        .await
        .unwrap();
    let lock = format!(
        "SELECT 1 FROM {} WHERE scope = 'reads' AND {} IN ('done', 'running') FOR UPDATE",
        D::records_table(store),
        D::KEY_COLUMN
    );
    let locked = D::Database::fetch_all(&mut locker, lock.into(), &[], &[])
        .await
        .unwrap();
    assert_eq!(locked.len(), 2);
    let answered = tokio::time::timeout(std::time::Duration::from_secs(10), ask_without_writing(store)).await;
    D::Database::execute(&mut locker, "ROLLBACK".into(), &[], &[])
        .await
        .unwrap();
    answered.expect("a begin that changes nothing waited for another transaction's row lock");
}

/// The charges table of the tests: an id the server assigns, a key and cents, beside the
/// store's records table (named after it, so that the tests' clean-up of old tables takes it).
pub struct Charges<D>(PhantomData<fn() -> D>);

impl<D> Charges<D> {
    /// The charges of dialect `D`.
    #[must_use]
    pub fn new() -> Self {
        Self(PhantomData)
    }
}

impl<D> std::fmt::Debug for Charges<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Charges")
    }
}

impl<D> Default for Charges<D> {
    fn default() -> Self {
        Self::new()
    }
}

impl<D> Clone for Charges<D> {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl<D: Dialect> Charges<D> {
    /// Creates the charges table beside `store`'s records; its name.
    ///
    /// # Panics
    ///
    /// When the server refuses it.
    pub async fn create(store: &D::Store) -> Arc<str> {
        let table = format!("{}_charges", D::records_table(store));
        let create = format!(
            "CREATE TABLE {table} (id {}, idem_key VARCHAR(255) NOT NULL, cents INT NOT NULL)",
            D::ID_COLUMN
        );
        let mut connection = D::pool(store).acquire().await.expect("a connection");
        D::Database::execute(&mut *connection, create.into(), &[], &[])
            .await
            .unwrap_or_else(|e| panic!("create {table}: {e}"));
        table.into()
    }

    /// Inserts a charge of `cents` for `key` into `table` through `tx`; its id.
    ///
    /// # Errors
    ///
    /// The server's.
    pub async fn insert_charge(
        tx: &mut sqlx::Transaction<'static, D::Database>,
        table: &str,
        key: &Key,
        cents: i32,
    ) -> Result<i64, BoxError> {
        let insert = format!(
            "INSERT INTO {table} (idem_key, cents) VALUES ({}, {}){}",
            D::placeholder(1),
            D::placeholder(2),
            D::RETURNING_ID
        );
        let params = [
            Param::Text(Some(key.as_str())),
            Param::Int(Some(i64::from(cents))),
        ];
        let row = match D::Database::fetch_optional(&mut **tx, insert.into(), &params, &[0, 1]).await? {
            Some(row) => row,
            None => D::Database::fetch_optional(&mut **tx, D::INSERTED_ID.into(), &[], &[])
                .await?
                .ok_or("the server gave no inserted id")?,
        };
        Ok(D::Database::int(&row, 0)?)
    }

    /// The charges of `table` by key, read outside any transaction.
    ///
    /// # Panics
    ///
    /// When the server refuses the read.
    pub async fn by_key(store: &D::Store, table: &str) -> Vec<(String, i64)> {
        let count = format!("SELECT idem_key, COUNT(*) FROM {table} GROUP BY idem_key");
        let mut connection = D::pool(store).acquire().await.expect("a connection");
        let rows = D::Database::fetch_all(&mut *connection, count.into(), &[], &[])
            .await
            .unwrap_or_else(|e| panic!("count {table}: {e}"));
        rows.iter()
            .map(|row| {
                (
                    D::Database::text(row, 0).unwrap(),
                    D::Database::int(row, 1).unwrap(),
                )
            })
            .collect()
    }

    /// Writes a charge of 1,000 cents for the attempt's key into `table` through `tx`: an
    /// [`outage::WriteRow`].
    pub fn write_row<'t>(
        tx: &'t mut sqlx::Transaction<'static, D::Database>,
        attempt: Attempt,
        table: Arc<str>,
    ) -> TxFuture<'t, Result<(), BoxError>> {
        Box::pin(async move {
            Self::insert_charge(tx, &table, attempt.key(), 1000)
                .await
                .map(drop)
        })
    }
}

impl<D: Dialect> Business<D::Store> for Charges<D> {
    async fn create_table(&self, store: &D::Store) -> Arc<str> {
        Self::create(store).await
    }

    fn insert<'t>(
        &self,
        tx: &'t mut sqlx::Transaction<'static, D::Database>,
        table: Arc<str>,
        key: Key,
        cents: i32,
    ) -> TxFuture<'t, Result<i64, BoxError>> {
        Box::pin(async move { Self::insert_charge(tx, &table, &key, cents).await })
    }

    async fn rows(&self, store: &D::Store, table: &str, key: &Key) -> i64 {
        let count = format!(
            "SELECT COUNT(*) FROM {table} WHERE idem_key = {}",
            D::placeholder(1)
        );
        let mut connection = D::pool(store).acquire().await.expect("a connection");
        let row = D::Database::fetch_optional(
            &mut *connection,
            count.into(),
            &[Param::Text(Some(key.as_str()))],
            &[0],
        )
        .await
        .unwrap_or_else(|e| panic!("count {table}: {e}"))
        .expect("a count");
        D::Database::int(&row, 0).unwrap()
    }

    fn kill<'t>(
        &self,
        tx: &'t mut sqlx::Transaction<'static, D::Database>,
    ) -> TxFuture<'t, Result<(), BoxError>> {
        Box::pin(async move {
            let row = D::Database::fetch_optional(&mut **tx, D::CONNECTION_ID.into(), &[], &[])
                .await?
                .ok_or("the server gave no connection id")?;
            let id = D::Database::int(&row, 0)?;
            let mut killer = <<D::Database as Database>::Connection as Connection>::connect(&D::url())
                .await
                .unwrap_or_else(|e| panic!("a second connection to the server: {e}"));
            let killed = D::Database::fetch_optional(&mut killer, D::kill(id).into(), &[], &[])
                .await
                .unwrap_or_else(|e| panic!("kill connection {id}: {e}"));
            if let Some(row) = killed {
                assert_eq!(
                    D::Database::int(&row, 0).unwrap(),
                    1,
                    "connection {id} was not killed"
                );
            }
            killer.close().await.ok();
            Ok(())
        })
    }
}

/// [`outage::transactional_run`] on a charges table beside `store`'s records: every key's
/// charge written once although the server behind `proxy` went away mid-run.
pub async fn outage_in_same_transaction<D: Dialect>(store: D::Store, proxy: &TcpProxy) {
    let table = Charges::<D>::create(&store).await;
    let rows = async || Charges::<D>::by_key(&store, &table).await;
    outage::transactional_run(store.clone(), proxy, &table, Charges::<D>::write_row, rows).await;
}

/// The two outage tests of a sqlx-based store ([`outage::guarded_run`] and
/// [`outage_in_same_transaction`]), given its [`Dialect`], a function that starts a loopback
/// proxy in front of its server and one that connects a store on a table of its own through
/// that proxy. As the PostgreSQL and MySQL stores' `tests/it/connection_loss.rs` expand it:
///
/// ```text
/// idempotency_testkit::sql_outage_suite!(common::Sql, common::start_proxy, proxied_store);
/// ```
#[macro_export]
macro_rules! sql_outage_suite {
    ($dialect:ty, $start_proxy:path, $proxied_store:path) => {
        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn an_outage_gives_errors_then_correct_results_and_no_duplicates() {
            let proxy = $start_proxy().await;
            $crate::outage::guarded_run($proxied_store(&proxy).await, &proxy).await;
        }

        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn an_outage_in_same_transaction_mode_writes_each_row_once() {
            let proxy = $start_proxy().await;
            let store = $proxied_store(&proxy).await;
            $crate::sql::outage_in_same_transaction::<$dialect>(store, &proxy).await;
        }
    };
}

/// How old a test's table must be before another run drops it: older than any run.
const OUTDATED_AFTER: std::time::Duration = std::time::Duration::from_secs(3600);

/// A fresh suffix for the names of a test's tables on a shared server: the Unix time in seconds
/// and a random part, `{seconds}_{16 hex digits}`. The time lets a later run drop what a crashed
/// run left behind ([`outdated`]); the random part keeps apart two tests that start in the same
/// second (`cargo test` runs a file's tests as threads of one process).
#[must_use]
pub fn fresh_suffix() -> String {
    use std::hash::{BuildHasher, RandomState};
    let random = RandomState::new().hash_one(std::time::Instant::now());
    format!("{}_{random:016x}", unix_seconds())
}

/// A fresh table name, `{prefix}_{fresh_suffix}` (`prefix` without `_`).
#[must_use]
pub fn fresh_table(prefix: &str) -> String {
    format!("{prefix}_{}", fresh_suffix())
}

/// Whether `table`, named `{prefix}_{seconds}_…` as [`fresh_table`] names it, was created more
/// than an hour ago. A name without a time is never outdated: it is not a test's.
#[must_use]
pub fn outdated(table: &str) -> bool {
    let created = table.split('_').nth(1).and_then(|t| t.parse::<u64>().ok());
    created.is_some_and(|t| t.saturating_add(OUTDATED_AFTER.as_secs()) < unix_seconds())
}

/// The system clock in whole seconds since the Unix epoch, as the names carry it.
fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
}

/// Drops each of `tables` that is [`outdated`], as `qualified` names it in SQL (its schema, say).
/// A failed drop is left alone: another run may be dropping the same table.
pub async fn drop_outdated<DB>(pool: &Pool<DB>, tables: &[String], qualified: impl Fn(&str) -> String)
where
    DB: Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    for table in tables.iter().filter(|table| outdated(table)) {
        let drop = format!("DROP TABLE IF EXISTS {}", qualified(table));
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(drop)).execute(pool).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_names_carry_their_time_and_only_old_ones_are_outdated() {
        let (a, b) = (fresh_table("t"), fresh_table("t"));
        assert_ne!(a, b, "two names of the same instant differ");
        assert!(a.starts_with("t_") && !outdated(&a), "{a}");
        let now = unix_seconds();
        assert!(outdated(&format!("t_{}_00", now - 3601)));
        assert!(!outdated(&format!("t_{}_00", now - 3599)));
        for not_a_test_table in ["users", "t_users", "idempotency_records", "t__1"] {
            assert!(!outdated(not_a_test_table), "{not_a_test_table}");
        }
    }
}

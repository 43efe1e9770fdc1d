//! The outbox on MySQL and MariaDB: the same table and the same relay as on PostgreSQL, in this
//! dialect.
//!
//! What differs, and why:
//!
//! * **The schema is a database.** A [`Tables`] schema of `public` (the default) means the
//!   URL's own database; any other names a database of the server.
//! * **Groups are held with named locks.** A round takes `GET_LOCK(…, 0)` on each pending
//!   ordering group (what `pg_try_advisory_xact_lock` is on PostgreSQL) and releases them all
//!   after its commit; a relay that dies loses its session and its locks with it. The round's
//!   transaction reads at `READ COMMITTED`, so that the rows of a group just taken are read as
//!   the previous holder committed them, not as the round's first read saw them.
//! * **No notifications.** Relays poll (`idem relay --poll`).
//! * **Times are UTC** `DATETIME(6)` columns, written and compared with `UTC_TIMESTAMP(6)`,
//!   whatever the sessions' time zones.

use std::time::Duration;

use idempotency_mysql::sqlx::pool::PoolConnection;
use idempotency_mysql::sqlx::{self, AssertSqlSafe, MySql, MySqlConnection, MySqlPool, Transaction};

use crate::dialect::{
    Answer, Dialect, Held, OutboxRow, OutboxStats, PURGE_BATCH, Pending, PendingColumns, Purge, Round,
    RowColumns, StatsColumns, held, in_batches, select_one,
};
use crate::outbox::sealed;
use crate::{OUTBOX_VERSION, Outbox, OutboxConnection, OutboxError, OutgoingMessage, Tables, headers};

/// The lock every migration of this project takes on a MySQL server (the store's too).
const MIGRATION_LOCK: &str = "idempotency-migrate";

/// How long a migration waits for another instance's, in seconds.
const MIGRATION_LOCK_WAIT: i64 = 60;

/// Wraps a driver error with what was being done.
fn db(what: &'static str) -> impl FnOnce(sqlx::Error) -> OutboxError {
    move |source| OutboxError::MySql { what, source }
}

/// The outbox table's name as MySQL statements use it: `table` in the URL's database, or
/// `schema.table`.
fn qualified(tables: &Tables) -> String {
    match tables.schema_name() {
        "public" => tables.outbox_name().to_owned(),
        schema => format!("{schema}.{}", tables.outbox_name()),
    }
}

/// The statements that create the outbox table.
fn create_sql(tables: &Tables) -> String {
    let table = qualified(tables);
    let outbox = tables.outbox_name();
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    ordering_key VARCHAR(255) NOT NULL DEFAULT '',
    destination VARCHAR(1024) NOT NULL DEFAULT '',
    `key` VARCHAR(255) NULL,
    payload LONGBLOB NOT NULL,
    headers JSON NOT NULL DEFAULT ('[]'),
    created_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    sent_at DATETIME(6) NULL,
    attempts INT NOT NULL DEFAULT 0,
    last_error TEXT NULL,
    dead_at DATETIME(6) NULL,
    KEY {outbox}_pending (sent_at, dead_at, id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COMMENT = 'idempotency-outbox v{OUTBOX_VERSION}'"
    )
}

/// The table's comment, `None` when there is no such table.
async fn comment(connection: &mut MySqlConnection, tables: &Tables) -> Result<Option<String>, OutboxError> {
    let schema = match tables.schema_name() {
        "public" => None,
        schema => Some(schema),
    };
    sqlx::query_scalar(
        "SELECT TABLE_COMMENT FROM information_schema.TABLES
         WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ?",
    )
    .bind(schema)
    .bind(tables.outbox_name())
    .fetch_optional(connection)
    .await
    .map_err(db("read the schema version"))
}

/// Checks the outbox table's mark: absent is fine when `may_create`.
async fn check_mark(
    connection: &mut MySqlConnection,
    tables: &Tables,
    may_create: bool,
) -> Result<(), OutboxError> {
    let table = qualified(tables);
    let expected = format!("idempotency-outbox v{OUTBOX_VERSION}");
    match comment(connection, tables).await? {
        None if may_create => Ok(()),
        None => Err(OutboxError::Schema(format!(
            "{table} does not exist: create it with `idem relay migrate` (or `Tables::migrate_outbox`) first"
        ))),
        Some(comment) if comment == expected => Ok(()),
        Some(comment) => Err(OutboxError::Schema(format!(
            "{table} is marked {comment:?}; this version reads {expected:?} (a newer version created it, or it is another application's table)"
        ))),
    }
}

/// Creates the outbox table if it is missing, under the migration lock.
async fn migrate(pool: &MySqlPool, tables: &Tables) -> Result<(), OutboxError> {
    let mut connection = pool.acquire().await.map_err(db("connect for the migration"))?;
    let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
        .bind(MIGRATION_LOCK)
        .bind(MIGRATION_LOCK_WAIT)
        .fetch_one(&mut *connection)
        .await
        .map_err(db("lock the migration"))?;
    if locked != Some(1) {
        return Err(OutboxError::Invalid(format!(
            "another instance held the migration lock `{MIGRATION_LOCK}` for {MIGRATION_LOCK_WAIT} s"
        )));
    }
    let migrated = async {
        check_mark(&mut connection, tables, true).await?;
        sqlx::raw_sql(AssertSqlSafe(create_sql(tables)))
            .execute(&mut *connection)
            .await
            .map_err(db("create the outbox table"))?;
        // A table created by another instance between the check and the create is checked too.
        check_mark(&mut connection, tables, false).await
    }
    .await;
    let released = sqlx::query("DO RELEASE_LOCK(?)")
        .bind(MIGRATION_LOCK)
        .execute(&mut *connection)
        .await;
    migrated?;
    released.map_err(db("release the migration lock"))?;
    Ok(())
}

/// Checks that the outbox table exists and carries this version's mark.
async fn check(pool: &MySqlPool, tables: &Tables) -> Result<(), OutboxError> {
    let mut connection = pool.acquire().await.map_err(db("connect"))?;
    check_mark(&mut connection, tables, false).await
}

impl sealed::Sealed for MySqlConnection {}
impl OutboxConnection for MySqlConnection {
    fn insert<'a>(&'a mut self, outbox: &'a Outbox, message: &'a OutgoingMessage) -> Answer<'a, i64> {
        Box::pin(async move {
            let sql = format!(
                "INSERT INTO {} (destination, ordering_key, `key`, payload, headers) VALUES (?, ?, ?, ?, ?)",
                qualified(outbox.tables())
            );
            let done = sqlx::query(AssertSqlSafe(sql))
                .bind(&message.destination)
                .bind(&message.ordering_key)
                .bind(message.key.as_ref().map(idempotency_core::Key::as_str))
                .bind(&message.payload)
                .bind(headers::to_json(&message.headers).to_string())
                .execute(self)
                .await
                .map_err(db("enqueue an outbox message"))?;
            i64::try_from(done.last_insert_id())
                .map_err(|_| OutboxError::Invalid("the outbox's ids passed i64::MAX".into()))
        })
    }
}

impl sealed::Sealed for Transaction<'_, MySql> {}
impl OutboxConnection for Transaction<'_, MySql> {
    fn insert<'a>(&'a mut self, outbox: &'a Outbox, message: &'a OutgoingMessage) -> Answer<'a, i64> {
        (**self).insert(outbox, message)
    }
}

/// `?, ?, …`: `n` placeholders.
fn placeholders(n: usize) -> String {
    vec!["?"; n].join(", ")
}

/// A relay round on MySQL: a connection in a `READ COMMITTED` transaction holding the named
/// locks of its groups. Dropped before [`Round::finish`] (an error, a panic), the connection is
/// closed rather than returned to the pool: the server rolls back and releases the locks.
struct MySqlRound {
    /// `None` once finished: the connection went back to the pool.
    connection: Option<PoolConnection<MySql>>,
    /// The qualified table.
    table: String,
}

impl Drop for MySqlRound {
    fn drop(&mut self) {
        if let Some(connection) = &mut self.connection {
            connection.close_on_drop();
        }
    }
}

impl MySqlRound {
    /// The round's connection.
    fn connection(&mut self) -> &mut MySqlConnection {
        self.connection
            .as_deref_mut()
            .unwrap_or_else(|| unreachable!("a finished round runs no statement"))
    }

    /// Begins a round: holds the groups of up to `batch` of the oldest pending rows, and reads
    /// their pending rows in id order.
    async fn begin(
        pool: &MySqlPool,
        tables: &Tables,
        batch: u32,
    ) -> Result<(Self, Vec<Pending>), OutboxError> {
        let connection = pool.acquire().await.map_err(db("connect for a relay round"))?;
        let mut round = Self {
            connection: Some(connection),
            table: qualified(tables),
        };
        sqlx::raw_sql("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; BEGIN")
            .execute(round.connection())
            .await
            .map_err(db("begin a relay round"))?;
        // The groups of the oldest pending rows that no other relay holds, each now held by this
        // session. The derived tables (a `DISTINCT` and a `LIMIT`) are materialised, so the lock
        // is tried once per group.
        let table = round.table.clone();
        let keys = format!(
            "SELECT ordering_key FROM
             (SELECT DISTINCT ordering_key FROM
              (SELECT ordering_key FROM {table} WHERE sent_at IS NULL AND dead_at IS NULL ORDER BY id LIMIT ?) pending) groups_
             WHERE GET_LOCK(CONCAT('idem-outbox:', SHA1(CONCAT(?, ':', ordering_key))), 0) = 1"
        );
        let held: Vec<String> = sqlx::query_scalar(AssertSqlSafe(keys))
            .bind(i64::from(batch))
            .bind(table.as_str())
            .fetch_all(round.connection())
            .await
            .map_err(db("lock the pending ordering groups"))?;
        if held.is_empty() {
            return Ok((round, Vec::new()));
        }
        let claim = format!(
            "SELECT id, ordering_key, destination, `key`, payload, CAST(headers AS CHAR) AS headers, attempts
             FROM {table} WHERE sent_at IS NULL AND dead_at IS NULL AND ordering_key IN ({}) ORDER BY id LIMIT ?",
            placeholders(held.len())
        );
        let mut query = sqlx::query_as::<_, PendingColumns>(AssertSqlSafe(claim));
        for group in &held {
            query = query.bind(group);
        }
        let rows = query
            .bind(i64::from(batch))
            .fetch_all(round.connection())
            .await
            .map_err(db("read the pending rows"))?;
        Ok((round, rows.into_iter().map(Pending::from).collect()))
    }
}

impl Round for MySqlRound {
    fn failed<'b>(&'b mut self, id: i64, why: &'b str, dead: bool) -> Answer<'b, ()> {
        Box::pin(async move {
            let sql = format!(
                "UPDATE {} SET attempts = attempts + 1, last_error = ?,
                        dead_at = CASE WHEN ? THEN UTC_TIMESTAMP(6) END WHERE id = ?",
                self.table
            );
            sqlx::query(AssertSqlSafe(sql))
                .bind(why)
                .bind(dead)
                .bind(id)
                .execute(self.connection())
                .await
                .map_err(db("record a publish error"))?;
            Ok(())
        })
    }

    fn finish(mut self: Box<Self>, sent: &[i64]) -> Answer<'_, ()> {
        Box::pin(async move {
            if !sent.is_empty() {
                let sql = format!(
                    "UPDATE {} SET sent_at = UTC_TIMESTAMP(6), attempts = attempts + 1 WHERE id IN ({})",
                    self.table,
                    placeholders(sent.len())
                );
                let mut query = sqlx::query(AssertSqlSafe(sql));
                for id in sent {
                    query = query.bind(id);
                }
                query
                    .execute(self.connection())
                    .await
                    .map_err(db("mark rows sent"))?;
            }
            // Committed before the groups are released: the next holder reads them sent.
            sqlx::raw_sql("COMMIT; DO RELEASE_ALL_LOCKS()")
                .execute(self.connection())
                .await
                .map_err(db("commit a relay round"))?;
            // Back to the pool, its locks released and its transaction ended.
            drop(self.connection.take());
            Ok(())
        })
    }
}

/// An age in seconds, by the server's UTC clock, of the `DATETIME(6)` column expression `at`.
fn age(at: &str) -> String {
    format!("TIMESTAMPDIFF(MICROSECOND, {at}, UTC_TIMESTAMP(6)) / 1e6")
}

/// A duration as the microseconds `INTERVAL ? MICROSECOND` takes.
fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

impl Dialect for MySqlPool {
    fn qualified_outbox(&self, tables: &Tables) -> String {
        qualified(tables)
    }

    fn reachable(&self) -> Answer<'_, ()> {
        Box::pin(async move { select_one(self).await.map_err(db("answer SELECT 1")) })
    }

    fn migrate<'a>(&'a self, tables: &'a Tables) -> Answer<'a, ()> {
        Box::pin(migrate(self, tables))
    }

    fn check<'a>(&'a self, tables: &'a Tables) -> Answer<'a, ()> {
        Box::pin(check(self, tables))
    }

    fn round<'a>(&'a self, tables: &'a Tables, batch: u32) -> Answer<'a, Held> {
        Box::pin(async move { MySqlRound::begin(self, tables, batch).await.map(held) })
    }

    fn list<'a>(&'a self, tables: &'a Tables, all: bool, limit: i64) -> Answer<'a, Vec<OutboxRow>> {
        Box::pin(async move {
            let sql = format!(
                "SELECT id, ordering_key, destination, `key`, CAST(sent_at IS NOT NULL AS SIGNED),
                        CAST(dead_at IS NOT NULL AS SIGNED), attempts, last_error, {}
                 FROM {} WHERE ? OR sent_at IS NULL ORDER BY id LIMIT ?",
                age("created_at"),
                qualified(tables)
            );
            let rows: Vec<RowColumns> = sqlx::query_as(AssertSqlSafe(sql))
                .bind(all)
                .bind(limit)
                .fetch_all(self)
                .await
                .map_err(db("list the outbox"))?;
            Ok(rows.into_iter().map(OutboxRow::from).collect())
        })
    }

    fn stats<'a>(&'a self, tables: &'a Tables) -> Answer<'a, OutboxStats> {
        Box::pin(async move {
            let sql = format!(
                "SELECT COUNT(CASE WHEN sent_at IS NULL AND dead_at IS NULL THEN 1 END),
                        COUNT(CASE WHEN sent_at IS NOT NULL THEN 1 END),
                        COUNT(CASE WHEN dead_at IS NOT NULL AND sent_at IS NULL THEN 1 END),
                        {}
                 FROM {}",
                age("MIN(CASE WHEN sent_at IS NULL AND dead_at IS NULL THEN created_at END)"),
                qualified(tables)
            );
            let counts: StatsColumns = sqlx::query_as(AssertSqlSafe(sql))
                .fetch_one(self)
                .await
                .map_err(db("count the outbox"))?;
            Ok(counts.into())
        })
    }

    /// The relays find the rows at their next poll: MySQL has no notifications.
    fn replay<'a>(&'a self, tables: &'a Tables, id: Option<i64>) -> Answer<'a, u64> {
        Box::pin(async move {
            let sql = format!(
                "UPDATE {} SET dead_at = NULL, attempts = 0, last_error = NULL
                 WHERE dead_at IS NOT NULL AND sent_at IS NULL AND (? IS NULL OR id = ?)",
                qualified(tables)
            );
            Ok(sqlx::query(AssertSqlSafe(sql))
                .bind(id)
                .bind(id)
                .execute(self)
                .await
                .map_err(db("replay dead outbox rows"))?
                .rows_affected())
        })
    }

    fn purge<'a>(&'a self, tables: &'a Tables, rows: Purge, age: Duration) -> Answer<'a, u64> {
        // As on PostgreSQL: dead rows parked at least `age` ago, sent rows older than `age`.
        let older = match rows {
            Purge::Sent => "sent_at <",
            Purge::Dead => "sent_at IS NULL AND dead_at <=",
        };
        let sql = format!(
            "DELETE FROM {} WHERE {older} UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND LIMIT {PURGE_BATCH}",
            qualified(tables)
        );
        Box::pin(async move {
            in_batches(|| async {
                Ok(sqlx::query(AssertSqlSafe(sql.as_str()))
                    .bind(micros(age))
                    .execute(self)
                    .await
                    .map_err(db(rows.what()))?
                    .rows_affected())
            })
            .await
        })
    }
}

//! The outbox on PostgreSQL: the table of [`Tables::migrate`], rounds that hold their groups
//! with transaction-scoped advisory locks, and relays woken by the table's `NOTIFY`.

use std::time::Duration;

use idempotency_core::Key;
use idempotency_postgres::sqlx::{self, AssertSqlSafe, PgConnection, PgPool, Postgres, Row};

use crate::dialect::{
    Answer, Dialect, Held, OutboxRow, OutboxStats, PURGE_BATCH, Pending, PendingColumns, Purge, Round,
    RowColumns, StatsColumns, held, in_batches, select_one,
};
use crate::outbox::sealed;
use crate::{Outbox, OutboxConnection, OutboxError, OutgoingMessage, Tables, headers};

impl sealed::Sealed for PgConnection {}
impl OutboxConnection for PgConnection {
    fn insert<'a>(&'a mut self, outbox: &'a Outbox, message: &'a OutgoingMessage) -> Answer<'a, i64> {
        Box::pin(async move {
            // The table's trigger notifies the relays when the transaction commits.
            let sql = format!(
                "INSERT INTO {} (destination, ordering_key, key, payload, headers) VALUES ($1, $2, $3, $4, $5::jsonb)
                 RETURNING id",
                outbox.tables().qualified_outbox()
            );
            let row = sqlx::query(AssertSqlSafe(sql))
                .bind(&message.destination)
                .bind(&message.ordering_key)
                .bind(message.key.as_ref().map(Key::as_str))
                .bind(&message.payload)
                .bind(headers::to_json(&message.headers).to_string())
                .fetch_one(self)
                .await
                .map_err(OutboxError::db("enqueue an outbox message"))?;
            Ok(row.get("id"))
        })
    }
}

impl sealed::Sealed for sqlx::Transaction<'_, Postgres> {}
impl OutboxConnection for sqlx::Transaction<'_, Postgres> {
    fn insert<'a>(&'a mut self, outbox: &'a Outbox, message: &'a OutgoingMessage) -> Answer<'a, i64> {
        (**self).insert(outbox, message)
    }
}

/// A relay round on PostgreSQL: a transaction holding its groups' advisory locks.
struct PgRound {
    tx: sqlx::Transaction<'static, Postgres>,
    table: String,
}

impl PgRound {
    /// Begins a round (see [`Dialect::round`]).
    async fn begin(pool: &PgPool, tables: &Tables, batch: u32) -> Result<(Self, Vec<Pending>), OutboxError> {
        let table = tables.qualified_outbox();
        let mut tx = pool
            .begin()
            .await
            .map_err(OutboxError::db("begin a relay round"))?;
        // The ordering keys of the oldest pending rows that no other relay holds, each now held
        // by this transaction. The lock is a volatile call, so PostgreSQL evaluates it on the
        // distinct keys only, after the limit.
        let keys = format!(
            "SELECT ordering_key FROM
             (SELECT DISTINCT ordering_key FROM
              (SELECT ordering_key FROM {table} WHERE sent_at IS NULL AND dead_at IS NULL ORDER BY id LIMIT $1) pending) keys
             WHERE pg_try_advisory_xact_lock(hashtextextended('{table}:' || ordering_key, 0))"
        );
        let held: Vec<String> = sqlx::query_scalar(AssertSqlSafe(keys))
            .bind(i64::from(batch))
            .fetch_all(&mut *tx)
            .await
            .map_err(OutboxError::db("lock the pending ordering keys"))?;
        if held.is_empty() {
            return Ok((Self { tx, table }, Vec::new()));
        }
        let claim = format!(
            "SELECT id, ordering_key, destination, key, payload, headers::text AS headers, attempts FROM {table}
             WHERE sent_at IS NULL AND dead_at IS NULL AND ordering_key = ANY($1) ORDER BY id LIMIT $2"
        );
        let rows: Vec<PendingColumns> = sqlx::query_as(AssertSqlSafe(claim))
            .bind(&held)
            .bind(i64::from(batch))
            .fetch_all(&mut *tx)
            .await
            .map_err(OutboxError::db("read the pending rows"))?;
        Ok((Self { tx, table }, rows.into_iter().map(Pending::from).collect()))
    }
}

impl Round for PgRound {
    fn failed<'b>(&'b mut self, id: i64, why: &'b str, dead: bool) -> Answer<'b, ()> {
        Box::pin(async move {
            // A row parked as dead: its group goes on without it.
            let sql = format!(
                "UPDATE {} SET attempts = attempts + 1, last_error = $2, dead_at = CASE WHEN $3 THEN now() END
                 WHERE id = $1",
                self.table
            );
            sqlx::query(AssertSqlSafe(sql))
                .bind(id)
                .bind(why)
                .bind(dead)
                .execute(&mut *self.tx)
                .await
                .map_err(OutboxError::db("record a publish error"))?;
            Ok(())
        })
    }

    fn finish(mut self: Box<Self>, sent: &[i64]) -> Answer<'_, ()> {
        Box::pin(async move {
            if !sent.is_empty() {
                let sql = format!(
                    "UPDATE {} SET sent_at = now(), attempts = attempts + 1 WHERE id = ANY($1)",
                    self.table
                );
                sqlx::query(AssertSqlSafe(sql))
                    .bind(sent)
                    .execute(&mut *self.tx)
                    .await
                    .map_err(OutboxError::db("mark rows sent"))?;
            }
            self.tx
                .commit()
                .await
                .map_err(OutboxError::db("commit a relay round"))
        })
    }
}

impl Dialect for PgPool {
    fn qualified_outbox(&self, tables: &Tables) -> String {
        tables.qualified_outbox()
    }

    fn reachable(&self) -> Answer<'_, ()> {
        Box::pin(async move { select_one(self).await.map_err(OutboxError::db("answer SELECT 1")) })
    }

    fn migrate<'a>(&'a self, tables: &'a Tables) -> Answer<'a, ()> {
        Box::pin(tables.migrate_tables(self, false))
    }

    fn check<'a>(&'a self, tables: &'a Tables) -> Answer<'a, ()> {
        Box::pin(tables.check_tables(self, false))
    }

    fn round<'a>(&'a self, tables: &'a Tables, batch: u32) -> Answer<'a, Held> {
        Box::pin(async move { PgRound::begin(self, tables, batch).await.map(held) })
    }

    fn list<'a>(&'a self, tables: &'a Tables, all: bool, limit: i64) -> Answer<'a, Vec<OutboxRow>> {
        Box::pin(async move {
            let sql = format!(
                "SELECT id, ordering_key, destination, key, (sent_at IS NOT NULL)::int::int8, (dead_at IS NOT NULL)::int::int8,
                        attempts, last_error, extract(epoch FROM now() - created_at)::float8
                 FROM {} WHERE $1 OR sent_at IS NULL ORDER BY id LIMIT $2",
                tables.qualified_outbox()
            );
            let rows: Vec<RowColumns> = sqlx::query_as(AssertSqlSafe(sql))
                .bind(all)
                .bind(limit)
                .fetch_all(self)
                .await
                .map_err(OutboxError::db("list the outbox"))?;
            Ok(rows.into_iter().map(OutboxRow::from).collect())
        })
    }

    fn stats<'a>(&'a self, tables: &'a Tables) -> Answer<'a, OutboxStats> {
        Box::pin(async move {
            let sql = format!(
                "SELECT count(*) FILTER (WHERE sent_at IS NULL AND dead_at IS NULL), count(*) FILTER (WHERE sent_at IS NOT NULL),
                        count(*) FILTER (WHERE dead_at IS NOT NULL AND sent_at IS NULL),
                        extract(epoch FROM now() - min(created_at) FILTER (WHERE sent_at IS NULL AND dead_at IS NULL))::float8
                 FROM {}",
                tables.qualified_outbox()
            );
            let counts: StatsColumns = sqlx::query_as(AssertSqlSafe(sql))
                .fetch_one(self)
                .await
                .map_err(OutboxError::db("count the outbox"))?;
            Ok(counts.into())
        })
    }

    fn replay<'a>(&'a self, tables: &'a Tables, id: Option<i64>) -> Answer<'a, u64> {
        Box::pin(async move {
            let sql = format!(
                "UPDATE {} SET dead_at = NULL, attempts = 0, last_error = NULL
                 WHERE dead_at IS NOT NULL AND sent_at IS NULL AND ($1::bigint IS NULL OR id = $1)",
                tables.qualified_outbox()
            );
            let replayed = sqlx::query(AssertSqlSafe(sql))
                .bind(id)
                .execute(self)
                .await
                .map_err(OutboxError::db("replay dead outbox rows"))?
                .rows_affected();
            if replayed > 0 {
                // The relays are woken as by an insert.
                sqlx::query("SELECT pg_notify($1, '')")
                    .bind(tables.outbox_channel())
                    .execute(self)
                    .await
                    .map_err(OutboxError::db("wake the relays"))?;
            }
            Ok(replayed)
        })
    }

    fn purge<'a>(&'a self, tables: &'a Tables, rows: Purge, age: Duration) -> Answer<'a, u64> {
        let table = tables.qualified_outbox();
        let older = match rows {
            Purge::Sent => "sent_at < now() - make_interval(secs => $1)",
            Purge::Dead => "sent_at IS NULL AND dead_at <= now() - make_interval(secs => $1)",
        };
        let sql = format!(
            "DELETE FROM {table} WHERE id IN (SELECT id FROM {table} WHERE {older} LIMIT {PURGE_BATCH})"
        );
        Box::pin(async move {
            in_batches(|| async {
                Ok(sqlx::query(AssertSqlSafe(sql.as_str()))
                    .bind(age.as_secs_f64())
                    .execute(self)
                    .await
                    .map_err(OutboxError::db(rows.what()))?
                    .rows_affected())
            })
            .await
        })
    }

    fn notifications(&self) -> Option<&PgPool> {
        Some(self)
    }
}

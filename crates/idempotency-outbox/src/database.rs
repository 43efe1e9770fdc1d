//! The databases an outbox lives in.

#[cfg(feature = "mysql")]
use idempotency_mysql::sqlx::MySqlPool;
use idempotency_postgres::sqlx::PgPool;

use crate::Tables;

/// A pool on the database of an outbox table: PostgreSQL, or with the `mysql` feature MySQL or
/// MariaDB. The relay and the operations functions take one (or anything that converts into
/// one: `PgPool`, `&PgPool`, `MySqlPool`, `&MySqlPool`).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Database {
    /// PostgreSQL: rounds hold their groups with advisory locks, relays wake on `NOTIFY`.
    Postgres(PgPool),
    /// MySQL or MariaDB: rounds hold their groups with named locks, relays poll.
    #[cfg(feature = "mysql")]
    MySql(MySqlPool),
}

impl Database {
    /// The outbox table's name as this database's statements use it (the default name of a
    /// relay).
    #[must_use]
    pub fn qualified_outbox(&self, tables: &Tables) -> String {
        match self {
            Self::Postgres(_) => tables.qualified_outbox(),
            #[cfg(feature = "mysql")]
            Self::MySql(_) => crate::mysql::qualified(tables),
        }
    }
}

impl Database {
    /// Whether the database answers a `SELECT 1` now (a readiness probe's question).
    ///
    /// # Errors
    ///
    /// The driver's error: the database cannot be reached, or refused the connection.
    pub async fn reachable(&self) -> Result<(), crate::OutboxError> {
        const WHAT: &str = "answer SELECT 1";
        let ping = sqlx::raw_sql(sqlx::AssertSqlSafe("SELECT 1"));
        match self {
            Self::Postgres(pool) => ping
                .execute(pool)
                .await
                .map(|_| ())
                .map_err(crate::OutboxError::db(WHAT)),
            #[cfg(feature = "mysql")]
            Self::MySql(pool) => ping
                .execute(pool)
                .await
                .map(|_| ())
                .map_err(|source| crate::OutboxError::MySql { what: WHAT, source }),
        }
    }
}

impl From<PgPool> for Database {
    fn from(pool: PgPool) -> Self {
        Self::Postgres(pool)
    }
}

impl From<&PgPool> for Database {
    fn from(pool: &PgPool) -> Self {
        Self::Postgres(pool.clone())
    }
}

impl From<&Database> for Database {
    fn from(database: &Database) -> Self {
        database.clone()
    }
}

#[cfg(feature = "mysql")]
impl From<MySqlPool> for Database {
    fn from(pool: MySqlPool) -> Self {
        Self::MySql(pool)
    }
}

#[cfg(feature = "mysql")]
impl From<&MySqlPool> for Database {
    fn from(pool: &MySqlPool) -> Self {
        Self::MySql(pool.clone())
    }
}

//! The databases an outbox lives in.

#[cfg(feature = "mysql")]
use idempotency_mysql::sqlx::MySqlPool;
use idempotency_postgres::sqlx::PgPool;

use crate::dialect::Dialect;
use crate::{OutboxError, Tables};

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
    /// This database's outbox statements: the one place a database is chosen.
    pub(crate) fn dialect(&self) -> &dyn Dialect {
        match self {
            Self::Postgres(pool) => pool,
            #[cfg(feature = "mysql")]
            Self::MySql(pool) => pool,
        }
    }

    /// The outbox table's name as this database's statements use it (the default name of a
    /// relay).
    #[must_use]
    pub fn qualified_outbox(&self, tables: &Tables) -> String {
        self.dialect().qualified_outbox(tables)
    }

    /// Whether the database answers a `SELECT 1` now (a readiness probe's question).
    ///
    /// # Errors
    ///
    /// The driver's error: the database cannot be reached, or refused the connection.
    pub async fn reachable(&self) -> Result<(), OutboxError> {
        self.dialect().reachable().await
    }
}

impl Tables {
    /// Creates (or upgrades) the outbox table alone, as [`migrate`](Self::migrate) does both:
    /// what `idem relay migrate` runs for a service that has no inbox. On PostgreSQL or, with
    /// the `mysql` feature, on MySQL and MariaDB (where the schema `public`, the default, means
    /// the URL's database, and the lock is the named lock `idempotency-migrate`).
    ///
    /// # Errors
    ///
    /// As [`migrate`](Self::migrate).
    pub async fn migrate_outbox(&self, database: impl Into<Database>) -> Result<(), OutboxError> {
        database.into().dialect().migrate(self).await
    }

    /// As [`check`](Self::check), for the outbox table alone.
    ///
    /// # Errors
    ///
    /// As [`check`](Self::check).
    pub async fn check_outbox(&self, database: impl Into<Database>) -> Result<(), OutboxError> {
        database.into().dialect().check(self).await
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

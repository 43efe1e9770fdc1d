//! Connection options, and the table and schema names the store's SQL is built with.

use std::str::FromStr;
use std::time::Duration;

#[cfg(any(doc, test))]
use idempotency_core::ErrorKind;
use idempotency_core::{Access, GroupSettings, Identifier, StoreError};
use sqlx::postgres::PgConnectOptions;

/// How to connect a [`crate::PostgresStore`].
///
/// ```
/// use idempotency_postgres::PostgresOptions;
///
/// let options = PostgresOptions::from_url("postgres://postgres@127.0.0.1/test")?
///     .table("payment_keys")?
///     .schema("billing")?
///     .max_connections(32);
/// assert_eq!(options.qualified_table(), "billing.payment_keys");
/// # Ok::<(), idempotency_core::StoreError>(())
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct PostgresOptions {
    /// The parsed connection options (host, port, database, credentials, TLS…).
    pub connect: PgConnectOptions,
    /// The URL's group commit (`?batch=on`, [`group_commit_parameters`](idempotency_core::sql::group_commit_parameters)),
    /// for [`KIND`], which opens the store behind a [`GroupCommit`](idempotency_core::GroupCommit).
    pub group_commit: Option<GroupSettings>,
    /// The records table (default `idempotency_records`).
    pub table: Identifier,
    /// The schema of the table (default `public`).
    pub schema: Identifier,
    /// The most connections the store's operations use (default 16); the sqlx pool the
    /// application's own transactions use ([`crate::PostgresStore::pool`]) has the same bound,
    /// and opens connections as they are needed.
    pub max_connections: u32,
    /// How long an operation waits for a free connection before failing with a retryable
    /// [`ErrorKind::Timeout`] (default 5 s). A `begin` or a read waits at most this long for
    /// its lane too, then fails with [`ErrorKind::Overloaded`].
    pub acquire_timeout: Duration,
    /// The connections kept for lease-keeping (`extend`, `complete`, `release`): `begin` and
    /// the reads use at most `max_connections - lease_connections` at once, so a storm of
    /// retries never delays a running attempt's heartbeat (default: a quarter of the pool, at
    /// least 1). See [`idempotency_core::Lanes`].
    pub lease_connections: u32,
    /// Whether `connect` creates or upgrades the schema (default `true`; turn it off when the
    /// application's role may not run DDL, and run [`crate::PostgresStore::migrate`] from a
    /// deployment step instead).
    pub migrate: bool,
    /// What connecting may do (default [`Access::Create`]: migrate as `migrate` says). With
    /// [`Access::Existing`] or [`Access::ReadOnly`] nothing is migrated, a URL without a
    /// database name or a database without the records table is refused, and read-only
    /// sessions run with `default_transaction_read_only`.
    pub access: Access,
}

idempotency_core::sql_options_debug!(PostgresOptions {
    group_commit,
    table,
    schema,
    max_connections,
    acquire_timeout,
    lease_connections,
    migrate,
    access
});

impl PostgresOptions {
    /// Parses a `postgres://` or `postgresql://` URL (libpq syntax, as sqlx accepts it).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::InvalidConfig`] for another scheme or a malformed URL. The message never
    /// contains the password.
    pub fn from_url(url: &str) -> Result<Self, StoreError> {
        let (url, group_commit) = idempotency_core::sql::group_commit_parameters(url, false)?;
        let url = url.as_str();
        let connect = idempotency_core::sql::parse_url(
            url,
            "PostgreSQL",
            &["postgres", "postgresql"],
            &[
                "sslrootcert",
                "ssl-root-cert",
                "ssl-ca",
                "sslcert",
                "ssl-cert",
                "sslkey",
                "ssl-key",
            ],
            PgConnectOptions::from_str,
        )?;
        Ok(Self {
            group_commit,
            ..Self::with(connect)
        })
    }

    /// Options around connection options built in code.
    #[must_use]
    pub fn with(connect: PgConnectOptions) -> Self {
        idempotency_core::sql_options_defaults!(Self {
            connect,
            schema: Identifier::new("public").expect("a valid identifier"),
        })
    }

    idempotency_core::sql_pool_options!();

    /// Sets the schema of the records table.
    ///
    /// # Errors
    ///
    /// As [`Identifier::new`].
    pub fn schema(mut self, schema: &str) -> Result<Self, StoreError> {
        self.schema = Identifier::new(schema)?;
        Ok(self)
    }

    /// `schema.table`, as used in the store's SQL.
    #[must_use]
    pub fn qualified_table(&self) -> String {
        format!("{}.{}", self.schema, self.table)
    }
}

idempotency_core::url_store_kind! {
    /// `postgres://…` and `postgresql://…` URLs: the store on its default table, created if
    /// missing (see [`PostgresOptions::from_url`]), for a [`Registry`](idempotency_core::Registry).
    name: "postgres",
    schemes: &["postgres", "postgresql"],
    example: "postgres://…",
    options: PostgresOptions,
    open: crate::PostgresStore::connect_with,
    group_commit: group_commit,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_parsed_and_never_echo_passwords() {
        let options = PostgresOptions::from_url("postgres://app:s3cret@127.0.0.1:5433/orders").unwrap();
        assert_eq!(options.connect.get_port(), 5433);
        assert_eq!(options.connect.get_database(), Some("orders"));
        assert_eq!(options.qualified_table(), "public.idempotency_records");
        assert!(!format!("{options:?}").contains("s3cret"));

        for url in [
            "mysql://app:s3cret@db/x",
            "127.0.0.1:5432",
            "postgres://app:s3cret@host:notaport/db",
        ] {
            let error = PostgresOptions::from_url(url).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{url}");
            assert!(!error.to_string().contains("s3cret"), "{url}: {error}");
        }
    }
}

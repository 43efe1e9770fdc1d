//! Connection options and the table name the store's SQL is built with.

use std::str::FromStr;
use std::time::Duration;

use idempotency_core::{Access, ErrorKind, GroupSettings, Identifier, StoreError, redact_url};
use sqlx::mysql::MySqlConnectOptions;

/// How to connect a [`crate::MysqlStore`].
///
/// ```
/// use idempotency_mysql::MysqlOptions;
///
/// let options = MysqlOptions::from_url("mysql://app@127.0.0.1/payments")?
///     .table("payment_keys")?
///     .max_connections(32);
/// assert_eq!(options.table.as_str(), "payment_keys");
/// assert_eq!(options.lease_connections, 8);
/// # Ok::<(), idempotency_core::StoreError>(())
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct MysqlOptions {
    /// The parsed connection options (host, port, database, credentials, TLS…). The store
    /// always sets the session's `time_zone` to `+00:00`.
    pub connect: MySqlConnectOptions,
    /// The URL's group commit (`?batch=on`, [`group_commit_parameters`](idempotency_core::sql::group_commit_parameters)),
    /// for [`KIND`], which opens the store behind a [`GroupCommit`](idempotency_core::GroupCommit).
    pub group_commit: Option<GroupSettings>,
    /// The records table, in the URL's database (default `idempotency_records`).
    pub table: Identifier,
    /// The most connections the store's operations use (default 16); the sqlx pool the
    /// application's own transactions use ([`crate::MysqlStore::pool`]) has the same bound,
    /// and opens connections as they are needed.
    pub max_connections: u32,
    /// How long an operation waits for a free connection before failing with a retryable
    /// [`ErrorKind::Timeout`] (default 5 s). A `begin` or a read waits at most this long for
    /// its lane too, then fails with [`ErrorKind::Overloaded`].
    pub acquire_timeout: Duration,
    /// The connections kept for lease-keeping (`extend`, `complete`, `release`): `begin` and
    /// the reads use at most `max_connections - lease_connections` at once (default: a quarter
    /// of the pool, at least 1). See [`idempotency_core::Lanes`].
    pub lease_connections: u32,
    /// Whether `connect` creates the table (default `true`; turn it off when the application's
    /// account may not run DDL, and run [`crate::MysqlStore::migrate`] from a deployment step).
    pub migrate: bool,
    /// What connecting may do (default [`Access::Create`]). With [`Access::Existing`] or
    /// [`Access::ReadOnly`] nothing is created and a database without the records table is
    /// refused; read-only sessions run `SET SESSION TRANSACTION READ ONLY`.
    pub access: Access,
}

idempotency_core::sql_options_debug!(MysqlOptions {
    group_commit,
    table,
    max_connections,
    acquire_timeout,
    lease_connections,
    migrate,
    access
});

impl MysqlOptions {
    /// Parses a `mysql://` or `mariadb://` URL (`mysql://USER:PASSWORD@HOST:PORT/DATABASE`,
    /// with sqlx's options such as `?ssl-mode=required`). The URL must name the database: MySQL
    /// has no default one to put the table in.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::InvalidConfig`] for another scheme, a malformed URL or one without a
    /// database. The message never contains the password.
    pub fn from_url(url: &str) -> Result<Self, StoreError> {
        let (url, group_commit) = idempotency_core::sql::group_commit_parameters(url, false)?;
        let url = url.as_str();
        let connect = idempotency_core::sql::parse_url(
            url,
            "MySQL",
            &["mysql", "mariadb"],
            &["ssl-ca", "sslca", "ssl-cert", "sslcert", "ssl-key", "sslkey"],
            MySqlConnectOptions::from_str,
        )?;
        if connect.get_database().is_none_or(str::is_empty) {
            return Err(StoreError::new(
                ErrorKind::InvalidConfig,
                format!(
                    "the MySQL URL `{}` names no database: name the database the records table lives in, mysql://HOST/DATABASE",
                    redact_url(url)
                ),
            ));
        }
        Ok(Self {
            group_commit,
            ..Self::with(connect)
        })
    }

    /// Options around connection options built in code.
    #[must_use]
    pub fn with(connect: MySqlConnectOptions) -> Self {
        idempotency_core::sql_options_defaults!(Self { connect })
    }

    idempotency_core::sql_pool_options!();
}

idempotency_core::url_store_kind! {
    /// `mysql://…` and `mariadb://…` URLs: the store on its default table, created if missing (see
    /// [`MysqlOptions::from_url`]), for a [`Registry`](idempotency_core::Registry).
    name: "mysql",
    schemes: &["mysql", "mariadb"],
    example: "mysql://USER@HOST/DATABASE",
    options: MysqlOptions,
    open: crate::MysqlStore::connect_with,
    group_commit: group_commit,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_parsed_and_never_echo_passwords() {
        let options = MysqlOptions::from_url("mysql://app:s3cret@127.0.0.1:3307/orders").unwrap();
        assert_eq!(options.connect.get_port(), 3307);
        assert_eq!(options.connect.get_database(), Some("orders"));
        assert_eq!(options.table.as_str(), "idempotency_records");
        assert!(!format!("{options:?}").contains("s3cret"));
        let mariadb = MysqlOptions::from_url("mariadb://app@db.internal/orders").unwrap();
        assert_eq!(mariadb.connect.get_host(), "db.internal");

        let cases = [
            ("postgres://app:s3cret@db/x", "is not a mysql://"),
            ("127.0.0.1:3306", "is not a mysql://"),
            ("mysql://app:s3cret@host:notaport/db", "malformed MySQL URL"),
            ("mysql://app:s3cret@host:3306", "names no database"),
            ("mysql://app:s3cret@host:3306/", "names no database"),
            (
                "mysql://app:s3cret@host/db?ssl-mode=sometimes",
                "malformed MySQL URL",
            ),
        ];
        for (url, expected) in cases {
            let error = MysqlOptions::from_url(url).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{url}");
            assert!(error.to_string().contains(expected), "{url}: {error}");
            assert!(!error.to_string().contains("s3cret"), "{url}: {error}");
        }
    }

    #[test]
    fn table_names_are_validated() {
        let options = MysqlOptions::from_url("mysql://root@127.0.0.1/test").unwrap();
        let error = options.table("keys`; DROP TABLE users; --").unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidConfig);
        assert!(error.to_string().contains("unsafe SQL identifier"), "{error}");
    }
}

//! Classifying sqlx and PostgreSQL errors into [`ErrorKind`]s.

use idempotency_core::{ErrorKind, StoreError, sql};

/// The kind of a PostgreSQL error, from its SQLSTATE.
fn kind_of_sqlstate(code: &str) -> ErrorKind {
    match code {
        // Connection exceptions; the server shutting down or starting; too many connections.
        c if c.starts_with("08") => ErrorKind::Unavailable,
        "57P01" | "57P02" | "57P03" | "53300" => ErrorKind::Unavailable,
        // Query cancelled (statement_timeout, lock_timeout), serialization failure, deadlock.
        "57014" | "55P03" | "40001" | "40P01" => ErrorKind::Timeout,
        // Authentication failures, unknown database or role: the configuration is wrong.
        c if c.starts_with("28") => ErrorKind::InvalidConfig,
        "3D000" => ErrorKind::InvalidConfig,
        // Undefined table or column: the schema is missing or from another version.
        "42P01" | "42703" => ErrorKind::Schema,
        // Insufficient privilege, read-only transaction (a hot standby).
        "42501" | "25006" => ErrorKind::ReadOnly,
        // Data corrupted, index corrupted.
        "XX001" | "XX002" => ErrorKind::Corrupt,
        _ => ErrorKind::Backend,
    }
}

/// Classifies `error`; `doing` says what the store was doing (see
/// [`idempotency_core::sql::map_error`]).
pub(crate) fn map_error(doing: &str, error: sqlx::Error) -> StoreError {
    sql::map_error(doing, error, |db| {
        let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
        (
            kind_of_sqlstate(&code),
            format!("{} (SQLSTATE {code})", db.message()),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_map_to_kinds() {
        assert_eq!(kind_of_sqlstate("08006"), ErrorKind::Unavailable);
        assert_eq!(kind_of_sqlstate("57P01"), ErrorKind::Unavailable);
        assert_eq!(kind_of_sqlstate("28P01"), ErrorKind::InvalidConfig);
        assert_eq!(kind_of_sqlstate("3D000"), ErrorKind::InvalidConfig);
        assert_eq!(kind_of_sqlstate("42P01"), ErrorKind::Schema);
        assert_eq!(kind_of_sqlstate("25006"), ErrorKind::ReadOnly);
        assert_eq!(kind_of_sqlstate("40P01"), ErrorKind::Timeout);
        assert_eq!(kind_of_sqlstate("23505"), ErrorKind::Backend);
    }
}

//! Classifying sqlx and MySQL/MariaDB errors into [`ErrorKind`]s.

use idempotency_core::{ErrorKind, StoreError, sql};
use sqlx::mysql::MySqlDatabaseError;

/// `ER_DUP_ENTRY`: the key exists (a concurrent `begin` inserted it first).
pub(crate) const DUPLICATE_KEY: u16 = 1062;
/// `ER_LOCK_DEADLOCK`: InnoDB rolled this transaction back to break a deadlock.
pub(crate) const DEADLOCK: u16 = 1213;

/// The kind of a server error, from its error number.
pub(crate) fn kind_of_number(number: u16) -> ErrorKind {
    match number {
        // Too many connections, server shutdown, connection killed (MariaDB), disconnected for
        // inactivity (MySQL 8), the server going away.
        1040 | 1053 | 1077 | 1152 | 1158..=1161 | 1927 | 4031 => ErrorKind::Unavailable,
        // Lock wait timeout, deadlock (the transaction was rolled back), query interrupted
        // (`KILL QUERY`, `max_statement_time`), execution time exceeded (MySQL).
        1205 | DEADLOCK | 1317 | 1969 | 3024 => ErrorKind::Timeout,
        // Access denied (wrong password, no grant on the database), unknown database.
        1044 | 1045 | 1049 | 1698 => ErrorKind::InvalidConfig,
        // Unknown table or column: the schema is missing or from another version.
        1146 | 1054 => ErrorKind::Schema,
        // Not allowed to write: command denied on the table, `read_only` server, read-only
        // transaction.
        1142 | 1290 | 1792 | 1836 => ErrorKind::ReadOnly,
        // Table or index corrupted, or marked crashed.
        1034 | 1194 | 1195 | 1712 => ErrorKind::Corrupt,
        _ => ErrorKind::Backend,
    }
}

/// The server's error number, when `error` is one the server sent.
pub(crate) fn number(error: &sqlx::Error) -> Option<u16> {
    match error {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number),
        _ => None,
    }
}

/// Classifies `error`; `doing` says what the store was doing (see
/// [`idempotency_core::sql::map_error`]).
pub(crate) fn map_error(doing: &str, error: sqlx::Error) -> StoreError {
    sql::map_error(doing, error, |db| {
        let number = db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map_or(0, MySqlDatabaseError::number);
        let hint = match number {
            1153 | 1301 => " (an outcome larger than the server's max_allowed_packet)",
            _ => "",
        };
        (
            kind_of_number(number),
            format!("{} (error {number}){hint}", db.message()),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_numbers_map_to_kinds() {
        assert_eq!(kind_of_number(1040), ErrorKind::Unavailable);
        assert_eq!(kind_of_number(1927), ErrorKind::Unavailable);
        assert_eq!(kind_of_number(1213), ErrorKind::Timeout);
        assert_eq!(kind_of_number(1205), ErrorKind::Timeout);
        assert_eq!(kind_of_number(1045), ErrorKind::InvalidConfig);
        assert_eq!(kind_of_number(1049), ErrorKind::InvalidConfig);
        assert_eq!(kind_of_number(1146), ErrorKind::Schema);
        assert_eq!(kind_of_number(1290), ErrorKind::ReadOnly);
        assert_eq!(kind_of_number(1792), ErrorKind::ReadOnly);
        assert_eq!(kind_of_number(DUPLICATE_KEY), ErrorKind::Backend);
    }
}

//! The schema and the statements, built once per store from its validated table name.
//!
//! Times are `DATETIME(3)` in UTC in the table (readable by operators) and Unix milliseconds
//! (whole milliseconds, as `DATETIME(3)` holds them) on the wire. Every time the store decides
//! with is the server's: `UTC_TIMESTAMP(3)` (the statement's start) in the statements that
//! decide by themselves, and `SYSDATE(3)` (the moment the row is read, after its lock was
//! granted) in the locking read; the store's sessions run with `time_zone = '+00:00'`, so
//! both are UTC.
//!
//! The SQL runs on MariaDB 10.6+ and MySQL 8.0+: no `RETURNING`, no `FOR SHARE` (MariaDB has
//! only `LOCK IN SHARE MODE`, which MySQL 8 still accepts), no window functions, no CTEs.

use std::sync::Arc;

use idempotency_core::Identifier;
use idempotency_core::sql::{self as sql_rows, admin};

/// The schema version this crate writes; recorded as the table's comment.
pub const SCHEMA_VERSION: u32 = 1;

/// The origin `DATETIME` values are counted from.
const EPOCH: &str = "'1970-01-01 00:00:00'";

/// Milliseconds since the Unix epoch of a UTC `DATETIME` expression (a `BIGINT`).
fn ms(expression: &str) -> String {
    format!("(TIMESTAMPDIFF(MICROSECOND, {EPOCH}, {expression}) DIV 1000)")
}

/// The `DATETIME(3)` of a parameter in Unix milliseconds (`NULL` stays `NULL`).
fn at(parameter: &str) -> String {
    format!("TIMESTAMPADD(MICROSECOND, {parameter} * 1000, {EPOCH})")
}

/// The server's time when the statement started, in Unix milliseconds.
fn now() -> String {
    ms("UTC_TIMESTAMP(3)")
}

/// Which parameter ([`admin::Action`]'s order) each `?` of an admin statement takes: MySQL binds
/// its `?` one by one, so a parameter tested for NULL and then compared with is bound twice.
fn placeholders(action: admin::Action) -> &'static [usize] {
    use admin::Action;
    match action {
        Action::Get => &[0, 1],
        Action::Now => &[],
        Action::Stats => &[0, 0],
        Action::List => &[0, 0, 1, 1, 2, 2, 3, 3, 4, 5],
        Action::Purge => &[0],
        Action::Forget | Action::Withdraw => &[0, 1, 2],
        Action::Release => &[3, 0, 1, 2],
    }
}

/// All the statements of one store.
#[derive(Debug)]
pub(crate) struct Statements {
    pub(crate) table: String,
    pub(crate) create: Arc<str>,
    pub(crate) peek: Arc<str>,
    pub(crate) lock: Arc<str>,
    pub(crate) share: Arc<str>,
    pub(crate) insert: Arc<str>,
    pub(crate) update: Arc<str>,
    pub(crate) complete: Arc<str>,
    pub(crate) completed_by: Arc<str>,
    pub(crate) extend: Arc<str>,
    /// The statements of the reads and the operators' writes (`idempotency_core::sql::admin`).
    pub(crate) admin: admin::Statements,
}

impl Statements {
    pub(crate) fn new(table: &Identifier) -> Self {
        let t = table.as_str();
        let columns = sql_rows::record_columns("r.`key`", "r.attempt", ms);
        let live = "expires_at > UTC_TIMESTAMP(3)";
        let record = "scope = ? AND `key` = ?";
        Self {
            // Scope and key are visible ASCII (the core's rule), compared byte for byte
            // (`ascii_bin`: `Key` and `key` are two keys) and readable as they are.
            create: format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                     scope        VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
                     `key`        VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
                     fingerprint  VARBINARY(64) NOT NULL,
                     attempt      BIGINT      NOT NULL,
                     created_at   DATETIME(3) NOT NULL,
                     expires_at   DATETIME(3) NOT NULL,
                     token        VARBINARY(64) NOT NULL,
                     completed    BOOLEAN     NOT NULL,
                     acquired_at  DATETIME(3) NULL,
                     lease_until  DATETIME(3) NULL,
                     completed_at DATETIME(3) NULL,
                     outcome      LONGBLOB    NULL,
                     PRIMARY KEY (scope, `key`),
                     KEY expiry (expires_at),
                     KEY in_flight (completed, acquired_at)
                 ) ENGINE = InnoDB DEFAULT CHARSET = ascii COLLATE = ascii_bin COMMENT = '{comment}'",
                comment = sql_rows::version_comment(SCHEMA_VERSION),
            )
            .into(),
            // Parameters: scope, key. `begin`'s first look: one row with the server's time and
            // the record as it is (all NULL when there is none), expired or not. A consistent
            // read: no lock, no write. A replay, an in-flight conflict and a mismatch are
            // answered from it alone.
            peek: format!(
                "SELECT {now}, {columns} FROM (SELECT 1 AS one) AS n LEFT JOIN {t} AS r ON r.{record}",
                now = now(),
            )
            .into(),
            // Parameters: scope, key. The record under its exclusive row lock, with the time
            // at which the lock was granted.
            lock: format!(
                "SELECT {now}, {columns} FROM {t} AS r WHERE r.{record} FOR UPDATE",
                now = ms("SYSDATE(3)"),
            )
            .into(),
            // The same under a shared lock: inside a caller's transaction, after a duplicate
            // key, many duplicates read the committed record at once without deadlocking.
            share: format!(
                "SELECT {now}, {columns} FROM {t} AS r WHERE r.{record} LOCK IN SHARE MODE",
                now = ms("SYSDATE(3)"),
            )
            .into(),
            // Parameters: the record's columns, times in Unix milliseconds.
            insert: format!(
                "INSERT INTO {t} (scope, `key`, fingerprint, attempt, created_at, expires_at, token,
                                  completed, acquired_at, lease_until, completed_at, outcome)
                 VALUES (?, ?, ?, ?, {at}, {at}, ?, ?, {at}, {at}, {at}, ?)",
                at = at("?"),
            )
            .into(),
            // Parameters: the record's columns after scope and key, then scope, key. Only run
            // under the row lock.
            update: format!(
                "UPDATE {t} SET fingerprint = ?, attempt = ?, created_at = {at}, expires_at = {at},
                     token = ?, completed = ?, acquired_at = {at}, lease_until = {at},
                     completed_at = {at}, outcome = ?
                 WHERE {record}",
                at = at("?"),
            )
            .into(),
            // Parameters: retention ms, outcome, scope, key, token. One statement decided under
            // the row lock; the new expiry goes back in the reply's insert id
            // (`LAST_INSERT_ID(expr)`), so no second read is needed. No row: see `completed_by`.
            complete: format!(
                "UPDATE {t} SET completed = TRUE, completed_at = UTC_TIMESTAMP(3),
                     expires_at = {expires}, outcome = ?, acquired_at = NULL, lease_until = NULL
                 WHERE {record} AND token = ? AND NOT completed AND {live}",
                expires = at(&format!("LAST_INSERT_ID({} + ?)", now())),
            )
            .into(),
            // Parameters: scope, key, token. A retried `complete` by the token that completed
            // the record is accepted again with the record's expiry.
            completed_by: format!(
                "SELECT {expires} FROM {t} WHERE {record} AND token = ? AND completed AND {live}",
                expires = ms("expires_at"),
            )
            .into(),
            // Parameters: lease ms, lease ms, scope, key, token. The new end of the lease goes
            // back in the reply's insert id. (`expires_at` is assigned first: MySQL assigns
            // left to right, MariaDB at once unless told otherwise; both read the old value
            // here.)
            extend: format!(
                "UPDATE {t} SET expires_at = GREATEST(expires_at, TIMESTAMPADD(MICROSECOND, ? * 1000, UTC_TIMESTAMP(3))),
                     lease_until = {lease}
                 WHERE {record} AND token = ? AND NOT completed AND {live}",
                lease = at(&format!("LAST_INSERT_ID({} + ?)", now())),
            )
            .into(),
            admin: admin::Statements {
                placeholders,
            now: format!("SELECT {}", ms("SYSDATE(3)")).into(),
            // Parameters: scope, key.
            get: format!("SELECT {columns} FROM {t} AS r WHERE r.{record} AND r.{live}").into(),
            // Parameters: scope or NULL, twice.
            stats: format!(
                "SELECT
                     CAST(COALESCE(SUM(expires_at <= UTC_TIMESTAMP(3)), 0) AS SIGNED),
                     CAST(COALESCE(SUM({live} AND NOT completed), 0) AS SIGNED),
                     CAST(COALESCE(SUM({live} AND NOT completed AND lease_until <= UTC_TIMESTAMP(3)), 0) AS SIGNED),
                     CAST(COALESCE(SUM({live} AND completed), 0) AS SIGNED),
                     {oldest},
                     {now}
                 FROM {t} WHERE (? IS NULL OR scope = ?)",
                oldest = ms(&format!("MIN(CASE WHEN {live} AND NOT completed THEN acquired_at END)")),
                now = now(),
            )
            .into(),
            // Parameters: scope or NULL (twice), completed or NULL (twice), older-than ms or
            // NULL (twice), the (scope, key) to resume after or NULL (scope twice, key), limit.
            list: format!(
                "SELECT r.scope, r.`key`, r.fingerprint, r.attempt, {created}, {expires}, r.completed,
                        {acquired}, {lease}, {completed}, CAST(LENGTH(r.outcome) AS SIGNED)
                 FROM {t} AS r
                 WHERE r.{live}
                   AND (? IS NULL OR r.scope = ?)
                   AND (? IS NULL OR r.completed = ?)
                   AND (? IS NULL OR
                        CASE WHEN r.completed THEN r.completed_at ELSE r.acquired_at END
                            <= TIMESTAMPADD(MICROSECOND, -1000 * ?, UTC_TIMESTAMP(3)))
                   AND (? IS NULL OR (r.scope, r.`key`) > (?, ?))
                 ORDER BY r.scope, r.`key`
                 LIMIT ?",
                created = ms("r.created_at"),
                expires = ms("r.expires_at"),
                acquired = ms("r.acquired_at"),
                lease = ms("r.lease_until"),
                completed = ms("r.completed_at"),
            )
            .into(),
            // Parameters: scope, key, token.
            forget: format!("DELETE FROM {t} WHERE {record} AND token = ? AND {live}").into(),
            // Parameters: scope, key, token. Removes a first attempt's in-flight record (one a
            // transaction's claim created), as if it had never been claimed.
            withdraw: format!("DELETE FROM {t} WHERE {record} AND token = ? AND NOT completed").into(),
            // Parameters: the token of no attempt, scope, key, token. The record stays, its
            // lease ended: the next begin takes it over as attempt + 1.
            release: format!(
                "UPDATE {t} SET token = ?, lease_until = UTC_TIMESTAMP(3)
                 WHERE {record} AND token = ? AND NOT completed AND {live}"
            )
            .into(),
            // Parameters: limit. Oldest first along the expiry index, in a bounded batch.
            purge: format!(
                "DELETE FROM {t} WHERE expires_at <= UTC_TIMESTAMP(3) ORDER BY expires_at LIMIT ?"
            )
            .into(),
            },
            table: t.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each `?` of an admin statement takes one parameter, and every parameter is bound.
    #[test]
    fn every_placeholder_binds_a_parameter_of_its_action() {
        let statements = Statements::new(&Identifier::new("records").unwrap());
        for action in admin::Action::ALL {
            let order = (statements.admin.placeholders)(action);
            let marks = statements.admin.of(action).matches('?').count();
            assert_eq!(marks, order.len(), "{action:?}: `?` in the statement");
            for parameter in 0..action.parameters() {
                assert!(
                    order.contains(&parameter),
                    "{action:?}: parameter {parameter} unbound"
                );
            }
            assert!(
                order.iter().all(|&at| at < action.parameters()),
                "{action:?}: {order:?}"
            );
        }
    }
}

//! The schema and the statements the store issues, public so that tools (and the benchmark that
//! compares the store with these statements issued directly) use exactly the same SQL.

/// The schema version this crate writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = 1;

/// Marks a database as an idempotency store (`PRAGMA application_id`, "IDM1").
pub const APPLICATION_ID: i64 = 0x4944_4D31;

/// Version 1 of the schema.
///
/// A record is one row. In-flight rows have `completed = 0`, `acquired_at` and `lease_until`;
/// completed rows have `completed = 1`, `completed_at` and `outcome`. `token` is the fencing token
/// of the holder, or of the attempt that completed the record. Times are Unix milliseconds of the
/// store's clock.
pub const SCHEMA_V1: &str = "
CREATE TABLE idempotency_records (
    scope        TEXT    NOT NULL,
    key          TEXT    NOT NULL,
    fingerprint  BLOB    NOT NULL,
    attempt      INTEGER NOT NULL,
    created_at   INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL,
    token        BLOB    NOT NULL,
    completed    INTEGER NOT NULL,
    acquired_at  INTEGER,
    lease_until  INTEGER,
    completed_at INTEGER,
    outcome      BLOB,
    PRIMARY KEY (scope, key)
);
CREATE INDEX idempotency_records_expiry ON idempotency_records (expires_at);
CREATE INDEX idempotency_records_in_flight ON idempotency_records (acquired_at) WHERE completed = 0;
";

/// Reads one record by `(scope, key)`.
pub const SELECT_RECORD: &str = "
SELECT scope, key, fingerprint, attempt, created_at, expires_at, token, completed,
       acquired_at, lease_until, completed_at, outcome
FROM idempotency_records WHERE scope = ?1 AND key = ?2";

/// Inserts or replaces a whole record.
pub const UPSERT_RECORD: &str = "
INSERT INTO idempotency_records (scope, key, fingerprint, attempt, created_at, expires_at, token,
                                 completed, acquired_at, lease_until, completed_at, outcome)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)
ON CONFLICT (scope, key) DO UPDATE SET
    fingerprint = excluded.fingerprint, attempt = excluded.attempt,
    created_at = excluded.created_at, expires_at = excluded.expires_at, token = excluded.token,
    completed = excluded.completed, acquired_at = excluded.acquired_at,
    lease_until = excluded.lease_until, completed_at = excluded.completed_at,
    outcome = excluded.outcome";

/// Deletes up to `?2` records expired at `?1`.
pub const PURGE_EXPIRED: &str = "
DELETE FROM idempotency_records WHERE rowid IN (
    SELECT rowid FROM idempotency_records WHERE expires_at <= ?1 LIMIT ?2)";

/// Deletes the record of `?1` scope and `?2` key if it is live at `?4` and holds the token `?3`.
pub const FORGET: &str = "
DELETE FROM idempotency_records WHERE scope = ?1 AND key = ?2 AND token = ?3 AND expires_at > ?4";

/// Counts by state at `?1`, for all scopes (`?2` NULL) or one.
pub const STATS: &str = "
SELECT
    COALESCE(SUM(expires_at <= ?1), 0),
    COALESCE(SUM(expires_at > ?1 AND completed = 0), 0),
    COALESCE(SUM(expires_at > ?1 AND completed = 0 AND lease_until <= ?1), 0),
    COALESCE(SUM(expires_at > ?1 AND completed = 1), 0),
    MIN(CASE WHEN expires_at > ?1 AND completed = 0 THEN acquired_at END)
FROM idempotency_records WHERE ?2 IS NULL OR scope = ?2";

/// Lists live records at `?1` without outcome bodies. Parameters: `?2` scope or NULL, `?3` state
/// (0 in flight, 1 completed) or NULL, `?4` the latest state start to include or NULL, `?5`/`?6`
/// the `(scope, key)` to resume after or NULL, `?7` the limit.
pub const LIST: &str = "
SELECT scope, key, fingerprint, attempt, created_at, expires_at, completed,
       acquired_at, lease_until, completed_at, length(outcome)
FROM idempotency_records
WHERE expires_at > ?1
  AND (?2 IS NULL OR scope = ?2)
  AND (?3 IS NULL OR completed = ?3)
  AND (?4 IS NULL OR (CASE completed WHEN 0 THEN acquired_at ELSE completed_at END) <= ?4)
  AND (?5 IS NULL OR (scope, key) > (?5, ?6))
ORDER BY scope, key
LIMIT ?7";

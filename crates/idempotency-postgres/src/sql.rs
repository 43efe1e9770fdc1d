//! The schema and the statements, built once per store from its validated table name.
//!
//! Every operation is one statement, so one round trip: the decision is made by the server under
//! the row lock, with the server's `now()`. Times are `timestamptz` in the table (readable by
//! operators) and Unix milliseconds (rounded down) on the wire.

use std::sync::Arc;

use idempotency_core::Identifier;
use idempotency_core::sql::{self as sql_rows, admin};

/// The schema version this crate writes; recorded as the table's comment.
pub const SCHEMA_VERSION: u32 = 1;

/// Milliseconds since the Unix epoch of a `timestamptz` expression, rounded down.
fn ms(expression: &str) -> String {
    format!("floor(extract(epoch FROM {expression}) * 1000)::int8")
}

/// All the statements of one store.
#[derive(Debug)]
pub(crate) struct Statements {
    pub(crate) table: String,
    pub(crate) schema: String,
    pub(crate) create: Arc<str>,
    pub(crate) peek: Arc<str>,
    pub(crate) begin: Arc<str>,
    pub(crate) claim: Arc<str>,
    pub(crate) complete: Arc<str>,
    pub(crate) begin_many: Arc<str>,
    pub(crate) complete_many: Arc<str>,
    pub(crate) extend: Arc<str>,
    /// The statements of the reads and the operators' writes (`idempotency_core::sql::admin`).
    pub(crate) admin: admin::Statements,
}

impl Statements {
    pub(crate) fn new(schema: &Identifier, table: &Identifier) -> Self {
        let t = format!("{schema}.{table}");
        let columns = sql_rows::record_columns("r.key", "r.attempt::int8", ms);
        let lease = "$5::int8 * interval '1 millisecond'";
        let retention = "$6::int8 * interval '1 millisecond'";
        Self {
            create: format!(
                "CREATE SCHEMA IF NOT EXISTS {schema};
                 CREATE TABLE IF NOT EXISTS {t} (
                     scope        text COLLATE \"C\" NOT NULL,
                     key          text COLLATE \"C\" NOT NULL,
                     fingerprint  bytea       NOT NULL,
                     attempt      int4        NOT NULL,
                     created_at   timestamptz NOT NULL,
                     expires_at   timestamptz NOT NULL,
                     token        bytea       NOT NULL,
                     completed    bool        NOT NULL,
                     acquired_at  timestamptz,
                     lease_until  timestamptz,
                     completed_at timestamptz,
                     outcome      bytea,
                     PRIMARY KEY (scope, key)
                 );
                 CREATE INDEX IF NOT EXISTS {table}_expiry ON {t} (expires_at);
                 CREATE INDEX IF NOT EXISTS {table}_in_flight ON {t} (acquired_at) WHERE NOT completed;
                 COMMENT ON TABLE {t} IS '{comment}';",
                comment = sql_rows::version_comment(SCHEMA_VERSION),
            )
            .into(),
            // $1 scope, $2 key.
            //
            // `begin`'s first look: the record as it is, expired or not, with the server's time.
            // A plain read, which takes no row lock and plans no insertion: a replay, an
            // in-flight conflict and a mismatch are answered from it alone.
            peek: format!(
                "SELECT {columns}, {now} FROM {t} r WHERE r.scope = $1 AND r.key = $2",
                now = ms("now()"),
            )
            .into(),
            // $1 scope, $2 key, $3 fingerprint, $4 token, $5 lease ms, $6 retention ms.
            //
            // When the first look found nothing: a new key is inserted; an existing record is returned as it is,
            // with the server's time, and is neither locked nor written: the insert's source is
            // empty when the record exists, so no insertion is even attempted. The client then
            // decides a replay, an in-flight conflict, a mismatch or its own earlier claim
            // without a write; only an expired record or a takeover needs `claim`. If a
            // concurrent transaction committed the record after this statement's snapshot,
            // the insert finds the conflict and neither branch returns a row: the client runs
            // the statement again.
            begin: format!(
                "WITH existing AS (
                     SELECT * FROM {t} WHERE scope = $1 AND key = $2
                 ), claimed AS (
                     INSERT INTO {t} AS r (scope, key, fingerprint, attempt, created_at, expires_at, token,
                                           completed, acquired_at, lease_until, completed_at, outcome)
                     SELECT $1::text, $2::text, $3::bytea, 1, now(), now() + GREATEST({lease}, {retention}),
                            $4::bytea, false, now(), now() + {lease}, NULL, NULL
                     WHERE NOT EXISTS (SELECT 1 FROM existing)
                     ON CONFLICT (scope, key) DO NOTHING
                     RETURNING r.*
                 )
                 SELECT true AS claimed, {columns}, {now} FROM claimed r
                 UNION ALL
                 SELECT false AS claimed, {columns}, {now} FROM existing r",
                now = ms("now()"),
            )
            .into(),
            // The same parameters. The upsert claims the record when it is absent, expired, or an in-flight attempt
            // with the same fingerprint whose lease has run out (a takeover). Otherwise it
            // changes nothing and the second branch returns the record as it is, with the
            // server's time, for the client to tell a replay, an in-flight conflict, a mismatch
            // or its own earlier claim apart. If a concurrent transaction committed the record
            // after this statement's snapshot, neither branch returns a row; the client then
            // runs the statement again.
            claim: format!(
                "WITH claimed AS (
                     INSERT INTO {t} AS r (scope, key, fingerprint, attempt, created_at, expires_at, token,
                                           completed, acquired_at, lease_until, completed_at, outcome)
                     VALUES ($1, $2, $3, 1, now(), now() + GREATEST({lease}, {retention}), $4,
                             false, now(), now() + {lease}, NULL, NULL)
                     ON CONFLICT (scope, key) DO UPDATE SET
                         fingerprint = EXCLUDED.fingerprint,
                         attempt = CASE WHEN r.expires_at <= now() THEN 1 ELSE r.attempt + 1 END,
                         created_at = CASE WHEN r.expires_at <= now() THEN now() ELSE r.created_at END,
                         expires_at = CASE WHEN r.expires_at <= now() THEN EXCLUDED.expires_at
                                           ELSE GREATEST(r.expires_at, EXCLUDED.expires_at) END,
                         token = EXCLUDED.token,
                         completed = false,
                         acquired_at = now(),
                         lease_until = EXCLUDED.lease_until,
                         completed_at = NULL,
                         outcome = NULL
                     WHERE r.expires_at <= now()
                        OR (NOT r.completed AND r.fingerprint = EXCLUDED.fingerprint
                            AND r.token <> EXCLUDED.token AND r.lease_until <= now())
                     RETURNING r.*
                 )
                 SELECT true AS claimed, {columns}, {now} FROM claimed r
                 UNION ALL
                 SELECT false AS claimed, {columns}, {now} FROM {t} r
                 WHERE r.scope = $1 AND r.key = $2 AND NOT EXISTS (SELECT 1 FROM claimed)",
                now = ms("now()"),
            )
            .into(),
            // $1 scope, $2 key, $3 token, $4 outcome, $5 retention ms. The second branch accepts
            // a retried complete by the token that completed the record.
            complete: format!(
                "WITH done AS (
                     UPDATE {t} SET completed = true, completed_at = now(),
                         expires_at = now() + $5::int8 * interval '1 millisecond',
                         outcome = $4, acquired_at = NULL, lease_until = NULL
                     WHERE scope = $1 AND key = $2 AND token = $3 AND NOT completed AND expires_at > now()
                     RETURNING expires_at
                 )
                 SELECT {done} FROM done
                 UNION ALL
                 SELECT {kept} FROM {t}
                 WHERE scope = $1 AND key = $2 AND token = $3 AND completed AND expires_at > now()
                   AND NOT EXISTS (SELECT 1 FROM done)",
                done = ms("done.expires_at"),
                kept = ms("expires_at"),
            )
            .into(),
            // Arrays, one element per key (no key twice, in lock order): $1 scopes, $2 keys,
            // $3 fingerprints, $4 tokens, $5 lease ms, $6 retention ms.
            //
            // `begin` for a batch, as `peek` and `begin` decide it for one key: the keys with
            // no record are inserted (in the arrays' order, so that two batches take their
            // index locks in the same order); the records of the others are returned unlocked
            // and unwritten, with the server's time, for the client to decide. Every row
            // starts with the key's position in the arrays (from 1). A key with no row was
            // committed by a concurrent transaction after this statement's snapshot: the
            // client asks again for it alone.
            //
            // Each key is looked up through the primary key whatever the table's statistics:
            // a join of the arrays with the table is planned, on a new table, as a hash join
            // over a scan of the whole table, and the plan a connection caches for the
            // statement keeps doing so as the table grows (every batch read every record).
            // `OFFSET 0` keeps the lookup a subquery run once per key.
            begin_many: format!(
                "WITH q AS (
                     SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[], $5::int8[], $6::int8[])
                         WITH ORDINALITY AS q(scope, key, fingerprint, token, lease, retention, ord)
                 ), existing AS (
                     SELECT q.ord, r.* FROM q CROSS JOIN LATERAL (
                         SELECT * FROM {t} r WHERE r.scope = q.scope AND r.key = q.key OFFSET 0
                     ) r
                 ), claimed AS (
                     INSERT INTO {t} AS r (scope, key, fingerprint, attempt, created_at, expires_at, token,
                                           completed, acquired_at, lease_until, completed_at, outcome)
                     SELECT q.scope, q.key, q.fingerprint, 1, now(),
                            now() + GREATEST(q.lease, q.retention) * interval '1 millisecond',
                            q.token, false, now(), now() + q.lease * interval '1 millisecond', NULL, NULL
                     FROM q WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE e.ord = q.ord)
                     ORDER BY q.ord
                     ON CONFLICT (scope, key) DO NOTHING
                     RETURNING r.*
                 )
                 SELECT q.ord, true AS claimed, {columns}, {now}
                 FROM claimed r JOIN q ON q.scope = r.scope AND q.key = r.key
                 UNION ALL
                 SELECT r.ord, false AS claimed, {columns}, {now} FROM existing r",
                now = ms("now()"),
            )
            .into(),
            // Arrays, one element per key (no key twice): $1 scopes, $2 keys, $3 tokens,
            // $4 outcomes, $5 retention ms.
            //
            // `complete` for a batch: a row (the key's position from 1, the new expiry) for
            // each key completed now or already completed by the same token; no row for a key
            // the token no longer holds. The update finds its rows through the primary key
            // (`= ANY` on both columns) and the read through a subquery per key, whatever the
            // statistics, as `begin_many` does.
            complete_many: format!(
                "WITH q AS (
                     SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[], $5::int8[])
                         WITH ORDINALITY AS q(scope, key, token, outcome, retention, ord)
                 ), done AS (
                     UPDATE {t} r SET completed = true, completed_at = now(),
                         expires_at = now() + q.retention * interval '1 millisecond',
                         outcome = q.outcome, acquired_at = NULL, lease_until = NULL
                     FROM q
                     WHERE r.scope = ANY($1::text[]) AND r.key = ANY($2::text[])
                       AND r.scope = q.scope AND r.key = q.key AND r.token = q.token
                       AND NOT r.completed AND r.expires_at > now()
                     RETURNING q.ord, r.expires_at
                 )
                 SELECT ord, {done} FROM done
                 UNION ALL
                 SELECT q.ord, {kept} FROM q CROSS JOIN LATERAL (
                     SELECT * FROM {t} r WHERE r.scope = q.scope AND r.key = q.key OFFSET 0
                 ) r
                 WHERE r.token = q.token AND r.completed AND r.expires_at > now()
                   AND NOT EXISTS (SELECT 1 FROM done d WHERE d.ord = q.ord)",
                done = ms("done.expires_at"),
                kept = ms("r.expires_at"),
            )
            .into(),
            // $1 scope, $2 key, $3 token, $4 lease ms.
            extend: format!(
                "UPDATE {t} SET lease_until = now() + $4::int8 * interval '1 millisecond',
                     expires_at = GREATEST(expires_at, now() + $4::int8 * interval '1 millisecond')
                 WHERE scope = $1 AND key = $2 AND token = $3 AND NOT completed AND expires_at > now()
                 RETURNING {lease}",
                lease = ms("lease_until"),
            )
            .into(),
            admin: admin::Statements {
                // PostgreSQL numbers its placeholders: each parameter is bound once, in
                // `Action`'s order.
                placeholders: admin::Action::in_order,
            // $1 scope, $2 key.
            get: format!(
                "SELECT {columns} FROM {t} r WHERE r.scope = $1 AND r.key = $2 AND r.expires_at > now()"
            )
            .into(),
            // $1 scope or NULL.
            stats: format!(
                "SELECT
                     count(*) FILTER (WHERE expires_at <= now()),
                     count(*) FILTER (WHERE expires_at > now() AND NOT completed),
                     count(*) FILTER (WHERE expires_at > now() AND NOT completed AND lease_until <= now()),
                     count(*) FILTER (WHERE expires_at > now() AND completed),
                     {oldest},
                     {now}
                 FROM {t} WHERE $1::text IS NULL OR scope = $1",
                oldest = ms("min(acquired_at) FILTER (WHERE expires_at > now() AND NOT completed)"),
                now = ms("now()"),
            )
            .into(),
            // $1 scope or NULL, $2 completed or NULL, $3 older-than ms or NULL, $4/$5 the
            // (scope, key) to resume after or NULL, $6 limit.
            list: format!(
                "SELECT r.scope, r.key, r.fingerprint, r.attempt::int8, {created}, {expires}, r.completed,
                        {acquired}, {lease}, {completed}, octet_length(r.outcome)::int8
                 FROM {t} r
                 WHERE r.expires_at > now()
                   AND ($1::text IS NULL OR r.scope = $1)
                   AND ($2::bool IS NULL OR r.completed = $2)
                   AND ($3::int8 IS NULL OR
                        CASE WHEN r.completed THEN r.completed_at ELSE r.acquired_at END
                            <= now() - $3::int8 * interval '1 millisecond')
                   AND ($4::text IS NULL OR (r.scope, r.key) > ($4::text COLLATE \"C\", $5::text COLLATE \"C\"))
                 ORDER BY r.scope, r.key
                 LIMIT $6",
                created = ms("r.created_at"),
                expires = ms("r.expires_at"),
                acquired = ms("r.acquired_at"),
                lease = ms("r.lease_until"),
                completed = ms("r.completed_at"),
            )
            .into(),
            // $1 limit. SKIP LOCKED: concurrent purgers (several gateways) split the work.
            purge: format!(
                "DELETE FROM {t} WHERE ctid = ANY(ARRAY(
                     SELECT ctid FROM {t} WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED))"
            )
            .into(),
            now: "SELECT (extract(epoch FROM now()) * 1000)::int8".into(),
            forget: format!(
                "DELETE FROM {t} WHERE scope = $1 AND key = $2 AND token = $3 AND expires_at > now()"
            )
            .into(),
            // $1 scope, $2 key, $3 token. Removes a first attempt's in-flight record (one a
            // transaction's claim created), as if it had never been claimed.
            withdraw: format!("DELETE FROM {t} WHERE scope = $1 AND key = $2 AND token = $3 AND NOT completed")
                .into(),
            // $1 scope, $2 key, $3 token, $4 the token of no attempt. The record stays, its
            // lease ended: the next begin takes it over as attempt + 1.
            release: format!(
                "UPDATE {t} SET token = $4, lease_until = now()
                 WHERE scope = $1 AND key = $2 AND token = $3 AND NOT completed AND expires_at > now()"
            )
            .into(),
            },
            table: table.to_string(),
            schema: schema.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The admin statements number their placeholders `$1` up to their action's count.
    #[test]
    fn every_placeholder_binds_a_parameter_of_its_action() {
        let statements = Statements::new(
            &Identifier::new("public").unwrap(),
            &Identifier::new("records").unwrap(),
        );
        for action in admin::Action::ALL {
            let statement = statements.admin.of(action);
            let count = action.parameters();
            assert_eq!((statements.admin.placeholders)(action).len(), count, "{action:?}");
            for number in 1..=count {
                assert!(
                    statement.contains(&format!("${number}")),
                    "{action:?}: ${number} unused"
                );
            }
            let beyond = format!("${}", count + 1);
            assert!(
                !statement.contains(&beyond),
                "{action:?}: {beyond} in {statement}"
            );
        }
    }
}

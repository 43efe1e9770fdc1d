//! The inbox and outbox tables: names validated as identifiers, created under an advisory lock,
//! and marked with a version that later versions check.

use idempotency_postgres::Identifier;
use idempotency_postgres::sqlx::{self, AssertSqlSafe, PgPool};

use crate::OutboxError;

/// The version of the inbox table this crate writes into its comment, and the only one it
/// reads.
pub const SCHEMA_VERSION: u32 = 1;

/// The version of the outbox table (`docs/OUTBOX.md`): 2 adds the `key` and `dead_at` columns,
/// defaults that let any language insert a row with a plain `INSERT`, and a trigger that
/// notifies the relays of every insert. A version 1 table is upgraded in place by
/// [`Tables::migrate`].
pub const OUTBOX_VERSION: u32 = 2;

/// Where the inbox and the outbox live: a schema and two table names, each a safe SQL identifier
/// (`a-z`, `0-9`, `_`, not starting with a digit, at most 63 bytes).
///
/// ```
/// use idempotency_outbox::Tables;
///
/// let tables = Tables::default().schema("billing")?.inbox("billing_inbox")?;
/// assert_eq!(tables.qualified_inbox(), "billing.billing_inbox");
/// assert_eq!(tables.qualified_outbox(), "billing.idempotency_outbox");
/// assert!(Tables::default().schema("Billing; DROP TABLE x").is_err());
/// # Ok::<(), idempotency_core::StoreError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tables {
    schema: Identifier,
    inbox: Identifier,
    outbox: Identifier,
}

impl Default for Tables {
    /// `public.idempotency_inbox` and `public.idempotency_outbox`.
    fn default() -> Self {
        let name = |name: &str| Identifier::new(name).unwrap_or_else(|_| unreachable!("a valid default"));
        Self {
            schema: name("public"),
            inbox: name("idempotency_inbox"),
            outbox: name("idempotency_outbox"),
        }
    }
}

impl Tables {
    /// Sets the schema.
    ///
    /// # Errors
    ///
    /// `InvalidConfig` naming the rule `schema` breaks.
    pub fn schema(mut self, schema: &str) -> Result<Self, idempotency_core::StoreError> {
        self.schema = Identifier::new(schema)?;
        Ok(self)
    }

    /// Sets the inbox table.
    ///
    /// # Errors
    ///
    /// As [`schema`](Self::schema).
    pub fn inbox(mut self, table: &str) -> Result<Self, idempotency_core::StoreError> {
        self.inbox = Identifier::new(table)?;
        Ok(self)
    }

    /// Sets the outbox table.
    ///
    /// # Errors
    ///
    /// As [`schema`](Self::schema).
    pub fn outbox(mut self, table: &str) -> Result<Self, idempotency_core::StoreError> {
        self.outbox = Identifier::new(table)?;
        Ok(self)
    }

    /// The schema's name (on MySQL a database; `public` there means the URL's own).
    #[cfg(feature = "mysql")]
    pub(crate) fn schema_name(&self) -> &str {
        self.schema.as_str()
    }

    /// The outbox table's name, unqualified.
    #[cfg(feature = "mysql")]
    pub(crate) fn outbox_name(&self) -> &str {
        self.outbox.as_str()
    }

    /// `schema.inbox`, as the SQL uses it.
    #[must_use]
    pub fn qualified_inbox(&self) -> String {
        format!("{}.{}", self.schema.as_str(), self.inbox.as_str())
    }

    /// `schema.outbox`, as the SQL uses it.
    #[must_use]
    pub fn qualified_outbox(&self) -> String {
        format!("{}.{}", self.schema.as_str(), self.outbox.as_str())
    }

    /// The `LISTEN/NOTIFY` channel of the inbox: `schema_inbox`.
    pub(crate) fn inbox_channel(&self) -> String {
        format!("{}_{}", self.schema.as_str(), self.inbox.as_str())
    }

    /// The `LISTEN/NOTIFY` channel of the outbox: `schema_outbox`.
    pub(crate) fn outbox_channel(&self) -> String {
        format!("{}_{}", self.schema.as_str(), self.outbox.as_str())
    }

    /// The statements that create (or upgrade) the outbox, and the inbox first when `inbox`.
    fn create_sql(&self, inbox: bool) -> String {
        let mut sql = format!("CREATE SCHEMA IF NOT EXISTS {};\n", self.schema.as_str());
        if inbox {
            sql.push_str(&self.inbox_sql());
        }
        sql.push_str(&self.outbox_sql());
        sql
    }

    fn inbox_sql(&self) -> String {
        let (schema, inbox) = (self.schema.as_str(), self.inbox.as_str());
        format!(
            "CREATE TABLE IF NOT EXISTS {schema}.{inbox} (
    id bigserial NOT NULL UNIQUE,
    consumer text NOT NULL,
    key text NOT NULL,
    fingerprint text NOT NULL,
    payload bytea NOT NULL,
    headers jsonb NOT NULL DEFAULT '[]'::jsonb,
    state text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'processed', 'dead')),
    attempts integer NOT NULL DEFAULT 0,
    last_error text,
    received_at timestamptz NOT NULL DEFAULT now(),
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    PRIMARY KEY (consumer, key)
);
CREATE INDEX IF NOT EXISTS {inbox}_due ON {schema}.{inbox} (consumer, next_attempt_at, id) WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS {inbox}_finished ON {schema}.{inbox} (finished_at) WHERE state <> 'pending';
COMMENT ON TABLE {schema}.{inbox} IS '{inbox_version}';
",
            inbox_version = version_comment("inbox", SCHEMA_VERSION),
        )
    }

    fn outbox_sql(&self) -> String {
        let (schema, outbox) = (self.schema.as_str(), self.outbox.as_str());
        format!(
            "CREATE TABLE IF NOT EXISTS {schema}.{outbox} (
    id bigserial PRIMARY KEY,
    ordering_key text NOT NULL DEFAULT '',
    destination text NOT NULL DEFAULT '',
    key text,
    payload bytea NOT NULL,
    headers jsonb NOT NULL DEFAULT '[]'::jsonb,
    created_at timestamptz NOT NULL DEFAULT now(),
    sent_at timestamptz,
    attempts integer NOT NULL DEFAULT 0,
    last_error text,
    dead_at timestamptz
);
ALTER TABLE {schema}.{outbox} ADD COLUMN IF NOT EXISTS key text;
ALTER TABLE {schema}.{outbox} ADD COLUMN IF NOT EXISTS dead_at timestamptz;
ALTER TABLE {schema}.{outbox} ALTER COLUMN ordering_key SET DEFAULT '';
ALTER TABLE {schema}.{outbox} ALTER COLUMN destination SET DEFAULT '';
CREATE INDEX IF NOT EXISTS {outbox}_pending ON {schema}.{outbox} (id) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS {outbox}_sent ON {schema}.{outbox} (sent_at) WHERE sent_at IS NOT NULL;
CREATE OR REPLACE FUNCTION {schema}.{outbox}_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{outbox_channel}', '');
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER {outbox}_notify AFTER INSERT ON {schema}.{outbox}
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.{outbox}_notify();
COMMENT ON TABLE {schema}.{outbox} IS '{outbox_version}';",
            outbox_version = version_comment("outbox", OUTBOX_VERSION),
            outbox_channel = self.outbox_channel(),
        )
    }

    /// Creates the schema and both tables if they are missing, under the advisory lock every
    /// migration of this project takes, so that instances starting at once do not race. Safe at
    /// every start (`idem inbox migrate` runs it).
    ///
    /// # Errors
    ///
    /// [`OutboxError::Schema`] when a table exists with another version's mark (or none: another
    /// application's table); the server's error otherwise.
    pub async fn migrate(&self, pool: &PgPool) -> Result<(), OutboxError> {
        self.migrate_tables(pool, true).await
    }

    /// Creates the tables (the inbox too when `inbox`) under the migration lock.
    pub(crate) async fn migrate_tables(&self, pool: &PgPool, inbox: bool) -> Result<(), OutboxError> {
        let mut tx = pool
            .begin()
            .await
            .map_err(OutboxError::db("begin the migration"))?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idempotency-migrate'))")
            .execute(&mut *tx)
            .await
            .map_err(OutboxError::db("lock the migration"))?;
        for (table, what) in self.tables(inbox) {
            check_mark(&mut tx, &table, what, true).await?;
        }
        sqlx::raw_sql(AssertSqlSafe(self.create_sql(inbox)))
            .execute(&mut *tx)
            .await
            .map_err(OutboxError::db("create the inbox and outbox tables"))?;
        tx.commit().await.map_err(OutboxError::db("commit the migration"))
    }

    /// Checks that both tables exist and carry this version's mark, without changing anything
    /// (what the operations commands do).
    ///
    /// # Errors
    ///
    /// [`OutboxError::Schema`] for a missing table (`idem inbox migrate` creates it) or another
    /// version's.
    pub async fn check(&self, pool: &PgPool) -> Result<(), OutboxError> {
        self.check_tables(pool, true).await
    }

    /// Checks the tables' marks (the inbox's too when `inbox`).
    pub(crate) async fn check_tables(&self, pool: &PgPool, inbox: bool) -> Result<(), OutboxError> {
        let mut connection = pool.acquire().await.map_err(OutboxError::db("connect"))?;
        for (table, what) in self.tables(inbox) {
            check_mark(&mut connection, &table, what, false).await?;
        }
        Ok(())
    }

    /// The qualified tables and what each is: the outbox, and the inbox first when `inbox`.
    fn tables(&self, inbox: bool) -> Vec<(String, &'static str)> {
        let mut tables = Vec::with_capacity(2);
        if inbox {
            tables.push((self.qualified_inbox(), "inbox"));
        }
        tables.push((self.qualified_outbox(), "outbox"));
        tables
    }
}

/// What a table of `version` is marked with.
fn version_comment(what: &str, version: u32) -> String {
    format!("idempotency-{what} v{version}")
}

/// Checks `table`'s mark: absent is fine when `may_create`, else an error naming the fix.
async fn check_mark(
    connection: &mut sqlx::PgConnection,
    table: &str,
    what: &str,
    may_create: bool,
) -> Result<(), OutboxError> {
    let (exists, comment): (bool, Option<String>) =
        sqlx::query_as("SELECT to_regclass($1) IS NOT NULL, obj_description(to_regclass($1), 'pg_class')")
            .bind(table)
            .fetch_one(&mut *connection)
            .await
            .map_err(OutboxError::db("read the schema version"))?;
    let version = if what == "outbox" {
        OUTBOX_VERSION
    } else {
        SCHEMA_VERSION
    };
    let expected = version_comment(what, version);
    // Migrating upgrades an outbox of version 1 in place.
    let upgradable = may_create && what == "outbox" && comment.as_deref() == Some(&*version_comment(what, 1));
    match (exists, comment) {
        (false, _) if may_create => Ok(()),
        (true, _) if upgradable => Ok(()),
        (false, _) => Err(OutboxError::Schema(format!(
            "{table} does not exist: create it with `idem inbox migrate` (or `Tables::migrate`) first"
        ))),
        (true, Some(comment)) if comment == expected => Ok(()),
        (true, comment) => Err(OutboxError::Schema(format!(
            "{table} is marked {comment:?}; this version reads {expected:?} (a newer version created it, or it is another application's table)"
        ))),
    }
}

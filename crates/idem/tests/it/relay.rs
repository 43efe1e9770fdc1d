//! `idem relay` from the outside: the binary between a real PostgreSQL outbox, written with the
//! plain SQL `docs/OUTBOX.md` shows, and a real RabbitMQ queue; a row that cannot be published
//! parked as dead and replayed with `idem outbox replay`; an upgrade of a version 1 table.

use crate::common;

use std::time::Duration;

use common::Process;
use futures_util::StreamExt;
use idempotency::Key;
use idempotency::postgres::sqlx::{self, AssertSqlSafe, PgPool};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};

fn mysql_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The first `language` example of `docs/OUTBOX.md`, as written there.
fn documented(language: &str) -> String {
    documented_in("", language)
}

/// The first `language` example of `docs/OUTBOX.md` after the heading `section` (`""`: from the
/// top).
fn documented_in(section: &str, language: &str) -> String {
    let whole = include_str!("../../../../docs/OUTBOX.md");
    let guide = &whole[whole
        .find(section)
        .unwrap_or_else(|| panic!("docs/OUTBOX.md has {section:?}"))..];
    let fence = format!("```{language}\n");
    let start = guide
        .find(&fence)
        .unwrap_or_else(|| panic!("docs/OUTBOX.md has a {language} example"))
        + fence.len();
    let end = start + guide[start..].find("```").unwrap();
    guide[start..end].to_owned()
}

/// The SQL example of `docs/OUTBOX.md`.
fn documented_insert() -> String {
    documented("sql")
}

/// The Python of the test tools' virtual environment (`scripts/services` installs psycopg
/// there).
fn tools_python() -> std::path::PathBuf {
    std::env::var_os("IDEM_TOOLS_VENV")
        .map_or_else(
            || {
                std::path::PathBuf::from(std::env::var_os("HOME").unwrap())
                    .join(".local/share/idem/tools-venv")
            },
            std::path::PathBuf::from,
        )
        .join("bin/python")
}

/// Runs the tools' Python with `args`; panics with its errors unless it succeeds.
fn python(args: &[&str]) {
    let python = tools_python();
    let output = std::process::Command::new(&python)
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{} is needed for this test (scripts/services installs it): {e}",
                python.display()
            )
        });
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The Python example of `docs/OUTBOX.md`, run as written with psycopg, writes a row the relay
/// reads as the SQL example's: the same key, destination, group, payload and headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_python_insert_writes_the_row_the_relay_expects() {
    let pool = PgPool::connect(&common::database_url()).await.unwrap();
    let schema = outbox_with(&pool, &[]).await;
    let script = format!(
        "import json, sys\nimport psycopg\nconn = psycopg.connect(sys.argv[1], autocommit=True)\nconn.execute('SET search_path TO ' + sys.argv[2])\n{}conn.close()\n",
        documented("python")
    );
    python(&["-c", &script, &common::database_url(), &schema]);
    let (destination, group, key, payload, content_type): (String, String, String, Vec<u8>, String) =
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT destination, ordering_key, key, payload, headers->>'content-type' FROM {schema}.idempotency_outbox"
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        (destination.as_str(), group.as_str(), key.as_str()),
        ("order.created", "order-42", "order-42:created")
    );
    assert_eq!(
        String::from_utf8(payload).unwrap(),
        r#"{"order": "order-42", "amount_cents": 1000}"#
    );
    assert_eq!(content_type, "application/json");
    let orders: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {schema}.orders")))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(orders, 1, "the order and its event in one transaction");
    drop_schema(&pool, &schema).await;
}

/// The MySQL examples of `docs/OUTBOX.md`, run as written (the SQL through the server, the
/// Python with PyMySQL) into a migrated MySQL outbox: the rows the relay expects, each with its
/// order in the same transaction; another application's table of the same name is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_mysql_inserts_write_the_rows_the_relay_expects() {
    let table = Table::new(Db::MySql).await;
    let my = table.mysql().clone();
    let mut connection = my.acquire().await.unwrap();
    sqlx::query(AssertSqlSafe(format!("USE {}", table.schema)))
        .execute(&mut *connection)
        .await
        .unwrap();
    sqlx::raw_sql(AssertSqlSafe(documented_in("## MySQL and MariaDB", "sql")))
        .execute(&mut *connection)
        .await
        .unwrap();
    sqlx::query("DELETE FROM orders")
        .execute(&mut *connection)
        .await
        .unwrap();
    let script = format!(
        "import json, sys\nfrom urllib.parse import urlparse\nimport pymysql\nurl = urlparse(sys.argv[1])\nconn = pymysql.connect(host=url.hostname, port=url.port or 3306, user=url.username, password=url.password or '', database=sys.argv[2])\n{}conn.close()\n",
        documented_in("## MySQL and MariaDB", "python")
    );
    python(&["-c", &script, &mysql_url(), &table.schema]);
    let rows: Vec<(String, String, String, Vec<u8>, String)> = sqlx::query_as(
        "SELECT destination, ordering_key, `key`, payload, JSON_UNQUOTE(JSON_EXTRACT(headers, '$.\"content-type\"'))
         FROM idempotency_outbox ORDER BY id",
    )
    .fetch_all(&mut *connection)
    .await
    .unwrap();
    assert_eq!(rows.len(), 2, "the SQL row and the Python row");
    for (destination, group, key, payload, content_type) in &rows {
        assert_eq!(
            (destination.as_str(), group.as_str(), key.as_str()),
            ("order.created", "order-42", "order-42:created")
        );
        let body: serde_json::Value = serde_json::from_slice(payload).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"order": "order-42", "amount_cents": 1000})
        );
        assert_eq!(content_type, "application/json");
    }
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&mut *connection)
        .await
        .unwrap();
    assert_eq!(orders, 1, "the Python order and its event in one transaction");
    // Another application's table where the outbox should be is refused, and left alone.
    sqlx::raw_sql("CREATE TABLE theirs (id INT PRIMARY KEY) COMMENT = 'billing v3'")
        .execute(&mut *connection)
        .await
        .unwrap();
    drop(connection);
    let (code, out, err) = common::idem(&[
        "relay",
        "migrate",
        "--database",
        &mysql_url(),
        "--schema",
        &table.schema,
        "--outbox-table",
        "theirs",
    ]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("is marked \"billing v3\""), "{err}");
    table.drop().await;
}

/// On MySQL: a row whose headers are not headers, or whose key is not a key, is parked with the
/// reason while its group goes on; `idem outbox list|stats|replay|purge` see and act on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_rows_that_cannot_be_published_are_parked_and_operated_on() {
    use axum::extract::State;
    use std::sync::{Arc, Mutex};

    let arrived: Arc<Mutex<Vec<String>>> = Arc::default();
    let app = axum::Router::new()
        .route(
            "/events",
            axum::routing::post(
                |State(arrived): State<Arc<Mutex<Vec<String>>>>, body: String| async move {
                    arrived.lock().unwrap().push(body);
                    "ok"
                },
            ),
        )
        .with_state(Arc::clone(&arrived));
    let addr = common::serve_app(app).await;
    let table = Table::new(Db::MySql).await;
    let my = table.mysql().clone();
    for (key, headers, payload) in [
        (Some("k-1"), "{}", "first"),
        (Some("k-2"), "[1]", "bad headers"),
        (Some("not a key"), "{}", "bad key"),
        (None, r#"{"x-source": "shop"}"#, "last"),
    ] {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.idempotency_outbox (ordering_key, `key`, payload, headers) VALUES ('g', ?, ?, ?)",
            table.schema
        )))
        .bind(key)
        .bind(payload)
        .bind(headers)
        .execute(&my)
        .await
        .unwrap();
    }
    let relay = table.relay(&format!("http://{addr}/events"));
    idempotency_testkit::eventually(Duration::from_secs(30), "the group went on", async || {
        arrived.lock().unwrap().len() >= 2
    })
    .await;
    assert_eq!(*arrived.lock().unwrap(), ["first", "last"]);
    let url = table.url();
    let at = ["--database", url.as_str(), "--schema", table.schema.as_str()];
    let stats: serde_json::Value =
        serde_json::from_str(&idem_ok(&[&["outbox", "stats", "--json"][..], &at[..]].concat())).unwrap();
    assert_eq!(
        (&stats["pending"], &stats["dead"], &stats["sent"]),
        (&0.into(), &2.into(), &2.into()),
        "{stats}"
    );
    let listed: serde_json::Value =
        serde_json::from_str(&idem_ok(&[&["outbox", "list", "--json"][..], &at[..]].concat())).unwrap();
    let reasons: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|row| row["last_error"].as_str().unwrap())
        .collect();
    assert_eq!(reasons.len(), 2, "{listed}");
    assert!(reasons[0].contains("the headers' entry 0"), "{reasons:?}");
    assert!(reasons[1].contains("not a valid Idempotency-Key"), "{reasons:?}");
    drop(relay);
    let replayed = idem_ok(&[&["outbox", "replay", "--json"][..], &at[..]].concat());
    assert_eq!(replayed.trim(), r#"{"replayed":2}"#);
    assert_eq!(table.count("dead_at IS NULL AND sent_at IS NULL").await, 2);
    // Parked again by a relay, then purged.
    let relay = table.relay(&format!("http://{addr}/events"));
    idempotency_testkit::eventually(Duration::from_secs(30), "parked again", async || {
        table.count("dead_at IS NOT NULL").await == 2
    })
    .await;
    drop(relay);
    let purged = idem_ok(&[&["outbox", "purge", "--older-than", "0s", "--json"][..], &at[..]].concat());
    assert_eq!(purged.trim(), r#"{"purged":2}"#);
    assert_eq!(table.count("TRUE").await, 2, "the sent rows are kept");
    table.drop().await;
}

/// `idem relay --config FILE` runs every `[[relay]]` of the file in one process (here a
/// PostgreSQL outbox to one webhook and a MySQL one to another, with the gateway's settings in
/// the same file); a file that is wrong is refused with its line and column before any relay
/// starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_file_runs_every_relay_it_names() {
    use axum::extract::{Path, State};
    use std::sync::{Arc, Mutex};

    type Arrived = Arc<Mutex<Vec<(String, String)>>>;
    let arrived = Arrived::default();
    let app = axum::Router::new()
        .route(
            "/{hook}",
            axum::routing::post(
                |State(arrived): State<Arrived>, Path(hook): Path<String>, body: String| async move {
                    arrived.lock().unwrap().push((hook, body));
                    "ok"
                },
            ),
        )
        .with_state(Arc::clone(&arrived));
    let addr = common::serve_app(app).await;
    let (pg, my) = (Table::new(Db::Postgres).await, Table::new(Db::MySql).await);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idem.toml");
    let write = |relays: &str| {
        std::fs::write(
            &file,
            format!(
                "upstream = \"http://127.0.0.1:3000\"\nstore = \"sqlite://{}\"\n\n{relays}",
                dir.path().join("gateway.db").display()
            ),
        )
        .unwrap();
    };
    // The MySQL relay's database URL from a file, as a mounted Secret gives it.
    let secret = dir.path().join("mysql-url");
    std::fs::write(&secret, format!("{}\n", my.url())).unwrap();
    let relays = format!(
        "[[relay]]\ndatabase = \"{}\"\nschema = \"{}\"\nto = \"http://{addr}/postgres\"\n\n[[relay]]\ndatabase-file = \"{}\"\nschema = \"{}\"\nto = \"http://{addr}/mysql\"\npoll = \"100ms\"\nname = \"shop\"\n",
        pg.url(),
        pg.schema,
        secret.display(),
        my.schema
    );
    write(&relays);
    let path = file.display().to_string();
    // The gateway reads the same file and leaves the relays to `idem relay`.
    let checked = idem_ok(&["serve", "--config", &path, "--check"]);
    assert!(checked.contains("valid"), "{checked}");
    let _relays = common::spawn_idem(&["relay", "--config", &path], &[], "warn", false);
    for (table, payload) in [(&pg, "from postgres"), (&my, "from mysql")] {
        let insert = format!(
            "INSERT INTO {}.idempotency_outbox (ordering_key, payload) VALUES ('g', '{payload}')",
            table.schema
        );
        table.execute(insert).await;
    }
    idempotency_testkit::eventually(Duration::from_secs(30), "both rows posted", async || {
        arrived.lock().unwrap().len() >= 2
    })
    .await;
    let mut got = arrived.lock().unwrap().clone();
    got.sort();
    assert_eq!(
        got,
        [
            ("mysql".to_owned(), "from mysql".to_owned()),
            ("postgres".to_owned(), "from postgres".to_owned())
        ]
    );
    // Wrong files: the place and the reason, and no relay runs; a secret file's content is
    // never shown.
    let password = dir.path().join("to-url");
    std::fs::write(&password, "amqp://relay:S3CRET-relay@rabbit/%2f\n").unwrap();
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "\n").unwrap();
    for (relays, says) in [
        (
            format!(
                "{relays}\n[[relay]]\ndatabase = \"{}\"\nschema = \"{}\"\nto = \"http://{addr}/again\"\n",
                my.url(),
                my.schema
            ),
            "relays the same outbox table".to_owned(),
        ),
        (
            "[[relay]]\ndatabase = \"postgres://x\"\nto = \"http://h/\"\nbogus = 1\n".to_owned(),
            ":7:1: unknown key `bogus` in [[relay]]".to_owned(),
        ),
        (
            "[[relay]]\ndatabase = \"postgres://x\"\nto = \"http://h/\"\nbatch = 0\n".to_owned(),
            ":7:1: [[relay]]: invalid value '0' for '--batch".to_owned(),
        ),
        (
            "[[relay]]\ndatabase = \"postgres://x\"\n".to_owned(),
            ":4:1: [[relay]] has no `to`".to_owned(),
        ),
        (
            "[[relay]]\ndatabase = \"postgres://x\"\nto = \"http://h/\"\nadmin-listen = \"127.0.0.1:1\"\n"
                .to_owned(),
            "unknown key `admin-listen` in [[relay]]".to_owned(),
        ),
        (String::new(), "has no [[relay]] table".to_owned()),
        (
            format!(
                "[[relay]]\ndatabase = \"postgres://x\"\nto = \"http://h/\"\nto-file = \"{}\"\n",
                password.display()
            ),
            "[[relay]] gives `to` and `to-file`: give the value one way".to_owned(),
        ),
        (
            "[[relay]]\ndatabase = \"postgres://x\"\nto-file = \"/nonexistent/to-url\"\n".to_owned(),
            ":6:11: `to-file` /nonexistent/to-url: No such file".to_owned(),
        ),
        (
            format!(
                "[[relay]]\ndatabase = \"postgres://x\"\nto-file = \"{}\"\n",
                empty.display()
            ),
            "the file is empty".to_owned(),
        ),
        (
            "[[relay]]\ndatabase = \"postgres://x\"\nto = \"http://h/\"\nbatch-file = \"/x\"\n".to_owned(),
            "unknown key `batch-file` in [[relay]]".to_owned(),
        ),
    ] {
        write(&relays);
        let (code, out, err) = common::idem(&["relay", "--config", &path]);
        assert_eq!(code, 1, "{relays}: {out}{err}");
        assert!(err.contains(&says), "{relays}: {err}");
        assert!(!err.contains("S3CRET"), "a secret file's content is shown: {err}");
    }
    let (code, _, err) = common::idem(&["relay", "--config", &path, "--to", "http://h/"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("cannot be used with"), "{err}");
    pg.drop().await;
    my.drop().await;
}

/// A schema of the test's own, with an `orders` table beside the outbox.
async fn schema(pool: &PgPool) -> String {
    let schema = format!(
        "relay_{}",
        Key::generate().as_str().replace('-', "_").to_lowercase()
    );
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA {schema}; CREATE TABLE {schema}.orders (id text PRIMARY KEY, amount_cents integer NOT NULL)"
    )))
    .execute(pool)
    .await
    .unwrap_or_else(|e| panic!("PostgreSQL at {} is needed for this test: {e}", common::database_url()));
    schema
}

/// Drops a test's schema, its tables with it.
async fn drop_schema(pool: &PgPool, schema: &str) {
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(pool)
        .await
        .unwrap();
}

/// A RabbitMQ connection and channel, and a new queue `PREFIX.<id>` (declared with the
/// dead-letter topology `idem consume` expects when `topology`).
async fn rabbit_queue(prefix: &str, topology: bool) -> (Connection, lapin::Channel, String) {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("RabbitMQ at {} is needed for this test: {e}", amqp_url()));
    let channel = connection.create_channel().await.unwrap();
    let queue = format!("{prefix}.{}", Key::generate());
    if topology {
        idempotency_amqp::Topology::for_queue(&queue)
            .declare(&channel)
            .await
            .unwrap();
    } else {
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
    }
    (connection, channel, queue)
}

/// The next message `consumer` gets (within 30 s, else panics saying `what` was expected),
/// acknowledged; its body.
async fn next_body(consumer: &mut lapin::Consumer, what: &str) -> Vec<u8> {
    let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
        .await
        .expect(what)
        .unwrap()
        .unwrap();
    delivery.ack(BasicAckOptions::default()).await.unwrap();
    delivery.data
}

/// `idem` with `args`, run to completion; panics unless it succeeds.
fn idem_ok(args: &[&str]) -> String {
    let (code, out, err) = common::idem(args);
    assert_eq!(code, 0, "idem {args:?}: {out}{err}");
    out
}

/// `idem relay` for `schema`'s outbox to `to`, in the background, polling only once a minute:
/// a row is published at once only if the table's trigger woke it.
fn start_relay(schema: &str, to: &str) -> Process {
    relay_on(&common::database_url(), schema, to)
}

/// `idem relay` for the outbox of `schema` in `database` to `to`, in the background, polling
/// once a minute on PostgreSQL (a row is published at once only if the table's trigger woke the
/// relay) and every 100 ms on MySQL (which has no notifications).
fn relay_on(database: &str, schema: &str, to: &str) -> Process {
    relay_with(database, schema, to, &[], "warn", false)
}

/// As [`relay_on`], with `extra` flags, logging at `log`, its standard error captured when
/// `capture`.
fn relay_with(database: &str, schema: &str, to: &str, extra: &[&str], log: &str, capture: bool) -> Process {
    let poll = if database.starts_with("mysql") {
        "100ms"
    } else {
        "60s"
    };
    let mut args = vec![
        "relay",
        "--database",
        database,
        "--schema",
        schema,
        "--to",
        to,
        "--poll",
        poll,
        "--max-attempts",
        "2",
    ];
    args.extend_from_slice(extra);
    common::spawn_idem(&args, &aws_env(), log, capture)
}

/// The databases an outbox table lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Db {
    Postgres,
    MySql,
}

/// A test's own outbox table, migrated by `idem relay migrate`: in a PostgreSQL schema or a
/// MySQL database of its own (`--schema` names either), beside an `orders` table.
struct Table {
    schema: String,
    pool: Pool,
}

/// A pool on a [`Table`]'s database.
enum Pool {
    Postgres(PgPool),
    MySql(sqlx::MySqlPool),
}

impl Table {
    /// A new table on `db`.
    async fn new(db: Db) -> Self {
        match db {
            Db::Postgres => {
                let pg = PgPool::connect(&common::database_url())
                    .await
                    .unwrap_or_else(|e| {
                        panic!(
                            "PostgreSQL at {} is needed for this test: {e}",
                            common::database_url()
                        )
                    });
                let schema = outbox_with(&pg, &[]).await;
                Self {
                    schema,
                    pool: Pool::Postgres(pg),
                }
            }
            Db::MySql => {
                let my = sqlx::MySqlPool::connect(&mysql_url())
                    .await
                    .unwrap_or_else(|e| panic!("MySQL at {} is needed for this test: {e}", mysql_url()));
                let schema = format!(
                    "relay_{}",
                    Key::generate().as_str().replace('-', "_").to_lowercase()
                );
                for sql in [
                    format!("CREATE DATABASE {schema}"),
                    format!(
                        "CREATE TABLE {schema}.orders (id VARCHAR(64) PRIMARY KEY, amount_cents INT NOT NULL)"
                    ),
                ] {
                    sqlx::query(AssertSqlSafe(sql)).execute(&my).await.unwrap();
                }
                let url = mysql_url();
                idem_ok(&["relay", "migrate", "--database", &url, "--schema", &schema]);
                Self {
                    schema,
                    pool: Pool::MySql(my),
                }
            }
        }
    }

    /// The database's URL, as `--database` takes it.
    fn url(&self) -> String {
        match self.pool {
            Pool::Postgres(_) => common::database_url(),
            Pool::MySql(_) => mysql_url(),
        }
    }

    /// The MySQL pool of a table on MySQL.
    fn mysql(&self) -> &sqlx::MySqlPool {
        match &self.pool {
            Pool::MySql(my) => my,
            Pool::Postgres(_) => panic!("a MySQL table was expected"),
        }
    }

    /// Runs `sql` (no parameters).
    async fn execute(&self, sql: String) {
        match &self.pool {
            Pool::Postgres(pg) => drop(sqlx::query(AssertSqlSafe(sql)).execute(pg).await.unwrap()),
            Pool::MySql(my) => drop(sqlx::query(AssertSqlSafe(sql)).execute(my).await.unwrap()),
        }
    }

    /// How many rows of the outbox match `condition`.
    async fn count(&self, condition: &str) -> i64 {
        let sql = format!(
            "SELECT count(*) FROM {}.idempotency_outbox WHERE {condition}",
            self.schema
        );
        match &self.pool {
            Pool::Postgres(pg) => sqlx::query_scalar(AssertSqlSafe(sql))
                .fetch_one(pg)
                .await
                .unwrap(),
            Pool::MySql(my) => sqlx::query_scalar(AssertSqlSafe(sql))
                .fetch_one(my)
                .await
                .unwrap(),
        }
    }

    /// Runs the Python producer (psycopg or PyMySQL) with `transactions` transactions into the
    /// outbox, and checks that nine in ten committed.
    async fn produce(&self, transactions: u32) {
        let script = match self.pool {
            Pool::Postgres(_) => PRODUCER,
            Pool::MySql(_) => MYSQL_PRODUCER,
        };
        python(&["-c", script, &self.url(), &self.schema, &transactions.to_string()]);
        assert_eq!(self.count("TRUE").await, i64::from(transactions) * 9);
    }

    /// `idem relay` for this table to `to`, in the background (see [`start_relay`]).
    fn relay(&self, to: &str) -> Process {
        relay_on(&self.url(), &self.schema, to)
    }

    /// Drops the table's schema or database.
    async fn drop(self) {
        match &self.pool {
            Pool::Postgres(pg) => drop_schema(pg, &self.schema).await,
            Pool::MySql(_) => self.execute(format!("DROP DATABASE {}", self.schema)).await,
        }
    }
}

/// Runs an `async fn(Db)` scenario as one test per database.
macro_rules! on_both_databases {
    ($(#[$attr:meta])* $scenario:ident => $postgres:ident, $mysql:ident) => {
        $(#[$attr])*
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $postgres() {
            $scenario(Db::Postgres).await;
        }

        $(#[$attr])*
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $mysql() {
            $scenario(Db::MySql).await;
        }
    };
}

/// The credentials and region the local AWS server takes, unless the environment has some.
fn aws_env() -> Vec<(&'static str, String)> {
    [
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_REGION", "us-east-1"),
    ]
    .into_iter()
    .filter(|(name, _)| std::env::var_os(name).is_none())
    .map(|(name, value)| (name, value.to_owned()))
    .collect()
}

/// A client of the local AWS server's SQS, and a new queue of the test's own named after
/// `name` (a FIFO queue when it ends in `.fifo`), with its `-dead` queue beside it.
#[cfg(feature = "sqs")]
async fn sqs_queue(name: &str) -> (idempotency_sqs::aws_sdk_sqs::Client, String) {
    use idempotency_sqs::aws_sdk_sqs::config::{Credentials, Region};
    use idempotency_sqs::aws_sdk_sqs::types::QueueAttributeName;
    use idempotency_sqs::aws_sdk_sqs::{Client, Config};

    let endpoint = std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:5000".into());
    let client = Client::from_conf(
        Config::builder()
            .behavior_version_latest()
            .http_client(idempotency_sqs::http_client())
            .endpoint_url(&endpoint)
            .region(Region::new("us-east-1"))
            .credentials_provider(Credentials::new("test", "test", None, None, "tests"))
            .build(),
    );
    let stem = format!("relay-{}-{}", Key::generate(), name.trim_end_matches(".fifo"));
    let fifo = name.ends_with(".fifo");
    let mut url = String::new();
    // The queue, and its dead-letter queue where `idem consume` looks for it.
    for queue in [stem.clone(), format!("{stem}-dead")] {
        let mut create = client.create_queue();
        if fifo {
            create = create
                .queue_name(format!("{queue}.fifo"))
                .attributes(QueueAttributeName::FifoQueue, "true");
        } else {
            create = create.queue_name(queue);
        }
        let created = create
            .send()
            .await
            .unwrap_or_else(|e| panic!("the local AWS server at {endpoint} is needed for this test: {e:?}"))
            .queue_url
            .unwrap();
        if url.is_empty() {
            url = created;
        }
    }
    (client, url)
}

/// A mock Kafka cluster (kept while the value lives), its bootstrap servers, and a topic of
/// three partitions (with its `.dead` topic).
#[cfg(feature = "kafka")]
fn kafka_topic() -> (
    idempotency_kafka::rdkafka::mocking::MockCluster<
        'static,
        idempotency_kafka::rdkafka::producer::DefaultProducerContext,
    >,
    String,
    String,
) {
    let cluster =
        idempotency_kafka::rdkafka::mocking::MockCluster::new(1).expect("librdkafka's mock cluster");
    let topic = format!("events-{}", Key::generate());
    cluster.create_topic(&topic, 3, 1).unwrap();
    // Where `idem consume` puts its dead letters.
    cluster.create_topic(&format!("{topic}.dead"), 1, 1).unwrap();
    let brokers = cluster.bootstrap_servers();
    (cluster, brokers, topic)
}

/// A reader of the three partitions of `topic`, from their start.
#[cfg(feature = "kafka")]
fn kafka_reader(brokers: &str, topic: &str) -> idempotency_kafka::rdkafka::consumer::StreamConsumer {
    use idempotency_kafka::rdkafka::consumer::Consumer;
    use idempotency_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};

    let reader: idempotency_kafka::rdkafka::consumer::StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "relay-test")
        .create()
        .unwrap();
    let mut partitions = TopicPartitionList::new();
    for partition in 0..3 {
        partitions
            .add_partition_offset(topic, partition, Offset::Beginning)
            .unwrap();
    }
    reader.assign(&partitions).unwrap();
    reader
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_in_sql_are_published_in_order_with_their_keys() {
    let pool = PgPool::connect(&common::database_url()).await.unwrap();
    let schema = schema(&pool).await;
    let database = common::database_url();
    let out = idem_ok(&["relay", "migrate", "--database", &database, "--schema", &schema]);
    assert!(
        out.contains(&format!("{schema}.idempotency_outbox: ready")),
        "{out}"
    );

    let (_connection, channel, queue) = rabbit_queue("order.created", false).await;
    let to = format!("{}?routing_key={queue}", amqp_url());
    let _relay = start_relay(&schema, &to);

    // The documented transaction, as written, then rows of two groups with and without keys
    // and destinations: an empty destination goes to --to's routing key.
    let snippet = documented_insert().replace("'order.created'", &format!("'{queue}'"));
    sqlx::raw_sql(AssertSqlSafe(format!("SET search_path TO {schema}; {snippet}")))
        .execute(&pool)
        .await
        .unwrap();
    for i in 1..=4 {
        let key = if i % 2 == 0 {
            format!("'order-7:{i}'")
        } else {
            "NULL".into()
        };
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO {schema}.idempotency_outbox (ordering_key, key, payload) VALUES ('order-7', {key}, 'step {i}')"
        )))
        .execute(&pool)
        .await
        .unwrap();
    }

    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "relay-test".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut got = Vec::new();
    while got.len() < 5 {
        let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .expect("the relay published within 30 s (woken by the insert trigger, not the 60 s poll)")
            .unwrap()
            .unwrap();
        let headers = delivery.properties.headers().clone().unwrap_or_default();
        let header = |name: &str| match headers.inner().get(name) {
            Some(AMQPValue::LongString(value)) => String::from_utf8_lossy(value.as_bytes()).into_owned(),
            _ => String::new(),
        };
        got.push((
            header("Idempotency-Key"),
            header("content-type"),
            String::from_utf8_lossy(&delivery.data).into_owned(),
        ));
        delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(got[0].0, "order-42:created");
    assert_eq!(got[0].1, "application/json");
    assert_eq!(got[0].2, r#"{"order":"order-42","amount_cents":1000}"#);
    let steps: Vec<&str> = got[1..].iter().map(|(_, _, body)| body.as_str()).collect();
    assert_eq!(
        steps,
        ["step 1", "step 2", "step 3", "step 4"],
        "one group, in id order"
    );
    assert!(
        got[1].0.starts_with(&format!("{schema}.idempotency_outbox:")),
        "{got:?}"
    );
    assert_eq!(got[2].0, "order-7:2");

    // A row for a queue that does not exist fails twice and is parked; its group goes on.
    let missing = format!("missing.{}", Key::generate());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {schema}.idempotency_outbox (destination, ordering_key, payload) VALUES ('{missing}', 'g', 'parked');
         INSERT INTO {schema}.idempotency_outbox (ordering_key, payload) VALUES ('g', 'after');"
    )))
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        next_body(&mut consumer, "the group goes on after its parked row").await,
        b"after"
    );
    let at = [
        "--database",
        database.as_str(),
        "--schema",
        schema.as_str(),
        "--inbox-table",
        "no_inbox",
    ];
    let outbox = |command: &[&str]| {
        let mut args = vec!["outbox"];
        args.extend_from_slice(command);
        args.extend_from_slice(&at);
        idem_ok(&args)
    };
    let stats: serde_json::Value = serde_json::from_str(&outbox(&["stats", "--json"])).unwrap();
    assert_eq!(
        (stats["pending"].as_i64(), stats["dead"].as_i64()),
        (Some(0), Some(1)),
        "{stats}"
    );
    // Headers that are not headers park their row at once, with the reason; the group goes on.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {schema}.idempotency_outbox (ordering_key, payload, headers) VALUES ('h', 'bad', '42');
         INSERT INTO {schema}.idempotency_outbox (ordering_key, payload) VALUES ('h', 'good');"
    )))
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        next_body(&mut consumer, "the group goes on after a row with bad headers").await,
        b"good"
    );
    let listed = outbox(&["list", "--json"]);
    assert!(
        listed.contains("the headers are a JSON object of text values, not a number"),
        "{listed}"
    );
    let stats: serde_json::Value = serde_json::from_str(&outbox(&["stats", "--json"])).unwrap();
    assert_eq!(stats["dead"], 2, "{stats}");
    let listed = outbox(&["list"]);
    assert!(listed.contains("dead") && listed.contains(&missing), "{listed}");

    // Once the queue exists, the replayed row goes out.
    channel
        .queue_declare(
            missing.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(outbox(&["replay"]), "2 dead row(s) back to pending\n");
    let mut parked = channel
        .basic_consume(
            missing.as_str().into(),
            "relay-test-2".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(
        next_body(&mut parked, "the replayed row is published").await,
        b"parked"
    );
    // The row with bad headers, replayed too, is parked again at once; everything else is sent.
    idempotency_testkit::eventually(Duration::from_secs(30), "every good row sent", async || {
        let stats: serde_json::Value = serde_json::from_str(&outbox(&["stats", "--json"])).unwrap();
        stats["pending"] == 0 && stats["dead"] == 1 && stats["sent"] == 8
    })
    .await;
    assert_eq!(outbox(&["purge", "--older-than", "1h"]), "0 dead row(s) purged\n");
    assert_eq!(outbox(&["purge", "--older-than", "0s"]), "1 dead row(s) purged\n");

    let _ = channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await;
    let _ = channel
        .queue_delete(missing.as_str().into(), Default::default())
        .await;
    drop_schema(&pool, &schema).await;
}

/// A migrated outbox in a schema of the test's own, and `rows` inserted as
/// `(destination, ordering_key, key or NULL, payload)`.
async fn outbox_with(pool: &PgPool, rows: &[(&str, &str, Option<&str>, &str)]) -> String {
    let schema = schema(pool).await;
    let database = common::database_url();
    idem_ok(&["relay", "migrate", "--database", &database, "--schema", &schema]);
    for (destination, group, key, payload) in rows {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {schema}.idempotency_outbox (destination, ordering_key, key, payload, headers)
             VALUES ($1, $2, $3, convert_to($4, 'UTF8'), '{{\"x-source\": \"shop\"}}')"
        )))
        .bind(destination)
        .bind(group)
        .bind(key)
        .bind(payload)
        .execute(pool)
        .await
        .unwrap();
    }
    schema
}

/// A webhook: every row POSTed to the URL with `{destination}` replaced, its key and headers
/// with it; a 503 is a failed publish, retried until the webhook takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_are_posted_to_a_webhook_until_it_answers_2xx() {
    use axum::extract::{Path, State};
    use axum::http::{HeaderMap, StatusCode};
    use std::sync::{Arc, Mutex};

    type Got = Arc<Mutex<Vec<(String, String, String, String)>>>;
    async fn hook(
        State(got): State<Got>,
        Path(path): Path<String>,
        headers: HeaderMap,
        body: String,
    ) -> StatusCode {
        let header = |name: &str| {
            headers
                .get(name)
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default()
        };
        let mut got = got.lock().unwrap();
        // The first call of all fails, as a webhook that is restarting.
        let refused = got.is_empty();
        got.push((path, header("idempotency-key"), header("x-source"), body));
        if refused {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::NO_CONTENT
        }
    }
    let got = Got::default();
    let app = axum::Router::new()
        .route("/hooks/{path}", axum::routing::post(hook))
        .with_state(Arc::clone(&got));
    let addr = common::serve_app(app).await;
    let pool = PgPool::connect(&common::database_url()).await.unwrap();
    let schema = outbox_with(
        &pool,
        &[
            ("orders/created", "order-1", Some("order-1:created"), "one"),
            ("orders/paid", "order-1", None, "two"),
        ],
    )
    .await;
    let admin = common::free_addr();
    let database = common::database_url();
    let to = format!("http://{addr}/hooks/{{destination}}");
    let admin_text = admin.to_string();
    let mut relay = common::spawn_idem(
        &[
            "relay",
            "--database",
            &database,
            "--schema",
            &schema,
            "--to",
            &to,
            "--admin-listen",
            &admin_text,
        ],
        &[],
        "warn",
        false,
    );
    idempotency_testkit::eventually(Duration::from_secs(30), "three calls", async || {
        got.lock().unwrap().len() >= 3
    })
    .await;
    // What it did is on its metrics; SIGTERM ends it cleanly.
    let client = common::client();
    let outbox = format!("{schema}.idempotency_outbox");
    let labels = [("outbox", outbox.as_str())];
    common::metric_at_least(admin, "idempotency_outbox_published_total", &labels, 2.0).await;
    let errors = common::metric(&client, admin, "idempotency_outbox_relay_errors_total", &labels).await;
    assert_eq!(errors, 1.0);
    let status = relay
        .terminate(Duration::from_secs(30))
        .expect("idem relay stops on SIGTERM");
    assert!(status.success(), "{status}");
    let got = got.lock().unwrap().clone();
    // The refused first row was posted again before the second (one group, in order).
    let bodies: Vec<&str> = got.iter().map(|call| call.3.as_str()).collect();
    assert_eq!(bodies, ["one", "one", "two"], "{got:?}");
    // Encoded, the destination stayed one segment: it matched `/hooks/{path}`, which decoded it.
    assert_eq!(got[1].0, "orders/created");
    assert_eq!(got[1].1, "order-1:created");
    assert_eq!(got[1].2, "shop");
    assert!(
        got[2].1.starts_with(&format!("{schema}.idempotency_outbox:")),
        "{got:?}"
    );
    drop_schema(&pool, &schema).await;
}

/// `/_idem/readyz` of `idem relay`: ready while its database and its destination answer, `503`
/// naming the one that does not (the database behind a proxy that is down, the webhook not
/// listening), ready again once both answer, and `503` from the first moment of SIGTERM while
/// a round still runs. After the database came back, a row is published on its notification
/// (the relay polls only hourly here): the cut notification connection was made again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_database_and_the_destination_and_ends_at_sigterm() {
    use axum::http::StatusCode;
    use std::sync::Arc;
    use tokio::sync::Notify;

    let pool = PgPool::connect(&common::database_url()).await.unwrap();
    let schema = outbox_with(&pool, &[]).await;
    // The webhook: held until released, so that a round is running at SIGTERM.
    let arrived = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let (hook_arrived, hook_release) = (Arc::clone(&arrived), Arc::clone(&release));
    let app = axum::Router::new().route(
        "/hooks/{path}",
        axum::routing::post(move || {
            let (arrived, release) = (Arc::clone(&hook_arrived), Arc::clone(&hook_release));
            async move {
                arrived.notify_one();
                release.notified().await;
                StatusCode::NO_CONTENT
            }
        }),
    );
    // Held, not listening: a connection to it is refused until the webhook starts.
    let hook = common::HeldPort::new();
    let hook_addr = hook.addr;
    let to = format!("http://{hook_addr}/hooks/{{destination}}");
    let (db_proxy, database) = idempotency_testkit::TcpProxy::in_front_of(&common::database_url())
        .await
        .unwrap();
    let admin = common::free_addr();
    let admin_text = admin.to_string();
    // Notifications alone wake it: a row written after the database came back must not wait for
    // a poll.
    let mut relay = common::spawn_idem(
        &[
            "relay",
            "--database",
            &database,
            "--schema",
            &schema,
            "--to",
            &to,
            "--poll",
            "1h",
            "--admin-listen",
            &admin_text,
        ],
        &[],
        "warn",
        false,
    );
    let client = common::client();
    let readyz = async || {
        common::try_send(&client, admin, "GET", "/_idem/readyz", &[], b"")
            .await
            .map(|seen| (seen.status, String::from_utf8_lossy(&seen.body).into_owned()))
    };
    let until = async |what: &str, status: u16, naming: &str| {
        idempotency_testkit::eventually(Duration::from_secs(30), what, async || {
            readyz()
                .await
                .is_some_and(|(got, body)| got == status && body.contains(naming))
        })
        .await;
    };
    until("not ready: the webhook does not listen", 503, "the webhook at").await;
    common::serve_app_on(hook.free(), app).await;
    until("ready", 200, "ready").await;
    db_proxy.set_down(true);
    until("not ready: the database", 503, "the database").await;
    db_proxy.set_down(false);
    until("ready again", 200, "ready").await;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {schema}.idempotency_outbox (destination, ordering_key, payload) VALUES ('d', 'g', convert_to('x', 'UTF8'))"
    )))
    .execute(&pool)
    .await
    .unwrap();
    // The notification connection was cut with the database: the relay listens again and
    // looks for what it missed, so the row is taken now, not at the next poll.
    tokio::time::timeout(Duration::from_secs(30), arrived.notified())
        .await
        .expect("the row is published after the database came back, without waiting for a poll");
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &relay.child.id().to_string()])
        .status();
    until("draining from the signal on", 503, "draining").await;
    release.notify_one();
    let status = relay
        .terminate(Duration::from_secs(30))
        .expect("idem relay stops once the round ends");
    assert!(status.success(), "{status}");
    drop_schema(&pool, &schema).await;
}

/// A webhook's `{destination}` is encoded only as much as it must be to stay one path segment
/// (RFC 3986 §2.3): `orders.created` reaches a router's literal route `/hooks/orders.created`
/// as written, while a `/` and a whole `..` segment are encoded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_destination_reaches_a_literal_route_as_written() {
    use axum::http::StatusCode;
    use std::sync::{Arc, Mutex};

    let paths: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = Arc::clone(&paths);
    let app = axum::Router::new()
        .route(
            "/hooks/orders.created",
            axum::routing::post(|| async { StatusCode::NO_CONTENT }),
        )
        .fallback(|| async { StatusCode::NOT_FOUND })
        .layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                let seen = Arc::clone(&seen);
                async move {
                    let path = request.uri().path().to_owned();
                    let answer = next.run(request).await;
                    seen.lock()
                        .unwrap()
                        .push(format!("{} {path}", answer.status().as_u16()));
                    answer
                }
            },
        ));
    let addr = common::serve_app(app).await;
    let pool = PgPool::connect(&common::database_url()).await.unwrap();
    let schema = outbox_with(
        &pool,
        &[
            ("orders.created", "g1", None, "one"),
            ("billing:invoice~v2", "g2", None, "two"),
            ("a/b", "g3", None, "three"),
            ("..", "g4", None, "four"),
        ],
    )
    .await;
    let database = common::database_url();
    let to = format!("http://{addr}/hooks/{{destination}}");
    let relay = common::spawn_idem(
        &[
            "relay",
            "--database",
            &database,
            "--schema",
            &schema,
            "--to",
            &to,
            "--max-attempts",
            "1",
        ],
        &[],
        "warn",
        false,
    );
    idempotency_testkit::eventually(Duration::from_secs(30), "four calls", async || {
        paths.lock().unwrap().len() >= 4
    })
    .await;
    drop(relay);
    let mut paths = paths.lock().unwrap().clone();
    paths.sort();
    assert_eq!(
        paths,
        [
            "204 /hooks/orders.created",
            "404 /hooks/%2E%2E",
            "404 /hooks/a%2Fb",
            "404 /hooks/billing:invoice~v2",
        ]
    );
    drop_schema(&pool, &schema).await;
}

/// SQS: each row sent with its key as the `Idempotency-Key` attribute (and its headers as
/// attributes), to the `--to` queue or the one its destination names.
#[cfg(feature = "sqs")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_are_sent_to_sqs_with_their_key_as_an_attribute() {
    let (client, default) = sqs_queue("events").await;
    let (_, other) = sqs_queue("other").await;
    let urls = [default, other];
    let pool = PgPool::connect(&common::database_url()).await.unwrap();
    let schema = outbox_with(
        &pool,
        &[
            ("", "g", Some("evt-1"), "to the default queue"),
            (&urls[1], "g", None, "to the other queue"),
        ],
    )
    .await;
    let _relay = start_relay(&schema, &format!("sqs://?queue_url={}", urls[0]));
    let mut got = Vec::new();
    idempotency_testkit::eventually(Duration::from_secs(30), "both messages", async || {
        for url in &urls {
            let received = client
                .receive_message()
                .queue_url(url)
                .message_attribute_names("All")
                .max_number_of_messages(10)
                .send()
                .await
                .unwrap();
            for message in received.messages.unwrap_or_default() {
                let attribute = |name: &str| {
                    message
                        .message_attributes()
                        .and_then(|a| a.get(name))
                        .and_then(|v| v.string_value())
                        .unwrap_or_default()
                        .to_owned()
                };
                got.push((
                    url.clone(),
                    attribute("Idempotency-Key"),
                    attribute("x-source"),
                    message.body().unwrap_or_default().to_owned(),
                ));
            }
        }
        got.len() >= 2
    })
    .await;
    got.sort_by(|a, b| a.3.cmp(&b.3));
    assert_eq!(got[0].0, urls[0]);
    assert_eq!(
        (got[0].1.as_str(), got[0].2.as_str(), got[0].3.as_str()),
        ("evt-1", "shop", "to the default queue")
    );
    assert_eq!(got[1].0, urls[1]);
    assert!(
        got[1].1.starts_with(&format!("{schema}.idempotency_outbox:")),
        "{got:?}"
    );
    drop_schema(&pool, &schema).await;
}

/// NATS JetStream: each row acknowledged by the stream, its key as `Idempotency-Key` and
/// `Nats-Msg-Id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_are_published_to_jetstream_with_their_key_as_the_message_id() {
    let stream = idempotency_testkit::nats::TestStream::new("relay", |_| {}).await;
    let pool = PgPool::connect(&common::database_url()).await.unwrap();
    let schema = outbox_with(&pool, &[("", "g", Some("evt-9"), "nine"), ("", "g", None, "ten")]).await;
    let to = format!(
        "{}?subject={}",
        idempotency_testkit::nats::nats_url(),
        stream.work
    );
    let _relay = start_relay(&schema, &to);
    let reader: async_nats::jetstream::consumer::PullConsumer = stream
        .created
        .create_consumer(async_nats::jetstream::consumer::pull::Config::default())
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut messages = reader.messages().await.unwrap();
    while got.len() < 2 {
        let message = tokio::time::timeout(Duration::from_secs(30), messages.next())
            .await
            .expect("the relay published within 30 s")
            .unwrap()
            .unwrap();
        let headers = message.headers.clone().unwrap_or_default();
        got.push((
            idempotency_testkit::nats::header(&headers, "Idempotency-Key"),
            idempotency_testkit::nats::header(&headers, "Nats-Msg-Id"),
            String::from_utf8_lossy(&message.payload).into_owned(),
        ));
        message.ack().await.unwrap();
    }
    assert_eq!(
        got[0],
        ("evt-9".to_owned(), "evt-9".to_owned(), "nine".to_owned())
    );
    assert_eq!(got[1].0, got[1].1);
    assert_eq!(got[1].2, "ten");
    drop_schema(&pool, &schema).await;
}

/// Kafka (librdkafka's mock cluster): each row acknowledged by every replica, its key as the
/// `Idempotency-Key` header, its ordering group as the record key, so a group stays in one
/// partition, in order.
#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_are_produced_to_kafka_keyed_by_their_group() {
    use idempotency_kafka::rdkafka::message::{Headers, Message};

    let (_cluster, brokers, topic) = kafka_topic();
    let pool = PgPool::connect(&common::database_url()).await.unwrap();
    let rows: Vec<(String, String)> = (0..30)
        .map(|i| (format!("order-{}", i % 3), format!("{i}")))
        .collect();
    let borrowed: Vec<(&str, &str, Option<&str>, &str)> = rows
        .iter()
        .map(|(group, body)| ("", group.as_str(), None, body.as_str()))
        .collect();
    let schema = outbox_with(&pool, &borrowed).await;
    let _relay = start_relay(&schema, &format!("kafka://{brokers}?topic={topic}"));
    let reader = kafka_reader(&brokers, &topic);
    let mut by_group: std::collections::HashMap<String, (i32, Vec<u32>)> = std::collections::HashMap::new();
    for _ in 0..30 {
        let record = tokio::time::timeout(Duration::from_secs(30), reader.recv())
            .await
            .expect("every row within 30 s")
            .unwrap();
        let group = String::from_utf8_lossy(record.key().unwrap()).into_owned();
        let key = record
            .headers()
            .and_then(|headers| headers.iter().find(|h| h.key == "Idempotency-Key"))
            .and_then(|h| h.value)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default();
        assert!(key.starts_with(&format!("{schema}.idempotency_outbox:")), "{key}");
        let n: u32 = String::from_utf8_lossy(record.payload().unwrap())
            .parse()
            .unwrap();
        let entry = by_group.entry(group).or_insert((record.partition(), Vec::new()));
        assert_eq!(entry.0, record.partition(), "a group stays in one partition");
        entry.1.push(n);
    }
    for (group, (_, ns)) in &by_group {
        let mut sorted = ns.clone();
        sorted.sort_unstable();
        assert_eq!(ns, &sorted, "{group} in order");
    }
    drop_schema(&pool, &schema).await;
}

on_both_databases!(two_relays_share_a_table => two_relays_share_a_table_without_reordering_a_group, two_relays_share_a_mysql_table_without_reordering_a_group);

/// Two relays on one table: every row published once, each group in order (the lock per group,
/// advisory on PostgreSQL and named on MySQL, keeps a group with one relay at a time). The
/// Python producer writes 1,000 rows (100 rolled back) in 20 groups.
async fn two_relays_share_a_table(db: Db) {
    let table = Table::new(db).await;
    table.produce(100).await;
    let (_connection, channel, queue) = rabbit_queue("relay.shared", false).await;
    let to = format!("{}?routing_key={queue}", amqp_url());
    let _relays = [table.relay(&to), table.relay(&to)];
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "shared".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut keys = std::collections::HashSet::new();
    let mut arrived = Vec::new();
    while arrived.len() < 900 {
        let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .expect("every row within 30 s")
            .unwrap()
            .unwrap();
        arrived.push(String::from_utf8_lossy(&delivery.data).parse().unwrap());
        let key = delivery.properties.message_id().clone().unwrap().to_string();
        assert!(keys.insert(key.clone()), "{key} published twice");
        delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    exactly_the_committed_rows_in_order(&arrived, 100);
    idempotency_testkit::eventually(Duration::from_secs(30), "every row marked sent", async || {
        table.count("sent_at IS NULL").await == 0
    })
    .await;
    // Every publish was confirmed before its row was marked sent, so a copy would be in the
    // queue before this marker.
    channel
        .basic_publish(
            "".into(),
            queue.as_str().into(),
            lapin::options::BasicPublishOptions::default(),
            b"marker",
            lapin::BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let next = tokio::time::timeout(Duration::from_secs(30), consumer.next())
        .await
        .expect("the marker arrives")
        .unwrap()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&next.data),
        "marker",
        "no row published twice"
    );
    let _ = channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await;
    table.drop().await;
}

/// The Python producer: `argv[3]` transactions of 10 rows through psycopg, one transaction in
/// ten rolled back; row `i` is in group `g{i % 20}` with key `evt-{i}` and payload `i`.
const PRODUCER: &str = r#"
import sys
import psycopg

conn = psycopg.connect(sys.argv[1], autocommit=True)
conn.execute("SET search_path TO " + sys.argv[2])

class Rollback(Exception):
    pass

for t in range(int(sys.argv[3])):
    try:
        with conn.transaction():
            for i in range(t * 10, t * 10 + 10):
                conn.execute(
                    "INSERT INTO idempotency_outbox (ordering_key, key, payload) VALUES (%s, %s, %s)",
                    ("g%d" % (i % 20), "evt-%d" % i, str(i).encode()),
                )
            if t % 10 == 9:
                raise Rollback()
    except Rollback:
        pass
conn.close()
"#;

/// The Python producer on MySQL, through PyMySQL: as [`PRODUCER`], into the database `argv[2]`
/// of the server `argv[1]` names.
const MYSQL_PRODUCER: &str = r#"
import sys
from urllib.parse import urlparse
import pymysql

url = urlparse(sys.argv[1])
conn = pymysql.connect(host=url.hostname, port=url.port or 3306, user=url.username,
                       password=url.password or "", database=sys.argv[2])
for t in range(int(sys.argv[3])):
    with conn.cursor() as cursor:
        for i in range(t * 10, t * 10 + 10):
            cursor.execute(
                "INSERT INTO idempotency_outbox (ordering_key, `key`, payload) VALUES (%s, %s, %s)",
                ("g%d" % (i % 20), "evt-%d" % i, str(i).encode()),
            )
    if t % 10 == 9:
        conn.rollback()
    else:
        conn.commit()
conn.close()
"#;

/// The calls a handler behind `idem consume` got: each message's `Idempotency-Key` and payload,
/// in the order they came.
type Calls = std::sync::Arc<std::sync::Mutex<Vec<(String, u32)>>>;

/// `idem consume` feeding a handler that notes each call, running while it lives.
struct Guarded {
    _process: Process,
    _dir: tempfile::TempDir,
    /// Its `--admin-listen` address.
    admin: std::net::SocketAddr,
    /// What the handler got.
    calls: Calls,
}

/// `idem consume --from FROM` (records in SQLite; `at_once` messages fetched and handled at once:
/// 1 where only one at a time keeps the broker's order) feeding a handler that notes each call.
async fn guarded_consumer(from: &str, env: &[(&'static str, String)], at_once: &str) -> Guarded {
    use axum::extract::State;
    use axum::http::HeaderMap;

    async fn handle(State(calls): State<Calls>, headers: HeaderMap, body: String) -> &'static str {
        let key = headers["idempotency-key"].to_str().unwrap().to_owned();
        calls.lock().unwrap().push((key, body.parse().unwrap()));
        "done"
    }
    let calls = Calls::default();
    let handler = common::serve_app(
        axum::Router::new()
            .route("/events", axum::routing::post(handle))
            .with_state(std::sync::Arc::clone(&calls)),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("consumer.db").display());
    let admin = common::free_addr();
    let (to, admin_text) = (format!("http://{handler}/events"), admin.to_string());
    let consumer = common::spawn_idem(
        &[
            "consume",
            "--from",
            from,
            "--to",
            &to,
            "--store",
            &store,
            "--admin-listen",
            &admin_text,
            "--prefetch",
            at_once,
            "--concurrency",
            at_once,
            "--batch",
            "1",
        ],
        env,
        "warn",
        false,
    );
    Guarded {
        _process: common::ready(consumer, admin, "idem consume").await,
        _dir: dir,
        admin,
        calls,
    }
}

/// Waits for the guarded consumer's handler to have run `expected` calls, then checks them
/// against the Python producer's `transactions`: each committed row's key once, none rolled
/// back, each group in order.
async fn handled_exactly_once_in_order(calls: &Calls, expected: usize, transactions: u32) {
    // A bound for a stalled consumer, not a speed: the SQS case goes through one local server
    // that the other SQS tests share.
    idempotency_testkit::eventually(Duration::from_secs(300), "every row handled", async || {
        calls.lock().unwrap().len() >= expected
    })
    .await;
    let calls = calls.lock().unwrap().clone();
    for (key, n) in &calls {
        assert_eq!(*key, format!("evt-{n}"), "each row with its key");
    }
    let arrived: Vec<u32> = calls.iter().map(|(_, n)| *n).collect();
    exactly_the_committed_rows_in_order(&arrived, transactions);
}

/// Checks what arrived (payloads, in arrival order) against the Python producer's
/// `transactions`: exactly the committed rows, once each, none rolled back, each group in order.
fn exactly_the_committed_rows_in_order(arrived: &[u32], transactions: u32) {
    let expected: std::collections::BTreeSet<u32> =
        (0..transactions * 10).filter(|i| (i / 10) % 10 != 9).collect();
    let got: std::collections::BTreeSet<u32> = arrived.iter().copied().collect();
    assert_eq!(arrived.len(), expected.len(), "each committed row once");
    assert_eq!(got, expected, "exactly the committed rows, none rolled back");
    let mut last: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    for n in arrived {
        if let Some(previous) = last.insert(n % 20, *n) {
            assert!(previous < *n, "group g{}: {n} arrived after {previous}", n % 20);
        }
    }
}

on_both_databases!(jetstream => a_thousand_python_rows_reach_jetstream_committed_only_and_in_order, a_thousand_python_rows_from_mysql_reach_jetstream);

/// 1,000 rows from the Python producer (100 rolled back) to JetStream, and `idem consume` on
/// the other side: exactly the 900 committed are handled, once each, each group in order.
async fn jetstream(db: Db) {
    let stream = idempotency_testkit::nats::TestStream::new("relay", |_| {}).await;
    let table = Table::new(db).await;
    table.produce(100).await;
    let nats = idempotency_testkit::nats::nats_url();
    let _relay = table.relay(&format!("{nats}?subject={}", stream.work));
    let from = format!(
        "{nats}?stream={}&consumer=idem&subject={}&dead_letter={}",
        stream.stream, stream.work, stream.dead
    );
    let consumer = guarded_consumer(&from, &[], "1").await;
    handled_exactly_once_in_order(&consumer.calls, 900, 100).await;
    table.drop().await;
}

on_both_databases!(webhook => a_thousand_python_rows_reach_a_webhook_committed_only_and_in_order, a_thousand_python_rows_from_mysql_reach_a_webhook);

/// 1,000 rows from the Python producer (100 rolled back) to a counting webhook: exactly the 900
/// committed arrive, each group in order.
async fn webhook(db: Db) {
    use axum::extract::State;
    use std::sync::{Arc, Mutex};

    let arrived: Arc<Mutex<Vec<u32>>> = Arc::default();
    let app = axum::Router::new()
        .route(
            "/events",
            axum::routing::post(
                |State(arrived): State<Arc<Mutex<Vec<u32>>>>, body: String| async move {
                    arrived.lock().unwrap().push(body.parse().unwrap());
                    "ok"
                },
            ),
        )
        .with_state(Arc::clone(&arrived));
    let addr = common::serve_app(app).await;
    let table = Table::new(db).await;
    table.produce(100).await;
    let _relay = table.relay(&format!("http://{addr}/events"));
    idempotency_testkit::eventually(Duration::from_secs(60), "900 rows posted", async || {
        arrived.lock().unwrap().len() >= 900
    })
    .await;
    exactly_the_committed_rows_in_order(&arrived.lock().unwrap(), 100);
    table.drop().await;
}

on_both_databases!(#[cfg(feature = "sqs")] sqs_fifo => a_thousand_python_rows_reach_an_sqs_fifo_queue_committed_only_and_in_order, a_thousand_python_rows_from_mysql_reach_an_sqs_fifo_queue);

/// 1,000 rows from the Python producer (100 rolled back) to an SQS FIFO queue (the group as the
/// message group), and `idem consume` on the other side: exactly the 900 committed are handled,
/// once each, each group in order.
#[cfg(feature = "sqs")]
async fn sqs_fifo(db: Db) {
    let (_client, url) = sqs_queue("events.fifo").await;
    let table = Table::new(db).await;
    table.produce(100).await;
    let _relay = table.relay(&format!("sqs://?queue_url={url}"));
    let mut env = aws_env();
    env.push((
        "AWS_ENDPOINT_URL",
        std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:5000".into()),
    ));
    let from = format!("sqs://?queue_url={url}&wait=0s&visibility=30s");
    // Ten a receive (SQS's most), ten groups handled at once: the worker keeps each group's
    // order whatever its concurrency. Short polling: the local AWS server answers one request at
    // a time, and a long poll would hold up the relay's sends and the consumer's deletes.
    let consumer = guarded_consumer(&from, &env, "10").await;
    handled_exactly_once_in_order(&consumer.calls, 900, 100).await;
    table.drop().await;
}

on_both_databases!(#[cfg(feature = "kafka")] kafka => a_thousand_python_rows_reach_kafka_committed_only_and_in_order, a_thousand_python_rows_from_mysql_reach_kafka);

/// 1,000 rows from the Python producer (100 rolled back) to Kafka (mock cluster, 3 partitions;
/// the group as the record key), and `idem consume` on the other side: exactly the 900
/// committed are handled, once each, each group in order.
#[cfg(feature = "kafka")]
async fn kafka(db: Db) {
    let (_cluster, brokers, topic) = kafka_topic();
    let table = Table::new(db).await;
    table.produce(100).await;
    let _relay = table.relay(&format!("kafka://{brokers}?topic={topic}"));
    let from = format!("kafka://{brokers}?topic={topic}&group=relay-test");
    let consumer = guarded_consumer(&from, &[], "1").await;
    // Each group is in one partition, which the consumer handles in order.
    handled_exactly_once_in_order(&consumer.calls, 900, 100).await;
    table.drop().await;
}

on_both_databases!(killed_five_times => a_relay_killed_five_times_loses_nothing_and_a_guarded_consumer_runs_each_row_once, a_mysql_relay_killed_five_times_loses_nothing);

/// The relay SIGKILLed five times while it publishes 1,800 committed rows (200 more rolled back
/// by the Python producer): after the restarts every committed row is sent, none of the rolled
/// back ones, and a guarded consumer (`idem consume`, one message at a time) runs each key once
/// and each group in order, however many copies the broker got.
async fn killed_five_times(db: Db) {
    let table = Table::new(db).await;
    table.produce(200).await;

    let (_connection, channel, queue) = rabbit_queue("relay.crash", true).await;
    let consumer = guarded_consumer(&format!("{}?queue={queue}", amqp_url()), &[], "1").await;

    let sent = async || -> i64 { table.count("sent_at IS NOT NULL").await };
    let relay_to = format!("{}?routing_key={queue}", amqp_url());
    let database = table.url();
    let relay_args = [
        "relay",
        "--database",
        &database,
        "--schema",
        &table.schema,
        "--to",
        &relay_to,
        "--batch",
        "10",
        "--poll",
        "100ms",
    ];
    let mut kills = 0;
    for threshold in [200, 500, 800, 1100, 1400] {
        let mut relay = common::spawn_idem(&relay_args, &[], "error", false);
        idempotency_testkit::eventually(Duration::from_secs(60), "the relay makes progress", async || {
            sent().await >= threshold
        })
        .await;
        relay.kill9();
        kills += 1;
    }
    let _relay = common::spawn_idem(&relay_args, &[], "error", false);
    idempotency_testkit::eventually(Duration::from_secs(120), "every committed row sent", async || {
        sent().await == 1800
    })
    .await;
    handled_exactly_once_in_order(&consumer.calls, 1800, 200).await;
    let duplicates = common::metric(
        &common::client(),
        consumer.admin,
        "idempotency_consumer_messages_total",
        &[("result", "duplicate")],
    )
    .await;
    eprintln!(
        "{db:?}: {kills} kills; {duplicates} duplicate copies reached the consumer and were acked unhandled"
    );
    let _ = channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await;
    table.drop().await;
}

/// A round that only parks rows (100 with keys that are not keys, a whole batch) is progress:
/// the relay goes on with the rows after them at once, not after its next poll (60 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_that_only_parks_rows_goes_on_at_once() {
    let pool = PgPool::connect(&common::database_url()).await.unwrap();
    let mut rows: Vec<(&str, &str, Option<&str>, &str)> = vec![("", "g", Some("not a key"), "bad"); 100];
    rows.extend([("", "g", None, "good-1"), ("", "g", None, "good-2")]);
    let schema = outbox_with(&pool, &rows).await;
    let (_connection, channel, queue) = rabbit_queue("relay.parked", false).await;
    let _relay = start_relay(&schema, &format!("{}?routing_key={queue}", amqp_url()));
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "parked".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for expected in ["good-1", "good-2"] {
        let body = next_body(
            &mut consumer,
            "the rows after a parked batch go out without waiting for the poll",
        )
        .await;
        assert_eq!(body, expected.as_bytes());
    }
    let dead: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {schema}.idempotency_outbox WHERE dead_at IS NOT NULL AND last_error LIKE '%not a valid Idempotency-Key%'"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(dead, 100);
    let _ = channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await;
    drop_schema(&pool, &schema).await;
}

/// A table of version 1 (no `key`, no `dead_at`, no trigger) is upgraded in place, its rows kept.
#[tokio::test]
async fn a_version_1_table_is_upgraded_in_place() {
    let pool = PgPool::connect(&common::database_url()).await.unwrap();
    let schema = schema(&pool).await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {schema}.idempotency_outbox (
            id bigserial PRIMARY KEY, ordering_key text NOT NULL, destination text NOT NULL,
            payload bytea NOT NULL, headers jsonb NOT NULL DEFAULT '[]'::jsonb,
            created_at timestamptz NOT NULL DEFAULT now(), sent_at timestamptz,
            attempts integer NOT NULL DEFAULT 0, last_error text);
         COMMENT ON TABLE {schema}.idempotency_outbox IS 'idempotency-outbox v1';
         INSERT INTO {schema}.idempotency_outbox (ordering_key, destination, payload) VALUES ('a', 'q', 'kept');"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let database = common::database_url();
    idem_ok(&["relay", "migrate", "--database", &database, "--schema", &schema]);
    let (rows, comment): (i64, Option<String>) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT (SELECT count(*) FROM {schema}.idempotency_outbox WHERE key IS NULL AND dead_at IS NULL),
                obj_description(to_regclass('{schema}.idempotency_outbox'), 'pg_class')"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((rows, comment.as_deref()), (1, Some("idempotency-outbox v2")));
    // Another application's table is refused, and left alone.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {schema}.theirs (id int); COMMENT ON TABLE {schema}.theirs IS 'not ours'"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let (code, _, err) = common::idem(&[
        "relay",
        "migrate",
        "--database",
        &database,
        "--schema",
        &schema,
        "--outbox-table",
        "theirs",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("not ours"), "{err}");
    drop_schema(&pool, &schema).await;
}

/// What `idem relay` cannot use is refused at start with the reason, the password never shown.
#[test]
fn bad_input_is_refused_at_start() {
    // A MySQL table that is not an outbox table, or a MySQL URL without a database.
    let (code, out, err) = common::idem(&[
        "relay",
        "--database",
        &mysql_url(),
        "--outbox-table",
        "not_an_outbox",
        "--to",
        "http://127.0.0.1:9/x",
    ]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("not_an_outbox does not exist: create it with `idem relay migrate`"),
        "{err}"
    );
    let (code, out, err) = common::idem(&[
        "outbox",
        "list",
        "--database",
        "mysql://app:s3cret@127.0.0.1:3306",
    ]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("names no database"), "{err}");
    assert!(!err.contains("s3cret"), "{err}");
    let (code, out, err) = common::idem(&["inbox", "list", "--database", &mysql_url()]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("the inbox is on PostgreSQL"), "{err}");
    let database = common::database_url();
    for (to, says) in [
        ("smtp://mail/x", "the destination is amqp://"),
        ("http:///nohost", "--to"),
        ("ftp://host/x", "amqp://"),
        ("amqp://guest:s3cret@127.0.0.1:1/%2f?routing_key=q", "--to"),
    ] {
        let (code, out, err) = common::idem(&["relay", "--database", &database, "--to", to]);
        assert_eq!(code, 1, "{to}: {out}{err}");
        assert!(err.contains(says), "{to}: {err}");
        assert!(!err.contains("s3cret"), "{to}: {err}");
    }
    // A missing exchange or queue is named at start.
    let missing = format!("missing-{}", Key::generate());
    for (to, says) in [
        (
            format!("{}?exchange={missing}", amqp_url()),
            format!("the exchange `{missing}` does not exist"),
        ),
        (
            format!("{}?routing_key={missing}", amqp_url()),
            format!("the queue `{missing}` does not exist"),
        ),
    ] {
        let (code, out, err) = common::idem(&["relay", "--database", &database, "--to", &to]);
        assert_eq!(code, 1, "{to}: {out}{err}");
        assert!(err.contains(&says), "{to}: {err}");
    }
    // A subject no stream captures, a topic the brokers do not have.
    let subject = format!("nowhere.{}", Key::generate());
    let to = format!("{}?subject={subject}", idempotency_testkit::nats::nats_url());
    let (code, out, err) = common::idem(&["relay", "--database", &database, "--to", &to]);
    assert_eq!(code, 1, "{to}: {out}{err}");
    assert!(
        err.contains(&format!("no JetStream stream captures the subject `{subject}`")),
        "{err}"
    );
    #[cfg(feature = "kafka")]
    {
        let (_cluster, brokers, topic) = kafka_topic();
        let missing = format!("{topic}-missing");
        let to = format!("kafka://{brokers}?topic={missing}");
        let (code, out, err) = common::idem(&["relay", "--database", &database, "--to", &to]);
        assert_eq!(code, 1, "{to}: {out}{err}");
        assert!(
            err.contains(&format!("the topic `{missing}` does not exist")),
            "{err}"
        );
    }
    let (code, _, err) = common::idem(&["relay", "--database", &database]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--to"), "{err}");
    let (code, _, err) = common::idem(&[
        "relay",
        "--database",
        "postgres://app:s3cret@127.0.0.1:1/x",
        "--to",
        &amqp_url(),
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(!err.contains("s3cret"), "{err}");
}

/// `--admin-listen 127.0.0.1:0` takes a port the kernel picks, and the start line names it, so
/// that whatever started the relay can probe it without choosing a port first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_start_line_names_the_admin_address_the_kernel_picked() {
    let pool = PgPool::connect(&common::database_url()).await.unwrap();
    let schema = outbox_with(&pool, &[]).await;
    let mut relay = relay_with(
        &common::database_url(),
        &schema,
        "http://127.0.0.1:1/hooks/{destination}",
        &["--admin-listen", "127.0.0.1:0", "--log-format", "json"],
        "info",
        true,
    );
    let admin = common::address_in(&common::logged(&mut relay, "relaying"), "admin_listen");
    let live = common::send(&common::client(), admin, "GET", "/_idem/livez", &[], b"").await;
    assert_eq!(live.status, 200, "the admin listener at the announced address");
    drop(relay);
    drop_schema(&pool, &schema).await;
}

/// The destination URL, a password in it, from `IDEM_RELAY_TO_FILE` (a mounted Secret): it is
/// used, and its password shows nowhere, nor does `IDEM_RELAY_TO`'s in `--help`.
#[test]
fn the_destination_comes_from_a_file_and_its_password_never_shows() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("to-url");
    std::fs::write(
        &file,
        "amqp://relay:S3CRET-relay@127.0.0.1:1/%2f?exchange=events\n",
    )
    .unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["relay", "--database", &common::database_url()])
        .env("IDEM_RELAY_TO_FILE", &file)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--to amqp://relay:***@127.0.0.1:1/"),
        "the file's URL was used: {err}"
    );
    assert!(!err.contains("S3CRET"), "{err}");
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["relay", "--help"])
        .env("IDEM_RELAY_TO", "amqp://relay:S3CRET-relay@rabbit/%2f")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("IDEM_RELAY_TO"), "{help}");
    assert!(!help.contains("S3CRET"), "{help}");
}

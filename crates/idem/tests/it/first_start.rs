//! Many processes starting together on a store nobody has prepared yet, as a compose file with
//! replicas or a restart of several workers does: every `idem migrate` and every `idem serve`
//! starts, they agree on one schema, and the gateways share one scope secret.

use crate::common;

use std::process::{Command, Stdio};

use common::{Process, idem};
use idempotency::mysql::sqlx::{self as mysql_sqlx, MySqlPool};
use idempotency::postgres::sqlx::{self as pg_sqlx, PgPool};

/// Processes started at once.
const PROCESSES: usize = 8;

/// Rounds, each on a new store.
const ROUNDS: usize = 10;

/// `idem migrate` `PROCESSES` times at once on `store`: every one must succeed.
fn migrate_together(store: &str, round: usize) {
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            Command::new(env!("CARGO_BIN_EXE_idem"))
                .args(["migrate", "--store", store])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start idem migrate")
        })
        .collect();
    for (n, child) in children.into_iter().enumerate() {
        let output = child.wait_with_output().unwrap();
        assert!(
            output.status.success(),
            "round {round}, process {n}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

/// `idem serve` `PROCESSES` times at once on `store` with `--scope-header Authorization` and
/// no secret (the first gateway keeps one in the store): every one becomes healthy, and a key
/// sent to the first is replayed by the last, so they share the schema and the secret.
async fn serve_together(store: &str, round: usize) {
    let (_upstream, upstream) = common::start_upstream();
    let upstream = format!("http://{upstream}");
    let listens = common::free_addrs(PROCESSES);
    let started: Vec<Process> = listens
        .iter()
        .map(|listen| Process {
            child: Command::new(env!("CARGO_BIN_EXE_idem"))
                .args(["serve", "--listen", &listen.to_string(), "--upstream", &upstream])
                .args(["--store", store, "--scope-header", "Authorization"])
                .env("IDEM_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("start idem serve"),
        })
        .collect();
    let mut gateways = Vec::new();
    for (process, listen) in started.into_iter().zip(&listens) {
        gateways.push(common::ready(process, *listen, &format!("round {round}: idem serve")).await);
    }
    let client = common::client();
    let key = format!("first-start-{round}");
    let request = [
        ("Idempotency-Key", key.as_str()),
        ("Authorization", "Bearer alice"),
    ];
    let first = common::send(&client, listens[0], "POST", "/echo", &request, b"EUR 10").await;
    assert_eq!(first.status, 201, "round {round}: {first:?}");
    let last = common::send(
        &client,
        listens[PROCESSES - 1],
        "POST",
        "/echo",
        &request,
        b"EUR 10",
    )
    .await;
    assert_eq!(last.status, 201, "round {round}: {last:?}");
    assert_eq!(
        last.header("idempotent-replayed"),
        Some("true"),
        "round {round}: the last gateway ran the key again (another secret or another schema)"
    );
    assert_eq!(last.body, first.body);
}

/// `PROCESSES` `idem serve` (when `serve`) or `idem migrate` at once on the new `store`; then
/// read-only inspection works: the schema is the one this version writes.
async fn start_together(store: &str, round: usize, serve: bool) {
    if serve {
        serve_together(store, round).await;
    } else {
        migrate_together(store, round);
    }
    let (code, _, err) = idem(&["keys", "stats", "--store", store]);
    assert_eq!(code, 0, "round {round}: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_new_file_many_first_starts() {
    for round in 0..ROUNDS {
        for serve in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("idem.db");
            let store = format!("sqlite://{}", path.display());
            start_together(&store, round, serve).await;
            let connection = rusqlite::Connection::open(&path).unwrap();
            let objects: Vec<String> = connection
                .prepare("SELECT type || ' ' || name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' ORDER BY name")
                .unwrap()
                .query_map([], |row| row.get(0))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
            assert_eq!(
                objects,
                [
                    "table idempotency_records",
                    "index idempotency_records_expiry",
                    "index idempotency_records_in_flight"
                ],
                "round {round}"
            );
            let check: String = connection
                .query_row("PRAGMA integrity_check", [], |row| row.get(0))
                .unwrap();
            assert_eq!(check, "ok", "round {round}");
        }
    }
}

fn mysql_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// `url` with its database replaced by `database`.
fn with_database(url: &str, database: &str) -> String {
    let mut url = url::Url::parse(url).unwrap();
    url.set_path(&format!("/{database}"));
    url.to_string()
}

/// A database name of this run's own.
fn new_database(round: usize, serve: bool) -> String {
    let what = if serve { "serve" } else { "migrate" };
    format!("idem_first_start_{}_{what}_{round}", std::process::id())
}

/// Every round twice (`idem migrate`, then `idem serve`), each time on a new database of the
/// server at `url`: `run` executes a statement on the server (creating and dropping the
/// database, `drop` after the name), and `tables` lists a database's tables (its name and
/// URL), which must be `expected` alone.
async fn on_new_databases(
    url: &str,
    run: impl AsyncFn(String),
    tables: impl AsyncFn(&str, &str) -> Vec<String>,
    expected: &str,
    drop: &str,
) {
    for round in 0..ROUNDS {
        for serve in [false, true] {
            let database = new_database(round, serve);
            run(format!("CREATE DATABASE {database}")).await;
            let store = with_database(url, &database);
            start_together(&store, round, serve).await;
            assert_eq!(tables(&database, &store).await, [expected], "round {round}");
            run(format!("DROP DATABASE {database}{drop}")).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_new_database_many_first_starts() {
    let admin = PgPool::connect(&common::database_url())
        .await
        .expect("PostgreSQL at DATABASE_URL");
    let run = async |statement: String| {
        pg_sqlx::raw_sql(pg_sqlx::AssertSqlSafe(statement))
            .execute(&admin)
            .await
            .unwrap();
    };
    let tables = async |_: &str, store: &str| {
        let pool = PgPool::connect(store).await.unwrap();
        let tables = pg_sqlx::query_scalar(
            "SELECT table_schema || '.' || table_name FROM information_schema.tables
             WHERE table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY 1",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        pool.close().await;
        tables
    };
    on_new_databases(
        &common::database_url(),
        run,
        tables,
        "public.idempotency_records",
        " WITH (FORCE)",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_new_database_many_first_starts() {
    let admin = MySqlPool::connect(&mysql_url())
        .await
        .expect("MariaDB at MYSQL_URL");
    let run = async |statement: String| {
        mysql_sqlx::raw_sql(mysql_sqlx::AssertSqlSafe(statement))
            .execute(&admin)
            .await
            .unwrap();
    };
    let tables = async |database: &str, _: &str| {
        mysql_sqlx::query_scalar(
            "SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = ? ORDER BY 1",
        )
        .bind(database)
        .fetch_all(&admin)
        .await
        .unwrap()
    };
    on_new_databases(&mysql_url(), run, tables, "idempotency_records", "").await;
}

/// A process whose address is taken says so and exits before it touches its store or its
/// database: no SQLite file is created by a gateway or a consumer that could not serve, and a
/// relay names the address, not the database it never reached. So a port chosen for a process
/// is also held from its very start, not only once its store is open.
#[test]
fn an_address_already_taken_is_refused_before_the_store_is_touched() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = held.local_addr().unwrap().to_string();
    let free = common::free_addr().to_string();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let store = format!("sqlite://{}", path.display());
    let upstream = "http://127.0.0.1:1";
    let cases: [(&str, Vec<&str>); 4] = [
        (
            "serve --listen",
            vec![
                "serve",
                "--listen",
                &taken,
                "--upstream",
                upstream,
                "--store",
                &store,
            ],
        ),
        (
            "serve --admin-listen",
            vec![
                "serve",
                "--listen",
                &free,
                "--admin-listen",
                &taken,
                "--upstream",
                upstream,
                "--store",
                &store,
            ],
        ),
        (
            "consume --admin-listen",
            vec![
                "consume",
                "--from",
                "amqp://127.0.0.1:1/%2f?queue=orders",
                "--to",
                upstream,
                "--store",
                &store,
                "--admin-listen",
                &taken,
            ],
        ),
        (
            "relay --admin-listen",
            vec![
                "relay",
                "--database",
                "postgres://relay:s3cret@127.0.0.1:1/orders",
                "--to",
                upstream,
                "--admin-listen",
                &taken,
            ],
        ),
    ];
    for (what, args) in cases {
        let (code, out, err) = idem(&args);
        assert_eq!(code, 1, "{what}: {out}{err}");
        assert!(
            err.contains(&format!("cannot listen on {taken}")),
            "{what}: {err}"
        );
        assert!(!err.contains("s3cret"), "{what}: {err}");
        assert!(
            !path.exists(),
            "{what}: the store was created by a process that could not serve"
        );
    }
}

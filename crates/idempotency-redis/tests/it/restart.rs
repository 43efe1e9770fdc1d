//! Stopping and restarting the Redis server mid-run.
//!
//! The test runs a Redis server of its own (the shared one on 6379 serves other tests) with
//! `appendonly yes` and `appendfsync always`, the setting the crate docs recommend for payments.
//! While workers drive keys through the guard, the server is killed with SIGKILL and started
//! again 1.5 s later on the same port and data directory. While it is down, callers get typed,
//! retryable errors. After it is back, the connection manager reconnects by itself, every key
//! ends completed with its own outcome, and no operation ran twice.

use crate::common;

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_core::{
    Decision, Execution, Fingerprint, Guard, Key, Outcome, RecordState, Recorded, Scope, Store,
};
use idempotency_redis::RedisStore;
use tokio::process::{Child, Command};

const KEYS: usize = 100;
const WORKERS: usize = 5;

struct Server {
    port: u16,
    dir: tempfile::TempDir,
    child: Child,
}

impl Server {
    async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = tempfile::tempdir().unwrap();
        let child = spawn(port, dir.path()).await;
        Self { port, dir, child }
    }

    async fn kill(&mut self) {
        self.child.kill().await.unwrap();
    }

    async fn restart(&mut self) {
        self.child = spawn(self.port, self.dir.path()).await;
    }
}

async fn spawn(port: u16, dir: &std::path::Path) -> Child {
    let child = Command::new("redis-server")
        .args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--save", ""])
        .args(["--appendonly", "yes", "--appendfsync", "always"])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("redis-server must be installed (scripts/services installs it)");
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
            return child;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("redis-server did not start on port {port}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_gives_errors_then_correct_results_and_no_duplicates() {
    let mut server = Server::start().await;
    let store = RedisStore::connect(&format!("redis://127.0.0.1:{}", server.port))
        .await
        .unwrap()
        .prefix(&common::unique_prefix())
        .unwrap();
    // The outage (1.5 s) is shorter than the lease (5 s): an outcome that could not be recorded
    // while the server was away is recorded once it is back.
    let guard = Guard::new(store.clone()).lease(Duration::from_secs(5));
    let keys: Vec<Key> = (0..KEYS)
        .map(|i| Key::new(format!("restart-{i}")).unwrap())
        .collect();
    let queue = Arc::new(Mutex::new(keys.clone()));
    let executions: Arc<Mutex<HashMap<String, u32>>> = Arc::default();

    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (guard, queue, executions) = (guard.clone(), Arc::clone(&queue), Arc::clone(&executions));
            tokio::spawn(async move {
                loop {
                    let Some(key) = queue.lock().unwrap().pop() else {
                        return;
                    };
                    loop {
                        let run = guard
                            .run(
                                Scope::global(),
                                key.clone(),
                                Fingerprint::of_bytes(key.as_str().as_bytes()),
                                |v: &String| Decision::Complete(Outcome::new(v.clone())),
                                |attempt| {
                                    let executions = Arc::clone(&executions);
                                    async move {
                                        *executions
                                            .lock()
                                            .unwrap()
                                            .entry(attempt.key().to_string())
                                            .or_default() += 1;
                                        tokio::time::sleep(Duration::from_millis(30)).await;
                                        format!("done {}", attempt.key())
                                    }
                                },
                            )
                            .await;
                        match run {
                            Ok(
                                Execution::Executed {
                                    recorded: Recorded::Completed { .. },
                                    ..
                                }
                                | Execution::Replayed(_),
                            ) => {
                                break;
                            }
                            Ok(Execution::InFlight { retry_after, .. }) => {
                                tokio::time::sleep(retry_after).await;
                            }
                            Ok(other) => panic!("{key}: {other:?}"),
                            Err(error) => {
                                assert!(error.is_retryable(), "{key}: {error}");
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                        }
                    }
                }
            })
        })
        .collect();

    tokio::time::sleep(Duration::from_millis(300)).await;
    server.kill().await;
    let back_at = tokio::time::Instant::now() + Duration::from_millis(1500);
    let probe = Key::new("probe").unwrap();
    let mut failed_probes = 0;
    while tokio::time::Instant::now() < back_at {
        if let Err(error) = store.get(&Scope::global(), &probe).await {
            assert!(
                error.is_retryable(),
                "a stopped server must be retryable: {error}"
            );
            failed_probes += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    server.restart().await;
    for worker in workers {
        worker.await.unwrap();
    }

    assert!(
        failed_probes > 0,
        "the store answered while the server was stopped"
    );
    let executions = executions.lock().unwrap().clone();
    for key in &keys {
        let record = store.get(&Scope::global(), key).await.unwrap().expect("record");
        let RecordState::Completed { outcome, .. } = record.state else {
            panic!("{key} not completed")
        };
        assert_eq!(outcome.as_bytes(), format!("done {key}").as_bytes());
        assert_eq!(
            executions.get(key.as_str()),
            Some(&1),
            "{key} ran {:?} times",
            executions.get(key.as_str())
        );
    }
}

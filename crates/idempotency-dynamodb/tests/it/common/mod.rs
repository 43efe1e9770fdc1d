//! What the DynamoDB tests share: the local server and a store on one of its tables.

#![allow(dead_code, unreachable_pub)] // each test crate uses a part

use std::sync::Arc;
use std::time::Duration;

use aws_sdk_dynamodb::config::{Credentials, Region};
use idempotency_core::ManualClock;
use idempotency_dynamodb::{DynamoDbOptions, DynamoDbStore};

/// The local server: `AWS_ENDPOINT_URL`, or the loopback default `scripts/services` starts.
pub fn endpoint() -> String {
    std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:5000".into())
}

/// A client of the server at `endpoint`, with the placeholder credentials it accepts.
pub fn client(endpoint: &str) -> aws_sdk_dynamodb::Client {
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version_latest()
        .http_client(idempotency_dynamodb::http_client())
        .endpoint_url(endpoint)
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "tests"))
        .build();
    aws_sdk_dynamodb::Client::from_conf(config)
}

/// A store on `table` (created if missing) deciding with `clock` and allowing `skew`; panics
/// when the local server is unreachable.
pub async fn store(table: &str, clock: &ManualClock, skew: Duration) -> DynamoDbStore {
    let options = DynamoDbOptions::table(table)
        .unwrap()
        .clock(Arc::new(clock.clone()))
        .max_clock_skew(skew);
    let store = DynamoDbStore::new(client(&endpoint()), options);
    store.migrate().await.unwrap_or_else(|e| {
        panic!(
            "the local AWS server at {} is needed for this test: {e}",
            endpoint()
        )
    });
    store
}

/// A moto server of a test's own, started with `scripts/moto-server.py --durable`: it records
/// every request before applying it and replays the recording when started again, so that it
/// can be killed and restarted with its tables intact, as a DynamoDB node would come back.
pub struct DurableMoto {
    port: u16,
    recording: std::path::PathBuf,
    child: Option<std::process::Child>,
}

impl DurableMoto {
    /// Starts a server on a free loopback port, recording into `recording`; panics when the
    /// moto that `scripts/services` installs is missing or does not start.
    pub async fn start(recording: std::path::PathBuf) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut moto = Self {
            port,
            recording,
            child: None,
        };
        moto.restart().await;
        moto
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// SIGKILL: requests in flight are cut, applied or not.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// Starts the server again on the same port and recording, and waits until it answers.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "moto is still running");
        let venv = std::env::var("IDEM_MOTO_VENV").map_or_else(
            |_| {
                std::path::PathBuf::from(std::env::var("HOME").unwrap_or_default())
                    .join(".local/share/idem/moto-venv")
            },
            std::path::PathBuf::from,
        );
        let python = venv.join("bin/python");
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/moto-server.py");
        let child = std::process::Command::new(&python)
            .arg(script)
            .args(["--port", &self.port.to_string(), "--durable"])
            .arg(&self.recording)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "{} (moto, installed by scripts/services) is needed for this test: {e}",
                    python.display()
                )
            });
        self.child = Some(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("moto on port {} exited at start: {status}", self.port);
            }
            assert!(
                std::time::Instant::now() < deadline,
                "moto on port {} did not start within a minute",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for DurableMoto {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

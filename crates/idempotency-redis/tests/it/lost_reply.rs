//! A command whose reply is lost is sent once. The server below answers like a Redis server (or
//! like a one-node cluster that owns every slot), runs nothing, and drops the connection when the
//! first script arrives, after it counted it: the situation of a script that ran on the real
//! server and whose reply died with the connection. Had the client re-sent it, a `release` that
//! ran would run again and answer `LeaseLost` for a lease it had just given back.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotency_core::{BeginRequest, ErrorKind, Fingerprint, Key, Scope, Store};
use idempotency_redis::RedisStore;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// A RESP server that counts the scripts it receives and answers none of them.
struct LosingServer {
    port: u16,
    scripts: Arc<AtomicUsize>,
}

impl LosingServer {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let scripts = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&scripts);
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(serve(socket, port, Arc::clone(&counted)));
            }
        });
        Self { port, scripts }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn scripts(&self) -> usize {
        self.scripts.load(Ordering::SeqCst)
    }
}

/// Reads one command (an array of bulk strings); `None` when the client hung up.
async fn command(reader: &mut BufReader<TcpStream>) -> Option<Vec<String>> {
    let mut line = String::new();
    reader.read_line(&mut line).await.ok().filter(|n| *n > 0)?;
    let count: usize = line.trim_end().strip_prefix('*')?.parse().ok()?;
    let mut parts = Vec::with_capacity(count);
    for _ in 0..count {
        line.clear();
        reader.read_line(&mut line).await.ok()?;
        let len: usize = line.trim_end().strip_prefix('$')?.parse().ok()?;
        let mut bytes = vec![0; len + 2];
        reader.read_exact(&mut bytes).await.ok()?;
        bytes.truncate(len);
        parts.push(String::from_utf8_lossy(&bytes).into_owned());
    }
    Some(parts)
}

async fn serve(socket: TcpStream, port: u16, scripts: Arc<AtomicUsize>) {
    let mut reader = BufReader::new(socket);
    while let Some(parts) = command(&mut reader).await {
        let name = parts.first().map(|p| p.to_ascii_uppercase()).unwrap_or_default();
        let sub = parts.get(1).map(|p| p.to_ascii_uppercase()).unwrap_or_default();
        let reply = match (name.as_str(), sub.as_str()) {
            ("EVALSHA" | "EVAL", _) => {
                scripts.fetch_add(1, Ordering::SeqCst);
                return; // the reply is lost with the connection
            }
            ("CLUSTER", "SLOTS") => {
                format!("*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:{port}\r\n")
            }
            ("PING", _) => "+PONG\r\n".to_owned(),
            _ => "+OK\r\n".to_owned(),
        };
        if reader.get_mut().write_all(reply.as_bytes()).await.is_err() {
            return;
        }
    }
}

async fn a_lost_reply_is_not_sent_again(store: RedisStore, server: &LosingServer) {
    let request = BeginRequest::new(Scope::global(), Key::generate(), Fingerprint::of_bytes(b"x"));
    let error = store.begin(&request).await.unwrap_err();
    assert!(error.is_retryable(), "{error}");
    assert_ne!(error.kind(), ErrorKind::InvalidConfig, "{error}");
    // Give a background re-send, were there one, the time to reach the server.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        server.scripts(),
        1,
        "the script was sent again after its reply was lost"
    );
}

#[tokio::test]
async fn single_server_sends_a_command_whose_reply_was_lost_once() {
    let server = LosingServer::start().await;
    let store = RedisStore::connect(&server.url()).await.unwrap();
    a_lost_reply_is_not_sent_again(store, &server).await;
}

#[tokio::test]
async fn cluster_sends_a_command_whose_reply_was_lost_once() {
    let server = LosingServer::start().await;
    let store = RedisStore::connect_cluster(&[server.url()]).await.unwrap();
    a_lost_reply_is_not_sent_again(store, &server).await;
}

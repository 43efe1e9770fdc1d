//! The gateway against an upstream that fails *after* it received the request: it drops the
//! connection, answers garbage, truncates its body, or stalls its headers or its body past
//! `--upstream-timeout`. The upstream may have done the work, so the outcome is unknown: the
//! gateway must say so, keep the key in flight (a retry gets `409`) until the lease ends, and
//! only then run the request again, as attempt 2. A refused connection proves nothing was sent,
//! and releases the key at once.

use crate::common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::raw::{Head, read_request};
use common::{client, free_addr, metric, send, start_gateway};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

/// The attempts the upstream received, by forwarded key.
type Seen = Arc<Mutex<HashMap<String, Vec<String>>>>;

/// Notes that the upstream received `head`'s attempt of its key.
fn note(seen: &Seen, head: &Head) {
    seen.lock()
        .unwrap()
        .entry(head.key.clone())
        .or_default()
        .push(head.attempt.clone());
}

/// An upstream that records every request, then misbehaves as its path says on a key's first
/// attempt, and answers `201` with the attempt number on later ones.
async fn faulty_upstream() -> (SocketAddr, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Seen::default();
    let record = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let seen = Arc::clone(&record);
            tokio::spawn(async move {
                let Some(head) = read_request(&mut stream).await else {
                    return;
                };
                note(&seen, &head);
                if head.attempt != "1" {
                    let body = format!("{{\"attempt\":\"{}\"}}", head.attempt);
                    let answer = format!(
                        "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = stream.write_all(answer.as_bytes()).await;
                    return;
                }
                // The work is done (the request was recorded); now the answer goes wrong.
                let answer: &[u8] = match head.path.as_str() {
                    "/drop" => b"",
                    "/garbage" => b"HTTP/1.1 200 OK\r\nthis is not a header\r\n\r\n",
                    "/truncated" => b"HTTP/1.1 201 Created\r\ncontent-length: 100\r\n\r\n0123456789",
                    "/stall-body" => {
                        let _ = stream
                            .write_all(b"HTTP/1.1 201 Created\r\ncontent-length: 100\r\n\r\n0123456789")
                            .await;
                        tokio::time::sleep(Duration::from_secs(20)).await;
                        b""
                    }
                    "/stall" => {
                        tokio::time::sleep(Duration::from_secs(20)).await;
                        b""
                    }
                    _ => b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n",
                };
                let _ = stream.write_all(answer).await;
                // Dropping the stream closes the connection.
            });
        }
    });
    (addr, seen)
}

/// (path, status, problem type) of each fault.
const FAULTS: [(&str, u16, &str); 5] = [
    ("/drop", 502, "urn:idempotency:problem:upstream-answer-lost"),
    ("/garbage", 502, "urn:idempotency:problem:upstream-answer-lost"),
    ("/truncated", 502, "urn:idempotency:problem:upstream-answer-lost"),
    ("/stall-body", 504, "urn:idempotency:problem:upstream-timeout"),
    ("/stall", 504, "urn:idempotency:problem:upstream-timeout"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_upstream_received_is_never_released_and_never_run_twice_at_once() {
    let (upstream, seen) = faulty_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let store = common::sqlite_url(dir.path());
    let addr = free_addr();
    let up = format!("http://{upstream}");
    let _gateway = start_gateway(
        addr,
        &[
            "--upstream",
            &up,
            "--store",
            &store,
            "--lease",
            "2s",
            "--upstream-timeout",
            "500ms",
        ],
        true,
    )
    .await;
    let client = client();
    let runs = FAULTS.map(|(path, status, problem)| {
        let client = client.clone();
        tokio::spawn(async move {
            let key = format!("fault{}", path.replace('/', "-"));
            let headers = [("idempotency-key", key.as_str())];
            let first = send(&client, addr, "POST", path, &headers, b"{}").await;
            assert_eq!(first.status, status, "{path}: {first:?}");
            assert_eq!(first.json()["type"], problem, "{path}: {first:?}");
            assert!(
                first.json()["detail"]
                    .as_str()
                    .is_some_and(|d| d.contains("unknown")),
                "{path}: the problem must say the outcome is unknown: {first:?}"
            );
            assert!(first.header("retry-after").is_some(), "{path}: {first:?}");
            // Right away, the key is still in flight: the upstream may still be working.
            let retry = send(&client, addr, "POST", path, &headers, b"{}").await;
            assert_eq!(
                retry.status, 409,
                "{path}: a retry ran again while the outcome was unknown: {retry:?}"
            );
            // Once the lease ends, the retry runs again, as attempt 2.
            let deadline = Instant::now() + Duration::from_secs(30);
            let done = loop {
                let retry = send(&client, addr, "POST", path, &headers, b"{}").await;
                if retry.status != 409 || Instant::now() > deadline {
                    break retry;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            assert_eq!(done.status, 201, "{path}: {done:?}");
            assert_eq!(done.json()["attempt"], "2", "{path}: {done:?}");
            key
        })
    });
    for run in runs {
        let key = run.await.unwrap();
        let attempts = seen.lock().unwrap()[&key].clone();
        assert_eq!(attempts, ["1", "2"], "{key}: the upstream saw {attempts:?}");
    }
    // Each fault is counted by kind, and the layer's own metrics carry the gateway's name.
    let lost = metric(
        &client,
        addr,
        "idem_upstream_errors_total",
        &[("kind", "answer_lost")],
    )
    .await;
    assert!(lost >= 3.0, "{lost}");
    let timeouts = metric(
        &client,
        addr,
        "idem_upstream_errors_total",
        &[("kind", "timeout")],
    )
    .await;
    assert!(timeouts >= 2.0, "{timeouts}");
    let unknown = metric(
        &client,
        addr,
        "idempotency_outcome_unknown_total",
        &[("guard", "gateway")],
    )
    .await;
    assert!(unknown >= 5.0, "{unknown}");
    let takeovers = metric(
        &client,
        addr,
        "idempotency_lease_takeovers_total",
        &[("guard", "gateway")],
    )
    .await;
    assert!(takeovers >= 5.0, "{takeovers}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_sent_nothing_and_releases_the_key_at_once() {
    // Nothing listens on the upstream's port until the second try.
    let port_holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream = port_holder.local_addr().unwrap();
    drop(port_holder);
    let dir = tempfile::tempdir().unwrap();
    let store = common::sqlite_url(dir.path());
    let addr = free_addr();
    let up = format!("http://{upstream}");
    let _gateway = start_gateway(addr, &["--upstream", &up, "--store", &store], true).await;
    let client = client();
    let headers = [("idempotency-key", "refused-1")];
    let first = send(&client, addr, "POST", "/pay", &headers, b"{}").await;
    assert_eq!(first.status, 502);
    assert_eq!(
        first.json()["type"],
        "urn:idempotency:problem:upstream-unreachable"
    );
    assert!(
        first.json()["detail"]
            .as_str()
            .is_some_and(|d| d.contains("nothing was sent")),
        "{first:?}"
    );
    assert_eq!(
        metric(
            &client,
            addr,
            "idem_upstream_errors_total",
            &[("kind", "unreachable")]
        )
        .await,
        1.0
    );
    // The upstream comes up: the retry runs at once, as attempt 2 (the key was used before).
    let listener = TcpListener::bind(upstream).await.unwrap();
    let seen: Seen = Seen::default();
    let record = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            if let Some(head) = read_request(&mut stream).await {
                note(&record, &head);
                let _ = stream
                    .write_all(b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                    .await;
            }
        }
    });
    let retry = send(&client, addr, "POST", "/pay", &headers, b"{}").await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(seen.lock().unwrap()["refused-1"], ["2"]);
}

/// A keep-alive upstream that answers `201` and counts the connections it accepted; with
/// `close_after_answer` it closes each connection right after its first answer, without saying
/// so (as a server whose keep-alive timeout is shorter than the gateway's does). The semaphore
/// gains a permit each time a connection has been closed.
async fn keep_alive_upstream(
    close_after_answer: bool,
) -> (SocketAddr, Seen, Arc<AtomicUsize>, Arc<tokio::sync::Semaphore>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Seen::default();
    let connections = Arc::new(AtomicUsize::new(0));
    let closed = Arc::new(tokio::sync::Semaphore::new(0));
    let (record, accepted, closes) = (Arc::clone(&seen), Arc::clone(&connections), Arc::clone(&closed));
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            accepted.fetch_add(1, Ordering::SeqCst);
            let (record, closes) = (Arc::clone(&record), Arc::clone(&closes));
            tokio::spawn(async move {
                while let Some(head) = read_request(&mut stream).await {
                    note(&record, &head);
                    let answer = b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok";
                    if stream.write_all(answer).await.is_err() || close_after_answer {
                        break;
                    }
                }
                // On loopback the FIN is in the gateway's receive queue once this returns.
                drop(stream);
                closes.add_permits(1);
            });
        }
    });
    (addr, seen, connections, closed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_reused_and_one_the_upstream_closed_is_replaced_without_a_lost_answer() {
    for close_after_answer in [false, true] {
        let (upstream, seen, accepted, closed) = keep_alive_upstream(close_after_answer).await;
        let addr = free_addr();
        let up = format!("http://{upstream}");
        let _gateway = start_gateway(addr, &["--upstream", &up, "--store", "memory://"], true).await;
        let client = client();
        for i in 0..10 {
            let key = format!("keep-alive-{i}");
            let answer = send(&client, addr, "POST", "/pay", &[("idempotency-key", &key)], b"{}").await;
            assert_eq!(answer.status, 201, "{close_after_answer} {key}: {answer:?}");
            if close_after_answer {
                // The upstream has closed the connection: the gateway must notice it before it
                // sends the next request on it.
                closed.acquire().await.unwrap().forget();
            }
        }
        let seen = seen.lock().unwrap().clone();
        for i in 0..10 {
            assert_eq!(
                seen[&format!("keep-alive-{i}")],
                ["1"],
                "{close_after_answer}: {seen:?}"
            );
        }
        let expected = if close_after_answer { 10 } else { 1 };
        assert_eq!(accepted.load(Ordering::SeqCst), expected, "{close_after_answer}");
        let opened = metric(&client, addr, "idem_upstream_connections_opened_total", &[]).await;
        assert_eq!(opened, expected as f64, "{close_after_answer}");
        let lost = metric(
            &client,
            addr,
            "idem_upstream_errors_total",
            &[("kind", "answer_lost")],
        )
        .await;
        assert_eq!(
            lost, 0.0,
            "{close_after_answer}: a closed idle connection was taken for a lost answer"
        );
    }
}

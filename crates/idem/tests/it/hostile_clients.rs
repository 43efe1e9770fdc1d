//! `idem serve` against clients that hold its resources: headers or bodies that never finish,
//! more connections than it should serve, a body far over the limit, and a shutdown while all
//! of that goes on.

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{Fronted, calls, client, metric, send};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads from `stream` until the peer closes it (or 20 s pass, which fails the test); returns
/// what was read, or the error that ended the read.
async fn read_to_close(stream: &mut TcpStream) -> Result<String, std::io::Error> {
    let mut seen = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut seen)).await;
    let read = read.expect("the gateway kept the connection open");
    read.map(|_| String::from_utf8_lossy(&seen).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_headers_and_bodies_are_cut_off_and_nothing_runs() {
    let flags = ["--header-timeout", "300ms", "--body-timeout", "300ms"];
    let gateway = Fronted::sqlite(&flags).await;
    let (addr, upstream) = (gateway.addr, gateway.upstream);

    // Headers that never end: the connection is closed.
    let mut slow_head = TcpStream::connect(addr).await.unwrap();
    slow_head
        .write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\nidempotency-key: slow-head\r\n")
        .await
        .unwrap();
    let _ = read_to_close(&mut slow_head).await;

    // A body that never ends: 408, and the request did not run.
    let mut slow_body = TcpStream::connect(addr).await.unwrap();
    slow_body
        .write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\nidempotency-key: slow-body\r\ncontent-length: 100\r\n\r\n0123456789")
        .await
        .unwrap();
    let answer = read_to_close(&mut slow_body).await.unwrap_or_default();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("urn:idempotency:problem:request-timeout"),
        "{answer}"
    );
    let client = client();
    assert_eq!(calls(&client, upstream, "slow-body").await, 0);
    assert!(metric(&client, addr, "idem_request_body_timeouts_total", &[]).await >= 1.0);
    // Nothing was recorded either: the same key with the whole body runs.
    let whole = send(
        &client,
        addr,
        "POST",
        "/echo",
        &[("idempotency-key", "slow-body")],
        b"x",
    )
    .await;
    assert_eq!(whole.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_gets_its_413_not_a_reset() {
    let gateway = Fronted::sqlite(&[]).await;
    let (addr, upstream) = (gateway.addr, gateway.upstream);
    let body = vec![b'x'; 2 << 20];
    for round in 0..5 {
        // A plain HTTP/1.1 client: it sends the whole body, and only then reads the answer.
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST /echo HTTP/1.1\r\nhost: x\r\nidempotency-key: big-{round}\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        let sent = async {
            stream.write_all(head.as_bytes()).await?;
            // The gateway has answered by the time the body follows, as it has over a slow link.
            tokio::time::sleep(Duration::from_millis(100)).await;
            stream.write_all(&body).await
        }
        .await;
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut answer))
            .await
            .expect("the gateway kept the connection open");
        let answer = String::from_utf8_lossy(&answer);
        assert!(
            sent.is_ok() && read.is_ok() && answer.starts_with("HTTP/1.1 413"),
            "round {round}: sent {sent:?}, read {read:?}: {answer}"
        );
    }
    // `Expect: 100-continue` still gets the 413 before any of the body is sent.
    let mut expecting = TcpStream::connect(addr).await.unwrap();
    expecting
        .write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\nidempotency-key: big-expect\r\ncontent-length: 2097152\r\nexpect: 100-continue\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0_u8; 12];
    expecting.read_exact(&mut first).await.unwrap();
    assert_eq!(&first, b"HTTP/1.1 413");
    assert_eq!(calls(&client(), upstream, "big-0").await, 0);
}

/// Opens a connection that has sent half of its headers.
async fn stalled(addr: SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(b"GET /echo HTTP/1.1\r\n").await.unwrap();
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_capped() {
    // Not waiting for health: the check's own connection would count.
    let gateway = Fronted::start(None, &["--max-connections", "3"], false).await;
    let addr = gateway.addr;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut held = vec![stalled(addr).await, stalled(addr).await, stalled(addr).await];
    let client = client();
    let waiting = {
        let client = client.clone();
        tokio::spawn(async move {
            send(
                &client,
                addr,
                "POST",
                "/echo",
                &[("idempotency-key", "capped")],
                b"x",
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "a fourth connection was served");
    drop(held.pop());
    let answer = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("served once a connection closed")
        .unwrap();
    assert_eq!(answer.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_bounded_by_the_drain_timeout() {
    let mut fronted = Fronted::sqlite(&["--drain-timeout", "1s"]).await;
    let (addr, store) = (fronted.addr, fronted.store.clone());
    let client = client();
    // An idle keep-alive connection, three stalled clients, and a request the upstream takes
    // 30 s to answer.
    assert_eq!(
        send(&client, addr, "GET", "/calls?key=x", &[], b"").await.status,
        200
    );
    let _stalled = [stalled(addr).await, stalled(addr).await, stalled(addr).await];
    let slow = {
        let client = client.clone();
        tokio::spawn(async move {
            common::try_send(
                &client,
                addr,
                "POST",
                "/slow?ms=30000",
                &[("idempotency-key", "slow")],
                b"x",
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let asked = Instant::now();
    let status = fronted.gateway.terminate(Duration::from_secs(20));
    assert!(
        status.is_some(),
        "still running 20 s after SIGTERM with --drain-timeout 1s"
    );
    assert!(slow.await.unwrap().is_none(), "the slow request was abandoned");
    // The abandoned request's key stays in flight: its lease protects it until a retry takes over.
    let (code, out, err) = common::idem(&["keys", "get", "slow", "--store", &store, "--json"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"in_flight\""), "{out}");
    eprintln!("exited {:?} after SIGTERM", asked.elapsed());
}

/// Many clients each holding a large unfinished body cannot make the gateway hold more than
/// `--max-buffered` bytes of bodies: past it, a guarded request gets 503 `overloaded` with
/// `Retry-After` and does not run; once the held bodies are done, it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_bodies_share_one_memory_bound() {
    let gateway = Fronted::sqlite(&["--max-body", "64KiB", "--max-buffered", "100KiB"]).await;
    let (addr, upstream) = (gateway.addr, gateway.upstream);

    // Two clients send 40 KiB of a 60 KiB body each and stall: 80 KiB held.
    let mut holders = Vec::new();
    for n in 0..2 {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST /echo HTTP/1.1\r\nhost: x\r\nidempotency-key: held-{n}\r\ncontent-length: {}\r\n\r\n",
            60 * 1024
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(&[b'a'; 40 * 1024]).await.unwrap();
        holders.push(stream);
    }
    // Once the gateway has read the holders' 80 KiB, a third body of 30 KiB would pass 100 KiB:
    // refused, and it did not run.
    let client = client();
    while metric(&client, addr, "idempotency_http_bodies_buffered_bytes", &[]).await < (80 * 1024) as f64 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let body = vec![b'b'; 30 * 1024];
    let key = "third".to_owned();
    let shed = send(
        &client,
        addr,
        "POST",
        "/echo",
        &[("idempotency-key", &key)],
        &body,
    )
    .await;
    assert_eq!(shed.status, 503, "a body past the bound was refused");
    assert_eq!(shed.json()["type"], "urn:idempotency:problem:overloaded");
    assert_eq!(shed.header("retry-after"), Some("1"));
    assert!(metric(&client, addr, "idempotency_http_bodies_shed_total", &[]).await >= 1.0);
    assert_eq!(calls(&client, upstream, &key).await, 0);

    // The holders finish: their requests run, and the refused one runs on retry.
    for (n, stream) in holders.iter_mut().enumerate() {
        stream.write_all(&[b'a'; 20 * 1024]).await.unwrap();
        let mut head = [0_u8; 12];
        stream.read_exact(&mut head).await.unwrap();
        assert_eq!(&head, b"HTTP/1.1 201", "holder {n}");
    }
    let retried = send(
        &client,
        addr,
        "POST",
        "/echo",
        &[("idempotency-key", "third")],
        &body,
    )
    .await;
    assert_eq!(retried.status, 201);
    assert_eq!(calls(&client, upstream, "third").await, 1);
    // Every share went back when its request ended.
    let held = metric(&client, addr, "idempotency_http_bodies_buffered_bytes", &[]).await;
    assert_eq!(held, 0.0);
}

//! The reconcile hook through the binary: a raw upstream that charges and then drops its answer
//! (or drops it without charging), and a reconcile endpoint backed by its ledger. The retry
//! after the lease asks the ledger: a charge found is adopted (the upstream is not called
//! again), a 404 lets the attempt run, and a hook that is down, hangs or answers garbage runs
//! nothing and keeps the key in flight.

use crate::common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::raw::read_request;
use common::{HttpClient, Seen, client, free_addr, idem, metric, send, start_gateway};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

/// What the raw upstream saw.
#[derive(Default)]
struct Upstream {
    /// The attempts of each key's `POST`s.
    posts: HashMap<String, Vec<String>>,
    /// The charges made, by key.
    ledger: HashMap<String, u32>,
    /// The ledger questions: (key, attempt) as the headers carried them, and the path.
    asked: Vec<(String, String, String)>,
}

type Shared = Arc<Mutex<Upstream>>;

/// The upstream. `POST /charge-then-drop`: charges, then drops the connection on a key's
/// first attempt; `POST /drop`: drops it without charging on the first; later attempts charge
/// and answer 201. `GET /ledger/{key}`: the charge as JSON (200) or 404; `GET /ledger-hang/…`
/// never answers; `GET /ledger-garbage/…` answers bytes that are not HTTP.
async fn upstream() -> (SocketAddr, Shared) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Shared::default();
    let state = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let seen = Arc::clone(&state);
            tokio::spawn(async move {
                let Some(head) = read_request(&mut stream).await else {
                    return;
                };
                let answer: Vec<u8> = if head.method == "POST" {
                    let first = {
                        let mut seen = seen.lock().unwrap();
                        let attempts = seen.posts.entry(head.key.clone()).or_default();
                        attempts.push(head.attempt.clone());
                        let first = attempts.len() == 1;
                        if !first || head.path == "/charge-then-drop" {
                            *seen.ledger.entry(head.key.clone()).or_default() += 1;
                        }
                        first
                    };
                    if first {
                        // The answer is lost: the connection closes without one.
                        return;
                    }
                    let body = format!("{{\"charged\":true,\"attempt\":\"{}\"}}", head.attempt);
                    respond("201 Created", &body)
                } else {
                    let answer = {
                        let mut seen = seen.lock().unwrap();
                        seen.asked
                            .push((head.key.clone(), head.attempt.clone(), head.path.clone()));
                        match head.path.rsplit_once('/') {
                            Some(("/ledger", key)) => Some(match seen.ledger.get(key) {
                                Some(n) => {
                                    respond("200 OK", &format!("{{\"charged\":true,\"charges\":{n}}}"))
                                }
                                None => respond("404 Not Found", ""),
                            }),
                            Some(("/ledger-garbage", _)) => Some(b"this is not HTTP\r\n\r\n".to_vec()),
                            _ => None,
                        }
                    };
                    let Some(answer) = answer else {
                        // The hook hangs.
                        tokio::time::sleep(Duration::from_secs(30)).await;
                        return;
                    };
                    answer
                };
                let _ = stream.write_all(&answer).await;
            });
        }
    });
    (addr, seen)
}

fn respond(status: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Sends `key` to `path` until the answer is not `409` (the lease of the lost attempt ends).
async fn after_the_lease(client: &HttpClient, gateway: SocketAddr, path: &str, key: &str) -> Seen {
    let headers = [("idempotency-key", key)];
    let first = send(client, gateway, "POST", path, &headers, b"{}").await;
    assert_eq!(first.status, 502, "{path} {key}: {first:?}");
    let answer = Arc::new(Mutex::new(None));
    let what = format!("{path} {key}: an answer other than 409");
    idempotency_testkit::eventually(Duration::from_secs(30), &what, async || {
        let seen = send(client, gateway, "POST", path, &headers, b"{}").await;
        let done = seen.status != 409;
        *answer.lock().unwrap() = Some(seen);
        done
    })
    .await;
    answer.lock().unwrap().take().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_is_reconciled_from_the_ledger_and_never_run_blind() {
    let (up, seen) = upstream().await;
    // A port nothing listens on: the hook that is down.
    let down = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("idem.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[[route]]
path = "/hang"
reconcile = "GET /ledger-hang/{{key}}"

[[route]]
path = "/garbage"
reconcile = "GET /ledger-garbage/{{key}}"

[[route]]
path = "/down"
reconcile = "GET http://{down}/ledger/{{key}}"
"#
        ),
    )
    .unwrap();
    let store = common::sqlite_url(dir.path());
    let gateway = free_addr();
    let upstream_url = format!("http://{up}");
    let _gateway = start_gateway(
        gateway,
        &[
            "--upstream",
            &upstream_url,
            "--store",
            &store,
            "--config",
            config.to_str().unwrap(),
            "--reconcile",
            "GET /ledger/{key}",
            "--lease",
            "2s",
            "--upstream-timeout",
            "1s",
        ],
        true,
    )
    .await;
    let client = client();

    // Charged, answer lost: the ledger has it, the retry adopts it.
    let adopted = after_the_lease(&client, gateway, "/charge-then-drop", "pay-adopted").await;
    assert_eq!(adopted.status, 200, "{adopted:?}");
    assert_eq!(adopted.json()["charges"], 1, "{adopted:?}");
    assert_eq!(adopted.header("idempotency-reconciled"), Some("true"));
    assert!(
        adopted.header("idempotency-key-expires").is_some(),
        "stored: {adopted:?}"
    );
    let replay = send(
        &client,
        gateway,
        "POST",
        "/charge-then-drop",
        &[("idempotency-key", "pay-adopted")],
        b"{}",
    )
    .await;
    assert_eq!((replay.status, replay.body.clone()), (200, adopted.body.clone()));
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("idempotency-reconciled"), Some("true"));

    // Not charged, answer lost: the ledger says 404, the retry runs once more.
    let ran = after_the_lease(&client, gateway, "/drop", "pay-missing").await;
    assert_eq!(ran.status, 201, "{ran:?}");
    assert_eq!(ran.json()["attempt"], "2");
    assert!(ran.header("idempotency-reconciled").is_none());

    // The hook down, hanging or answering garbage: 503, the key stays in flight, nothing runs.
    for path in ["/down", "/hang", "/garbage"] {
        let key = format!("pay{}", path.replace('/', "-"));
        let refused = after_the_lease(&client, gateway, path, &key).await;
        assert_eq!(refused.status, 503, "{path}: {refused:?}");
        assert_eq!(
            refused.json()["type"],
            "urn:idempotency:problem:outcome-unreconciled",
            "{path}"
        );
        assert_eq!(refused.header("retry-after"), Some("2"), "{path}: the lease");
        let again = send(
            &client,
            gateway,
            "POST",
            path,
            &[("idempotency-key", &key)],
            b"{}",
        )
        .await;
        assert_eq!(again.status, 409, "{path}: still in flight: {again:?}");
    }

    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert_eq!(seen.posts["pay-adopted"], ["1"], "the upstream is called once");
    assert_eq!(seen.ledger["pay-adopted"], 1, "one charge");
    assert_eq!(seen.posts["pay-missing"], ["1", "2"], "run once more");
    assert_eq!(seen.ledger["pay-missing"], 1, "one charge");
    for key in ["pay-down", "pay-hang", "pay-garbage"] {
        assert_eq!(seen.posts[key], ["1"], "{key}: the upstream is not called again");
    }
    // The questions carry the key and the attempt they are asked for, the key encoded in the path.
    assert!(
        seen.asked
            .contains(&("pay-adopted".into(), "2".into(), "/ledger/pay-adopted".into())),
        "{:?}",
        seen.asked
    );
    assert!(
        seen.asked
            .iter()
            .any(|(key, _, path)| key == "pay-hang" && path == "/ledger-hang/pay-hang")
    );

    for (result, at_least) in [("adopted", 1.0), ("did_not_happen", 1.0), ("unresolved", 3.0)] {
        let counted = metric(
            &client,
            gateway,
            "idempotency_reconciled_total",
            &[("result", result)],
        )
        .await;
        assert!(counted >= at_least, "{result}: {counted}");
    }
}

/// `idem serve --check` with the gateway's own flags and `more`: (exit code, standard output
/// and standard error).
fn check(more: &[&str]) -> (i32, String) {
    let mut args = vec![
        "serve",
        "--upstream",
        "http://127.0.0.1:9",
        "--store",
        "memory://",
        "--check",
    ];
    args.extend_from_slice(more);
    let (code, stdout, stderr) = idem(&args);
    (code, stdout + &stderr)
}

#[test]
fn a_template_that_cannot_ask_is_refused_at_start() {
    for (template, says) in [
        ("GET /ledger", "has no {key}"),
        ("GET /ledger/{id}", "`{id}` is not a placeholder"),
        ("get /ledger/{key}", "not an HTTP method"),
        ("GET ledger/{key}", "starting with /"),
    ] {
        let (code, stderr) = check(&["--reconcile", template]);
        assert_eq!(code, 2, "{template}: {stderr}");
        assert!(stderr.contains(says), "{template}: {stderr}");
    }
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("idem.toml");
    std::fs::write(
        &config,
        "[[route]]\npath = \"/pay\"\nreconcile = \"GET /x/{attempt}\"\n",
    )
    .unwrap();
    let (code, stderr) = check(&["--config", config.to_str().unwrap()]);
    assert_ne!(code, 0, "{stderr}");
    assert!(
        stderr.contains("`reconcile`") && stderr.contains("`{attempt}` is not a placeholder"),
        "{stderr}"
    );
    let valid = "[[route]]\npath = \"/pay\"\nreconcile = \"POST https://ledger.internal/lookup?id={key}\"\n";
    std::fs::write(&config, valid).unwrap();
    let (code, said) = check(&[
        "--config",
        config.to_str().unwrap(),
        "--reconcile",
        "GET /ledger/{key}",
    ]);
    assert_eq!(code, 0, "valid templates pass: {said}");
    assert!(
        said.contains("POST https://ledger.internal/lookup?id={key}"),
        "{said}"
    );
    assert!(said.contains("GET /ledger/{key}"), "{said}");
}

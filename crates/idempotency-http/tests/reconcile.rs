//! The reconcile function: asked before a recovered attempt runs, its answer adopted, obeyed or
//! waited out. The store's clock is stepped past the lease, so nothing sleeps.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idempotency_core::{Key, ManualClock, MemoryStore, RecordState, Scope, Store};
use idempotency_http::{IdempotencyKey, IdempotencyLayer, OutcomeUnknown, Reconcile, Reconciled};
use tower::ServiceExt;

/// What the reconcile function answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hook {
    /// From the ledger, truthfully.
    Ledger,
    /// Cannot tell (the ledger is down).
    Down,
}

/// A service that charges (writes the key to its ledger) and then loses the answer the first
/// time, and its reconcile function reading that ledger.
struct Upstream {
    ledger: Arc<Mutex<Vec<String>>>,
    calls: Arc<AtomicU32>,
    asked: Arc<Mutex<Vec<(String, u32)>>>,
    hook: Arc<Mutex<Hook>>,
}

impl Upstream {
    fn new() -> Self {
        Self {
            ledger: Arc::default(),
            calls: Arc::default(),
            asked: Arc::default(),
            hook: Arc::new(Mutex::new(Hook::Ledger)),
        }
    }

    /// The guarded router, on a memory store with `clock`; `charge` says whether a call charges
    /// before it loses its answer.
    fn router(&self, clock: &ManualClock, charge: bool) -> (Router, MemoryStore) {
        let store = MemoryStore::with_clock(Arc::new(clock.clone()));
        let (ledger, calls) = (Arc::clone(&self.ledger), Arc::clone(&self.calls));
        let handler = post(move |key: axum::Extension<IdempotencyKey>| async move {
            let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
            if charge || call > 1 {
                ledger.lock().unwrap().push(key.message_key().to_string());
            }
            if call == 1 {
                // The answer is lost on the way back.
                let mut lost = (StatusCode::BAD_GATEWAY, "answer lost").into_response();
                lost.extensions_mut().insert(OutcomeUnknown);
                return lost;
            }
            (StatusCode::CREATED, format!("charged on attempt {}", key.attempt)).into_response()
        });
        let (ledger, asked, hook) = (
            Arc::clone(&self.ledger),
            Arc::clone(&self.asked),
            Arc::clone(&self.hook),
        );
        let layer = IdempotencyLayer::new(store.clone())
            .lease(Duration::from_secs(10))
            .reconcile(move |question: Reconcile| {
                let (ledger, asked, hook) = (Arc::clone(&ledger), Arc::clone(&asked), Arc::clone(&hook));
                async move {
                    let key = question.key.message_key().to_string();
                    asked.lock().unwrap().push((key.clone(), question.key.attempt));
                    if *hook.lock().unwrap() == Hook::Down {
                        return Reconciled::Unresolved("the ledger is down".into());
                    }
                    if ledger.lock().unwrap().contains(&key) {
                        let mut answer = Response::new(Bytes::from("charged (found in the ledger)"));
                        *answer.status_mut() = StatusCode::CREATED;
                        Reconciled::Happened(answer)
                    } else {
                        Reconciled::DidNotHappen
                    }
                }
            });
        (Router::new().route("/charges", handler).layer(layer), store)
    }
}

async fn send(router: &Router, key: &str) -> (StatusCode, http::HeaderMap, String) {
    let request = Request::post("/charges")
        .header("idempotency-key", key)
        .body(Body::from("{}"))
        .unwrap();
    let response = router.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

#[tokio::test]
async fn a_charge_whose_answer_was_lost_is_adopted_not_run_again() {
    let (clock, upstream) = (ManualClock::new(), Upstream::new());
    let (router, _store) = upstream.router(&clock, true);
    let (status, ..) = send(&router, "pay-1").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    // Within the lease the retry waits; no question is asked.
    assert_eq!(send(&router, "pay-1").await.0, StatusCode::CONFLICT);
    assert!(upstream.asked.lock().unwrap().is_empty());

    clock.advance(Duration::from_secs(11));
    let (status, headers, body) = send(&router, "pay-1").await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body, "charged (found in the ledger)");
    assert_eq!(headers["idempotency-reconciled"], "true");
    assert!(
        headers.contains_key("idempotency-key-expires"),
        "stored: {headers:?}"
    );
    assert_eq!(
        upstream.calls.load(Ordering::SeqCst),
        1,
        "the handler is not run again"
    );
    assert_eq!(*upstream.asked.lock().unwrap(), [("pay-1".to_owned(), 2)]);

    // The adopted outcome replays, saying where it came from; nothing is asked again.
    let (status, headers, body) = send(&router, "pay-1").await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::CREATED, "charged (found in the ledger)")
    );
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers["idempotency-reconciled"], "true");
    assert_eq!(upstream.asked.lock().unwrap().len(), 1);
    assert_eq!(upstream.ledger.lock().unwrap().len(), 1, "one charge");
}

#[tokio::test]
async fn a_charge_that_did_not_happen_runs_once_more() {
    let (clock, upstream) = (ManualClock::new(), Upstream::new());
    let (router, _store) = upstream.router(&clock, false);
    assert_eq!(send(&router, "pay-2").await.0, StatusCode::BAD_GATEWAY);
    clock.advance(Duration::from_secs(11));
    let (status, headers, body) = send(&router, "pay-2").await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::CREATED, "charged on attempt 2")
    );
    assert!(!headers.contains_key("idempotency-reconciled"));
    assert_eq!(upstream.calls.load(Ordering::SeqCst), 2);
    assert_eq!(upstream.ledger.lock().unwrap().len(), 1, "one charge");
}

#[tokio::test]
async fn an_unresolved_question_runs_nothing_and_keeps_the_key_in_flight() {
    let (clock, upstream) = (ManualClock::new(), Upstream::new());
    let (router, store) = upstream.router(&clock, true);
    assert_eq!(send(&router, "pay-3").await.0, StatusCode::BAD_GATEWAY);
    *upstream.hook.lock().unwrap() = Hook::Down;
    clock.advance(Duration::from_secs(11));
    let (status, headers, body) = send(&router, "pay-3").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(
        body.contains("urn:idempotency:problem:outcome-unreconciled"),
        "{body}"
    );
    assert!(
        !body.contains("ledger is down"),
        "the reason stays in the log: {body}"
    );
    assert_eq!(headers["retry-after"], "10", "the lease");
    assert_eq!(upstream.calls.load(Ordering::SeqCst), 1, "nothing ran blind");
    let record = store
        .get(&Scope::global(), &Key::new("pay-3").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(record.state, RecordState::InFlight { .. }), "{record:?}");
    assert_eq!(record.attempt, 2);
    assert_eq!(
        send(&router, "pay-3").await.0,
        StatusCode::CONFLICT,
        "still in flight"
    );

    // Once the ledger is back, the next recovered attempt asks again and adopts the charge.
    *upstream.hook.lock().unwrap() = Hook::Ledger;
    clock.advance(Duration::from_secs(11));
    let (status, headers, _) = send(&router, "pay-3").await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotency-reconciled"], "true");
    assert_eq!(upstream.calls.load(Ordering::SeqCst), 1);
    let asked: Vec<u32> = upstream.asked.lock().unwrap().iter().map(|(_, n)| *n).collect();
    assert_eq!(asked, [2, 3]);
}

/// A key released by a retryable answer is asked about too (a `5xx` may come after the side
/// effect): the function says it did not happen, and the attempt runs.
#[tokio::test]
async fn a_released_key_is_asked_about_before_it_runs_again() {
    let asked = Arc::new(AtomicU32::new(0));
    let calls = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&asked);
    let ran = Arc::clone(&calls);
    let layer = IdempotencyLayer::new(MemoryStore::new()).reconcile(move |question: Reconcile| {
        counted.fetch_add(1, Ordering::SeqCst);
        assert_eq!(question.key.attempt, 2);
        async { Reconciled::DidNotHappen }
    });
    let router = Router::new()
        .route(
            "/charges",
            post(move || async move {
                match ran.fetch_add(1, Ordering::SeqCst) {
                    0 => StatusCode::SERVICE_UNAVAILABLE,
                    _ => StatusCode::CREATED,
                }
            }),
        )
        .layer(layer);
    assert_eq!(send(&router, "pay-4").await.0, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(send(&router, "pay-4").await.0, StatusCode::CREATED);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(asked.load(Ordering::SeqCst), 1);
}

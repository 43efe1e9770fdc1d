//! Reconciling an unknown outcome: before a key whose previous attempt's outcome is unknown runs
//! again, the layer asks the service whether that attempt took effect.
//!
//! An attempt's outcome is unknown when its answer was lost (a dropped connection, a timeout, a
//! crash after the side effect): the key stays in flight until the attempt's lease ends, and the
//! first retry after that takes the key over as a *recovered* attempt
//! ([`IdempotencyKey::recovered`](crate::IdempotencyKey::recovered)). Without a reconcile
//! function that attempt runs the handler again, which is safe only when the handler (or what it
//! calls) deduplicates by the key. With one ([`IdempotencyLayer::reconcile`]), the recovered
//! attempt first asks it, while holding the key's lease:
//!
//! | the function answers | the layer |
//! |---|---|
//! | [`Reconciled::Happened`] with the response the first attempt would have given | stores it through the usual `complete` (this attempt's token), answers it with `Idempotency-Reconciled: true`, replays it to later retries; the handler does not run |
//! | [`Reconciled::DidNotHappen`] | runs the handler as this attempt |
//! | [`Reconciled::Unresolved`] (an error, a timeout, an answer it cannot read) | runs nothing, leaves the key in flight until this attempt's lease ends and answers `503` [`crate::Problem::Unreconciled`] with `Retry-After`; the next retry after that asks again |
//!
//! Each answer is counted by `idempotency_reconciled_total{guard, result}` (`result`: `adopted`,
//! `did_not_happen`, `unresolved`).
//!
//! The function is asked before every attempt after the first, which is every recovered one: a
//! key whose earlier attempt was released by a retryable answer (a `5xx`, say) is taken over
//! the same way, and a `500` can come from a service that crashed after its side effect, so
//! asking then too costs one question per retry and never runs anything twice that the
//! function knows about.
//!
//! [`IdempotencyLayer::reconcile`]: crate::IdempotencyLayer::reconcile

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Response, Uri};

use crate::capture::Captured;
use crate::key::IdempotencyKey;
use crate::problem::Problem;

/// A response whose outcome was adopted from a reconcile function carries this header with the
/// value `true` (its replays too).
pub const IDEMPOTENCY_RECONCILED: HeaderName = HeaderName::from_static("idempotency-reconciled");

/// What a reconcile function is asked about: the recovered attempt's key and the request it is
/// a retry of.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Reconcile {
    /// The key, the attempt about to run (the one whose outcome is unknown is `attempt - 1`, or
    /// earlier when several in a row were lost).
    pub key: IdempotencyKey,
    /// The request's method.
    pub method: Method,
    /// The request's target.
    pub uri: Uri,
    /// The request's headers.
    pub headers: HeaderMap,
}

/// A reconcile function's answer about a recovered attempt.
#[derive(Debug)]
pub enum Reconciled {
    /// The earlier attempt took effect, and this is what it answered (or would have answered):
    /// stored as the key's outcome and answered without running the handler.
    Happened(Response<Bytes>),
    /// The earlier attempt did not take effect: the handler runs.
    DidNotHappen,
    /// It cannot be told now (why, for the log: the client is not told): nothing runs, and the
    /// key stays in flight until this attempt's lease ends.
    Unresolved(String),
}

/// The boxed future a reconcile function returns.
pub(crate) type ReconcileFuture = Pin<Box<dyn Future<Output = Reconciled> + Send>>;

/// A reconcile function, as the layer keeps it.
pub(crate) type ReconcileFn = Arc<dyn Fn(Reconcile) -> ReconcileFuture + Send + Sync>;

/// Marks a captured response that was adopted from a reconcile function: stored whatever the
/// outcome policy says of its status.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Adopted;

impl Reconcile {
    /// What to ask about `request`, which runs as `key`.
    pub(crate) fn of<B>(request: &http::Request<B>, key: IdempotencyKey) -> Self {
        Self {
            key,
            method: request.method().clone(),
            uri: request.uri().clone(),
            headers: request.headers().clone(),
        }
    }
}

/// Asks `reconcile` about the recovered attempt `asked`, counting the answer under `guard`:
/// `Some` captured answer to record and give instead of running the handler, `None` to run it.
pub(crate) async fn ask<B, E>(
    reconcile: &ReconcileFn,
    asked: Reconcile,
    guard: &str,
) -> Option<Captured<B, E>> {
    let count = |result: &'static str| {
        metrics::counter!("idempotency_reconciled_total", "guard" => guard.to_owned(), "result" => result)
            .increment(1);
    };
    let attempt = asked.key.attempt;
    match reconcile(asked).await {
        Reconciled::Happened(response) => {
            count("adopted");
            tracing::info!(
                attempt,
                status = response.status().as_u16(),
                "the earlier attempt took effect: its outcome is adopted, and nothing runs again"
            );
            let (mut parts, body) = response.into_parts();
            parts
                .headers
                .insert(IDEMPOTENCY_RECONCILED, HeaderValue::from_static("true"));
            parts.extensions.insert(Adopted);
            Some(Captured::Buffered { parts, body })
        }
        Reconciled::DidNotHappen => {
            count("did_not_happen");
            tracing::info!(
                attempt,
                "the earlier attempt did not take effect: this attempt runs"
            );
            None
        }
        Reconciled::Unresolved(why) => {
            count("unresolved");
            tracing::warn!(
                attempt,
                why = %why,
                "whether the earlier attempt took effect cannot be told: nothing runs, and the key stays in flight"
            );
            let (parts, body) = Problem::Unreconciled.to_response().into_parts();
            Some(Captured::Buffered { parts, body })
        }
    }
}

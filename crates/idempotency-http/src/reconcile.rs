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

use http::HeaderValue;

use crate::capture::Captured;
use crate::config::ReconcileFn;
pub use crate::config::{IDEMPOTENCY_RECONCILED, Reconcile, Reconciled};
use crate::outcome::Adopted;
use crate::problem::Problem;

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

//! The guarded run of one request, and the wait for a duplicate's first request to finish (wait
//! mode) or the `409` that says it is still running.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use idempotency_core::{Execution, Fingerprint, Guard, InFlightWait, Key, Scope, Store};
use tower::Service;

use crate::body::{BoxError, ResponseBody};
use crate::capture::{Captured, capture, respond_executed};
use crate::key::IdempotencyKey;
use crate::layer::Config;
use crate::policy::decide;
use crate::problem::Problem;
use crate::replay::replay;
use crate::service::{passthrough, problem};

pub(crate) async fn run_guarded<I, S, ReqBody, ResBody>(
    inner: I,
    guard: Guard<S>,
    config: Arc<Config>,
    scope: Scope,
    key: Key,
    fingerprint: Fingerprint,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, I::Error>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    S: Store + Clone + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    // Created at the first in-flight answer (wait mode only): woken at once when this
    // gateway records the key's outcome, reading it again every 20 to 250 ms otherwise.
    let mut waiting: Option<InFlightWait> = None;
    // The handler runs at most once, whichever loop iteration acquires the key.
    let mut pending = Some((inner, request));
    loop {
        let run = guard
            .run(
                scope.clone(),
                key.clone(),
                fingerprint,
                |captured: &Captured<ResBody, I::Error>| decide(captured, &config),
                |attempt| {
                    let (mut inner, mut request) = pending.take().expect("the handler runs at most once");
                    request.extensions_mut().insert(IdempotencyKey {
                        scope: attempt.scope().clone(),
                        key: attempt.key().clone(),
                        attempt: attempt.number(),
                        recovered: attempt.recovered(),
                    });
                    let config = Arc::clone(&config);
                    async move { capture(inner.call(request).await, &config).await }
                },
            )
            .await;
        match run {
            Ok(Execution::Executed { value, recorded, .. }) => {
                return respond_executed(value, &recorded, guard.lease_duration());
            }
            Ok(Execution::Replayed(done)) => return Ok(replay(&done)),
            Ok(Execution::Mismatch) => return Ok(problem(&Problem::KeyReused)),
            Ok(Execution::InFlight { retry_after, .. }) => {
                let again = match (&mut waiting, config.wait) {
                    (_, None) => false,
                    (Some(waiting), _) => waiting.again(retry_after).await,
                    (None, Some(wait)) => {
                        waiting
                            .insert(guard.wait_in_flight(&scope, &key, wait))
                            .again(retry_after)
                            .await
                    }
                };
                if !again {
                    return Ok(problem(&Problem::InFlight { retry_after }));
                }
            }
            // A saturated store sheds new work to keep its running attempts' leases: never run
            // without the guard then (that is how the storm would double-execute), and say
            // "busy", not "unreachable".
            Err(error) if error.kind() == idempotency_core::ErrorKind::Overloaded => {
                tracing::warn!(%error, "idempotency store saturated; shedding the request");
                return Ok(problem(&Problem::Overloaded {
                    what: "the idempotency store's capacity",
                }));
            }
            Err(error) => {
                if config.fail_open {
                    tracing::warn!(%error, "idempotency store unavailable; running without it (fail-open)");
                    let (mut inner, request) = pending.take().expect("the handler has not run");
                    return inner.call(request).await.map(passthrough);
                }
                tracing::warn!(%error, "idempotency store unavailable; refusing the request (fail-closed)");
                return Ok(problem(&Problem::StoreUnavailable));
            }
        }
    }
}

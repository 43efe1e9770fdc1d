//! The guarded run of one request, and the wait for a duplicate's first request to finish (wait
//! mode) or the `409` that says it is still running.

use std::sync::Arc;

use http::{Request, Response};
use idempotency_core::{Execution, Fingerprint, Guard, InFlightWait, Key, Recorded, Scope, Store};

use crate::body::passthrough;
use crate::body::{HandlerBody, Inner, ResponseBody};
use crate::capture::{Captured, capture, respond_executed};
use crate::config::Config;
use crate::key::IdempotencyKey;
use crate::log::{Decided, RequestLog};
use crate::policy::decide;
use crate::problem::Problem;
use crate::problem::problem;
use crate::reconcile::{self, Reconcile};
use crate::replay::replay;

pub(crate) async fn run_guarded<I, S, ReqBody, ResBody>(
    inner: I,
    guard: Guard<S>,
    config: Arc<Config>,
    (scope, key, fingerprint): (Scope, Key, Fingerprint),
    request: Request<ReqBody>,
    log: RequestLog,
) -> Result<Response<ResponseBody<ResBody>>, I::Error>
where
    I: Inner<ReqBody, ResBody>,
    S: Store + Clone + 'static,
    ResBody: HandlerBody,
{
    // Created at the first in-flight answer (wait mode only): woken at once when this
    // gateway records the key's outcome, reading it again every 20 to 250 ms otherwise.
    let mut waiting: Option<InFlightWait> = None;
    // The handler runs at most once, whichever loop iteration acquires the key.
    let mut pending = Some((inner, request));
    let route = guard.label().to_owned();
    // Every answer goes out through here, with its log event.
    let answer =
        |decided: Decided, attempt: u32, response: Result<Response<ResponseBody<ResBody>>, I::Error>| {
            let status = response.as_ref().map_or(0, |response| response.status().as_u16());
            log.emit(&route, decided, attempt, status);
            response
        };
    loop {
        let run = guard
            .run(
                scope.clone(),
                key.clone(),
                fingerprint,
                |captured: &Captured<ResBody, I::Error>| decide(captured, &config),
                |attempt| {
                    let (mut inner, mut request) = pending.take().expect("the handler runs at most once");
                    let running = IdempotencyKey {
                        scope: attempt.scope().clone(),
                        key: attempt.key().clone(),
                        attempt: attempt.number(),
                        recovered: attempt.recovered(),
                    };
                    // An earlier attempt's outcome is unknown: ask before running again.
                    let asked = match &config.reconcile {
                        Some(reconcile) if attempt.recovered() => {
                            Some((Arc::clone(reconcile), Reconcile::of(&request, running.clone())))
                        }
                        _ => None,
                    };
                    request.extensions_mut().insert(running);
                    let config = Arc::clone(&config);
                    let timer = log.upstream_timer();
                    let route = &route;
                    async move {
                        if let Some((reconcile, asked)) = asked
                            && let Some(answer) = reconcile::ask(&reconcile, asked, route).await
                        {
                            return answer;
                        }
                        let began = std::time::Instant::now();
                        let captured = capture(inner.call(request).await, &config).await;
                        timer.record(began.elapsed(), captured.status());
                        captured
                    }
                },
            )
            .await;
        match run {
            Ok(Execution::Executed {
                value,
                recorded,
                attempt,
                ..
            }) => {
                let decided = match recorded {
                    Recorded::Completed { .. } if value.adopted() => Decided::Reconciled,
                    Recorded::Completed { .. } => Decided::Acquired,
                    Recorded::Released => Decided::Released,
                    Recorded::Unknown | Recorded::LeaseLost => Decided::Unknown,
                    Recorded::Failed(_) => Decided::StoreError,
                };
                return answer(
                    decided,
                    attempt,
                    respond_executed(value, &recorded, guard.lease_duration()),
                );
            }
            Ok(Execution::Replayed(done)) => return answer(Decided::Replayed, 0, Ok(replay(&done))),
            Ok(Execution::Mismatch) => return answer(Decided::Mismatch, 0, Ok(problem(&Problem::KeyReused))),
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
                    return answer(
                        Decided::InFlight,
                        0,
                        Ok(problem(&Problem::InFlight { retry_after })),
                    );
                }
            }
            // A saturated store sheds new work to keep its running attempts' leases: never run
            // without the guard then (that is how the storm would double-execute), and say
            // "busy", not "unreachable".
            Err(error) if error.kind() == idempotency_core::ErrorKind::Overloaded => {
                tracing::warn!(%error, "idempotency store saturated; shedding the request");
                return answer(
                    Decided::Overloaded,
                    0,
                    Ok(problem(&Problem::Overloaded {
                        what: "the idempotency store's capacity",
                    })),
                );
            }
            Err(error) => {
                if config.fail_open {
                    tracing::warn!(%error, "idempotency store unavailable; running without it (fail-open)");
                    let (mut inner, request) = pending.take().expect("the handler has not run");
                    let timer = log.upstream_timer();
                    let began = std::time::Instant::now();
                    let response = inner.call(request).await.map(passthrough);
                    let status = response.as_ref().ok().map(|response| response.status().as_u16());
                    timer.record(began.elapsed(), status);
                    return answer(Decided::StoreError, 1, response);
                }
                tracing::warn!(%error, "idempotency store unavailable; refusing the request (fail-closed)");
                return answer(Decided::StoreError, 0, Ok(problem(&Problem::StoreUnavailable)));
            }
        }
    }
}

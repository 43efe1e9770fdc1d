//! The service: the checks every guarded request passes before the guard runs it.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};
use tracing::Instrument;

use bytes::{Buf, Bytes, BytesMut};
use futures_util::FutureExt;
use http::{Request, Response, header};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idempotency_core::{Guard, JsonKeyError, JsonPointer, Key, Store};
use tokio::sync::OwnedSemaphorePermit;
use tower::Service;

use crate::body::{BoxError, HandlerBody, Inner, RequestBody, ResponseBody, passthrough};
use crate::capture::problem_in;
use crate::config::Config;
use crate::fingerprint::fingerprint;
use crate::future::{DetachOnDrop, DetachedRuns, ResponseFuture};
use crate::key::{KeyHeaderError, key_from_header};
use crate::problem::{Problem, problem};
use crate::run::run_guarded;

/// The service a [`crate::IdempotencyLayer`] wraps around `I`.
pub struct IdempotencyService<I, S> {
    inner: I,
    guard: Guard<S>,
    config: Arc<Config>,
    detached: DetachedRuns,
}

impl<I: Clone, S: Clone> Clone for IdempotencyService<I, S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            guard: self.guard.clone(),
            config: Arc::clone(&self.config),
            detached: self.detached.clone(),
        }
    }
}

impl<I, S> fmt::Debug for IdempotencyService<I, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService").finish_non_exhaustive()
    }
}

impl<I, S> IdempotencyService<I, S> {
    pub(crate) fn new(inner: I, guard: Guard<S>, config: Arc<Config>, detached: DetachedRuns) -> Self {
        Self {
            inner,
            guard,
            config,
            detached,
        }
    }
}

impl<I, S, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotencyService<I, S>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    S: Store + Clone + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = I::Error;
    type Future = ResponseFuture<ResBody, I::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The instance that was polled ready is the one to call (tower's `Service` contract).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(handle(
            inner,
            self.guard.clone(),
            Arc::clone(&self.config),
            self.detached.clone(),
            request,
        ))
    }
}

/// A request body's share of the layer's body budget. Dropping it gives the share back and takes
/// it off the `idempotency_http_bodies_buffered_bytes` gauge, so that the gauge is the number of
/// bytes all guarded requests hold at that moment.
struct HeldBody(OwnedSemaphorePermit);

impl HeldBody {
    /// Adds a chunk's permit to the share, and its bytes to the gauge.
    fn add(held: &mut Option<HeldBody>, permit: OwnedSemaphorePermit) {
        metrics::gauge!("idempotency_http_bodies_buffered_bytes").increment(permit.num_permits() as f64);
        match held {
            Some(HeldBody(held)) => held.merge(permit),
            None => *held = Some(HeldBody(permit)),
        }
    }
}

impl Drop for HeldBody {
    fn drop(&mut self) {
        metrics::gauge!("idempotency_http_bodies_buffered_bytes").decrement(self.0.num_permits() as f64);
    }
}

/// Reads a guarded request's body: at most `max_body` bytes (`too_large` beyond), each chunk
/// taken from the layer's body budget when it has one, so that all requests together hold at
/// most that much; the share returned is held until it is dropped.
async fn read_body<B>(
    body: B,
    config: &Config,
    too_large: Problem,
) -> Result<(Bytes, Option<HeldBody>), Problem>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let mut body = std::pin::pin!(Limited::new(body, config.max_body));
    // The chunks as they came: a body of one chunk (the usual case) is handed on uncopied.
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut held: Option<HeldBody> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| {
            if error.is::<LengthLimitError>() {
                too_large.clone()
            } else {
                problem_in(&*error).unwrap_or(Problem::BodyUnreadable)
            }
        })?;
        let Ok(mut data) = frame.into_data() else {
            continue;
        };
        if let Some(budget) = &config.body_budget {
            let size = u32::try_from(data.remaining()).unwrap_or(u32::MAX);
            match Arc::clone(budget).try_acquire_many_owned(size) {
                Ok(permit) => HeldBody::add(&mut held, permit),
                Err(_) => {
                    metrics::counter!("idempotency_http_bodies_shed_total").increment(1);
                    tracing::warn!("request bodies held in memory are at their limit; answering 503");
                    return Err(Problem::Overloaded {
                        what: "request bodies held in memory",
                    });
                }
            }
        }
        let len = data.remaining();
        chunks.push(data.copy_to_bytes(len));
    }
    let bytes = match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.swap_remove(0),
        _ => {
            let mut buffer = BytesMut::with_capacity(chunks.iter().map(Bytes::len).sum());
            for chunk in &chunks {
                buffer.extend_from_slice(chunk);
            }
            buffer.freeze()
        }
    };
    Ok((bytes, held))
}

/// The key in a JSON body's member at `pointer` ([`Key::from_json`]), or the problem to answer.
fn key_from_body(body: &[u8], pointer: &JsonPointer) -> Result<Option<Key>, Problem> {
    Key::from_json(body, pointer).map_err(|error| match error {
        JsonKeyError::NotAKey { pointer, why } => {
            Problem::InvalidKey(KeyHeaderError::FromBody { pointer, why })
        }
        error => Problem::InvalidBody(format!(
            "the key is read from the JSON body's member {}, and this body is {error}",
            pointer.as_str()
        )),
    })
}

async fn handle<I, S, ReqBody, ResBody>(
    mut inner: I,
    guard: Guard<S>,
    config: Arc<Config>,
    detached: DetachedRuns,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, I::Error>
where
    I: Inner<ReqBody, ResBody>,
    S: Store + Clone + 'static,
    ReqBody: RequestBody,
    ResBody: HandlerBody,
{
    if !config.methods.contains(request.method()) {
        return inner.call(request).await.map(passthrough);
    }
    let header_key = match key_from_header(request.headers(), &config.key_header) {
        Ok(Some(key)) => Some(key),
        // Read from the body once it is in.
        Ok(None) if config.key_from.is_some() => None,
        Ok(None) if config.require_key => return Ok(problem(&Problem::MissingKey)),
        Ok(None) => return inner.call(request).await.map(passthrough),
        Err(why) => return Ok(problem(&Problem::InvalidKey(why))),
    };
    let (parts, body) = request.into_parts();
    let too_large = Problem::BodyTooLarge {
        limit: config.max_body,
    };
    // A declared length over the limit is refused before a byte is read.
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > config.max_body as u64) {
        return Ok(problem(&too_large));
    }
    let (bytes, budget) = match read_body(body, &config, too_large).await {
        Ok(read) => read,
        Err(refused) => return Ok(problem(&refused)),
    };
    let key = match header_key {
        Some(key) => Ok(Some(key)),
        None => config
            .key_from
            .as_ref()
            .map_or(Ok(None), |pointer| key_from_body(&bytes, pointer)),
    };
    let key = match key {
        Ok(Some(key)) => key,
        Ok(None) if config.require_key => return Ok(problem(&Problem::MissingKey)),
        Ok(None) => {
            drop(budget);
            let request = Request::from_parts(parts, ReqBody::from(bytes));
            return inner.call(request).await.map(passthrough);
        }
        Err(refused) => return Ok(problem(&refused)),
    };
    let scope = (config.scope)(&parts);
    let fingerprint = match fingerprint(&parts, &bytes, &config) {
        Ok(fingerprint) => fingerprint,
        Err(refused) => return Ok(problem(&refused)),
    };
    let log = crate::log::RequestLog::new(std::time::Instant::now(), &parts, &scope, &key, config.log_keys);
    let request = Request::from_parts(parts, ReqBody::from(bytes));
    // If the client goes away, hyper drops this future; the guarded run must still finish and
    // record its outcome. `DetachOnDrop` polls it here and, only if it is dropped unfinished,
    // moves it onto a task of its own: the guarantee of a spawned task without paying a task
    // switch on every request.
    // The guarded request's span: its store calls and the inner service's work are children;
    // the decision and the attempt are recorded on it when the answer is known.
    let span = tracing::info_span!(
        "idempotency.request",
        route = guard.label(),
        decision = tracing::field::Empty,
        attempt = tracing::field::Empty,
    );
    let run = AssertUnwindSafe(
        async move {
            // The body's share of the budget is held until the run ends (detached or not).
            let _budget = budget;
            run_guarded(inner, guard, config, (scope, key, fingerprint), request, log).await
        }
        .instrument(span),
    )
    .catch_unwind();
    match DetachOnDrop::new(run, detached).await {
        Ok(result) => result,
        Err(_) => {
            // The guard released the key before the panic reached this point.
            tracing::error!("the idempotent request handler panicked");
            Ok(problem(&Problem::HandlerFailed))
        }
    }
}

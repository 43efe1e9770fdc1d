//! The service: the checks every guarded request passes before the guard runs it.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response, header};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idempotency_core::{Guard, Store};
use tower::Service;

use crate::body::{BoxError, ResponseBody};
use crate::capture::problem_in;
use crate::fingerprint::fingerprint;
use crate::future::{DetachOnDrop, DetachedRuns, ResponseFuture};
use crate::key::key_from_headers;
use crate::layer::Config;
use crate::problem::Problem;
use crate::wait::run_guarded;

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

pub(crate) fn problem<B>(problem: &Problem) -> Response<ResponseBody<B>> {
    problem.to_response().map(ResponseBody::full)
}

pub(crate) fn passthrough<B>(response: Response<B>) -> Response<ResponseBody<B>> {
    response.map(|body| ResponseBody::inner(Bytes::new(), Box::pin(body)))
}

async fn handle<I, S, ReqBody, ResBody>(
    mut inner: I,
    guard: Guard<S>,
    config: Arc<Config>,
    detached: DetachedRuns,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, I::Error>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    S: Store + Clone + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    if !config.methods.contains(request.method()) {
        return inner.call(request).await.map(passthrough);
    }
    let key = match key_from_headers(request.headers()) {
        Ok(Some(key)) => key,
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
    let bytes = match Limited::new(body, config.max_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.is::<LengthLimitError>() => return Ok(problem(&too_large)),
        Err(error) => return Ok(problem(&problem_in(&*error).unwrap_or(Problem::BodyUnreadable))),
    };
    let scope = (config.scope)(&parts);
    let fingerprint = fingerprint(&parts, &bytes, &config);
    let request = Request::from_parts(parts, ReqBody::from(bytes));
    // If the client goes away, hyper drops this future; the guarded run must still finish and
    // record its outcome. `DetachOnDrop` polls it here and, only if it is dropped unfinished,
    // moves it onto a task of its own: the guarantee of a spawned task without paying a task
    // switch on every request.
    let run = AssertUnwindSafe(run_guarded(
        inner,
        guard,
        config,
        scope,
        key,
        fingerprint,
        request,
    ))
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

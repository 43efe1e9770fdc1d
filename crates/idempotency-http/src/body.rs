//! The response body the layer returns: a buffered body (stored, replayed, or a problem), or
//! the handler's own body passed through (too large or streamed to store).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use tower::Service;

/// A boxed error from a passed-through body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The service a guarded request runs on, with the bounds every step of the run needs, written
/// once for the crate's own functions (the public `Service` impl spells them out).
pub(crate) trait Inner<ReqBody, ResBody>:
    Service<Request<ReqBody>, Response = Response<ResBody>, Future: Send + 'static, Error: Send + 'static>
    + Send
    + 'static
{
}

impl<T, ReqBody, ResBody> Inner<ReqBody, ResBody> for T where
    T: Service<Request<ReqBody>, Response = Response<ResBody>, Future: Send + 'static, Error: Send + 'static>
        + Send
        + 'static
{
}

/// A request body the layer can buffer, fingerprint and hand on.
pub(crate) trait RequestBody:
    Body<Data: Send, Error: Into<BoxError>> + From<Bytes> + Send + 'static
{
}

impl<T> RequestBody for T where T: Body<Data: Send, Error: Into<BoxError>> + From<Bytes> + Send + 'static {}

/// A handler's response body the layer can capture or pass through.
pub(crate) trait HandlerBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static {}

impl<T> HandlerBody for T where T: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static {}

/// The body of every response through the layer.
#[derive(Debug)]
pub struct ResponseBody<B> {
    kind: Kind<B>,
}

#[derive(Debug)]
enum Kind<B> {
    Full(Option<Bytes>),
    /// The handler's body, after the part of it already read (if any).
    Inner {
        prefix: Option<Bytes>,
        body: Pin<Box<B>>,
    },
}

impl<B> ResponseBody<B> {
    pub(crate) fn full(bytes: Bytes) -> Self {
        Self {
            kind: Kind::Full(Some(bytes).filter(|b| !b.is_empty())),
        }
    }

    /// The handler's body, `prefix` (what was read of it already) first.
    pub(crate) fn inner(prefix: Bytes, body: Pin<Box<B>>) -> Self {
        Self {
            kind: Kind::Inner {
                prefix: Some(prefix).filter(|b| !b.is_empty()),
                body,
            },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.kind {
            Kind::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Kind::Inner { prefix, body } => match prefix.take() {
                Some(bytes) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
                None => body
                    .as_mut()
                    .poll_frame(cx)
                    .map(|f| f.map(|r| r.map_err(Into::into))),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full(bytes) => bytes.is_none(),
            Kind::Inner { prefix, body } => prefix.is_none() && body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
            Kind::Inner { prefix, body } => {
                let read = prefix.as_ref().map_or(0, |b| b.len() as u64);
                let rest = body.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower() + read);
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper + read);
                }
                hint
            }
        }
    }
}

/// `response` passed through as it is: its body streamed, nothing of it kept.
pub(crate) fn passthrough<B>(response: Response<B>) -> Response<ResponseBody<B>> {
    response.map(|body| ResponseBody::inner(Bytes::new(), Box::pin(body)))
}

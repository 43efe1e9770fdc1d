//! The response body the layer returns: a buffered body (stored, replayed, or a problem), or
//! the handler's own body passed through (too large or streamed to store).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

/// A boxed error from a passed-through body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every response through the layer.
#[derive(Debug)]
pub struct ResponseBody<B> {
    kind: Kind<B>,
}

#[derive(Debug)]
enum Kind<B> {
    Full(Option<Bytes>),
    Inner(Pin<Box<B>>),
}

impl<B> ResponseBody<B> {
    pub(crate) fn full(bytes: Bytes) -> Self {
        Self {
            kind: Kind::Full(Some(bytes).filter(|b| !b.is_empty())),
        }
    }

    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner(Box::pin(body)),
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
            Kind::Inner(body) => body
                .as_mut()
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(Into::into))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full(bytes) => bytes.is_none(),
            Kind::Inner(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
            Kind::Inner(body) => body.size_hint(),
        }
    }
}

//! The service's future, and how a guarded run outlives a request whose client went away.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Response;
use tokio_util::task::TaskTracker;

use crate::body::ResponseBody;

type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;

/// The future of [`IdempotencyService`](crate::IdempotencyService): the answer to one request.
pub struct ResponseFuture<B, E> {
    inner: Pin<Box<dyn Future<Output = Answer<B, E>> + Send>>,
}

impl<B, E> ResponseFuture<B, E> {
    pub(crate) fn new(
        inner: impl Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'static,
    ) -> Self {
        Self {
            inner: Box::pin(inner),
        }
    }
}

impl<B, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<B, E> Future for ResponseFuture<B, E> {
    type Output = Answer<B, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

/// The guarded runs of one layer that finish on tasks of their own because their clients went
/// away: a handle the layer hands out ([`IdempotencyLayer::detached_runs`](crate::IdempotencyLayer::detached_runs)),
/// so that a server can let them record their outcomes before it exits. Clones share the runs.
#[derive(Debug, Clone, Default)]
pub struct DetachedRuns {
    tracker: TaskTracker,
}

impl DetachedRuns {
    /// How many runs are still finishing.
    #[must_use]
    pub fn count(&self) -> usize {
        self.tracker.len()
    }

    /// Waits until no run is finishing, for at most `limit`; returns whether they all finished.
    /// A server that drains on shutdown calls this after its last connection closed, so that the
    /// runs of clients that went away still record their outcomes before the process exits.
    pub async fn wait(&self, limit: Duration) -> bool {
        // A tracker's `wait` ends only once it is closed; closing does not stop it from
        // tracking runs detached later, and it is reopened for the next wait.
        self.tracker.close();
        let finished = tokio::time::timeout(limit, self.tracker.wait()).await.is_ok();
        self.tracker.reopen();
        finished
    }
}

/// A future that finishes on a task of its own if it is dropped before it is done.
pub(crate) struct DetachOnDrop<T: Send + 'static> {
    future: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
    detached: DetachedRuns,
}

impl<T: Send + 'static> DetachOnDrop<T> {
    pub(crate) fn new(future: impl Future<Output = T> + Send + 'static, detached: DetachedRuns) -> Self {
        Self {
            future: Some(Box::pin(future)),
            detached,
        }
    }
}

impl<T: Send + 'static> Future for DetachOnDrop<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(future) = self.future.as_mut() else {
            panic!("DetachOnDrop polled after completion");
        };
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<T: Send + 'static> Drop for DetachOnDrop<T> {
    fn drop(&mut self) {
        if let Some(future) = self.future.take() {
            match tokio::runtime::Handle::try_current() {
                // The future is boxed, so moving it to a task does not move what it pinned.
                Ok(runtime) => drop(self.detached.tracker.spawn_on(future, &runtime)),
                Err(_) => {
                    tracing::error!("an idempotent request was dropped outside a runtime and cancelled");
                }
            }
        }
    }
}

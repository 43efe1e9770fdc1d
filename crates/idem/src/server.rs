//! The gateway's HTTP/1 server: hyper's connections with the limits a server facing untrusted
//! clients needs, which `axum::serve` does not offer.
//!
//! - **A header read timeout**: a client that never finishes its headers loses its connection.
//! - **A connection cap**: past `max_connections` the server stops accepting (the kernel's
//!   backlog holds newcomers) instead of running out of file descriptors.
//! - **A request body deadline** ([`BodyDeadline`]): a body that does not arrive in time is
//!   answered `408`, and nothing runs.
//! - **Lingering close** ([`Lingering`]): when the server answers before reading the whole
//!   request (a `413`), it reads and discards what the client still sends, for a bounded time,
//!   before it closes; closing with unread bytes would make the kernel reset the connection and
//!   destroy the answer.
//! - **A bounded drain**: on shutdown, idle connections close at once, running requests get
//!   until the drain deadline to finish (and their runs that outlived their clients too); what
//!   is still running then is abandoned to its lease, and a retry takes it over.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use hyper::body::Frame;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use idempotency_http::{DetachedRuns, Problem};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::time::{Instant, Sleep};
use tokio_util::task::TaskTracker;

use crate::tls::ListenerTls;

/// How long a connection closed after an early answer keeps reading what the client still sends.
pub const LINGER: Duration = Duration::from_secs(5);

/// The limits the server applies.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// How long a client may take to send a request's headers.
    pub header_timeout: Duration,
    /// How many connections are served at once.
    pub max_connections: usize,
    /// How long shutdown waits for running requests before abandoning them to their leases.
    pub drain_timeout: Duration,
}

/// Serves `router` on `listener` (over TLS when `tls` is given) until `shutdown`, then drains within `limits.drain_timeout`
/// (connections, then the runs in `detached`); returns whether everything finished in time.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    tls: Option<&ListenerTls>,
    detached: DetachedRuns,
    shutdown: impl Future<Output = ()>,
) -> bool {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let connections = TaskTracker::new();
    let (stop, stopped) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            () = &mut shutdown => break,
            permit = Arc::clone(&permits).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    // Out of file descriptors, say: back off instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let stopped = stopped.clone();
        let tls = tls.map(|tls| tls.acceptor().clone());
        connections.spawn(async move {
            let _permit = permit;
            let stream = Lingering::new(stream);
            match tls {
                None => serve_connection(stream, service, limits, stopped).await,
                Some(acceptor) => {
                    // The handshake is part of the request's head: it gets the header timeout.
                    match tokio::time::timeout(limits.header_timeout, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => serve_connection(stream, service, limits, stopped).await,
                        Ok(Err(error)) => {
                            metrics::counter!("idem_tls_handshake_failures_total").increment(1);
                            tracing::debug!(%error, "a client's TLS handshake failed");
                        }
                        Err(_) => {
                            metrics::counter!("idem_tls_handshake_failures_total").increment(1);
                            tracing::debug!(
                                "a client's TLS handshake did not finish within the header timeout"
                            );
                        }
                    }
                }
            }
        });
    }
    drop(listener);
    let deadline = Instant::now() + limits.drain_timeout;
    let _ = stop.send(true);
    connections.close();
    if tokio::time::timeout_at(deadline, connections.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            connections = connections.len(),
            "drain timeout: abandoning requests still running to their leases; a retry takes them over"
        );
        return false;
    }
    // Requests whose clients went away finish on tasks of their own; let them record too.
    let left = deadline.saturating_duration_since(Instant::now());
    if !detached.wait(left).await {
        tracing::warn!(
            runs = detached.count(),
            "drain timeout: abandoning runs still going to their leases; a retry takes them over"
        );
        return false;
    }
    true
}

/// Serves one client connection until it ends, or, once `stopped` turns true, until its running
/// request has finished.
async fn serve_connection<IO>(
    io: IO,
    service: TowerToHyperService<Router>,
    limits: Limits,
    mut stopped: watch::Receiver<bool>,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let connection = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        _ = async { stopped.wait_for(|stop| *stop).await.map(|_| ()) } => {
            // Idle connections close now; a running request finishes first.
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(error) = result {
        tracing::debug!(%error, "connection ended with an error");
    }
}

/// A connection that, when closed, first lingers: it sends its end of the stream, then reads
/// and discards what the client still sends until the client closes or [`LINGER`] has passed.
#[derive(Debug)]
pub struct Lingering {
    inner: TcpStream,
    linger: Option<Pin<Box<Sleep>>>,
}

impl Lingering {
    /// `stream`, lingering when closed.
    #[must_use]
    pub fn new(stream: TcpStream) -> Self {
        Self {
            inner: stream,
            linger: None,
        }
    }
}

impl AsyncRead for Lingering {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Lingering {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.linger.is_none() {
            ready!(Pin::new(&mut self.inner).poll_shutdown(cx))?;
            self.linger = Some(Box::pin(tokio::time::sleep(LINGER)));
        }
        let mut discard = [0_u8; 16 * 1024];
        loop {
            if let Some(linger) = self.linger.as_mut()
                && linger.as_mut().poll(cx).is_ready()
            {
                return Poll::Ready(Ok(()));
            }
            let mut buf = ReadBuf::new(&mut discard);
            match Pin::new(&mut self.inner).poll_read(cx, &mut buf) {
                // The client closed, or the connection broke: nothing left to protect.
                Poll::Ready(Ok(())) if buf.filled().is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Err(_)) => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(())) => {}
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// A request body that must arrive whole within a deadline; past it, it fails with
/// [`Problem::RequestTimeout`], which the idempotency layer answers as a `408`.
#[derive(Debug)]
pub struct BodyDeadline {
    inner: Body,
    deadline: Pin<Box<Sleep>>,
}

impl BodyDeadline {
    /// `inner`, due within `limit` from now.
    #[must_use]
    pub fn new(inner: Body, limit: Duration) -> Self {
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep(limit)),
        }
    }
}

impl hyper::body::Body for BodyDeadline {
    type Data = bytes::Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<bytes::Bytes>, axum::BoxError>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(axum::BoxError::from)));
        }
        if self.deadline.as_mut().poll(cx).is_ready() {
            metrics::counter!("idem_request_body_timeouts_total").increment(1);
            return Poll::Ready(Some(Err(Box::new(Problem::RequestTimeout))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// A listener on `addr`, with the address it was given: `127.0.0.1:0` takes a port the kernel
/// picks, and what the process logs and probes is the bound one.
///
/// # Errors
///
/// [`crate::Error::Listen`] when it cannot be bound.
pub async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), crate::Error> {
    let listen = |source| crate::Error::Listen {
        addr: addr.to_string(),
        source,
    };
    let listener = TcpListener::bind(addr).await.map_err(listen)?;
    let bound = listener.local_addr().map_err(listen)?;
    Ok((listener, bound))
}

/// [`bind`] for a listener the command line may leave out (`--admin-listen`).
///
/// # Errors
///
/// [`crate::Error::Listen`] when it is given and cannot be bound.
pub async fn bind_optional(
    addr: Option<SocketAddr>,
) -> Result<Option<(TcpListener, SocketAddr)>, crate::Error> {
    match addr {
        Some(addr) => bind(addr).await.map(Some),
        None => Ok(None),
    }
}

/// Resolves at the first SIGTERM or Ctrl-C: the moment a long-running command stops taking new
/// work and finishes what it has.
pub async fn shutdown_signal() {
    let terminate = async {
        #[cfg(unix)]
        {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut signal) => {
                    signal.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        }
        #[cfg(not(unix))]
        std::future::pending::<()>().await;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
    tracing::info!("shutting down: no new connections; finishing in-flight requests");
}

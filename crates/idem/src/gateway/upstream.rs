//! The gateway's connections to its upstream: HTTP/1.1 keep-alive connections that the request
//! using one drives itself.
//!
//! A general-purpose client (hyper-util's) runs each connection as a task of its own and hands
//! every request to it through a channel: two tasks and two wake-ups per request, and a pool
//! keyed by host behind a lock. The gateway talks to one upstream. Here a request takes an idle connection from a stack (the most recently used
//! first), and the task that serves the client's connection polls the upstream connection
//! itself, while it waits for the head and while the layer or the server reads the body. When
//! the body has ended, the connection goes back on the stack; a body dropped before its end takes
//! its connection with it (HTTP/1 cannot reuse a connection mid-response).
//!
//! What the gateway promises about an upstream failure depends on whether the request was sent,
//! so this module says exactly that ([`Failure`]):
//! - a connection that could not be made, or a pooled connection that turned out closed before
//!   the request was written (hyper gives the request back), sent nothing: the request goes out
//!   on another connection, and if none can be made the failure is [`Failure::Unreachable`];
//! - anything after the request (or part of it) was written is [`Failure::AnswerLost`];
//! - the deadline passing first is [`Failure::TimedOut`], whatever the phase.
//!
//! A connection the upstream closes while a request is being written to it (a keep-alive
//! timeout that expires that very moment) cannot be told from an upstream that broke off after
//! reading the request: that is an answer lost, as with any HTTP/1 client.
//!
//! An `https://` upstream is reached over TLS (rustls, verified with the configuration
//! [`crate::tls::client_config`] builds; SNI and the name checked are the URL's host). A
//! handshake that fails sent nothing: [`Failure::Tls`], with rustls's reason.
//!
//! An idle connection is not polled while it waits on the stack, so an upstream that closes it
//! is noticed when the connection is next taken (it is then dropped, and the next one tried).
//! Connections idle longer than [`IDLE_TIMEOUT`] are closed when a request next looks, and the
//! stack keeps at most [`MAX_IDLE`].

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::body::Body;
use http::header::{self, HeaderValue};
use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_util::either::Either;

use crate::error::UpstreamError;

/// How long a connection may sit unused before a request closes it instead of using it
/// (hyper-util's default). An upstream that closes idle connections sooner costs nothing: its
/// close has arrived by the time a request looks, and the request takes another connection.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// The most idle connections kept: one per concurrent request at the busiest moment, up to this.
pub(crate) const MAX_IDLE: usize = 1024;

/// How long making a connection may take.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a request got no response.
#[derive(Debug)]
pub(crate) enum Failure {
    /// No connection could be made: nothing was sent.
    Unreachable(String),
    /// The TLS handshake failed (the reason names the host and the cause): nothing was sent.
    Tls(String),
    /// The request was sent, at least in part, and no response head came back.
    AnswerLost(hyper::Error),
    /// The deadline passed before the response head arrived.
    TimedOut,
}

/// One keep-alive connection: the handle requests are sent with and the connection itself,
/// which whoever uses it polls.
struct Connection {
    sender: http1::SendRequest<Body>,
    driver: http1::Connection<TokioIo<Stream>, Body>,
}

/// A connection's bytes: plain TCP, or TLS over it.
type Stream = Either<TcpStream, Box<TlsStream<TcpStream>>>;

impl Connection {
    /// Polls the connection's I/O. `Ready` means it is finished (closed, or failed): it carries
    /// nothing more.
    fn poll_driver(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        Pin::new(&mut self.driver).poll(cx).map(|_| ())
    }
}

struct Idle {
    connection: Connection,
    since: Instant,
}

/// The upstream's address and its idle connections. Clones share the connections.
#[derive(Clone)]
pub(crate) struct Upstream {
    inner: Arc<Inner>,
}

struct Inner {
    /// What `TcpStream::connect` resolves: `host:port`.
    address: String,
    /// For an `https://` upstream: the connector and the name the certificate must carry.
    tls: Option<(TlsConnector, ServerName<'static>)>,
    /// The `Host` header the upstream gets.
    host: HeaderValue,
    idle: Mutex<Vec<Idle>>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("address", &self.inner.address)
            .finish_non_exhaustive()
    }
}

impl Upstream {
    /// Connections to the authority of `upstream` (an `http` or `https` URI with a host;
    /// `parse_upstream` checked it); an `https` one is reached with `tls`.
    ///
    /// # Errors
    ///
    /// [`UpstreamError::Tls`]: an `https` upstream without a TLS configuration, or whose host is
    /// not a name a certificate can carry.
    pub(crate) fn new(upstream: &Uri, tls: Option<Arc<ClientConfig>>) -> Result<Self, UpstreamError> {
        let host = upstream.host().unwrap_or("localhost");
        let https = upstream.scheme_str() == Some("https");
        let default_port = if https { 443 } else { 80 };
        let port = upstream.port_u16().unwrap_or(default_port);
        // An IPv6 literal keeps its brackets in `host()`, which is what `connect` wants.
        let address = format!("{host}:{port}");
        // The host and a port other than the scheme's, never the URL's user information.
        let header = match upstream.port_u16() {
            Some(port) if port != default_port => address.clone(),
            _ => host.to_owned(),
        };
        let host_header =
            HeaderValue::from_str(&header).unwrap_or_else(|_| HeaderValue::from_static("localhost"));
        let tls = if https {
            let config = tls.ok_or_else(|| {
                UpstreamError::Tls(format!("{upstream}: an https upstream needs a TLS configuration"))
            })?;
            // The name checked against the certificate, and sent as SNI (not for an address).
            let name = host.trim_start_matches('[').trim_end_matches(']');
            let name = ServerName::try_from(name.to_owned()).map_err(|e| {
                UpstreamError::Tls(format!(
                    "{upstream}: `{name}` cannot be checked against a certificate: {e}"
                ))
            })?;
            Some((TlsConnector::from(config), name))
        } else {
            None
        };
        Ok(Self {
            inner: Arc::new(Inner {
                address,
                tls,
                host: host_header,
                idle: Mutex::new(Vec::new()),
            }),
        })
    }

    /// Sends `request` (its URI in origin form) and waits for the response head until
    /// `deadline`. The response's body keeps the connection and gives it back at its end.
    pub(crate) async fn send(
        &self,
        mut request: Request<Body>,
        deadline: Pin<Box<Sleep>>,
    ) -> Result<Response<UpstreamBody>, Failure> {
        request
            .headers_mut()
            .insert(header::HOST, self.inner.host.clone());
        let mut deadline = deadline;
        loop {
            let (mut connection, pooled) = match self.take() {
                Some(connection) => (connection, true),
                None => match self.connect(&mut deadline).await {
                    Ok(connection) => (connection, false),
                    Err(failure) => return Err(failure),
                },
            };
            // Wait until the connection can take a request, driving it meanwhile.
            let ready = std::future::poll_fn(|cx| {
                if deadline.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(None));
                }
                if let Poll::Ready(result) = connection.sender.poll_ready(cx) {
                    return Poll::Ready(result.map_err(Some));
                }
                match connection.poll_driver(cx) {
                    Poll::Ready(()) => connection.sender.poll_ready(cx).map_err(Some),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
            match ready {
                Ok(()) => {}
                Err(None) => return Err(Failure::TimedOut),
                // Closed before anything was sent on it: another connection.
                Err(Some(_)) if pooled => continue,
                Err(Some(error)) => return Err(Failure::Unreachable(error.to_string())),
            }
            let mut response = std::pin::pin!(connection.sender.try_send_request(request));
            let mut finished = false;
            let head = std::future::poll_fn(|cx| {
                if let Poll::Ready(result) = response.as_mut().poll(cx) {
                    return Poll::Ready(Some(result));
                }
                if !finished && connection.poll_driver(cx).is_ready() {
                    // The connection ended: the request's future answers on its next poll.
                    finished = true;
                    if let Poll::Ready(result) = response.as_mut().poll(cx) {
                        return Poll::Ready(Some(result));
                    }
                }
                if deadline.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(None);
                }
                Poll::Pending
            })
            .await;
            match head {
                None => return Err(Failure::TimedOut),
                Some(Ok(response)) => {
                    let (parts, body) = response.into_parts();
                    let body = UpstreamBody {
                        inner: body,
                        deadline,
                        connection: (!finished).then_some(connection),
                        upstream: self.clone(),
                    };
                    return Ok(Response::from_parts(parts, body));
                }
                Some(Err(mut error)) => match error.take_message() {
                    // Not written: the connection closed first. Another one.
                    Some(unsent) if pooled => request = unsent,
                    Some(_) => return Err(Failure::Unreachable(error.into_error().to_string())),
                    None => return Err(Failure::AnswerLost(error.into_error())),
                },
            }
        }
    }

    /// The most recently used idle connection that is still open, closing the stale ones.
    fn take(&self) -> Option<Connection> {
        let mut idle = self
            .inner
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        while let Some(Idle {
            mut connection,
            since,
        }) = idle.pop()
        {
            if now.duration_since(since) > IDLE_TIMEOUT {
                // The rest are older still.
                idle.clear();
                return None;
            }
            // A closed connection finishes at once; an open idle one has nothing to do.
            if connection
                .poll_driver(&mut Context::from_waker(Waker::noop()))
                .is_pending()
            {
                return Some(connection);
            }
        }
        None
    }

    fn put(&self, connection: Connection) {
        if connection.sender.is_closed() {
            return;
        }
        let mut idle = self
            .inner
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if idle.len() < MAX_IDLE {
            idle.push(Idle {
                connection,
                since: Instant::now(),
            });
        }
    }

    async fn connect(&self, deadline: &mut Pin<Box<Sleep>>) -> Result<Connection, Failure> {
        let address = &self.inner.address;
        let connect = async {
            let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(address))
                .await
                .map_err(|_| Failure::Unreachable(format!("connecting to {address} timed out")))?
                .map_err(|e| Failure::Unreachable(format!("cannot connect to {address}: {e}")))?;
            stream
                .set_nodelay(true)
                .map_err(|e| Failure::Unreachable(format!("cannot set TCP_NODELAY: {e}")))?;
            let stream = match &self.inner.tls {
                None => Either::Left(stream),
                Some((connector, name)) => {
                    let handshake = connector.connect(name.clone(), stream);
                    let stream = tokio::time::timeout(CONNECT_TIMEOUT, handshake)
                        .await
                        .map_err(|_| Failure::Tls(format!("the TLS handshake with {address} timed out")))?
                        .map_err(|e| Failure::Tls(crate::tls::describe_handshake_error(address, &e)))?;
                    Either::Right(Box::new(stream))
                }
            };
            let (sender, driver) = http1::handshake(TokioIo::new(stream))
                .await
                .map_err(|e| Failure::Unreachable(format!("HTTP/1 handshake with {address} failed: {e}")))?;
            metrics::counter!("idem_upstream_connections_opened_total").increment(1);
            Ok(Connection { sender, driver })
        };
        tokio::select! {
            connection = connect => connection,
            () = deadline.as_mut() => Err(Failure::TimedOut),
        }
    }
}

/// The upstream's response body. It drives its connection while it is read, fails with
/// [`idempotency_http::Problem::UpstreamTimeout`] when the deadline passes before its end and
/// with [`idempotency_http::Problem::UpstreamAnswerLost`] when the upstream breaks it off (the
/// layer then answers with the problem and keeps the key in flight: the upstream ran), and gives
/// its connection back when it has ended.
pub(crate) struct UpstreamBody {
    inner: Incoming,
    deadline: Pin<Box<Sleep>>,
    connection: Option<Connection>,
    upstream: Upstream,
}

impl hyper::body::Body for UpstreamBody {
    type Data = bytes::Bytes;
    type Error = idempotency_http::Problem;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        use idempotency_http::Problem;
        if self.deadline.as_mut().poll(cx).is_ready() {
            metrics::counter!("idem_upstream_errors_total", "kind" => "timeout").increment(1);
            tracing::warn!("the upstream's response body did not end within the upstream timeout");
            return Poll::Ready(Some(Err(Problem::UpstreamTimeout)));
        }
        if let Some(connection) = self.connection.as_mut()
            && connection.poll_driver(cx).is_ready()
        {
            // Finished: what it read is in the body's channel, and the body reports how it ended.
            self.connection = None;
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Err(error))) => {
                metrics::counter!("idem_upstream_errors_total", "kind" => "answer_lost").increment(1);
                tracing::warn!(%error, "the upstream broke its response body off");
                Poll::Ready(Some(Err(Problem::UpstreamAnswerLost)))
            }
            other => other.map_err(|_| Problem::UpstreamAnswerLost),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        // A body read to its end leaves its connection reusable; one dropped before (the client
        // went away, a limit was hit) leaves it mid-response, and it closes with the body.
        if hyper::body::Body::is_end_stream(&self.inner)
            && let Some(connection) = self.connection.take()
        {
            self.upstream.put(connection);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_header_is_the_host_and_a_port_other_than_80_never_the_user_information() {
        for (upstream, address, host) in [
            ("http://127.0.0.1:3000", "127.0.0.1:3000", "127.0.0.1:3000"),
            ("http://up.internal", "up.internal:80", "up.internal"),
            ("http://up.internal:80/base", "up.internal:80", "up.internal"),
            (
                "http://app:s3cret@up.internal:8080",
                "up.internal:8080",
                "up.internal:8080",
            ),
            ("http://[::1]:9000", "[::1]:9000", "[::1]:9000"),
        ] {
            let upstream = Upstream::new(&upstream.parse().unwrap(), None).unwrap();
            assert_eq!(upstream.inner.address, address);
            assert_eq!(upstream.inner.host, host);
        }
    }
}

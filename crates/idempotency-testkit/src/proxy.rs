//! A loopback TCP proxy that can cut connections, simulate an outage and put the server far
//! away, for testing what a store or a consumer does when its server goes away and comes back,
//! or answers slowly.
//!
//! Point the client at [`TcpProxy::addr`] instead of the server. [`TcpProxy::cut`] drops every
//! open connection (the client sees its socket closed mid-conversation); [`TcpProxy::set_down`]
//! also refuses new connections until it is brought back up, as a stopped server would;
//! [`TcpProxy::set_latency`] delays every byte by a one-way latency in each direction, as a
//! server in another zone would (the bytes are pipelined, not serialised: throughput stays);
//! [`TcpProxy::stall`] holds every byte in both directions, connections kept open, until it is
//! lifted, as a network that drops every packet (or a server that hangs) would: a client waits
//! for answers that do not come, then gets them all, in order.
//! [`TcpProxy::sent`] counts the bytes clients sent the server: what a client costs the server
//! on the wire, exactly, whatever the timing; [`TcpProxy::round_trips`] counts the times a
//! client spoke after the server had answered (a request-response protocol's round trips);
//! [`TcpProxy::cut_at_round_trip`] cuts every connection when a given round trip begins, its
//! request never reaching the server: a loss at an exact step of a protocol;
//! [`TcpProxy::stall_at_round_trip`] stalls there instead: a server that stops answering at
//! that step.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

#[derive(Debug)]
struct State {
    upstream: SocketAddr,
    down: AtomicBool,
    cuts: watch::Sender<u64>,
    /// Whether bytes are held rather than forwarded.
    stalled: watch::Sender<bool>,
    accepted: AtomicU64,
    /// The one-way latency, in microseconds.
    latency_us: AtomicU64,
    /// Bytes read from clients (and forwarded to the server).
    sent: AtomicU64,
    /// Times a client spoke first on its connection or after the server had answered.
    round_trips: AtomicU64,
    /// The round trip at which every connection is cut (0: none).
    cut_at_round_trip: AtomicU64,
    /// The round trip from which every byte is held, as [`TcpProxy::stall`] does (0: none).
    stall_at_round_trip: AtomicU64,
}

/// A loopback TCP proxy; see the [module docs](self). Dropping it stops accepting; connections
/// already open are cut.
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    state: Arc<State>,
    accept: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    /// Starts a proxy on `127.0.0.1:0` forwarding to `upstream`.
    ///
    /// # Errors
    ///
    /// If the listening socket cannot be bound.
    pub async fn start(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            upstream,
            down: AtomicBool::new(false),
            cuts: watch::channel(0).0,
            stalled: watch::channel(false).0,
            accepted: AtomicU64::new(0),
            latency_us: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            round_trips: AtomicU64::new(0),
            cut_at_round_trip: AtomicU64::new(0),
            stall_at_round_trip: AtomicU64::new(0),
        });
        let accept = tokio::spawn(accept_loop(listener, Arc::clone(&state)));
        Ok(Self { addr, state, accept })
    }

    /// The address clients connect to.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Drops every open connection; new ones are still accepted.
    pub fn cut(&self) {
        self.state.cuts.send_modify(|generation| *generation += 1);
    }

    /// Starts a proxy in front of the server of `url` (`scheme://[user[:password]@]host[:port]…`,
    /// the port the scheme's default where it has one, the host an IP address or a name that
    /// resolves) and returns it with `url` pointed at it.
    ///
    /// # Errors
    ///
    /// If the URL does not parse or names no `host:port`, the name does not resolve, or the
    /// socket cannot be bound. Errors show the URL without its password.
    pub async fn in_front_of(url: &str) -> io::Result<(Self, String)> {
        let invalid = |why: &str| {
            let shown = idempotency_core::redact_url(url);
            io::Error::new(io::ErrorKind::InvalidInput, format!("{why}: {shown}"))
        };
        let mut through = url::Url::parse(url).map_err(|e| invalid(&e.to_string()))?;
        let host = through.host_str().ok_or_else(|| invalid("no host"))?.to_owned();
        let port = through
            .port_or_known_default()
            .ok_or_else(|| invalid("no port"))?;
        let upstream = tokio::net::lookup_host((host.as_str(), port))
            .await
            .map_err(|e| invalid(&e.to_string()))?
            .next()
            .ok_or_else(|| invalid("no address"))?;
        let proxy = Self::start(upstream).await?;
        through
            .set_ip_host(proxy.addr().ip())
            .and_then(|()| through.set_port(Some(proxy.addr().port())))
            .map_err(|()| invalid("no host to replace"))?;
        Ok((proxy, through.into()))
    }

    /// Cuts every connection (as [`cut`](Self::cut)) when a client begins round trip number
    /// `round_trip` (counted as [`round_trips`](Self::round_trips) counts, over every connection
    /// so far): that request is not forwarded. A protocol's set-up is a fixed sequence of
    /// requests, so cutting at each of them in turn puts the loss at each step of it, whatever
    /// the timing. `None` cuts nothing (the default).
    pub fn cut_at_round_trip(&self, round_trip: Option<u64>) {
        let at = round_trip.map_or(0, |n| n.max(1));
        self.state.cut_at_round_trip.store(at, Ordering::SeqCst);
    }

    /// Stalls (as [`stall`](Self::stall)`(true)`) when a client begins round trip number
    /// `round_trip`, counted as [`cut_at_round_trip`](Self::cut_at_round_trip) counts: that
    /// request and everything after it is held until the stall is lifted. `None`: no such stall
    /// (the default).
    pub fn stall_at_round_trip(&self, round_trip: Option<u64>) {
        let at = round_trip.map_or(0, |n| n.max(1));
        self.state.stall_at_round_trip.store(at, Ordering::SeqCst);
    }

    /// Holds every byte, in both directions and on every connection, until called again with
    /// `false`; connections stay open meanwhile and what was held is then delivered in order.
    pub fn stall(&self, stalled: bool) {
        self.state.stalled.send_replace(stalled);
    }

    /// While down, every open connection is dropped and new ones are closed at once.
    pub fn set_down(&self, down: bool) {
        self.state.down.store(down, Ordering::SeqCst);
        if down {
            self.cut();
        }
    }

    /// Delays every byte by `one_way` in each direction (a round trip takes twice as long),
    /// for connections opened from now on. Zero (the default) forwards at once.
    pub fn set_latency(&self, one_way: Duration) {
        let micros = u64::try_from(one_way.as_micros()).unwrap_or(u64::MAX);
        self.state.latency_us.store(micros, Ordering::SeqCst);
    }

    /// How many bytes clients have sent the server through the proxy, on every connection so
    /// far. A client that waited for its answers has had all its bytes counted.
    #[must_use]
    pub fn sent(&self) -> u64 {
        self.state.sent.load(Ordering::SeqCst)
    }

    /// How many round trips clients have made through the proxy, on every connection so far:
    /// the times a client sent bytes first on its connection or after the server had sent
    /// some. A client that writes a request and waits for its answer makes one per request,
    /// however many packets either side's bytes take.
    #[must_use]
    pub fn round_trips(&self) -> u64 {
        self.state.round_trips.load(Ordering::SeqCst)
    }

    /// How many client connections the proxy has accepted (while up).
    #[must_use]
    pub fn accepted(&self) -> u64 {
        self.state.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        if state.down.load(Ordering::SeqCst) {
            drop(client);
            continue;
        }
        state.accepted.fetch_add(1, Ordering::SeqCst);
        let mut cuts = state.cuts.subscribe();
        let upstream = state.upstream;
        let latency = Duration::from_micros(state.latency_us.load(Ordering::SeqCst));
        let counts = Arc::clone(&state);
        let stalled = state.stalled.subscribe();
        tokio::spawn(async move {
            let Ok(mut server) = TcpStream::connect(upstream).await else {
                return;
            };
            let mut client = client;
            let (client_read, client_write) = client.split();
            let (server_read, server_write) = server.split();
            // Whether the server has spoken since the client last did.
            let answered = AtomicBool::new(true);
            let from_client = Direction::FromClient {
                state: &counts,
                answered: &answered,
            };
            tokio::select! {
                () = delayed_copy(client_read, server_write, latency, stalled.clone(), from_client) => {}
                () = delayed_copy(server_read, client_write, latency, stalled, Direction::FromServer(&answered)) => {}
                _ = cuts.changed() => {}
            }
            // Dropping both sockets closes them: the client sees the server go away.
        });
    }
}

/// Which way a copy goes, and what it counts.
#[derive(Clone, Copy)]
enum Direction<'a> {
    /// Client to server: counts the bytes, and a round trip when the server had answered.
    FromClient {
        state: &'a State,
        answered: &'a AtomicBool,
    },
    /// Server to client: marks that the server answered.
    FromServer(&'a AtomicBool),
}

impl Direction<'_> {
    /// Counts `n` bytes read; `false` when they must not be forwarded (every connection is
    /// being cut).
    fn read(self, n: usize) -> bool {
        match self {
            Self::FromClient { state, answered } => {
                state.sent.fetch_add(n as u64, Ordering::SeqCst);
                if answered.swap(false, Ordering::SeqCst) {
                    let round_trip = state.round_trips.fetch_add(1, Ordering::SeqCst) + 1;
                    if round_trip == state.cut_at_round_trip.load(Ordering::SeqCst) {
                        state.cuts.send_modify(|generation| *generation += 1);
                        return false;
                    }
                    if round_trip == state.stall_at_round_trip.load(Ordering::SeqCst) {
                        state.stalled.send_replace(true);
                    }
                }
                true
            }
            Self::FromServer(answered) => {
                answered.store(true, Ordering::SeqCst);
                true
            }
        }
    }
}

/// Copies `from` to `to`, each chunk written `latency` after it was read (at once when zero);
/// chunks read meanwhile queue behind it, so the delay adds to every byte once and throughput
/// is kept. Nothing is written while `stalled` says so. Counts what it reads as `direction`
/// says. Ends when either side closes or fails.
async fn delayed_copy(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    latency: Duration,
    mut stalled: watch::Receiver<bool>,
    direction: Direction<'_>,
) {
    let (queue, mut due) = mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let read = async move {
        let mut buffer = vec![0_u8; 64 * 1024];
        loop {
            match from.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if !direction.read(n) {
                        return;
                    }
                    let at = tokio::time::Instant::now() + latency;
                    if queue.send((at, buffer[..n].to_vec())).is_err() {
                        return;
                    }
                }
            }
        }
    };
    let write = async move {
        while let Some((at, bytes)) = due.recv().await {
            if !latency.is_zero() {
                tokio::time::sleep_until(at).await;
            }
            if stalled.wait_for(|stalled| !stalled).await.is_err() {
                return;
            }
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    // The writer outlives the reader until what was read is delivered.
    let ((), ()) = tokio::join!(read, write);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stall_holds_bytes_both_ways_until_it_is_lifted() {
        let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (proxy, url) = TcpProxy::in_front_of(&format!("tcp://{}", server.local_addr().unwrap()))
            .await
            .unwrap();
        assert_eq!(url, format!("tcp://{}", proxy.addr()));
        let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
        let (mut server, _) = server.accept().await.unwrap();

        proxy.stall(true);
        client.write_all(b"ping").await.unwrap();
        crate::eventually(Duration::from_secs(10), "the proxy read the bytes", async || {
            proxy.sent() == 4
        })
        .await;
        // Read by the proxy, held there: nothing reached the server.
        let mut buffer = [0_u8; 4];
        assert_eq!(
            server.try_read(&mut buffer).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        proxy.stall(false);
        server.read_exact(&mut buffer).await.unwrap();
        assert_eq!(&buffer, b"ping");

        proxy.stall(true);
        server.write_all(b"pong").await.unwrap();
        proxy.stall(false);
        client.read_exact(&mut buffer).await.unwrap();
        assert_eq!(&buffer, b"pong");
    }

    /// A proxy `configure`d before a client connects through it, after one request and its
    /// answer: the proxy, the client's socket and the server's.
    async fn after_one_round_trip(configure: impl FnOnce(&TcpProxy)) -> (TcpProxy, TcpStream, TcpStream) {
        let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = TcpProxy::start(server.local_addr().unwrap()).await.unwrap();
        configure(&proxy);
        let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
        let (mut server_side, _) = server.accept().await.unwrap();
        let mut buffer = [0_u8; 4];
        client.write_all(b"ping").await.unwrap();
        server_side.read_exact(&mut buffer).await.unwrap();
        server_side.write_all(b"pong").await.unwrap();
        client.read_exact(&mut buffer).await.unwrap();
        assert_eq!(&buffer, b"pong");
        (proxy, client, server_side)
    }

    #[tokio::test]
    async fn a_cut_at_a_round_trip_drops_that_request_and_every_connection() {
        let (proxy, mut client, mut server_side) =
            after_one_round_trip(|proxy| proxy.cut_at_round_trip(Some(2))).await;
        let mut buffer = [0_u8; 4];
        // The second request begins the second round trip: cut, and never forwarded.
        client.write_all(b"next").await.unwrap();
        assert_eq!(
            server_side.read(&mut buffer).await.unwrap(),
            0,
            "closed, nothing read"
        );
        assert_eq!(
            client.read(&mut buffer).await.unwrap_or(0),
            0,
            "the client's side is closed too"
        );
        assert_eq!((proxy.round_trips(), proxy.sent()), (2, 8));
    }

    #[tokio::test]
    async fn a_stall_at_a_round_trip_holds_that_request_until_it_is_lifted() {
        let (proxy, mut client, mut server_side) =
            after_one_round_trip(|proxy| proxy.stall_at_round_trip(Some(2))).await;
        let mut buffer = [0_u8; 4];
        client.write_all(b"next").await.unwrap();
        crate::eventually(
            Duration::from_secs(10),
            "the proxy read the request",
            async || proxy.sent() == 8,
        )
        .await;
        assert_eq!(
            server_side.try_read(&mut buffer).unwrap_err().kind(),
            io::ErrorKind::WouldBlock,
            "held"
        );
        proxy.stall(false);
        server_side.read_exact(&mut buffer).await.unwrap();
        assert_eq!(&buffer, b"next");
    }

    #[tokio::test]
    async fn a_url_is_pointed_at_the_proxy_with_its_credentials_path_and_query() {
        let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = server.local_addr().unwrap().port();
        let (proxy, url) =
            TcpProxy::in_front_of(&format!("amqp://guest:guest@localhost:{port}/%2f?heartbeat=5"))
                .await
                .unwrap();
        assert_eq!(
            url,
            format!("amqp://guest:guest@{}/%2f?heartbeat=5", proxy.addr())
        );
        let (_, url) = TcpProxy::in_front_of(&format!("http://127.0.0.1:{port}?a=b"))
            .await
            .unwrap();
        assert!(url.ends_with("?a=b"), "{url}");

        for bad in ["127.0.0.1:5672", "amqp://", "amqp://host-without-port/x"] {
            let error = TcpProxy::in_front_of(bad).await.unwrap_err();
            assert!(error.to_string().contains(bad), "{bad}: {error}");
        }
        let error = TcpProxy::in_front_of("amqp://app:s3cret@host-without-port/x")
            .await
            .unwrap_err();
        assert!(!error.to_string().contains("s3cret"), "{error}");
    }
}

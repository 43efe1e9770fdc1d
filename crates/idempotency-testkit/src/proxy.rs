//! A loopback TCP proxy that can cut connections and simulate an outage, for testing what a
//! store or a consumer does when its server goes away and comes back.
//!
//! Point the client at [`TcpProxy::addr`] instead of the server. [`TcpProxy::cut`] drops every
//! open connection (the client sees its socket closed mid-conversation); [`TcpProxy::set_down`]
//! also refuses new connections until it is brought back up, as a stopped server would.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Debug)]
struct State {
    upstream: SocketAddr,
    down: AtomicBool,
    cuts: watch::Sender<u64>,
    accepted: AtomicU64,
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
            accepted: AtomicU64::new(0),
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

    /// While down, every open connection is dropped and new ones are closed at once.
    pub fn set_down(&self, down: bool) {
        self.state.down.store(down, Ordering::SeqCst);
        if down {
            self.cut();
        }
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
        tokio::spawn(async move {
            let Ok(mut server) = TcpStream::connect(upstream).await else {
                return;
            };
            let mut client = client;
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                _ = cuts.changed() => {}
            }
            // Dropping both sockets closes them: the client sees the server go away.
        });
    }
}

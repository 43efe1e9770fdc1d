//! Checks of the connections a store keeps to its server (PostgreSQL's and MySQL's, through
//! `idempotency_core::connections`), driven through a [`TcpProxy`] that counts them.

use std::time::Duration;

use idempotency_core::{BeginRequest, Claim, Fingerprint, Key, Scope, Store};

use crate::TcpProxy;
use crate::recorded::record_metrics;

/// How many replays and bare reads [`a_replay_costs_its_read`] counts.
const READS: u64 = 10;

/// Checks that a replay through `through` sends the server exactly what the store's read alone
/// sends: the store's connections go back to its pool without a ping (sqlx's pool pings every
/// connection it takes back: a second round trip, and a second wakeup of the server, per
/// statement). `request` is completed already; `through` reaches the server only through
/// `proxy`, with one connection, and `read` sends the store's first look at `request`'s record
/// (its `Peek` statement, bound with the scope and the key) on a bare connection through the
/// same proxy. Counted in bytes on the wire, which no timing changes; panics otherwise.
pub async fn a_replay_costs_its_read<S: Store + ?Sized>(
    through: &S,
    request: &BeginRequest,
    proxy: &TcpProxy,
    mut read: impl AsyncFnMut(),
) {
    let replay = async || {
        let claim = through.begin(request).await.expect("begin");
        assert!(matches!(claim, Claim::Replay(_)), "a replay, got {claim:?}");
    };
    // The first prepares the statement; the next ones are what every replay costs.
    replay().await;
    let before = proxy.sent();
    for _ in 0..READS {
        replay().await;
    }
    let replays = proxy.sent() - before;

    read().await;
    let before = proxy.sent();
    for _ in 0..READS {
        read().await;
    }
    let reads = proxy.sent() - before;

    assert!(reads > 0, "the bare reads went through the proxy");
    assert_eq!(
        replays, reads,
        "{READS} replays sent {replays} bytes, {READS} bare reads {reads}: the store sends more than its statement"
    );
}

/// Checks that a store whose connections follow its pool's lifetime replaces one past it, and
/// counts it under `idempotency_store_connections_closed_total{store=label, reason=lifetime}`.
/// `setup` gets the lifetime and returns a store whose pool's connections live that long, that
/// holds one connection at most and has opened none yet, and the proxy it alone reaches its
/// server through. A first read opens a connection; a read after the lifetime has passed opens
/// another. Runs on a runtime of its own ([`record_metrics`]); panics otherwise.
pub fn replaced_past_lifetime<S: Store>(label: &str, setup: impl AsyncFnOnce(Duration) -> (S, TcpProxy)) {
    let lifetime = Duration::from_millis(200);
    let metrics = record_metrics(async {
        let (store, proxy) = setup(lifetime).await;
        let scope = Scope::new("wire").expect("a valid scope");
        let key = Key::new("old").expect("a valid key");
        assert!(store.get(&scope, &key).await.expect("get").is_none());
        assert_eq!(
            proxy.accepted(),
            1,
            "the first read opened the store's one connection"
        );
        // Past the lifetime whatever the machine's speed: the connection was opened before.
        tokio::time::sleep(lifetime + lifetime / 2).await;
        assert!(store.get(&scope, &key).await.expect("get").is_none());
        assert_eq!(
            proxy.accepted(),
            2,
            "the connection past its lifetime was replaced"
        );
    });
    let closed = |reason| {
        metrics.counter(
            "idempotency_store_connections_closed_total",
            &[("store", label), ("reason", reason)],
        )
    };
    assert_eq!(closed("lifetime"), 1);
    assert_eq!(closed("failed") + closed("abandoned"), 0);
}

/// Checks that a store closes a connection whose statement was abandoned mid-way (the caller's
/// future dropped, the answer still on its way) and one whose statement failed, instead of
/// handing either to the next caller, and counts each under
/// `idempotency_store_connections_closed_total{store=label}` (`abandoned`, `failed`). `setup`
/// returns a store that holds one connection at most, waits for one long enough to open it
/// through a proxy 100 ms slower each round trip, and reaches its server only through the proxy
/// it returns. After the store is dropped, the gauges of open and in-use connections are back
/// at zero. Runs on a runtime of its own ([`record_metrics`]); panics otherwise.
pub fn replaced_when_abandoned_or_failed<S: Store>(label: &str, setup: impl AsyncFnOnce() -> (S, TcpProxy)) {
    let metrics = record_metrics(async {
        let (store, proxy) = setup().await;
        // Every byte 50 ms late each way: no answer comes sooner than 100 ms after its question.
        proxy.set_latency(Duration::from_millis(50));
        let scope = Scope::new("wire").expect("a valid scope");
        let key = Key::new("left").expect("a valid key");
        // The store's one connection, opened and given back settled.
        assert!(store.get(&scope, &key).await.expect("get").is_none());
        let opened = proxy.accepted();

        // The caller gives up after 10 ms, its read on the wire.
        let abandoned = tokio::time::timeout(Duration::from_millis(10), store.get(&scope, &key)).await;
        assert!(abandoned.is_err(), "the read was meant to be abandoned mid-way");

        let request = BeginRequest::new(scope.clone(), key.clone(), Fingerprint::of_bytes(b"a"));
        assert!(matches!(
            store.begin(&request).await.expect("begin"),
            Claim::Acquired(_)
        ));
        assert!(store.get(&scope, &key).await.expect("get").is_some());
        assert_eq!(
            proxy.accepted(),
            opened + 1,
            "the abandoned connection was replaced by exactly one new one"
        );

        // The server's side of the connection goes away: the first statement that notices
        // fails, and its connection is not used again.
        proxy.set_latency(Duration::ZERO);
        proxy.cut();
        crate::eventually(
            Duration::from_secs(10),
            "a statement on the cut connection fails",
            async || store.get(&scope, &key).await.is_err(),
        )
        .await;
        assert!(store.get(&scope, &key).await.expect("get").is_some());
        assert_eq!(proxy.accepted(), opened + 2, "the failed connection was replaced");
    });
    let store = [("store", label)];
    let closed = |reason| {
        metrics.counter(
            "idempotency_store_connections_closed_total",
            &[("store", label), ("reason", reason)],
        )
    };
    assert_eq!(
        metrics.counter("idempotency_store_connections_opened_total", &store),
        3,
        "the first connection and one replacement for each closed"
    );
    assert_eq!(closed("abandoned"), 1);
    assert_eq!(closed("failed"), 1);
    assert_eq!(closed("lifetime"), 0);
    // The store was dropped with its last connection: none open, none in use.
    assert!(metrics.gauge("idempotency_store_connections_open", &store).abs() < f64::EPSILON);
    assert!(
        metrics
            .gauge("idempotency_store_connections_in_use", &store)
            .abs()
            < f64::EPSILON
    );
}

//! Checks of the connections a store keeps to its server (PostgreSQL's and MySQL's, through
//! `idempotency_core::connections`), driven through a [`TcpProxy`] that counts them.

use std::time::Duration;

use idempotency_core::{Key, Scope, Store};

use crate::TcpProxy;
use crate::recorded::record_metrics;

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

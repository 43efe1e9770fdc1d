//! The URLs the Redis store answers to.

use std::sync::Arc;

use idempotency_core::{Access, DynStore, ErrorKind, OpenFuture, StoreError, StoreKind};

use crate::RedisStore;

/// `redis://host:port` and `rediss://…` (one server), and `redis-cluster://h1:p1,h2:p2` (a Redis
/// Cluster, reached through any of the listed nodes), for a
/// [`Registry`](idempotency_core::Registry).
pub const KIND: StoreKind = StoreKind {
    name: "redis",
    schemes: &["redis", "rediss", "redis-cluster"],
    example: "redis://…",
    open: open_url,
};

/// Redis has no schema to create, and the operations commands only read: every access opens
/// the same way.
fn open_url(url: String, _access: Access) -> OpenFuture {
    Box::pin(async move {
        let store = match url.strip_prefix("redis-cluster://") {
            Some(nodes) => RedisStore::connect_cluster(&cluster_nodes(nodes)?).await?,
            None => RedisStore::connect(&url).await?,
        };
        Ok(Arc::new(store) as DynStore)
    })
}

/// `h1:p1,h2:p2` as `redis://` URLs, one a node.
fn cluster_nodes(nodes: &str) -> Result<Vec<String>, StoreError> {
    let nodes: Vec<String> = nodes
        .split(',')
        .filter(|node| !node.is_empty())
        .map(|node| format!("redis://{node}"))
        .collect();
    if nodes.is_empty() {
        return Err(StoreError::new(
            ErrorKind::InvalidConfig,
            "a redis-cluster:// URL lists no nodes (expected redis-cluster://host:port,host:port)",
        ));
    }
    Ok(nodes)
}

//! Shared test setup: the server URLs and stores with prefixes of their own.

#![allow(dead_code, unreachable_pub)] // each test crate uses a part

use idempotency_core::Key;
use idempotency_redis::RedisStore;

/// The single server: `REDIS_URL`, or the loopback default that `scripts/services` starts.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// The cluster's nodes: `REDIS_CLUSTER_URLS` (comma-separated), or the three loopback masters
/// that `scripts/services` starts on ports 7000-7002.
pub fn cluster_urls() -> Vec<String> {
    std::env::var("REDIS_CLUSTER_URLS")
        .unwrap_or_else(|_| "redis://127.0.0.1:7000,redis://127.0.0.1:7001,redis://127.0.0.1:7002".into())
        .split(',')
        .map(str::to_owned)
        .collect()
}

/// A prefix no other test uses, so each store sees only its own records.
pub fn unique_prefix() -> String {
    format!("idem-test:{}:", Key::generate())
}

/// A store on the single server. Panics when the server is unreachable.
pub async fn single() -> RedisStore {
    RedisStore::connect(&redis_url())
        .await
        .unwrap_or_else(|e| panic!("Redis at {} is needed for this test: {e}", redis_url()))
        .prefix(&unique_prefix())
        .unwrap()
}

/// A store on the cluster. Panics when the cluster is unreachable.
pub async fn cluster() -> RedisStore {
    RedisStore::connect_cluster(&cluster_urls())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "the Redis Cluster at {:?} is needed for this test: {e}",
                cluster_urls()
            )
        })
        .prefix(&unique_prefix())
        .unwrap()
}

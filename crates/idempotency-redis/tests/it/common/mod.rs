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

/// Cuts the connections of one ACL user on every server it knows: the linearizability check's
/// faults. The user exists for the store under test only, so the connections of other tests on
/// the same servers are left alone.
#[derive(Debug)]
pub struct KillUser {
    user: String,
    nodes: Vec<String>,
}

impl KillUser {
    /// Creates (or resets) the ACL user `user` on every node of `nodes`, allowed everything, any
    /// password accepted, and returns the nodes' URLs with that user in them.
    pub async fn create(user: &str, nodes: &[String]) -> (Self, Vec<String>) {
        let mut urls = Vec::new();
        for node in nodes {
            let mut connection = redis::Client::open(node.as_str())
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap_or_else(|e| panic!("Redis at {node} is needed for this test: {e}"));
            let _: () = redis::cmd("ACL")
                .arg(&["SETUSER", user, "reset", "on", "nopass", "~*", "&*", "+@all"][..])
                .query_async(&mut connection)
                .await
                .unwrap();
            urls.push(node.replacen("redis://", &format!("redis://{user}:any@"), 1));
        }
        let killer = Self {
            user: user.to_owned(),
            nodes: nodes.to_vec(),
        };
        (killer, urls)
    }
}

#[async_trait::async_trait]
impl idempotency_testkit::linearizability::Cutter for KillUser {
    async fn cut(&self) {
        for node in &self.nodes {
            let mut connection = redis::Client::open(node.as_str())
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            let _: i64 = redis::cmd("CLIENT")
                .arg(&["KILL", "USER", self.user.as_str()][..])
                .query_async(&mut connection)
                .await
                .unwrap();
        }
    }
}

/// The value another application keeps at `key`, where a record's key would be.
pub const FOREIGN: &str = "someone else's data";

/// Writes [`FOREIGN`] at `key`.
pub async fn plant_foreign(connection: &mut redis::aio::MultiplexedConnection, key: &str) {
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg(FOREIGN)
        .query_async(connection)
        .await
        .unwrap();
}

/// Asserts that [`FOREIGN`] is still at `key`: the store refused it and did not overwrite it.
pub async fn assert_foreign_kept(connection: &mut redis::aio::MultiplexedConnection, key: &str) {
    let kept: String = redis::cmd("GET").arg(key).query_async(connection).await.unwrap();
    assert_eq!(kept, FOREIGN, "the foreign value must not be overwritten");
}

/// Writes another application's hash at `key` (a hash without a record's fields).
pub async fn plant_foreign_hash(connection: &mut redis::aio::MultiplexedConnection, key: &str) {
    let _: () = redis::cmd("HSET")
        .arg(key)
        .arg("owner")
        .arg("billing")
        .query_async(connection)
        .await
        .unwrap();
}

/// Asserts that the hash [`plant_foreign_hash`] wrote is still at `key`, then deletes it.
pub async fn assert_foreign_hash_kept_then_delete(
    connection: &mut redis::aio::MultiplexedConnection,
    key: &str,
) {
    let owner: String = redis::cmd("HGET")
        .arg(key)
        .arg("owner")
        .query_async(&mut *connection)
        .await
        .unwrap();
    assert_eq!(owner, "billing", "the foreign hash must not be overwritten");
    let _: () = redis::cmd("DEL").arg(key).query_async(connection).await.unwrap();
}

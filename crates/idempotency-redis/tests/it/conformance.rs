//! The Redis store passes the conformance suite and the model-based property test, on a single
//! server and on a three-master Redis Cluster (server clock: real time, short leases).

use crate::common;

use idempotency_redis::RedisStore;
use idempotency_testkit::linearizability::Cutter;
use idempotency_testkit::{Harness, TimeControl};

#[derive(Debug)]
struct SingleHarness;

#[async_trait::async_trait]
impl Harness for SingleHarness {
    type Store = RedisStore;

    async fn store(&self) -> RedisStore {
        common::single().await
    }

    fn time(&self) -> TimeControl {
        TimeControl::real()
    }

    fn expires_by_itself(&self) -> bool {
        true
    }

    /// A store whose connections the linearizability check kills with `CLIENT KILL USER`.
    async fn store_with_cuts(&self) -> Option<(RedisStore, Box<dyn Cutter>)> {
        let (killer, urls) = common::KillUser::create("idem-linearizability", &[common::redis_url()]).await;
        let store = RedisStore::connect(&urls[0])
            .await
            .unwrap()
            .prefix(&common::unique_prefix())
            .unwrap();
        Some((store, Box::new(killer)))
    }
}

idempotency_testkit::conformance_suite!(SingleHarness);

/// The same suite on a three-master Redis Cluster: records land in every slot range.
mod cluster {
    use super::*;

    #[derive(Debug)]
    struct ClusterHarness;

    #[async_trait::async_trait]
    impl Harness for ClusterHarness {
        type Store = RedisStore;

        async fn store(&self) -> RedisStore {
            common::cluster().await
        }

        fn time(&self) -> TimeControl {
            TimeControl::real()
        }

        fn expires_by_itself(&self) -> bool {
            true
        }

        /// A store whose connections to every node the linearizability check kills with
        /// `CLIENT KILL USER`.
        async fn store_with_cuts(&self) -> Option<(RedisStore, Box<dyn Cutter>)> {
            let (killer, urls) =
                common::KillUser::create("idem-linearizability-cluster", &common::cluster_urls()).await;
            let store = RedisStore::connect_cluster(&urls)
                .await
                .unwrap()
                .prefix(&common::unique_prefix())
                .unwrap();
            Some((store, Box::new(killer)))
        }
    }

    idempotency_testkit::conformance_suite!(ClusterHarness);
}

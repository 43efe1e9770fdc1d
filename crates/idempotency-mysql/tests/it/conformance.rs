//! The MySQL store passes the conformance suite and the model-based property test against the
//! real server (MariaDB by default; its own clock: real time, short leases).

use crate::common;

use idempotency_mysql::MysqlStore;
use idempotency_testkit::linearizability::Cutter;
use idempotency_testkit::{Harness, TimeControl};

#[derive(Debug)]
struct MysqlHarness;

#[async_trait::async_trait]
impl Harness for MysqlHarness {
    type Store = MysqlStore;

    async fn store(&self) -> MysqlStore {
        common::fresh_store().await
    }

    fn time(&self) -> TimeControl {
        TimeControl::real()
    }

    /// A store on a fresh table that reaches the server through the test kit's proxy, which
    /// the linearizability check cuts.
    async fn store_with_cuts(&self) -> Option<(MysqlStore, Box<dyn Cutter>)> {
        let store = common::fresh_store().await;
        let proxy = common::start_proxy().await;
        let proxied = common::proxied(&store, &proxy, 16).await;
        Some((proxied, Box::new(proxy)))
    }
}

idempotency_testkit::conformance_suite!(MysqlHarness);

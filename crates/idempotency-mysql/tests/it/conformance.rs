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

/// The store behind a group commit that sends one call or batch of each kind at a time, as
/// `?batch=on&batch_in_flight=1` opens it: concurrent `begin`s and `complete`s queue and go
/// to the server in batches (`begin_many`, `complete_many`), and every case, the model
/// comparison and the linearizability check with connection cuts hold on that path.
mod group_commit {
    use super::*;
    idempotency_testkit::conformance_suite!(idempotency_testkit::Grouped::one_at_a_time(MysqlHarness));

    /// `?batch=on` in a store URL (the gateway's `--store`) opens the store behind a group
    /// commit with the URL's settings, and the driver never sees the parameters.
    #[tokio::test]
    async fn a_url_with_batch_on_opens_the_store_behind_a_group_commit() {
        use idempotency_core::{
            Access, BeginRequest, Claim, Fenced, Fingerprint, Key, Outcome, Scope, Token,
        };

        let base = common::database_url();
        let joiner = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{joiner}batch=on&batch_max=8&batch_linger=2ms");
        let store = (idempotency_mysql::KIND.open)(url, Access::Create)
            .await
            .unwrap_or_else(|e| panic!("the server at {base} is needed for this test: {e}"));
        let shown = format!("{store:?}");
        assert!(shown.starts_with("GroupCommit"), "{shown}");
        assert!(
            shown.contains("max_batch: 8") && shown.contains("linger: 2ms"),
            "{shown}"
        );
        let key = Key::new(format!("batch-url-{:032x}", Token::random().as_u128())).expect("a valid key");
        let request = BeginRequest::new(Scope::global(), key, Fingerprint::of_bytes(b"payload"));
        let Claim::Acquired(held) = store.begin(&request).await.expect("begins") else {
            panic!("a fresh key is acquired");
        };
        let done = store
            .complete(
                &held,
                Outcome::new(&b"done"[..]),
                std::time::Duration::from_secs(60),
            )
            .await
            .expect("completes");
        assert!(matches!(done, Fenced::Accepted(_)), "{done:?}");
    }
}

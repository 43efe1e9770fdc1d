//! The PostgreSQL store passes the conformance suite and the model-based property test against
//! the real server (its own clock: real time, short leases).

use crate::common;

use idempotency_postgres::PostgresStore;
use idempotency_testkit::linearizability::Cutter;
use idempotency_testkit::{Harness, TimeControl};

#[derive(Debug)]
struct PostgresHarness;

#[async_trait::async_trait]
impl Harness for PostgresHarness {
    type Store = PostgresStore;

    async fn store(&self) -> PostgresStore {
        common::fresh_store().await
    }

    fn time(&self) -> TimeControl {
        TimeControl::real()
    }

    /// A store on a fresh table that reaches the server through the test kit's proxy, which
    /// the linearizability check cuts.
    async fn store_with_cuts(&self) -> Option<(PostgresStore, Box<dyn Cutter>)> {
        let store = common::fresh_store().await;
        let proxy = common::start_proxy().await;
        let proxied = common::proxied(&store, &proxy, 16).await;
        Some((proxied, Box::new(proxy)))
    }
}

idempotency_testkit::conformance_suite!(PostgresHarness);

/// The store behind a group commit that sends one call or batch of each kind at a time, as
/// `?batch=on&batch_in_flight=1` opens it: concurrent `begin`s and `complete`s queue and go
/// to the server in batches (`begin_many`, `complete_many`), and every case, the model
/// comparison and the linearizability check with connection cuts hold on that path.
mod group_commit {
    use super::*;
    use idempotency_core::{GroupCommit, GroupSettings};

    fn grouped(store: PostgresStore) -> GroupCommit<PostgresStore> {
        GroupCommit::with_settings(store, GroupSettings::default().in_flight(1))
    }

    idempotency_testkit::conformance_suite!(idempotency_testkit::Grouped::one_at_a_time(PostgresHarness));

    /// 64 concurrent new keys on one connection: the single calls would claim them in two
    /// round trips each (128); behind the group commit one goes alone and the others, queued
    /// meanwhile, ride in batches of one round trip. Counted at the proxy, which no timing
    /// changes; the bound is half the single calls' count.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_new_keys_are_claimed_in_batches() {
        use std::sync::Arc;

        use idempotency_core::{BeginRequest, Claim, Fingerprint, Key, Scope, Store};

        const KEYS: usize = 64;
        let store = common::fresh_store().await;
        let proxy = common::start_proxy().await;
        let through = grouped(common::proxied(&store, &proxy, 2).await);
        let request = |round: &str, i: usize| {
            let key = Key::new(format!("{round}-{i}")).expect("a valid key");
            BeginRequest::new(Scope::global(), key, Fingerprint::of_bytes(b"same"))
        };
        // Prepares the statements, so that the count below is what every claim costs.
        assert!(matches!(
            through.begin(&request("warm", 0)).await,
            Ok(Claim::Acquired(_))
        ));
        let start = Arc::new(tokio::sync::Barrier::new(KEYS));
        let before = proxy.round_trips();
        let calls: Vec<_> = (0..KEYS)
            .map(|i| {
                let (through, start, request) = (through.clone(), Arc::clone(&start), request("measured", i));
                tokio::spawn(async move {
                    start.wait().await;
                    through.begin(&request).await
                })
            })
            .collect();
        for call in calls {
            let claim = call.await.expect("ends").expect("begins");
            assert!(matches!(claim, Claim::Acquired(_)), "{claim:?}");
        }
        let round_trips = proxy.round_trips() - before;
        assert!(
            round_trips < KEYS as u64,
            "{KEYS} concurrent new keys took {round_trips} round trips (the single calls take {})",
            2 * KEYS
        );
    }

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
        let store = (idempotency_postgres::KIND.open)(url, Access::Create)
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

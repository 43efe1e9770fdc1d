//! A statement through the store costs the server what the statement alone costs: the store's
//! connections go back to its pool without a ping. (sqlx's pool pinged every connection it took
//! back, a second round trip and a second wakeup of the server for each statement: a replay
//! cost twice its read.) Counted in bytes on the wire, which no timing changes.

use crate::common;

use std::time::Duration;

use idempotency_core::{BeginRequest, Claim, Completion, Fenced, Fingerprint, Key, Outcome, Scope, Store};
use idempotency_postgres::Operation;
use idempotency_postgres::PostgresStore;
use idempotency_postgres::sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
use idempotency_postgres::sqlx::{self, AssertSqlSafe, Connection};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_sends_the_server_exactly_what_its_read_alone_sends() {
    let store = common::fresh_store().await;
    let scope = Scope::new("wire").unwrap();
    let key = Key::new("paid").unwrap();
    let request = BeginRequest::new(scope.clone(), key.clone(), Fingerprint::of_bytes(b"a"));
    idempotency_testkit::completed(&store, &request, "charged").await;

    let proxy = common::start_proxy().await;
    // One connection: with a ping on release, each begin would wait for the previous one's.
    let through = common::proxied(&store, &proxy, 1).await;
    // The same read on a bare connection through the same proxy: no pool at all.
    let options: PgConnectOptions = common::database_url().parse().unwrap();
    let mut bare = PgConnection::connect_with(&options.host("127.0.0.1").port(proxy.addr().port()))
        .await
        .unwrap();
    let peek = store.sql(Operation::Peek);
    idempotency_testkit::a_replay_costs_its_read(&through, &request, &proxy, async || {
        let found = sqlx::query(AssertSqlSafe(peek.to_owned()))
            .bind(scope.as_str())
            .bind(key.as_str())
            .fetch_optional(&mut bare)
            .await
            .unwrap();
        assert!(found.is_some(), "the bare read found the record");
    })
    .await;
}

/// A batch of new keys is claimed in one round trip and completed in one more, however many
/// keys it holds (the single calls take two round trips per key to claim, one to complete);
/// replaying the batch is one round trip too. Counted at the proxy, which no timing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_claimed_in_one_round_trip_and_completed_in_one() {
    const KEYS: usize = 64;
    let store = common::fresh_store().await;
    let proxy = common::start_proxy().await;
    let through = common::proxied(&store, &proxy, 1).await;
    let scope = Scope::new("batch").unwrap();
    let batch = |round: &str| -> Vec<BeginRequest> {
        (0..KEYS)
            .map(|i| {
                let key = Key::new(format!("{round}-{i}")).unwrap();
                BeginRequest::new(scope.clone(), key, Fingerprint::of_bytes(b"same"))
            })
            .collect()
    };
    // The first batch prepares the statements; the second is what every batch costs.
    claim_and_complete(&through, &batch("warm")).await;
    let requests = batch("measured");

    let before = proxy.round_trips();
    let claims = through.begin_many(&requests).await;
    let claimed = proxy.round_trips() - before;
    let completions = completions(claims);
    let before = proxy.round_trips();
    for done in through.complete_many(&completions).await {
        assert!(matches!(done.unwrap(), Fenced::Accepted(_)));
    }
    let completed = proxy.round_trips() - before;
    let before = proxy.round_trips();
    for claim in through.begin_many(&requests).await {
        assert!(matches!(claim.unwrap(), Claim::Replay(_)));
    }
    let replayed = proxy.round_trips() - before;

    assert_eq!(
        (claimed, completed, replayed),
        (1, 1, 1),
        "{KEYS} keys: claimed in {claimed} round trips, completed in {completed}, replayed in {replayed}"
    );
}

/// The completions of a batch of claims of new keys.
fn completions(claims: Vec<Result<Claim, idempotency_core::StoreError>>) -> Vec<Completion> {
    claims
        .into_iter()
        .map(|claim| match claim.unwrap() {
            Claim::Acquired(held) => Completion::new(held, Outcome::new("done"), Duration::from_secs(60)),
            other => panic!("a new key was not acquired: {other:?}"),
        })
        .collect()
}

async fn claim_and_complete(store: &PostgresStore, requests: &[BeginRequest]) {
    let completions = completions(store.begin_many(requests).await);
    for done in store.complete_many(&completions).await {
        assert!(matches!(done.unwrap(), Fenced::Accepted(_)));
    }
}

/// A connection whose statement was abandoned mid-way (the caller's future dropped) is closed,
/// not handed to the next caller with an answer still on its way; the next caller gets a new
/// connection and the right answer. So is one whose statement failed. The metrics say so.
#[test]
fn a_connection_left_mid_statement_or_failed_is_replaced_not_reused() {
    idempotency_testkit::replaced_when_abandoned_or_failed("postgres", async || {
        let store = common::fresh_store().await;
        let proxy = common::start_proxy().await;
        let through = common::proxied_waiting(&store, &proxy, 1, Duration::from_secs(30)).await;
        (through, proxy)
    });
}

/// A connection older than the pool's `max_lifetime` is closed when the next operation would
/// take it, and that operation opens a new one, as sqlx's own pool does: an application that
/// shortens the lifetime of its pool's connections (to follow a failover, say) gets it for the
/// store's too.
#[test]
fn a_connection_past_the_pools_lifetime_is_replaced() {
    idempotency_testkit::replaced_past_lifetime("postgres", async |lifetime| {
        let store = common::fresh_store().await;
        let proxy = common::start_proxy().await;
        let options = common::proxied_options(&store, &proxy);
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .max_lifetime(lifetime)
            .connect_lazy_with(options.connect.clone());
        (PostgresStore::from_pool(pool, &options), proxy)
    });
}

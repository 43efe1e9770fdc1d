//! With `?batch=on`, concurrent `begin`s and `complete`s on a single server share script calls,
//! and every key in a batch gets the answer it would have got alone: a foreign value at one key fails that key only,
//! two `begin`s of one key in one batch give one acquisition.

use crate::common;

use std::time::Duration;

use futures_util::future::join_all;
use idempotency_core::{BeginRequest, Claim, ErrorKind, Fingerprint, Key, Outcome, Scope, Store};
use idempotency_testkit::recorded::record_metrics;

/// A store on the single server with `query` in its URL.
async fn connect(query: &str) -> idempotency_redis::RedisStore {
    let url = format!("{}?{query}", common::redis_url());
    idempotency_redis::RedisStore::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("Redis at {url} is needed for this test: {e}"))
        .prefix(&common::unique_prefix())
        .unwrap()
}

fn request(key: &Key) -> BeginRequest {
    BeginRequest::new(Scope::global(), key.clone(), Fingerprint::of_bytes(b"charge"))
        .lease(Duration::from_secs(60))
        .retention(Duration::from_secs(60))
}

// One thread (the recorder's runtime): every call below is queued before the dispatcher first
// runs, so they ride in batches whatever the machine's speed. The metrics go to a recorder of
// this test's own: the other test's batches never count here, whatever runs at the same time.
#[test]
fn concurrent_calls_share_batches_and_each_key_gets_its_own_answer() {
    let recorded = record_metrics(concurrent_calls_share_batches());
    for op in ["begin", "complete"] {
        let largest = recorded
            .histogram_max("idempotency_redis_batch_size", &[("op", op)])
            .unwrap_or(0.0);
        assert!(
            largest >= 16.0,
            "the {op}s did not share script calls: largest batch {largest}"
        );
    }
}

async fn concurrent_calls_share_batches() {
    let store = connect("batch=on").await;
    let raw = redis::Client::open(common::redis_url()).unwrap();
    let mut connection = raw.get_multiplexed_async_connection().await.unwrap();

    let keys: Vec<Key> = (0..64)
        .map(|i| Key::new(format!("batched-{i}")).unwrap())
        .collect();
    // Something else lives at one record's key.
    let foreign = store.record_key(&Scope::global(), &keys[17]);
    common::plant_foreign(&mut connection, &foreign).await;

    // Every key once, and key 5 a second time in the same burst.
    let mut requests: Vec<BeginRequest> = keys.iter().map(request).collect();
    requests.push(request(&keys[5]));
    let claims = join_all(requests.iter().map(|r| store.begin(r))).await;

    let mut held = Vec::new();
    let mut in_flight = 0;
    for (i, claim) in claims.into_iter().enumerate() {
        match (i, claim) {
            (17, Err(error)) => {
                assert_eq!(error.kind(), ErrorKind::Protocol, "{error}");
                assert!(error.to_string().contains("WRONGTYPE"), "{error}");
            }
            (17, other) => panic!("the foreign key was not refused: {other:?}"),
            (_, Ok(Claim::Acquired(h))) => held.push(h),
            (_, Ok(Claim::InFlight { .. })) => in_flight += 1,
            (i, other) => panic!("begin {i}: {other:?}"),
        }
    }
    assert_eq!(held.len(), 63, "every other key acquired once");
    assert_eq!(in_flight, 1, "the second begin of one key found it in flight");
    common::assert_foreign_kept(&mut connection, &foreign).await;

    let completions = join_all(held.iter().map(|h| {
        store.complete(
            h,
            Outcome::new(format!("done {}", h.key)),
            Duration::from_secs(60),
        )
    }))
    .await;
    for completion in completions {
        assert!(!completion.unwrap().is_lease_lost(), "a completion was refused");
    }
    for h in &held {
        match store.begin(&request(&h.key)).await.unwrap() {
            Claim::Replay(done) => assert_eq!(done.outcome.as_bytes(), format!("done {}", h.key).as_bytes()),
            other => panic!("{}: {other:?}", h.key),
        }
    }
    let _: () = redis::cmd("DEL")
        .arg(&foreign)
        .query_async(&mut connection)
        .await
        .unwrap();
}

#[test]
fn by_default_and_with_batch_off_every_call_is_its_own_script() {
    let recorded = record_metrics(every_call_alone());
    for op in ["begin", "complete"] {
        assert_eq!(
            recorded.histogram_max("idempotency_redis_batch_size", &[("op", op)]),
            None,
            "{op}s went through the batcher"
        );
    }
}

async fn every_call_alone() {
    for store in [common::single().await, connect("batch=off").await] {
        let keys: Vec<Key> = (0..64).map(|i| Key::new(format!("alone-{i}")).unwrap()).collect();
        let requests: Vec<BeginRequest> = keys.iter().map(request).collect();
        let claims = join_all(requests.iter().map(|r| store.begin(r))).await;
        let held: Vec<_> = claims
            .into_iter()
            .map(|claim| match claim.unwrap() {
                Claim::Acquired(held) => held,
                other => panic!("{other:?}"),
            })
            .collect();
        let completions = join_all(
            held.iter()
                .map(|h| store.complete(h, Outcome::empty(), Duration::from_secs(60))),
        )
        .await;
        for completion in completions {
            assert!(!completion.unwrap().is_lease_lost());
        }
    }
}

//! Outcomes too large for one item are split into chunk items: a listing reports their size
//! without reading them, a purge deletes them with their record, and a missing chunk is reported
//! as damage, never replayed as a shorter outcome.

use crate::common;

use std::time::Duration;

use idempotency_core::{
    BeginRequest, Claim, ErrorKind, Fingerprint, Key, ListFilter, ManualClock, Outcome, Scope, Store,
    StoreAdmin, SummaryState,
};
use idempotency_dynamodb::DynamoDbStore;

/// 700 KB: three chunk items of at most 300 KB.
const SIZE: usize = 700 * 1024;

fn table(name: &str) -> String {
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("large-{name}-{run}")
}

/// Completes `key` with a `SIZE`-byte outcome kept for `retention`.
async fn complete_large(store: &DynamoDbStore, key: &str, retention: Duration) -> Vec<u8> {
    let request = BeginRequest::new(
        Scope::new("large").unwrap(),
        Key::new(key).unwrap(),
        Fingerprint::of_bytes(key.as_bytes()),
    );
    let Claim::Acquired(held) = store.begin(&request).await.unwrap() else {
        panic!("{key} acquires")
    };
    let body: Vec<u8> = (0..=250u8).cycle().take(SIZE).collect();
    let done = store
        .complete(&held, Outcome::new(body.clone()), retention)
        .await
        .unwrap();
    assert!(!done.is_lease_lost());
    body
}

/// Every item of the table, chunk items included.
async fn items(store: &DynamoDbStore) -> usize {
    let scanned = store
        .client()
        .scan()
        .table_name(store.table())
        .consistent_read(true)
        .send()
        .await
        .unwrap();
    scanned.items().len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_sizes_chunked_outcomes_and_a_purge_deletes_their_chunks() {
    let clock = ManualClock::new();
    let store = common::store(&table("purge"), &clock, Duration::ZERO).await;
    complete_large(&store, "report-1", Duration::from_secs(60)).await;
    assert_eq!(items(&store).await, 4, "the record and its three chunks");

    let listed = store.list(&ListFilter::default()).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert!(
        matches!(
            listed[0].state,
            SummaryState::Completed {
                outcome_len: SIZE,
                ..
            }
        ),
        "{:?}",
        listed[0].state
    );
    assert_eq!(store.stats(None).await.unwrap().completed, 1);

    clock.advance(Duration::from_secs(61));
    assert_eq!(store.purge_expired(100).await.unwrap(), 1);
    assert_eq!(items(&store).await, 0, "chunk items were left behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_chunk_is_damage_not_a_shorter_outcome() {
    let clock = ManualClock::new();
    let store = common::store(&table("damaged"), &clock, Duration::ZERO).await;
    let body = complete_large(&store, "report-2", Duration::from_secs(60)).await;
    let (scope, key) = (Scope::new("large").unwrap(), Key::new("report-2").unwrap());
    let record = store.get(&scope, &key).await.unwrap().unwrap();
    assert!(matches!(
        record.state,
        idempotency_core::RecordState::Completed { ref outcome, .. } if outcome.as_bytes() == body.as_slice()
    ));

    let chunk = format!("{} outcome 1", Key::qualified(&scope, &key).as_str());
    store
        .client()
        .delete_item()
        .table_name(store.table())
        .key("pk", aws_sdk_dynamodb::types::AttributeValue::S(chunk))
        .send()
        .await
        .unwrap();
    let error = store.get(&scope, &key).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Corrupt, "{error}");
    assert!(error.to_string().contains("outcome chunk 1"), "{error}");
    let request = BeginRequest::new(scope, key, Fingerprint::of_bytes(b"report-2"));
    let error = store.begin(&request).await.unwrap_err();
    assert_eq!(
        error.kind(),
        ErrorKind::Corrupt,
        "a replay of a damaged outcome: {error}"
    );
}

//! Races beyond the conformance suite's: 64 callers on one key split across two connection
//! pools (two application instances), on new keys and on expired leases, a hundred rounds
//! each; every round exactly one caller acquires.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{BeginRequest, Claim, Fingerprint, Key, Scope, Store, Token};
use idempotency_mysql::MysqlStore;

const ROUNDS: usize = 100;
const RACERS: usize = 64;

/// Runs `RACERS` begins on `key` at once, alternating between the two stores; how many acquired.
async fn race(stores: &[MysqlStore; 2], key: &Key, lease: Duration) -> usize {
    let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
    let racers: Vec<_> = (0..RACERS)
        .map(|i| {
            let store = stores[i % 2].clone();
            let barrier = Arc::clone(&barrier);
            let request = BeginRequest::new(
                Scope::new("race").unwrap(),
                key.clone(),
                Fingerprint::of_bytes(b"p"),
            )
            .token(Token::random())
            .lease(lease);
            tokio::spawn(async move {
                barrier.wait().await;
                store.begin(&request).await
            })
        })
        .collect();
    let mut acquired = 0;
    for racer in racers {
        match racer.await.unwrap().expect("no racer may fail") {
            Claim::Acquired(_) => acquired += 1,
            Claim::InFlight { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    acquired
}

async fn two_pools() -> [MysqlStore; 2] {
    let first = common::fresh_store().await;
    let second = common::store_on(first.table(), 16).await;
    [first, second]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_begins_across_two_pools_acquire_once() {
    let stores = two_pools().await;
    for round in 0..ROUNDS {
        let key = Key::new(format!("new-{round}")).unwrap();
        let acquired = race(&stores, &key, Duration::from_secs(60)).await;
        assert_eq!(
            acquired, 1,
            "round {round}: {acquired} callers acquired a new key"
        );
    }
    eprintln!(
        "deadlock victims run again: {} + {}",
        stores[0].deadlock_retries(),
        stores[1].deadlock_retries()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_takeovers_across_two_pools_take_over_once() {
    let stores = two_pools().await;
    for round in 0..ROUNDS {
        let key = Key::new(format!("expired-{round}")).unwrap();
        // A first holder whose lease runs out at once.
        let first = BeginRequest::new(
            Scope::new("race").unwrap(),
            key.clone(),
            Fingerprint::of_bytes(b"p"),
        )
        .lease(Duration::from_millis(1));
        assert!(matches!(
            stores[round % 2].begin(&first).await.unwrap(),
            Claim::Acquired(_)
        ));
        tokio::time::sleep(Duration::from_millis(5)).await;
        let acquired = race(&stores, &key, Duration::from_secs(60)).await;
        assert_eq!(
            acquired, 1,
            "round {round}: {acquired} callers took the expired lease over"
        );
    }
    eprintln!(
        "deadlock victims run again: {} + {}",
        stores[0].deadlock_retries(),
        stores[1].deadlock_retries()
    );
}

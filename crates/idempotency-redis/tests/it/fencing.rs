//! The classic Redis recipe bug, tested on a single server and on a cluster: a worker stalls
//! past its lease, a second worker takes the key over and completes, and then the first wakes up
//! and tries to store its result and to clean up. With an unconditional final `SET` (or `DEL`) it
//! would overwrite (or delete) the newer attempt's record; with fencing tokens it cannot.

use crate::common;

use std::time::Duration;

use idempotency_core::{
    BeginRequest, Claim, Decision, Execution, Fenced, Fingerprint, Guard, Held, Key, Outcome, RecordState,
    Recorded, Scope, Store,
};
use idempotency_redis::RedisStore;

async fn stale_worker_cannot_overwrite_or_delete(store: RedisStore) {
    let scope = Scope::new("payments").unwrap();
    let key = Key::generate();
    let request = BeginRequest::new(scope.clone(), key.clone(), Fingerprint::of_bytes(b"EUR 10"))
        .lease(Duration::from_millis(300))
        .retention(Duration::from_secs(600));

    // Worker A acquires, then stalls past its lease (a GC pause, a slow gateway).
    let Claim::Acquired(Held { token: stale, .. }) = store.begin(&request).await.unwrap() else {
        panic!("A acquires")
    };
    tokio::time::sleep(Duration::from_millis(450)).await;

    // Worker B takes over through the guard and completes.
    let guard = Guard::new(store.clone()).lease(Duration::from_secs(30));
    let newer = guard
        .run(
            scope.clone(),
            key.clone(),
            Fingerprint::of_bytes(b"EUR 10"),
            |v: &&'static str| Decision::Complete(Outcome::new(*v)),
            |attempt| async move {
                assert!(attempt.recovered(), "B must be told A may have partially run");
                "charged by B"
            },
        )
        .await
        .unwrap();
    assert!(
        matches!(
            newer,
            Execution::Executed {
                attempt: 2,
                recorded: Recorded::Completed { .. },
                ..
            }
        ),
        "{newer:?}"
    );

    // A wakes up: storing its result, extending and cleaning up are all refused.
    let late = store
        .complete(
            &idempotency_testkit::held(&scope, &key, stale),
            Outcome::new("charged by A"),
            Duration::from_secs(600),
        )
        .await
        .unwrap();
    assert_eq!(
        late,
        Fenced::LeaseLost,
        "the stale worker overwrote the newer result"
    );
    assert_eq!(
        store
            .extend(
                &idempotency_testkit::held(&scope, &key, stale),
                Duration::from_secs(30)
            )
            .await
            .unwrap(),
        Fenced::LeaseLost
    );
    assert_eq!(
        store
            .release(&idempotency_testkit::held(&scope, &key, stale))
            .await
            .unwrap(),
        Fenced::LeaseLost,
        "the stale worker deleted the record"
    );

    let record = store
        .get(&scope, &key)
        .await
        .unwrap()
        .expect("the newer record must survive");
    assert_eq!(record.attempt, 2);
    let RecordState::Completed { outcome, .. } = record.state else {
        panic!("completed")
    };
    assert_eq!(outcome.as_bytes(), b"charged by B");
    let Claim::Replay(done) = store
        .begin(&request.clone().token(idempotency_core::Token::random()))
        .await
        .unwrap()
    else {
        panic!("replay")
    };
    assert_eq!(done.outcome.as_bytes(), b"charged by B");
}

#[tokio::test]
async fn a_stale_worker_cannot_overwrite_or_delete_on_a_single_server() {
    stale_worker_cannot_overwrite_or_delete(common::single().await).await;
}

#[tokio::test]
async fn a_stale_worker_cannot_overwrite_or_delete_on_a_cluster() {
    stale_worker_cannot_overwrite_or_delete(common::cluster().await).await;
}

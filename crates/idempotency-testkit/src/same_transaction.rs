//! Same-transaction mode against a real server, for every [`TransactionalStore`] (PostgreSQL's
//! and MySQL's): the record and the business rows commit together or not at all. A store crate
//! implements [`Business`] (its business table, in its SQL) and expands
//! [`same_transaction_suite!`](crate::same_transaction_suite).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Attempt, BeginRequest, Claim, Decision, ErrorKind, Execution, Fingerprint, Guard, Held, Key, Outcome,
    Recorded, Scope, StoreError, Token, TransactionalStore, TxFuture,
};

pub use crate::outage::BoxError;

/// A store's business table, in its SQL: a charge per row, with an id the database assigns.
pub trait Business<S: TransactionalStore>: Clone + Send + Sync + 'static {
    /// Creates a business table of the test's own next to the records table; its name.
    fn create_table(&self, store: &S) -> impl Future<Output = Arc<str>> + Send;

    /// Inserts a row of `cents` for `key` into `table` through `tx`; its id.
    fn insert<'t>(
        &self,
        tx: &'t mut S::Transaction,
        table: Arc<str>,
        key: Key,
        cents: i32,
    ) -> TxFuture<'t, Result<i64, BoxError>>;

    /// How many rows `table` has for `key`, read outside any transaction.
    fn rows(&self, store: &S, table: &str, key: &Key) -> impl Future<Output = i64> + Send;

    /// Kills `tx`'s connection from another session (`pg_terminate_backend`, `KILL`).
    fn kill<'t>(&self, tx: &'t mut S::Transaction) -> TxFuture<'t, Result<(), BoxError>>;
}

fn request(key: &Key) -> BeginRequest {
    BeginRequest::new(
        Scope::new("payments").expect("a valid scope"),
        key.clone(),
        Fingerprint::of_bytes(b"EUR 10"),
    )
}

/// Why a same-transaction run wrote nothing.
enum TxError {
    /// The database failed: nothing committed (or the commit's fate is unknown).
    Store(StoreError),
    /// The operation failed; everything was rolled back.
    Operation(BoxError),
}

impl fmt::Debug for TxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Store(error) => write!(f, "store: {error}"),
            Self::Operation(error) => write!(f, "operation: {error}"),
        }
    }
}

/// Runs `operation` through the guard in same-transaction mode with `fingerprint`: a row id
/// is completed with the id as the outcome, an error rolls back. The answer is the guard's, with
/// the two ways of writing nothing as errors.
async fn guarded<S, F>(
    store: &S,
    key: &Key,
    fingerprint: &[u8],
    operation: F,
) -> Result<Execution<i64>, TxError>
where
    S: TransactionalStore + Clone,
    F: for<'t> FnOnce(&'t mut S::Transaction, Attempt) -> TxFuture<'t, Result<i64, BoxError>>
        + Send
        + 'static,
{
    let policy = |row: &Result<i64, BoxError>| match row {
        Ok(id) => Decision::Complete(Outcome::new(id.to_string())),
        Err(_) => Decision::Release,
    };
    let request = request(key);
    let run = Guard::new(store.clone())
        .run_in_transaction(
            request.scope,
            request.key,
            Fingerprint::of_bytes(fingerprint),
            policy,
            operation,
        )
        .await
        .map_err(TxError::Store)?;
    Ok(match run {
        Execution::Executed {
            value,
            attempt,
            recovered,
            recorded,
        } => match (value, recorded) {
            (Err(error), _) => return Err(TxError::Operation(error)),
            (Ok(_), Recorded::Failed(error)) => return Err(TxError::Store(error)),
            (Ok(id), recorded) => Execution::Executed {
                value: id,
                attempt,
                recovered,
                recorded,
            },
        },
        Execution::Replayed(done) => Execution::Replayed(done),
        Execution::InFlight { attempt, retry_after } => Execution::InFlight { attempt, retry_after },
        Execution::Mismatch => Execution::Mismatch,
    })
}

/// The operation most cases run: insert one charge row (after `hold`), store its id as the
/// outcome.
async fn charge<S, B>(
    store: &S,
    business: &B,
    table: &Arc<str>,
    key: &Key,
    hold: Duration,
) -> Result<Execution<i64>, TxError>
where
    S: TransactionalStore + Clone,
    B: Business<S>,
{
    let (business, table) = (business.clone(), Arc::clone(table));
    guarded(store, key, b"EUR 10", move |tx, attempt| {
        Box::pin(async move {
            let id = business.insert(tx, table, attempt.key().clone(), 1000).await?;
            tokio::time::sleep(hold).await;
            Ok(id)
        })
    })
    .await
}

fn outcome_of(run: &Execution<i64>) -> String {
    match run {
        Execution::Executed { value, .. } => value.to_string(),
        Execution::Replayed(done) => String::from_utf8(done.outcome.as_bytes().to_vec()).expect("text"),
        other => panic!("unexpected {other:?}"),
    }
}

/// After a run that wrote nothing: no business row and no record for `key`, and a retry runs
/// as attempt 1 and writes its row.
async fn nothing_left_then_the_retry_runs<S, B>(store: &S, business: &B, table: &Arc<str>, key: &Key)
where
    S: TransactionalStore + Clone,
    B: Business<S>,
{
    assert_eq!(
        business.rows(store, table, key).await,
        0,
        "the business row must not survive"
    );
    assert_eq!(
        store.get(&request(key).scope, key).await.unwrap(),
        None,
        "no record may remain"
    );
    let retried = charge(store, business, table, key, Duration::ZERO).await.unwrap();
    assert!(
        matches!(retried, Execution::Executed { attempt: 1, .. }),
        "{retried:?}"
    );
    assert_eq!(business.rows(store, table, key).await, 1);
}

/// 64 deliveries of one key at once, five rounds: one executes, all agree on the outcome, one
/// business row.
pub async fn concurrent_deliveries_write_the_business_row_once_and_agree<S, B>(store: S, business: B)
where
    S: TransactionalStore + Clone + Send + Sync + 'static,
    B: Business<S>,
{
    let table = business.create_table(&store).await;
    for round in 0..5 {
        let key = Key::generate();
        let barrier = Arc::new(tokio::sync::Barrier::new(64));
        let deliveries: Vec<_> = (0..64)
            .map(|_| {
                let (store, business, table, key, barrier) = (
                    store.clone(),
                    business.clone(),
                    Arc::clone(&table),
                    key.clone(),
                    Arc::clone(&barrier),
                );
                tokio::spawn(async move {
                    barrier.wait().await;
                    charge(&store, &business, &table, &key, Duration::from_millis(50)).await
                })
            })
            .collect();
        let mut executed = 0;
        let mut outcomes = Vec::new();
        for delivery in deliveries {
            let run = delivery.await.unwrap().expect("no delivery may fail");
            if matches!(run, Execution::Executed { .. }) {
                executed += 1;
            }
            outcomes.push(outcome_of(&run));
        }
        assert_eq!(executed, 1, "round {round}: {executed} deliveries executed");
        assert!(
            outcomes.iter().all(|o| o == &outcomes[0]),
            "round {round}: outcomes differ: {outcomes:?}"
        );
        assert_eq!(
            business.rows(&store, &table, &key).await,
            1,
            "round {round}: business rows"
        );
    }
}

/// An operation that fails after its write: neither the row nor a record remains, and the
/// retry runs as attempt 1.
pub async fn an_operation_error_leaves_neither_record_nor_row_and_the_retry_runs<S, B>(store: S, business: B)
where
    S: TransactionalStore + Clone + Send + Sync + 'static,
    B: Business<S>,
{
    let table = business.create_table(&store).await;
    let key = Key::generate();
    let failed = guarded(&store, &key, b"EUR 10", {
        let (business, table) = (business.clone(), Arc::clone(&table));
        move |tx, attempt| {
            Box::pin(async move {
                business.insert(tx, table, attempt.key().clone(), 1000).await?;
                Err::<i64, BoxError>("the card was declined".into())
            })
        }
    })
    .await;
    assert!(matches!(failed, Err(TxError::Operation(_))), "{failed:?}");
    nothing_left_then_the_retry_runs(&store, &business, &table, &key).await;
}

/// Another session kills the transaction's connection after the business write, before the
/// completion and the commit: a retryable `Unavailable` error, nothing remains, and the retry
/// succeeds as attempt 1.
pub async fn a_connection_killed_mid_transaction_leaves_nothing_and_the_retry_succeeds<S, B>(
    store: S,
    business: B,
) where
    S: TransactionalStore + Clone + Send + Sync + 'static,
    B: Business<S>,
{
    let table = business.create_table(&store).await;
    let key = Key::generate();
    let cut = guarded(&store, &key, b"EUR 10", {
        let (business, table) = (business.clone(), Arc::clone(&table));
        move |tx, attempt| {
            Box::pin(async move {
                let id = business.insert(tx, table, attempt.key().clone(), 1000).await?;
                business.kill(tx).await?;
                Ok(id)
            })
        }
    })
    .await;
    match cut {
        Err(TxError::Store(error)) => {
            assert!(
                error.is_retryable(),
                "a killed connection must be retryable: {error}"
            );
            assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
        }
        other => panic!("expected a store error, got {other:?}"),
    }
    nothing_left_then_the_retry_runs(&store, &business, &table, &key).await;
}

/// A transaction the caller opens and commits itself: the record is invisible until the
/// commit, then replays; a rollback leaves nothing, and the key is free.
pub async fn a_transaction_the_caller_holds_commits_the_record_with_its_rows<S, B>(store: S, business: B)
where
    S: TransactionalStore + Clone + Send + Sync + 'static,
    B: Business<S>,
{
    let table = business.create_table(&store).await;
    let key = Key::generate();
    let (mut tx, held) = claimed_with_a_row(&store, &business, &table, &key, &key).await;
    let scope = request(&key).scope;
    let done = store
        .complete_in(&mut tx, &held, &Outcome::new("ok"), Duration::from_secs(3600))
        .await
        .unwrap();
    assert!(!done.is_lease_lost());
    assert_eq!(
        store.get(&scope, &key).await.unwrap(),
        None,
        "invisible before the commit"
    );
    store.commit(tx).await.unwrap();
    let Claim::Replay(replayed) = store.begin(&request(&key).token(Token::random())).await.unwrap() else {
        panic!("replay after commit")
    };
    assert_eq!(replayed.outcome.as_bytes(), b"ok");
    assert_eq!(business.rows(&store, &table, &key).await, 1);

    // The caller rolls back: nothing remains, and the key is free.
    let other = Key::generate();
    let mut tx = store.begin_transaction().await.unwrap();
    assert!(matches!(
        store.begin_in(&mut tx, &request(&other)).await.unwrap(),
        Claim::Acquired(_)
    ));
    store.rollback(tx).await;
    assert_eq!(store.get(&scope, &other).await.unwrap(), None);
    assert!(matches!(
        store.begin(&request(&other)).await.unwrap(),
        Claim::Acquired(Held { attempt: 1, .. })
    ));
}

/// A new transaction in which `claimed` is acquired and a business row of 500 cents is written
/// for `row`.
async fn claimed_with_a_row<S, B>(
    store: &S,
    business: &B,
    table: &Arc<str>,
    claimed: &Key,
    row: &Key,
) -> (S::Transaction, Held)
where
    S: TransactionalStore,
    B: Business<S>,
{
    let mut tx = store.begin_transaction().await.unwrap();
    let Claim::Acquired(held) = store.begin_in(&mut tx, &request(claimed)).await.unwrap() else {
        panic!("acquire")
    };
    business
        .insert(&mut tx, Arc::clone(table), row.clone(), 500)
        .await
        .unwrap();
    (tx, held)
}

/// A first attempt's claim withdrawn inside a transaction (a batch's message whose operation
/// failed): the record is gone once the transaction commits, with the transaction's other rows
/// kept; the key is free for a new first attempt; withdrawing it again is a lost lease. A store
/// whose `withdraw_in` answered without removing the record would leave the key in flight.
pub async fn a_claim_withdrawn_in_a_transaction_frees_the_key_and_the_rest_commits<S, B>(
    store: S,
    business: B,
) where
    S: TransactionalStore + Clone + Send + Sync + 'static,
    B: Business<S>,
{
    let table = business.create_table(&store).await;
    let (withdrawn, kept) = (Key::generate(), Key::generate());
    let (mut tx, held) = claimed_with_a_row(&store, &business, &table, &withdrawn, &kept).await;
    let undone = store.withdraw_in(&mut tx, &held).await.unwrap();
    assert!(!undone.is_lease_lost(), "{undone:?}");
    let again = store.withdraw_in(&mut tx, &held).await.unwrap();
    assert!(again.is_lease_lost(), "withdrawn twice: {again:?}");
    store.commit(tx).await.unwrap();

    let scope = request(&withdrawn).scope;
    assert_eq!(store.get(&scope, &withdrawn).await.unwrap(), None);
    assert!(matches!(
        store.begin(&request(&withdrawn)).await.unwrap(),
        Claim::Acquired(Held { attempt: 1, .. })
    ));
    assert_eq!(business.rows(&store, &table, &kept).await, 1);
}

/// A key held outside any transaction: a same-transaction run answers in flight and writes
/// nothing; once completed elsewhere it replays that outcome; another payload is a mismatch.
pub async fn a_key_held_outside_a_transaction_is_respected<S, B>(store: S, business: B)
where
    S: TransactionalStore + Clone + Send + Sync + 'static,
    B: Business<S>,
{
    let table = business.create_table(&store).await;
    let key = Key::generate();
    let Claim::Acquired(holder) = store.begin(&request(&key)).await.unwrap() else {
        panic!("acquire")
    };
    let run = charge(&store, &business, &table, &key, Duration::ZERO)
        .await
        .unwrap();
    assert!(matches!(run, Execution::InFlight { attempt: 1, .. }), "{run:?}");
    assert_eq!(business.rows(&store, &table, &key).await, 0);
    let _ = store
        .complete(&holder, Outcome::new("elsewhere"), Duration::from_secs(60))
        .await
        .unwrap();
    let run = charge(&store, &business, &table, &key, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(outcome_of(&run), "elsewhere");
    let run = guarded(&store, &key, b"EUR 99", |_tx, _attempt| Box::pin(async { Ok(0) }))
        .await
        .unwrap();
    assert!(matches!(run, Execution::Mismatch), "{run:?}");
}

/// Expands to the same-transaction cases, one test each, on the store `$store` (an expression
/// evaluated in each test, awaited: `common::fresh_store()`) with the business table
/// `$business`.
#[macro_export]
macro_rules! same_transaction_suite {
    ($store:expr, $business:expr) => {
        $crate::same_transaction_suite!(@cases $store, $business;
            concurrent_deliveries_write_the_business_row_once_and_agree,
            an_operation_error_leaves_neither_record_nor_row_and_the_retry_runs,
            a_connection_killed_mid_transaction_leaves_nothing_and_the_retry_succeeds,
            a_transaction_the_caller_holds_commits_the_record_with_its_rows,
            a_claim_withdrawn_in_a_transaction_frees_the_key_and_the_rest_commits,
            a_key_held_outside_a_transaction_is_respected,
        );
    };
    (@cases $store:expr, $business:expr; $($case:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                $crate::same_transaction::$case($store.await, $business).await;
            }
        )*
    };
}

//! The server is killed in the middle of a run and started again: the store answers with
//! retryable errors while it is away, never with a wrong claim, and once it is back no
//! operation whose completion was recorded runs again.
//!
//! moto keeps its tables in memory, so a restarted moto would come back empty, which DynamoDB
//! never does. This test runs a moto of its own with `scripts/moto-server.py --durable`, which
//! records every request before applying it and replays the recording on start: SIGKILL cuts
//! the requests in flight (applied or not), and the restarted server has every write it
//! applied, as a DynamoDB node coming back would.

use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_core::{
    BeginRequest, Claim, Fenced, Fingerprint, Key, Outcome, RecordState, Scope, Store, StoreError,
};
use idempotency_dynamodb::{DynamoDbOptions, DynamoDbStore};

const KEYS: usize = 120;
const WORKERS: usize = 8;
const LEASE: Duration = Duration::from_secs(2);

/// What the run saw, per key and in all.
#[derive(Default)]
struct Ledger {
    /// Side effects performed, per key.
    effects: HashMap<String, u32>,
    /// Completions whose answer was an error (the write may or may not have been applied).
    lost_completions: HashMap<String, u32>,
    /// Errors seen, by kind; every one must be retryable.
    errors: Vec<StoreError>,
}

fn request(key: &str) -> BeginRequest {
    BeginRequest::new(
        Scope::new("outage").unwrap(),
        Key::new(key).unwrap(),
        Fingerprint::of_bytes(key.as_bytes()),
    )
    .lease(LEASE)
}

/// Runs `key` to completion the way a consumer would: retry on errors and in-flight answers,
/// perform the effect when acquired, stop at a replay.
async fn run_key(store: &DynamoDbStore, key: &str, ledger: &Mutex<Ledger>) {
    loop {
        match store.begin(&request(key)).await {
            Err(error) => {
                ledger.lock().unwrap().errors.push(error);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(Claim::InFlight { .. }) => tokio::time::sleep(Duration::from_millis(100)).await,
            Ok(Claim::Replay(_)) => return,
            Ok(Claim::Mismatch) => panic!("{key}: mismatch on its own fingerprint"),
            Ok(Claim::Acquired(held)) => {
                *ledger.lock().unwrap().effects.entry(key.to_owned()).or_default() += 1;
                let outcome = Outcome::new(format!("done {key}"));
                match store.complete(&held, outcome, Duration::from_secs(3600)).await {
                    Ok(Fenced::Accepted(_)) => return,
                    // Applied by an earlier try whose answer was lost, or taken over: a begin
                    // tells which.
                    Ok(Fenced::LeaseLost) => {}
                    Err(error) => {
                        let mut ledger = ledger.lock().unwrap();
                        *ledger.lost_completions.entry(key.to_owned()).or_default() += 1;
                        ledger.errors.push(error);
                    }
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_and_restarted_mid_run_gives_retryable_errors_and_runs_nothing_twice_after() {
    let dir = tempfile::tempdir().unwrap();
    let mut moto = common::DurableMoto::start(dir.path().join("requests.jsonl")).await;
    let options = DynamoDbOptions::table("outage")
        .unwrap()
        .max_clock_skew(Duration::ZERO);
    let store = Arc::new(DynamoDbStore::new(common::client(&moto.endpoint()), options));
    store.migrate().await.unwrap();
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let keys: Arc<Vec<String>> = Arc::new((0..KEYS).map(|i| format!("order-{i}")).collect());

    // The kill comes once a quarter of the keys have run, so it lands mid-run however fast
    // the server is; the server stays down for two seconds.
    let outage = {
        let ledger = Arc::clone(&ledger);
        tokio::spawn(async move {
            while ledger.lock().unwrap().effects.len() < KEYS / 4 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            moto.kill();
            let killed_after = ledger.lock().unwrap().effects.len();
            tokio::time::sleep(Duration::from_secs(2)).await;
            moto.restart().await;
            (moto, killed_after)
        })
    };
    let mut workers = Vec::new();
    for worker in 0..WORKERS {
        let (store, ledger, keys) = (Arc::clone(&store), Arc::clone(&ledger), Arc::clone(&keys));
        workers.push(tokio::spawn(async move {
            for key in keys.iter().skip(worker).step_by(WORKERS) {
                run_key(&store, key, &ledger).await;
                // Pace the run, so that most keys are still to run when the outage starts.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }
    for worker in workers {
        worker.await.unwrap();
    }
    let (moto, killed_after) = outage.await.unwrap();

    let ledger = Arc::try_unwrap(ledger).ok().unwrap().into_inner().unwrap();
    assert!(
        !ledger.errors.is_empty(),
        "the outage produced no error: it did not land in the run"
    );
    for error in &ledger.errors {
        assert!(error.is_retryable(), "not retryable: {error}");
    }
    // A key runs once, or once more per completion whose answer was lost (the lease then
    // decides, and the takeover is the next attempt).
    for key in keys.iter() {
        let effects = ledger.effects.get(key).copied().unwrap_or(0);
        let lost = ledger.lost_completions.get(key).copied().unwrap_or(0);
        assert!(
            (1..=1 + lost).contains(&effects),
            "{key}: {effects} effects with {lost} lost completions"
        );
        let record = store
            .get(&Scope::new("outage").unwrap(), &Key::new(key).unwrap())
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{key} has no record"));
        assert!(
            matches!(record.state, RecordState::Completed { .. }),
            "{key} is not completed: {:?}",
            record.state
        );
        // A begin applied by the server whose answer was lost is an attempt without an effect.
        assert!(
            record.attempt >= effects,
            "{key}: {effects} effects but attempt {}",
            record.attempt
        );
    }

    // After the outage: every key again, from every worker. Nothing runs.
    let before: u32 = ledger.effects.values().sum();
    let again = Arc::new(Mutex::new(Ledger::default()));
    let mut workers = Vec::new();
    for _ in 0..WORKERS {
        let (store, again, keys) = (Arc::clone(&store), Arc::clone(&again), Arc::clone(&keys));
        workers.push(tokio::spawn(async move {
            for key in keys.iter() {
                run_key(&store, key, &again).await;
            }
        }));
    }
    for worker in workers {
        worker.await.unwrap();
    }
    let again = again.lock().unwrap();
    assert!(
        again.errors.is_empty(),
        "errors after the outage: {:?}",
        again.errors
    );
    assert_eq!(
        again.effects.values().sum::<u32>(),
        0,
        "a key ran again after the outage"
    );
    eprintln!(
        "killed after {killed_after} of {KEYS} keys: {} retryable errors, {} lost completions, \
         {before} effects for {KEYS} keys",
        ledger.errors.len(),
        ledger.lost_completions.values().sum::<u32>()
    );
    drop(moto);
}

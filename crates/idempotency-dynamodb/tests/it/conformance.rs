//! The DynamoDB store passes the conformance suite against the local AWS server that
//! `scripts/services` starts (moto): on a manual clock, with no clock-skew allowance (the
//! suite's lease tests expect a takeover the moment a lease ends), each store on a table of its
//! own. Verified against moto only: moto's conditional writes and transactions stand in for
//! DynamoDB's.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotency_core::ManualClock;
use idempotency_dynamodb::DynamoDbStore;
use idempotency_testkit::linearizability::Scale;
use idempotency_testkit::{Harness, TimeControl};

#[derive(Debug)]
struct DynamoDbHarness {
    tables: AtomicUsize,
    run: u128,
    clock: ManualClock,
}

impl DynamoDbHarness {
    fn manual() -> Self {
        Self {
            tables: AtomicUsize::new(0),
            run: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos(),
            clock: ManualClock::new(),
        }
    }
}

#[async_trait::async_trait]
impl Harness for DynamoDbHarness {
    type Store = DynamoDbStore;

    async fn store(&self) -> DynamoDbStore {
        let n = self.tables.fetch_add(1, Ordering::SeqCst);
        common::store(
            &format!("conformance-{}-{n}", self.run),
            &self.clock,
            Duration::ZERO,
        )
        .await
    }

    fn time(&self) -> TimeControl {
        TimeControl::Manual(self.clock.clone())
    }

    /// A tenth of the usual operations: the local server answers one request at a time,
    /// a few hundred a second.
    fn linearizability(&self) -> Scale {
        Scale {
            histories: 5,
            operations: 400,
            ..Scale::default()
        }
    }

    /// A table per sequence: `list` and `stats` scan the whole table, which on a shared one
    /// grows with every sequence (74 s for the 100 sequences on one table, 16 s on a table each).
    fn model_store_per_case(&self) -> bool {
        true
    }
}

idempotency_testkit::conformance_cases!(DynamoDbHarness::manual());

/// The comparison with the reference model, with 100 random sequences instead of the suite's
/// default 1000: every operation is a round trip to the local server (a single Python process
/// that every DynamoDB and SQS test shares), each sequence on a table of its own.
#[test]
fn conformance_matches_reference_model() {
    idempotency_testkit::model::check_against_model(&DynamoDbHarness::manual(), 100);
}

/// Concurrent histories on one table are linearizable (no cuts: the AWS SDK retries a request
/// whose connection broke on its own, which the recorder would count as one call).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_histories_are_linearizable() {
    idempotency_testkit::linearizability::check_harness(&DynamoDbHarness::manual()).await;
}

//! The reference model passes every conformance case (which keeps the suite honest: every case
//! must hold for the model before it can be asked of another store). It runs the cases only:
//! comparing the model with itself could not fail.

use std::sync::Arc;

use idempotency_core::{ManualClock, MemoryStore};
use idempotency_testkit::{Harness, TimeControl};

#[derive(Debug)]
struct MemoryHarness {
    clock: ManualClock,
}

impl MemoryHarness {
    fn new() -> Self {
        Self {
            clock: ManualClock::new(),
        }
    }
}

#[async_trait::async_trait]
impl Harness for MemoryHarness {
    type Store = MemoryStore;

    async fn store(&self) -> MemoryStore {
        MemoryStore::with_clock(Arc::new(self.clock.clone()))
    }

    fn time(&self) -> TimeControl {
        TimeControl::Manual(self.clock.clone())
    }
}

idempotency_testkit::conformance_cases!(MemoryHarness::new());

/// The reference model's own locking, under concurrent clients: its histories are linearizable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_histories_are_linearizable() {
    idempotency_testkit::linearizability::check_harness(&MemoryHarness::new()).await;
}

/// The memory store on the real system clock, as single-process programs use it.
mod system_clock {
    use super::*;

    #[derive(Debug)]
    struct RealClockHarness;

    #[async_trait::async_trait]
    impl Harness for RealClockHarness {
        type Store = MemoryStore;

        async fn store(&self) -> MemoryStore {
            MemoryStore::new()
        }

        fn time(&self) -> TimeControl {
            TimeControl::real()
        }
    }

    idempotency_testkit::conformance_cases!(RealClockHarness);
}

/// The reference model behind a group commit that sends one call or batch at a time, so that
/// concurrent calls queue and ride in batches: every case holds, and the histories of
/// concurrent clients are linearizable.
mod group_commit {
    use super::*;

    fn harness() -> idempotency_testkit::Grouped<MemoryHarness> {
        idempotency_testkit::Grouped::one_at_a_time(MemoryHarness::new())
    }

    idempotency_testkit::conformance_cases!(harness());

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_histories_are_linearizable() {
        idempotency_testkit::linearizability::check_harness(&harness()).await;
    }
}

//! The PostgreSQL store passes the conformance suite and the model-based property test against
//! the real server (its own clock: real time, short leases).

mod common;

use idempotency_postgres::PostgresStore;
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
}

idempotency_testkit::conformance_suite!(PostgresHarness);

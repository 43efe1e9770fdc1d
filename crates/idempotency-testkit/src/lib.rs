//! The one conformance suite every idempotency [`Store`](idempotency_core::Store) passes.
//!
//! A store crate implements [`Harness`] (how to make a fresh store, how time passes) and adds one
//! line to an integration test:
//!
//! ```
//! use std::sync::Arc;
//! use idempotency_core::{ManualClock, MemoryStore};
//! use idempotency_testkit::{Harness, TimeControl};
//!
//! #[derive(Debug)]
//! struct MemoryHarness(ManualClock);
//!
//! #[async_trait::async_trait]
//! impl Harness for MemoryHarness {
//!     type Store = MemoryStore;
//!     async fn store(&self) -> MemoryStore {
//!         MemoryStore::with_clock(Arc::new(self.0.clone()))
//!     }
//!     fn time(&self) -> TimeControl {
//!         TimeControl::Manual(self.0.clone())
//!     }
//! }
//!
//! idempotency_testkit::conformance_suite!(MemoryHarness(ManualClock::new()));
//! # fn main() {}
//! ```
//!
//! which expands to one `#[tokio::test]` per [`cases::Case`] — every row of the protocol's
//! transition table, 64-way races on one key repeated [`cases::RACE_ROUNDS`] times, lease expiry and
//! takeover, fencing with stale tokens, retention, `purge_expired`, `stats` and `list` — plus
//! [`model::check_against_model`], the property test of random operation interleavings against
//! the in-memory reference model ([`model::DEFAULT_CASES`] cases).
//!
//! The test crate needs `tokio` (features `macros`, `rt-multi-thread`) as a dev-dependency.
//!
//! Stores whose clock the harness controls ([`TimeControl::Manual`]) run the time-dependent cases
//! instantly and are compared with the model to the millisecond; stores on a server clock
//! ([`TimeControl::Real`]) run them with leases of a few hundred milliseconds.

mod harness;

pub mod brokers;
pub mod connections;
pub mod faults;
pub mod history;
pub mod linearizability;
pub mod message;
#[cfg(feature = "nats")]
pub mod nats;
pub mod outage;
pub mod proxy;
pub mod recorded;
pub mod refusals;
pub mod same_transaction;
#[cfg(feature = "sql")]
pub mod sql;
pub mod tls;
pub mod wait;

pub mod cases;
pub mod model;

pub use cases::{completed, held};
pub use connections::{a_replay_costs_its_read, replaced_past_lifetime, replaced_when_abandoned_or_failed};
pub use faults::FaultyStore;
pub use harness::{Grouped, Harness, TimeControl};
pub use proxy::TcpProxy;
pub use wait::{eventually, eventually_explained};

/// Expands to the whole conformance suite for the harness expression `$harness` (evaluated once
/// per test): one test per [`cases::Case`], the property test against the reference model, and
/// the [linearizability check](linearizability) of concurrent histories. See the
/// [crate docs](crate).
#[macro_export]
macro_rules! conformance_suite {
    ($harness:expr) => {
        $crate::conformance_cases!($harness);

        #[test]
        fn conformance_matches_reference_model() {
            $crate::model::check_against_model(&$harness, $crate::model::DEFAULT_CASES);
        }

        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn concurrent_histories_are_linearizable() {
            $crate::linearizability::check_harness(&$harness).await;
        }
    };
}

/// Expands to one test per [`cases::Case`] for `$harness`, without the comparison with the
/// reference model: for the reference model itself ([`MemoryStore`](idempotency_core::MemoryStore)),
/// which that comparison would hold against itself. Every other store uses
/// [`conformance_suite!`].
#[macro_export]
macro_rules! conformance_cases {
    ($harness:expr) => {
        $crate::__with_cases!($crate::__case_tests!($harness));
    };
}

/// **The one list of conformance cases.** Calls `$callback!` with the tokens it was given, a
/// `;`, then every case name. [`cases::Case`], [`cases::run_all`] and the tests that
/// [`conformance_suite!`] expands to are all generated from it, and every case function in
/// `cases.rs` is private under `#![deny(dead_code)]`: a case written there and not listed here
/// fails the build, and a case listed here runs on every store.
#[doc(hidden)]
#[macro_export]
macro_rules! __with_cases {
    ($($callback:ident)::+ ! ( $($args:tt)* )) => {
        $($callback)::+! {
            $($args)*;
            begin_on_new_key_acquires_attempt_one,
            begin_after_complete_replays_outcome,
            begin_with_other_fingerprint_is_mismatch,
            mismatch_is_checked_before_in_flight,
            begin_while_lease_live_is_in_flight,
            begin_retried_with_own_token_acquires_again,
            takeover_after_lease_expiry_is_recovered,
            stale_token_gets_lease_lost,
            complete_after_lease_expiry_without_takeover,
            complete_retried_with_same_token_is_accepted,
            unknown_token_gets_lease_lost,
            release_keeps_the_attempt_count,
            the_token_of_no_attempt_holds_nothing,
            released_record_expires_after_retention,
            extend_keeps_the_lease_alive,
            completed_record_expires_after_retention,
            extreme_durations_are_clamped,
            now_is_the_clock_of_the_records,
            abandoned_in_flight_record_expires_after_retention,
            get_reports_each_state,
            outcomes_round_trip_byte_for_byte,
            keys_and_scopes_are_compared_exactly,
            scopes_isolate_keys,
            purge_expired_deletes_only_expired,
            forget_deletes_only_the_record_that_holds_the_token,
            stats_report_oldest_in_flight_age,
            list_filters_orders_and_pages,
            race_64_begins_exactly_one_acquires,
            race_64_begins_on_expired_lease_exactly_one_takes_over,
            race_stale_complete_against_takeover,
            a_batch_answers_each_key_as_its_single_call_would,
            the_same_key_twice_in_a_batch_is_claimed_by_the_first,
            a_stale_token_in_a_batch_loses_only_its_own_lease,
            race_64_batches_over_the_same_keys_claim_each_key_once,
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __case_tests {
    ($harness:expr; $($case:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                $crate::cases::Case::$case.run(&$harness).await;
            }
        )*
    };
}

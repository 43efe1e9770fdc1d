//! What a store provides to the suite: fresh stores and a way to let time pass.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::{Clock, ManualClock, StoreAdmin};

/// How the suite makes store time pass.
#[derive(Debug, Clone)]
pub enum TimeControl {
    /// The store reads this clock (embedded stores): time passes instantly and exactly, so the
    /// suite compares every timestamp with the model.
    Manual(ManualClock),
    /// The store reads a real clock (a server's `now()` or `TIME`): time passes by sleeping, with
    /// leases of a few hundred milliseconds, and timestamps are compared only for order.
    Real {
        /// The suite's unit of time: leases are a few units long and the suite sleeps a few
        /// units at a time. 200 ms works on loopback; raise it for slow CI machines.
        unit: Duration,
    },
}

impl TimeControl {
    /// Real time with the default unit of 200 ms.
    #[must_use]
    pub fn real() -> Self {
        Self::Real {
            unit: Duration::from_millis(200),
        }
    }

    /// The unit of time of the suite: leases are a few units long.
    #[must_use]
    pub fn unit(&self) -> Duration {
        match self {
            Self::Manual(_) => Duration::from_secs(10),
            Self::Real { unit } => *unit,
        }
    }

    /// Lets `duration` of store time pass.
    pub async fn pass(&self, duration: Duration) {
        match self {
            Self::Manual(clock) => clock.advance(duration),
            Self::Real { .. } => tokio::time::sleep(duration).await,
        }
    }

    /// Whether timestamps are exact (and so can be compared with the model's).
    #[must_use]
    pub fn is_exact(&self) -> bool {
        matches!(self, Self::Manual(_))
    }

    /// The manual clock's current time, if the time is manual.
    #[must_use]
    pub fn manual_now(&self) -> Option<idempotency_core::Timestamp> {
        match self {
            Self::Manual(clock) => Some(clock.now()),
            Self::Real { .. } => None,
        }
    }
}

/// A store under test.
///
/// ```
/// use std::sync::Arc;
/// use idempotency_core::{ManualClock, MemoryStore};
/// use idempotency_testkit::{Harness, TimeControl};
///
/// #[derive(Debug)]
/// struct MemoryHarness(ManualClock);
///
/// #[async_trait::async_trait]
/// impl Harness for MemoryHarness {
///     type Store = MemoryStore;
///     async fn store(&self) -> MemoryStore {
///         MemoryStore::with_clock(Arc::new(self.0.clone()))
///     }
///     fn time(&self) -> TimeControl {
///         TimeControl::Manual(self.0.clone())
///     }
/// }
/// ```
#[async_trait]
pub trait Harness: Send + Sync + fmt::Debug {
    /// The store type.
    type Store: StoreAdmin + Clone + 'static;

    /// A fresh, empty store that no other test uses (a new file, table or key prefix). Panics
    /// when the backing server is unreachable: a suite that cannot reach its server must fail,
    /// not skip.
    async fn store(&self) -> Self::Store;

    /// How store time passes for the stores this harness makes.
    fn time(&self) -> TimeControl;

    /// Whether the store deletes expired records by itself (Redis key expiry), so that none is
    /// ever counted as expired and `purge_expired` has nothing to do. The purge case then checks
    /// that the expired records are gone instead of purging them.
    fn expires_by_itself(&self) -> bool {
        false
    }

    /// A fresh store like [`store`](Self::store) whose connections to its server the
    /// linearizability check can cut, and what cuts them (the test kit's [`TcpProxy`](crate::TcpProxy)
    /// in front of the server, or a server-side kill of the store's connections). `None`, the
    /// default, for stores without a connection to cut (memory, SQLite): the check then runs
    /// without faults.
    async fn store_with_cuts(&self) -> Option<(Self::Store, Box<dyn crate::linearizability::Cutter>)> {
        None
    }

    /// How much the linearizability check runs on this harness's stores: by default 20 keys
    /// with 1000 operations each. A store whose server serves one request at a time may ask
    /// for less.
    fn linearizability(&self) -> crate::linearizability::Scale {
        crate::linearizability::Scale::default()
    }

    /// Whether the comparison with the reference model ([`check_against_model`](crate::model::check_against_model))
    /// gives each random sequence a fresh store (`true`), or runs every sequence on one store,
    /// each under a scope of its own (`false`, the default: cheap where a store is a key prefix
    /// or a table). A store whose `list` and `stats` read the whole store and filter afterwards
    /// (a DynamoDB `Scan`) slows down with every sequence on a shared one.
    fn model_store_per_case(&self) -> bool {
        false
    }
}

/// `H`'s stores behind a [`GroupCommit`](idempotency_core::GroupCommit) with `settings`: the
/// same cases, model comparison and linearizability check, with concurrent `begin`s and
/// `complete`s going to the store in batches (one slot, `in_flight(1)`, batches the most).
#[derive(Debug)]
pub struct Grouped<H> {
    /// The harness whose stores are wrapped.
    pub inner: H,
    /// How the wrapper gathers calls.
    pub settings: idempotency_core::GroupSettings,
}

impl<H> Grouped<H> {
    /// `inner`'s stores behind a group commit that sends one call or batch of each kind at a
    /// time, so that concurrent calls queue and ride in batches.
    pub fn one_at_a_time(inner: H) -> Self {
        Self {
            inner,
            settings: idempotency_core::GroupSettings::default().in_flight(1),
        }
    }
}

#[async_trait]
impl<H: Harness> Harness for Grouped<H> {
    type Store = idempotency_core::GroupCommit<H::Store>;

    async fn store(&self) -> Self::Store {
        idempotency_core::GroupCommit::with_settings(self.inner.store().await, self.settings)
    }

    fn time(&self) -> TimeControl {
        self.inner.time()
    }

    fn expires_by_itself(&self) -> bool {
        self.inner.expires_by_itself()
    }

    async fn store_with_cuts(&self) -> Option<(Self::Store, Box<dyn crate::linearizability::Cutter>)> {
        let (store, cutter) = self.inner.store_with_cuts().await?;
        Some((
            idempotency_core::GroupCommit::with_settings(store, self.settings),
            cutter,
        ))
    }

    fn linearizability(&self) -> crate::linearizability::Scale {
        self.inner.linearizability()
    }

    fn model_store_per_case(&self) -> bool {
        self.inner.model_store_per_case()
    }
}

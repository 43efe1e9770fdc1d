//! The in-memory store: the reference model.
//!
//! `MemoryStore` applies the pure transitions of [`crate::machine`] under a per-shard mutex, so
//! its behaviour *is* the specification: every other store is checked against it by the
//! conformance suite and by the model-based property test in `idempotency-testkit`.
//!
//! It is also a real store for tests and single-process programs: it is safe under any amount of
//! concurrency, expired records are dropped when touched, swept as the map grows, and removed by
//! [`StoreAdmin::purge_expired`]. Everything is lost when the process exits; use the SQLite store
//! when that matters.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;

use crate::machine::{self, Effect};
use crate::{
    Access, BeginRequest, Claim, Clock, DynStore, ErrorKind, Fenced, Held, Key, ListFilter, OpenFuture,
    Outcome, Record, RecordSummary, Scope, Stats, Store, StoreAdmin, StoreError, StoreKind, SystemClock,
    Timestamp, Token,
};

const SHARDS: usize = 64;

type Address = (Scope, Key);

/// The in-memory reference store. Clones share the same records.
///
/// ```
/// use idempotency_core::{BeginRequest, Claim, Fingerprint, Key, MemoryStore, Outcome, Scope, Store};
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let store = MemoryStore::new();
/// let request = BeginRequest::new(Scope::global(), Key::new("order-1")?, Fingerprint::of_bytes(b"pay 10"));
///
/// let Claim::Acquired(held) = store.begin(&request).await? else { unreachable!() };
/// // ... perform the side effect once ...
/// let _ = store.complete(&held, Outcome::new("charged"), request.retention).await?;
///
/// // A duplicate (with its own fresh token) gets the stored outcome instead of running again.
/// let duplicate = request.clone().token(idempotency_core::Token::random());
/// let Claim::Replay(done) = store.begin(&duplicate).await? else { unreachable!() };
/// assert_eq!(done.outcome.as_bytes(), b"charged");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
}

#[derive(Debug, Default)]
struct Shard {
    records: HashMap<Address, Record>,
    /// Size after the last sweep; the next sweep runs when the shard has doubled, which keeps
    /// the amortized cost of sweeping constant per insert.
    swept_at_len: usize,
}

impl MemoryStore {
    /// The `memory://` URL (nothing survives the process), for a [`Registry`](crate::Registry).
    pub const KIND: StoreKind = StoreKind {
        name: "memory",
        schemes: &["memory"],
        example: "memory://",
        open: open_url,
        check: check_url,
    };

    /// An empty store on the system clock.
    #[must_use]
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock))
    }

    /// An empty store on `clock` (use a [`crate::ManualClock`] to step through lease expiry in
    /// tests).
    #[must_use]
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        let shards = (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect();
        Self {
            inner: Arc::new(Inner {
                shards,
                hasher: RandomState::new(),
                clock,
            }),
        }
    }

    /// Number of records held, expired ones included.
    #[must_use]
    pub fn len(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|shard| lock(shard).records.len())
            .sum()
    }

    /// Whether the store holds no record at all.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, scope: &Scope, key: &Key) -> MutexGuard<'_, Shard> {
        let hash = self.inner.hasher.hash_one((scope, key));
        // The modulo of a 64-bit hash by a small power of two: truncation is the point.
        #[allow(clippy::cast_possible_truncation)]
        let index = (hash as usize) % SHARDS;
        lock(&self.inner.shards[index])
    }

    fn now(&self) -> Timestamp {
        self.inner.clock.now()
    }

    /// Runs one transition on the record at `(scope, key)` under its shard's lock.
    fn transition<R>(
        &self,
        scope: &Scope,
        key: &Key,
        step: impl FnOnce(Timestamp, Option<&Record>) -> (R, Effect),
    ) -> R {
        let mut shard = self.shard(scope, key);
        let now = self.now();
        let address = (scope.clone(), key.clone());
        let (answer, effect) = step(now, shard.records.get(&address));
        match effect {
            Effect::None => {}
            Effect::Put(record) => {
                if shard.records.insert(address, record).is_none() {
                    shard.sweep_if_grown(now);
                }
            }
        }
        answer
    }
}

fn open_url(url: String, access: Access) -> OpenFuture {
    Box::pin(async move {
        if access != Access::Create {
            return Err(StoreError::new(
                ErrorKind::InvalidConfig,
                "`memory://` is a store inside one process: opened here it would be a fresh, empty \
                 one, with nothing to inspect; point the command at the store the gateway or \
                 service uses (sqlite://, postgres://, redis://)",
            ));
        }
        check_url(&url)?;
        Ok(Arc::new(MemoryStore::new()) as DynStore)
    })
}

/// `memory://` (or `memory:`), and nothing more.
fn check_url(url: &str) -> Result<(), StoreError> {
    if url != "memory://" && url != "memory:" {
        return Err(StoreError::new(
            ErrorKind::InvalidConfig,
            format!(
                "`{}`: the memory store takes no path or options (use `memory://`)",
                crate::redact_url(url)
            ),
        ));
    }
    Ok(())
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl Shard {
    fn sweep_if_grown(&mut self, now: Timestamp) {
        if self.records.len() >= 2 * self.swept_at_len.max(64) {
            self.records.retain(|_, record| !record.is_expired(now));
            self.swept_at_len = self.records.len();
        }
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // The transitions cannot panic while holding the lock; a poisoned lock still guards a
    // consistent map.
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

#[async_trait]
impl Store for MemoryStore {
    async fn begin(&self, request: &BeginRequest) -> Result<Claim, StoreError> {
        Ok(self.transition(&request.scope, &request.key, |now, record| {
            machine::begin(now, record, request)
        }))
    }

    async fn complete(
        &self,
        held: &Held,
        outcome: Outcome,
        retention: Duration,
    ) -> Result<Fenced<Timestamp>, StoreError> {
        Ok(self.transition(&held.scope, &held.key, |now, record| {
            machine::complete(now, record, held.token, outcome, retention)
        }))
    }

    async fn release(&self, held: &Held) -> Result<Fenced<()>, StoreError> {
        Ok(self.transition(&held.scope, &held.key, |now, record| {
            machine::release(now, record, held.token)
        }))
    }

    async fn extend(&self, held: &Held, lease: Duration) -> Result<Fenced<Timestamp>, StoreError> {
        Ok(self.transition(&held.scope, &held.key, |now, record| {
            machine::extend(now, record, held.token, lease)
        }))
    }

    async fn get(&self, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
        let mut shard = self.shard(scope, key);
        let now = self.now();
        let address = (scope.clone(), key.clone());
        match shard.records.get(&address) {
            Some(record) if record.is_expired(now) => {
                shard.records.remove(&address);
                Ok(None)
            }
            record => Ok(record.cloned()),
        }
    }
}

#[async_trait]
impl StoreAdmin for MemoryStore {
    async fn now(&self) -> Result<Timestamp, StoreError> {
        Ok(self.inner.clock.now())
    }

    async fn stats(&self, scope: Option<&Scope>) -> Result<Stats, StoreError> {
        let now = self.now();
        let mut stats = Stats::default();
        for shard in &*self.inner.shards {
            for record in lock(shard).records.values() {
                if scope.is_none_or(|scope| &record.scope == scope) {
                    stats.count(record, now);
                }
            }
        }
        Ok(stats)
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordSummary>, StoreError> {
        let now = self.now();
        let mut found: Vec<RecordSummary> = Vec::new();
        for shard in &*self.inner.shards {
            found.extend(
                lock(shard)
                    .records
                    .values()
                    .filter(|record| filter.matches(record, now))
                    .map(Record::summary),
            );
        }
        Ok(filter.page(found))
    }

    async fn purge_expired(&self, limit: u64) -> Result<u64, StoreError> {
        let now = self.now();
        let mut purged = 0;
        for shard in &*self.inner.shards {
            if purged >= limit {
                break;
            }
            let mut shard = lock(shard);
            shard.records.retain(|_, record| {
                if purged < limit && record.is_expired(now) {
                    purged += 1;
                    false
                } else {
                    true
                }
            });
        }
        Ok(purged)
    }

    async fn forget(&self, scope: &Scope, key: &Key, token: Token) -> Result<Fenced<()>, StoreError> {
        let mut shard = self.shard(scope, key);
        let now = self.now();
        let address = (scope.clone(), key.clone());
        let held =
            machine::live(now, shard.records.get(&address)).is_some_and(|record| record.token() == token);
        if held {
            shard.records.remove(&address);
        }
        Ok(Fenced::accepted_if(held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Fingerprint, ManualClock};

    #[tokio::test]
    async fn a_memory_url_with_more_in_it_is_refused_without_its_password() {
        for url in ["memory://admin:s3cret@host", "memory://x?password=s3cret"] {
            let checked = check_url(url).unwrap_err().to_string();
            let opened = open_url(url.to_owned(), Access::Create)
                .await
                .map(drop)
                .unwrap_err()
                .to_string();
            for message in [checked, opened] {
                assert!(message.contains("takes no path or options"), "{message}");
                assert!(!message.contains("s3cret"), "the password is echoed: {message}");
            }
        }
        assert!(check_url("memory://").is_ok());
    }

    fn request(key: &str) -> BeginRequest {
        BeginRequest::new(
            Scope::global(),
            Key::new(key).unwrap(),
            Fingerprint::of_bytes(b"x"),
        )
        .lease(Duration::from_secs(10))
        .retention(Duration::from_secs(100))
    }

    #[tokio::test]
    async fn growing_shards_sweep_expired_records() {
        let clock = ManualClock::new();
        let store = MemoryStore::with_clock(Arc::new(clock.clone()));
        for i in 0..10_000 {
            let _ = store.begin(&request(&format!("old-{i}"))).await.unwrap();
        }
        assert_eq!(store.len(), 10_000);
        clock.advance(Duration::from_secs(101));
        for i in 0..10_000 {
            let _ = store.begin(&request(&format!("new-{i}"))).await.unwrap();
        }
        // Without sweeping, 20 000 records would be held; sweeps drop most of the expired ones
        // without anybody calling purge_expired.
        assert!(store.len() < 15_000, "held {}", store.len());
        assert_eq!(store.stats(None).await.unwrap().in_flight, 10_000);
    }

    #[tokio::test]
    async fn get_drops_an_expired_record() {
        let clock = ManualClock::new();
        let store = MemoryStore::with_clock(Arc::new(clock.clone()));
        let request = request("k");
        let _ = store.begin(&request).await.unwrap();
        clock.advance(Duration::from_secs(100));
        assert_eq!(store.get(&request.scope, &request.key).await.unwrap(), None);
        assert!(store.is_empty());
    }
}

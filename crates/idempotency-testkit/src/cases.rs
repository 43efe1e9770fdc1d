//! The conformance cases. Each is a private `async fn(&impl Harness)` that panics on a violation
//! of the contract, reached through [`Case`]; [`crate::conformance_suite!`] turns every one of
//! them into a test. The module denies dead code: a case function missing from the one list
//! ([`crate::__with_cases`]) fails the build instead of silently never running.
//!
//! The cases are written against [`idempotency_core::machine`]'s table (`docs/PROTOCOL.md`) and pass on the
//! in-memory reference store by construction; every other store must pass them unchanged.

#![deny(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idempotency_core::{
    BeginRequest, Claim, Completion, Fenced, Fingerprint, Held, Key, ListFilter, Outcome, Record,
    RecordState, Scope, StateFilter, Store, StoreAdmin, SummaryState, Token,
};
use tokio::sync::Barrier;

use crate::{Harness, TimeControl};

/// A lease that never expires during a case.
const LONG: Duration = Duration::from_secs(60);
/// A retention that never expires during a case.
const KEEP: Duration = Duration::from_secs(3600);

/// How many times the 64-way race runs per store.
pub const RACE_ROUNDS: usize = 100;
/// How many callers race on one key.
pub const RACERS: usize = 64;

struct Ctx<S> {
    store: S,
    time: TimeControl,
    scope: Scope,
}

impl<S: StoreAdmin + Clone + 'static> Ctx<S> {
    async fn new<H: Harness<Store = S>>(harness: &H) -> Self {
        Self {
            store: harness.store().await,
            time: harness.time(),
            // A scope of its own, so a case never sees another case's records even when a
            // harness hands out one shared store.
            scope: Scope::new(format!("conformance-{}", Key::generate())).expect("valid scope"),
        }
    }

    fn unit(&self) -> Duration {
        self.time.unit()
    }

    fn request(&self, key: &Key, fingerprint: u8) -> BeginRequest {
        BeginRequest::new(self.scope.clone(), key.clone(), fp(fingerprint))
            .lease(LONG)
            .retention(KEEP)
    }

    async fn begin(&self, request: &BeginRequest) -> Claim {
        self.store.begin(request).await.expect("begin")
    }

    async fn acquire(&self, request: &BeginRequest) -> Token {
        match self.begin(request).await {
            Claim::Acquired(Held { token, .. }) => token,
            other => panic!("expected Acquired, got {other:?}"),
        }
    }

    /// The handle of the attempt holding `token` on `key` (a stale or foreign token is exactly
    /// what the fencing cases hand to the store).
    fn held(&self, key: &Key, token: Token) -> Held {
        held(&self.scope, key, token)
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        outcome: &'static [u8],
    ) -> Fenced<idempotency_core::Timestamp> {
        self.store
            .complete(&self.held(key, token), Outcome::from(outcome), KEEP)
            .await
            .expect("complete")
    }

    async fn release(&self, key: &Key, token: Token) -> Fenced<()> {
        self.store.release(&self.held(key, token)).await.expect("release")
    }

    async fn extend(&self, key: &Key, token: Token, lease: Duration) -> Fenced<idempotency_core::Timestamp> {
        self.store
            .extend(&self.held(key, token), lease)
            .await
            .expect("extend")
    }

    async fn purge_all(&self) -> u64 {
        let mut total = 0;
        loop {
            let purged = self.store.purge_expired(1000).await.expect("purge_expired");
            total += purged;
            if purged < 1000 {
                return total;
            }
        }
    }
}

/// Claims `request`'s key and completes it with `outcome`, kept an hour: a record already done,
/// for tests of what its replays cost. Panics if the key was not free or the completion failed.
pub async fn completed<S: Store + ?Sized>(store: &S, request: &BeginRequest, outcome: &'static str) {
    let Claim::Acquired(held) = store.begin(request).await.expect("begin") else {
        panic!("{} was not free", request.key);
    };
    let done = store
        .complete(&held, Outcome::new(outcome), KEEP)
        .await
        .expect("complete");
    assert!(!done.is_lease_lost(), "the completion lost its lease");
}

/// A handle naming `(scope, key)` under `token`, for tests that drive a store's fencing
/// directly: a stale token, a foreign one, or one whose `begin` reply was lost. Stores read only
/// the scope, the key and the token of a handle; the other fields are the acquisition's report.
#[must_use]
pub fn held(scope: &Scope, key: &Key, token: Token) -> Held {
    Held {
        scope: scope.clone(),
        key: key.clone(),
        token,
        attempt: 1,
        recovered: false,
        lease_until: idempotency_core::Timestamp::from_unix_millis(0),
    }
}

fn fp(n: u8) -> Fingerprint {
    Fingerprint::of_bytes(&[n])
}

fn key() -> Key {
    Key::generate()
}

/// `begin` on an unknown key acquires attempt 1 with the caller's token.
async fn begin_on_new_key_acquires_attempt_one<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let request = ctx.request(&key, 1);
    match ctx.begin(&request).await {
        Claim::Acquired(Held {
            token,
            attempt,
            recovered,
            ..
        }) => {
            assert_eq!(token, request.token, "the store must adopt the caller's token");
            assert_eq!(attempt, 1);
            assert!(!recovered);
        }
        other => panic!("expected Acquired, got {other:?}"),
    }
    let record = ctx
        .store
        .get(&ctx.scope, &key)
        .await
        .expect("get")
        .expect("record exists");
    assert_eq!(record.attempt, 1);
    assert_eq!(record.fingerprint, fp(1));
    assert!(matches!(record.state, RecordState::InFlight { token, .. } if token == request.token));
}

/// After `complete`, `begin` replays the stored outcome, attempt and expiry.
async fn begin_after_complete_replays_outcome<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let token = ctx.acquire(&ctx.request(&key, 1)).await;
    let Fenced::Accepted(expires_at) = ctx.complete(&key, token, b"the outcome").await else {
        panic!("complete by the holder must be accepted");
    };
    for _ in 0..3 {
        match ctx.begin(&ctx.request(&key, 1)).await {
            Claim::Replay(done) => {
                assert_eq!(done.outcome.as_bytes(), b"the outcome");
                assert_eq!(done.attempt, 1);
                assert_eq!(done.expires_at, expires_at);
                assert!(done.completed_at <= done.expires_at);
            }
            other => panic!("expected Replay, got {other:?}"),
        }
    }
}

/// A different fingerprint is a mismatch, on an in-flight and on a completed record, and changes
/// nothing.
async fn begin_with_other_fingerprint_is_mismatch<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let first = ctx.request(&key, 1);
    let token = ctx.acquire(&first).await;
    assert_eq!(ctx.begin(&ctx.request(&key, 2)).await, Claim::Mismatch);
    let record = ctx.store.get(&ctx.scope, &key).await.unwrap().unwrap();
    assert_eq!(record.fingerprint, fp(1), "a mismatch must not change the record");
    assert!(matches!(record.state, RecordState::InFlight { token: held, .. } if held == token));

    assert!(!ctx.complete(&key, token, b"done").await.is_lease_lost());
    assert_eq!(ctx.begin(&ctx.request(&key, 2)).await, Claim::Mismatch);
    assert!(matches!(ctx.begin(&first).await, Claim::Replay(_)));
}

/// The mismatch check comes before the in-flight check: a different payload under a live lease
/// is a mismatch, not "in flight".
async fn mismatch_is_checked_before_in_flight<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let _ = ctx.acquire(&ctx.request(&key, 1)).await;
    assert!(matches!(
        ctx.begin(&ctx.request(&key, 1)).await,
        Claim::InFlight { .. }
    ));
    assert_eq!(ctx.begin(&ctx.request(&key, 9)).await, Claim::Mismatch);
    // Even the holder's own token does not override the fingerprint.
    let own = ctx.store.get(&ctx.scope, &key).await.unwrap().unwrap();
    let RecordState::InFlight { token, .. } = own.state else {
        panic!("in flight")
    };
    assert_eq!(
        ctx.begin(&ctx.request(&key, 9).token(token)).await,
        Claim::Mismatch
    );
}

/// A live lease answers `InFlight` with the holder's attempt and a positive `retry_after` no
/// longer than the lease.
async fn begin_while_lease_live_is_in_flight<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let _ = ctx.acquire(&ctx.request(&key, 1)).await;
    match ctx.begin(&ctx.request(&key, 1)).await {
        Claim::InFlight { attempt, retry_after } => {
            assert_eq!(attempt, 1);
            assert!(retry_after > Duration::ZERO, "retry_after must be positive");
            assert!(
                retry_after <= LONG,
                "retry_after {retry_after:?} exceeds the lease"
            );
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
}

/// A retried `begin` with the caller's own token (its first reply was lost) acquires again
/// instead of reporting its own attempt as in flight, and changes nothing.
async fn begin_retried_with_own_token_acquires_again<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let request = ctx.request(&key, 1);
    let first = ctx.begin(&request).await;
    let again = ctx.begin(&request).await;
    assert!(
        matches!(
            again,
            Claim::Acquired(Held {
                attempt: 1,
                recovered: false,
                ..
            })
        ),
        "{again:?}"
    );
    if ctx.time.is_exact() {
        assert_eq!(first, again);
    }
    assert!(matches!(
        ctx.begin(&ctx.request(&key, 1)).await,
        Claim::InFlight { attempt: 1, .. }
    ));
}

/// After the lease expires, the next `begin` takes over: the caller's token, attempt 2,
/// `recovered: true`.
async fn takeover_after_lease_expiry_is_recovered<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let short = ctx.request(&key, 1).lease(ctx.unit() * 2);
    let _ = ctx.acquire(&short).await;
    ctx.time.pass(ctx.unit() * 3).await;
    let takeover = ctx.request(&key, 1);
    match ctx.begin(&takeover).await {
        Claim::Acquired(Held {
            token,
            attempt,
            recovered,
            ..
        }) => {
            assert_eq!(token, takeover.token);
            assert_eq!(attempt, 2);
            assert!(recovered);
        }
        other => panic!("expected a takeover, got {other:?}"),
    }
    let record = ctx.store.get(&ctx.scope, &key).await.unwrap().unwrap();
    assert_eq!(record.attempt, 2);
    // A third caller now sees the new holder's live lease.
    assert!(matches!(
        ctx.begin(&ctx.request(&key, 1)).await,
        Claim::InFlight { attempt: 2, .. }
    ));
}

/// The fencing rule: once a lease is taken over, the stale token gets `LeaseLost` from
/// `complete`, `release` and `extend`, and the newer attempt's record is untouched — before and
/// after it completes.
async fn stale_token_gets_lease_lost<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let stale = ctx.acquire(&ctx.request(&key, 1).lease(ctx.unit() * 2)).await;
    ctx.time.pass(ctx.unit() * 3).await;
    let newer = ctx.acquire(&ctx.request(&key, 1)).await;

    assert_eq!(
        ctx.extend(&key, stale, LONG).await,
        Fenced::LeaseLost,
        "stale extend"
    );
    assert_eq!(
        ctx.complete(&key, stale, b"stale").await,
        Fenced::LeaseLost,
        "stale complete"
    );
    assert_eq!(ctx.release(&key, stale).await, Fenced::LeaseLost, "stale release");
    let record = ctx
        .store
        .get(&ctx.scope, &key)
        .await
        .unwrap()
        .expect("newer record kept");
    assert!(matches!(record.state, RecordState::InFlight { token, .. } if token == newer));
    assert_eq!(record.attempt, 2);

    assert!(!ctx.complete(&key, newer, b"newer").await.is_lease_lost());
    assert_eq!(ctx.complete(&key, stale, b"stale").await, Fenced::LeaseLost);
    assert_eq!(ctx.release(&key, stale).await, Fenced::LeaseLost);
    assert_eq!(ctx.extend(&key, stale, LONG).await, Fenced::LeaseLost);
    match ctx.begin(&ctx.request(&key, 1)).await {
        Claim::Replay(done) => {
            assert_eq!(
                done.outcome.as_bytes(),
                b"newer",
                "the stale worker overwrote the result"
            );
            assert_eq!(done.attempt, 2);
        }
        other => panic!("expected Replay, got {other:?}"),
    }
}

/// A holder whose lease expired may still complete as long as nobody took over.
async fn complete_after_lease_expiry_without_takeover<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let token = ctx.acquire(&ctx.request(&key, 1).lease(ctx.unit())).await;
    ctx.time.pass(ctx.unit() * 2).await;
    assert!(!ctx.complete(&key, token, b"late but fine").await.is_lease_lost());
    assert!(matches!(ctx.begin(&ctx.request(&key, 1)).await, Claim::Replay(_)));
}

/// A retried `complete` with the completing token is accepted again and keeps the first outcome;
/// another token is refused.
async fn complete_retried_with_same_token_is_accepted<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let token = ctx.acquire(&ctx.request(&key, 1)).await;
    let first = ctx.complete(&key, token, b"first").await;
    let again = ctx.complete(&key, token, b"second").await;
    assert!(!again.is_lease_lost(), "a retried complete must be accepted");
    if ctx.time.is_exact() {
        assert_eq!(first, again, "a retried complete must not move the expiry");
    }
    assert_eq!(
        ctx.complete(&key, Token::random(), b"third").await,
        Fenced::LeaseLost
    );
    let Claim::Replay(done) = ctx.begin(&ctx.request(&key, 1)).await else {
        panic!("replay")
    };
    assert_eq!(done.outcome.as_bytes(), b"first");
}

/// Operations with a token that never held the record, or on no record at all, are refused.
async fn unknown_token_gets_lease_lost<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let absent = key();
    assert_eq!(
        ctx.complete(&absent, Token::random(), b"x").await,
        Fenced::LeaseLost
    );
    assert_eq!(ctx.release(&absent, Token::random()).await, Fenced::LeaseLost);
    assert_eq!(
        ctx.extend(&absent, Token::random(), LONG).await,
        Fenced::LeaseLost
    );
    assert_eq!(
        ctx.store.get(&ctx.scope, &absent).await.unwrap(),
        None,
        "nothing may be created"
    );

    let key = key();
    let token = ctx.acquire(&ctx.request(&key, 1)).await;
    let stranger = Token::random();
    assert_eq!(ctx.complete(&key, stranger, b"x").await, Fenced::LeaseLost);
    assert_eq!(ctx.release(&key, stranger).await, Fenced::LeaseLost);
    assert_eq!(ctx.extend(&key, stranger, LONG).await, Fenced::LeaseLost);
    let record = ctx.store.get(&ctx.scope, &key).await.unwrap().unwrap();
    assert!(matches!(record.state, RecordState::InFlight { token: held, .. } if held == token));
}

/// `release` keeps the record: a key that has run before never looks new. The released
/// attempt's token is refused from then on; the record keeps its fingerprint (another payload
/// is a mismatch) and its attempt, so the retry runs as attempt 2 with `recovered`, and the
/// attempt after the retry's own release as attempt 3.
async fn release_keeps_the_attempt_count<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let first = ctx.acquire(&ctx.request(&key, 1)).await;
    assert_eq!(ctx.release(&key, first).await, Fenced::Accepted(()));
    let released = ctx.store.get(&ctx.scope, &key).await.unwrap().expect("kept");
    assert_eq!((released.attempt, released.fingerprint), (1, fp(1)));
    assert!(
        matches!(released.state, RecordState::InFlight { token, .. } if token == Token::NONE),
        "held by no attempt: {released:?}"
    );
    assert_eq!(ctx.complete(&key, first, b"late").await, Fenced::LeaseLost);
    assert_eq!(ctx.extend(&key, first, LONG).await, Fenced::LeaseLost);
    assert_eq!(ctx.release(&key, first).await, Fenced::LeaseLost);
    assert_eq!(ctx.begin(&ctx.request(&key, 2)).await, Claim::Mismatch);

    let retry = ctx.request(&key, 1);
    match ctx.begin(&retry).await {
        Claim::Acquired(held) => assert_eq!((held.attempt, held.recovered), (2, true)),
        other => panic!("expected the retry to take over, got {other:?}"),
    }
    assert_eq!(ctx.release(&key, retry.token).await, Fenced::Accepted(()));
    let third = ctx.request(&key, 1);
    match ctx.begin(&third).await {
        Claim::Acquired(held) => assert_eq!((held.attempt, held.recovered), (3, true)),
        other => panic!("expected a third attempt, got {other:?}"),
    }
    assert_eq!(ctx.complete(&key, retry.token, b"stale").await, Fenced::LeaseLost);
    assert!(!ctx.complete(&key, third.token, b"done").await.is_lease_lost());
}

/// No attempt holds [`Token::NONE`]: on a released record `complete`, `release` and `extend`
/// with it are refused, and the record is untouched.
async fn the_token_of_no_attempt_holds_nothing<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let token = ctx.acquire(&ctx.request(&key, 1)).await;
    assert_eq!(ctx.release(&key, token).await, Fenced::Accepted(()));
    let before = ctx.store.get(&ctx.scope, &key).await.unwrap();
    assert_eq!(ctx.complete(&key, Token::NONE, b"x").await, Fenced::LeaseLost);
    assert_eq!(ctx.extend(&key, Token::NONE, LONG).await, Fenced::LeaseLost);
    assert_eq!(ctx.release(&key, Token::NONE).await, Fenced::LeaseLost);
    assert_eq!(ctx.store.get(&ctx.scope, &key).await.unwrap(), before);
}

/// A released record lasts until the retention its attempts gave it; then the key is new again:
/// attempt 1, any payload.
async fn released_record_expires_after_retention<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let unit = ctx.unit();
    let token = ctx
        .acquire(&ctx.request(&key, 1).lease(unit).retention(unit * 4))
        .await;
    assert_eq!(ctx.release(&key, token).await, Fenced::Accepted(()));
    let stats = ctx.store.stats(Some(&ctx.scope)).await.unwrap();
    assert_eq!((stats.in_flight, stats.stale_leases), (1, 1), "{stats:?}");
    ctx.time.pass(unit * 5).await;
    assert_eq!(ctx.store.get(&ctx.scope, &key).await.unwrap(), None);
    match ctx.begin(&ctx.request(&key, 2)).await {
        Claim::Acquired(held) => assert_eq!((held.attempt, held.recovered), (1, false)),
        other => panic!("expected a new record, got {other:?}"),
    }
}

/// `extend` moves the lease to now + lease: a caller arriving after the original lease would
/// have expired still sees the attempt in flight, and without further heartbeats the extended
/// lease runs out too.
///
/// With a real clock only the lower bound of a sleep is guaranteed, so every "still live" check
/// here has several units of margin.
async fn extend_keeps_the_lease_alive<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let unit = ctx.unit();
    let token = ctx.acquire(&ctx.request(&key, 1).lease(unit * 2)).await;
    ctx.time.pass(unit).await;
    let Fenced::Accepted(lease_until) = ctx.extend(&key, token, unit * 6).await else {
        panic!("the holder's extend must be accepted");
    };
    ctx.time.pass(unit * 2).await;
    // Three units after acquiring: the original two-unit lease is over, the extended one is not.
    assert!(
        matches!(
            ctx.begin(&ctx.request(&key, 1)).await,
            Claim::InFlight { attempt: 1, .. }
        ),
        "an extended lease was taken over"
    );
    let record = ctx.store.get(&ctx.scope, &key).await.unwrap().unwrap();
    let RecordState::InFlight {
        lease_until: stored, ..
    } = record.state
    else {
        panic!("in flight")
    };
    assert_eq!(stored, lease_until);
    assert!(record.expires_at >= lease_until);
    ctx.time.pass(unit * 5).await;
    assert!(matches!(
        ctx.begin(&ctx.request(&key, 1)).await,
        Claim::Acquired(Held {
            attempt: 2,
            recovered: true,
            ..
        })
    ));
}

/// A completed record expires after its retention: then the key is new again (attempt 1, not
/// recovered) and `get` no longer returns it.
async fn completed_record_expires_after_retention<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let token = ctx.acquire(&ctx.request(&key, 1)).await;
    let retention = ctx.unit() * 4;
    let done = ctx
        .store
        .complete(&ctx.held(&key, token), Outcome::from(&b"x"[..]), retention)
        .await
        .unwrap();
    assert!(!done.is_lease_lost());
    assert!(matches!(ctx.begin(&ctx.request(&key, 1)).await, Claim::Replay(_)));
    ctx.time.pass(ctx.unit() * 5).await;
    assert_eq!(ctx.store.get(&ctx.scope, &key).await.unwrap(), None);
    assert_eq!(ctx.complete(&key, token, b"y").await, Fenced::LeaseLost);
    assert!(matches!(
        ctx.begin(&ctx.request(&key, 2)).await,
        Claim::Acquired(Held {
            attempt: 1,
            recovered: false,
            ..
        })
    ));
}

/// `StoreAdmin::now` reads the clock the records are measured by: right after a `begin`, it is
/// at or after the record's creation and before the end of its lease.
async fn now_is_the_clock_of_the_records<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let unit = ctx.unit();
    let _ = ctx.acquire(&ctx.request(&key, 1).lease(unit * 20)).await;
    let now = ctx.store.now().await.expect("now");
    let record = ctx
        .store
        .get(&ctx.scope, &key)
        .await
        .unwrap()
        .expect("the record");
    let RecordState::InFlight { lease_until, .. } = record.state else {
        panic!("in flight: {record:?}");
    };
    assert!(
        now >= record.created_at,
        "now {now:?} before creation {:?}",
        record.created_at
    );
    assert!(
        now < lease_until,
        "now {now:?} after the lease's end {lease_until:?}"
    );
}

/// Extreme durations, up to `Duration::MAX`, are clamped to [`idempotency_core::MAX_DURATION`]
/// by every store: a lease, a retention and a heartbeat that long are accepted, never an error
/// or a panic, and the record lives on (its expiry far ahead but within the stores' calendars).
async fn extreme_durations_are_clamped<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let token = ctx
        .acquire(&ctx.request(&key, 1).lease(Duration::MAX).retention(Duration::MAX))
        .await;
    assert!(matches!(
        ctx.begin(&ctx.request(&key, 1)).await,
        Claim::InFlight { attempt: 1, .. }
    ));
    let Fenced::Accepted(lease_until) = ctx.extend(&key, token, Duration::MAX).await else {
        panic!("the holder's extend must be accepted");
    };
    let record = ctx
        .store
        .get(&ctx.scope, &key)
        .await
        .unwrap()
        .expect("the record lives");
    let century = Duration::from_secs(100 * 365 * 86_400);
    assert!(lease_until > record.created_at.after(century), "{lease_until:?}");
    assert!(record.expires_at >= lease_until, "{record:?}");
    let Fenced::Accepted(expires_at) = ctx
        .store
        .complete(&ctx.held(&key, token), Outcome::from(&b"x"[..]), Duration::MAX)
        .await
        .expect("complete")
    else {
        panic!("the holder's complete must be accepted");
    };
    assert!(expires_at > record.created_at.after(century), "{expires_at:?}");
    let hour = Duration::from_secs(3600);
    assert!(
        expires_at.since(record.created_at) <= idempotency_core::MAX_DURATION + hour,
        "clamped: {expires_at:?}"
    );
    assert!(matches!(ctx.begin(&ctx.request(&key, 1)).await, Claim::Replay(_)));
}

/// An abandoned in-flight record is kept for its retention (so operators see it), then expires
/// like any other.
async fn abandoned_in_flight_record_expires_after_retention<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let unit = ctx.unit();
    let _ = ctx
        .acquire(&ctx.request(&key, 1).lease(unit).retention(unit * 6))
        .await;
    ctx.time.pass(unit * 2).await;
    let stats = ctx.store.stats(Some(&ctx.scope)).await.unwrap();
    assert_eq!((stats.in_flight, stats.stale_leases), (1, 1), "{stats:?}");
    ctx.time.pass(unit * 5).await;
    assert_eq!(ctx.store.get(&ctx.scope, &key).await.unwrap(), None);
    assert!(matches!(
        ctx.begin(&ctx.request(&key, 1)).await,
        Claim::Acquired(Held {
            attempt: 1,
            recovered: false,
            ..
        })
    ));
}

/// `get` shows the record in each state.
async fn get_reports_each_state<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    assert_eq!(ctx.store.get(&ctx.scope, &key).await.unwrap(), None);
    let request = ctx.request(&key, 7);
    let token = ctx.acquire(&request).await;
    let in_flight = ctx.store.get(&ctx.scope, &key).await.unwrap().unwrap();
    assert_eq!((&in_flight.scope, &in_flight.key), (&ctx.scope, &key));
    let RecordState::InFlight {
        token: held,
        acquired_at,
        lease_until,
    } = in_flight.state
    else {
        panic!("in flight")
    };
    assert_eq!(held, token);
    assert!(in_flight.created_at <= acquired_at && acquired_at < lease_until);
    assert!(lease_until <= in_flight.expires_at);

    let _ = ctx.complete(&key, token, b"result").await;
    let completed = ctx.store.get(&ctx.scope, &key).await.unwrap().unwrap();
    assert_eq!(completed.created_at, in_flight.created_at);
    assert_eq!(completed.fingerprint, fp(7));
    let RecordState::Completed {
        outcome,
        completed_at,
        ..
    } = completed.state
    else {
        panic!("completed")
    };
    assert_eq!(outcome.as_bytes(), b"result");
    assert!(acquired_at <= completed_at && completed_at < completed.expires_at);
}

/// Keys and scopes are compared byte for byte: keys that differ only in letter case, or one
/// that is a prefix of another, are distinct keys, each with its own record, and so are scopes.
async fn keys_and_scopes_are_compared_exactly<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let base = key();
    let variants: Vec<Key> = [
        base.as_str().to_owned(),
        base.as_str().to_uppercase(),
        format!("{}X", base.as_str()),
        format!("{}x", base.as_str()),
        base.as_str()[..base.as_str().len() - 1].to_owned(),
    ]
    .iter()
    .map(|k| Key::new(k).unwrap())
    .collect();
    for (n, key) in variants.iter().enumerate() {
        let token = ctx.acquire(&ctx.request(key, 1)).await;
        let done = ctx
            .store
            .complete(&ctx.held(key, token), Outcome::new(format!("outcome {n}")), KEEP)
            .await
            .unwrap();
        assert!(!done.is_lease_lost(), "{key}");
    }
    for (n, key) in variants.iter().enumerate() {
        let Claim::Replay(done) = ctx.begin(&ctx.request(key, 1)).await else {
            panic!("{key} has no record of its own")
        };
        assert_eq!(
            done.outcome.as_bytes(),
            format!("outcome {n}").as_bytes(),
            "{key}"
        );
    }
    let upper = Scope::new(ctx.scope.as_str().to_uppercase()).unwrap();
    let theirs = BeginRequest::new(upper.clone(), variants[0].clone(), fp(1))
        .lease(LONG)
        .retention(KEEP);
    assert!(
        matches!(ctx.store.begin(&theirs).await.unwrap(), Claim::Acquired(_)),
        "a scope differing in case must be another scope"
    );
}

/// Outcomes are stored byte for byte: empty, every byte value, and a 1 MiB body; a listing
/// reports each one's size.
async fn outcomes_round_trip_byte_for_byte<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let every_byte: Vec<u8> = (0..=255u8).cycle().take(4096).collect();
    let large: Vec<u8> = (0..(1 << 20))
        .map(|i: u32| i.wrapping_mul(2_654_435_761).to_be_bytes()[1])
        .collect();
    let mut sizes = Vec::new();
    for body in [Vec::new(), every_byte, large] {
        let key = key();
        sizes.push((key.clone(), body.len()));
        let token = ctx.acquire(&ctx.request(&key, 1)).await;
        let outcome = Outcome::new(Bytes::from(body.clone()));
        let done = ctx
            .store
            .complete(&ctx.held(&key, token), outcome, KEEP)
            .await
            .unwrap();
        assert!(!done.is_lease_lost());
        let Claim::Replay(replayed) = ctx.begin(&ctx.request(&key, 1)).await else {
            panic!("replay")
        };
        assert_eq!(replayed.outcome.len(), body.len());
        assert!(
            replayed.outcome.as_bytes() == body.as_slice(),
            "outcome bytes changed"
        );
    }
    let listed = ctx
        .store
        .list(&ListFilter::default().scope(ctx.scope.clone()))
        .await
        .unwrap();
    for (key, size) in sizes {
        let summary = listed
            .iter()
            .find(|summary| summary.key == key)
            .unwrap_or_else(|| panic!("{key} is not listed"));
        assert!(
            matches!(summary.state, SummaryState::Completed { outcome_len, .. } if outcome_len == size),
            "{key}: listed as {:?}, the outcome has {size} bytes",
            summary.state
        );
    }
}

/// The same key in two scopes is two records: neither sees the other's state or outcome.
async fn scopes_isolate_keys<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let other = Scope::new(format!("{}-other", ctx.scope)).unwrap();
    let key = key();
    let token = ctx.acquire(&ctx.request(&key, 1)).await;
    let theirs = BeginRequest::new(other.clone(), key.clone(), fp(2))
        .lease(LONG)
        .retention(KEEP);
    assert!(
        matches!(
            ctx.store.begin(&theirs).await.unwrap(),
            Claim::Acquired(Held { attempt: 1, .. })
        ),
        "a key in another scope must be independent (not in flight, not a mismatch)"
    );
    let _ = ctx.complete(&key, token, b"mine").await;
    assert!(matches!(
        ctx.store
            .begin(&theirs.clone().token(Token::random()))
            .await
            .unwrap(),
        Claim::InFlight { .. }
    ));
    assert_eq!(
        ctx.store
            .complete(&held(&other, &key, token), Outcome::from(&b"x"[..]), KEEP)
            .await
            .unwrap(),
        Fenced::LeaseLost,
        "a token from one scope must not act on another"
    );
    let _ = ctx
        .store
        .complete(
            &held(&other, &key, theirs.token),
            Outcome::from(&b"theirs"[..]),
            KEEP,
        )
        .await
        .unwrap();
    let Claim::Replay(mine) = ctx.begin(&ctx.request(&key, 1)).await else {
        panic!("replay")
    };
    assert_eq!(mine.outcome.as_bytes(), b"mine");
    let Claim::Replay(their) = ctx.store.begin(&theirs.token(Token::random())).await.unwrap() else {
        panic!("replay")
    };
    assert_eq!(their.outcome.as_bytes(), b"theirs");
}

/// `forget` deletes a live record only with the token it holds (a completed record's, an in-flight
/// one's, a released one's [`Token::NONE`]); the key then runs as a new first attempt, with any
/// payload, and the forgotten attempt's token holds nothing. A stale token, an absent key and an
/// expired record delete nothing.
async fn forget_deletes_only_the_record_that_holds_the_token<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let forget =
        async |key: &Key, token: Token| ctx.store.forget(&ctx.scope, key, token).await.expect("forget");

    let done = key();
    let token = ctx.acquire(&ctx.request(&done, 1)).await;
    assert!(!ctx.complete(&done, token, b"charged").await.is_lease_lost());
    let before = ctx.store.get(&ctx.scope, &done).await.unwrap();
    assert_eq!(before.as_ref().map(Record::token), Some(token));
    assert_eq!(forget(&done, Token::random()).await, Fenced::LeaseLost);
    assert_eq!(forget(&done, Token::NONE).await, Fenced::LeaseLost);
    assert_eq!(
        ctx.store.get(&ctx.scope, &done).await.unwrap(),
        before,
        "untouched"
    );
    assert_eq!(forget(&done, token).await, Fenced::Accepted(()));
    assert_eq!(ctx.store.get(&ctx.scope, &done).await.unwrap(), None);
    assert_eq!(forget(&done, token).await, Fenced::LeaseLost, "nothing left");
    match ctx.begin(&ctx.request(&done, 2)).await {
        Claim::Acquired(held) => assert_eq!((held.attempt, held.recovered), (1, false)),
        other => panic!("expected a new first attempt, got {other:?}"),
    }
    assert_eq!(ctx.complete(&done, token, b"late").await, Fenced::LeaseLost);

    let running = key();
    let first = ctx.acquire(&ctx.request(&running, 1)).await;
    assert_eq!(forget(&running, first).await, Fenced::Accepted(()));
    assert_eq!(ctx.complete(&running, first, b"late").await, Fenced::LeaseLost);
    assert_eq!(ctx.extend(&running, first, LONG).await, Fenced::LeaseLost);

    let released = key();
    let token = ctx.acquire(&ctx.request(&released, 1)).await;
    assert_eq!(ctx.release(&released, token).await, Fenced::Accepted(()));
    assert_eq!(
        forget(&released, token).await,
        Fenced::LeaseLost,
        "released: held by no attempt"
    );
    assert_eq!(forget(&released, Token::NONE).await, Fenced::Accepted(()));
    assert_eq!(ctx.store.get(&ctx.scope, &released).await.unwrap(), None);

    assert_eq!(forget(&key(), Token::NONE).await, Fenced::LeaseLost, "absent");

    let unit = ctx.unit();
    let expiring = key();
    let token = ctx.acquire(&ctx.request(&expiring, 1)).await;
    let _ = ctx
        .store
        .complete(&ctx.held(&expiring, token), Outcome::empty(), unit)
        .await
        .unwrap();
    ctx.time.pass(unit * 2).await;
    assert_eq!(forget(&expiring, token).await, Fenced::LeaseLost, "expired");
}

/// `purge_expired` deletes expired records, at most `limit` per call, and nothing live.
async fn purge_expired_deletes_only_expired<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    ctx.purge_all().await;
    let unit = ctx.unit();
    let mut live = Vec::new();
    for n in 0..5 {
        let key = key();
        let token = ctx.acquire(&ctx.request(&key, 1)).await;
        let retention = if n < 3 { unit } else { KEEP };
        let _ = ctx
            .store
            .complete(&held(&ctx.scope, &key, token), Outcome::empty(), retention)
            .await
            .unwrap();
        if n >= 3 {
            live.push(key);
        }
    }
    let abandoned = key();
    let _ = ctx
        .acquire(&ctx.request(&abandoned, 1).lease(unit).retention(unit))
        .await;
    let kept_in_flight = key();
    let _ = ctx.acquire(&ctx.request(&kept_in_flight, 1)).await;
    ctx.time.pass(unit * 2).await;

    let stats = ctx.store.stats(Some(&ctx.scope)).await.unwrap();
    if harness.expires_by_itself() {
        assert_eq!(
            (stats.expired, stats.completed, stats.in_flight),
            (0, 2, 1),
            "{stats:?}"
        );
        assert_eq!(
            ctx.store.purge_expired(100).await.unwrap(),
            0,
            "nothing is left to purge"
        );
    } else {
        assert_eq!(
            (stats.expired, stats.completed, stats.in_flight),
            (4, 2, 1),
            "{stats:?}"
        );
        assert_eq!(
            ctx.store.purge_expired(3).await.unwrap(),
            3,
            "purge must honour its limit"
        );
        assert_eq!(ctx.store.purge_expired(100).await.unwrap(), 1);
        assert_eq!(ctx.store.purge_expired(100).await.unwrap(), 0);
    }
    let stats = ctx.store.stats(Some(&ctx.scope)).await.unwrap();
    assert_eq!(
        (stats.expired, stats.completed, stats.in_flight),
        (0, 2, 1),
        "{stats:?}"
    );
    for key in &live {
        assert!(matches!(ctx.begin(&ctx.request(key, 1)).await, Claim::Replay(_)));
    }
    assert!(matches!(
        ctx.begin(&ctx.request(&kept_in_flight, 1)).await,
        Claim::InFlight { .. }
    ));
}

/// `stats` counts by state and reports the age of the oldest in-flight attempt and the stale
/// leases.
async fn stats_report_oldest_in_flight_age<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let unit = ctx.unit();
    assert_eq!(
        ctx.store.stats(Some(&ctx.scope)).await.unwrap(),
        Default::default()
    );
    let old = key();
    let _ = ctx.acquire(&ctx.request(&old, 1).lease(unit)).await;
    ctx.time.pass(unit * 2).await;
    let young = key();
    let _ = ctx.acquire(&ctx.request(&young, 1)).await;
    let done = key();
    let token = ctx.acquire(&ctx.request(&done, 1)).await;
    let _ = ctx.complete(&done, token, b"").await;

    let stats = ctx.store.stats(Some(&ctx.scope)).await.unwrap();
    assert_eq!(stats.in_flight, 2);
    assert_eq!(stats.stale_leases, 1, "the old attempt's lease has expired");
    assert_eq!(stats.completed, 1);
    assert_eq!(stats.expired, 0);
    let oldest = stats.oldest_in_flight.expect("two attempts in flight");
    assert!(
        oldest >= unit * 2,
        "oldest in-flight age {oldest:?} is less than the time passed"
    );
    if ctx.time.is_exact() {
        assert_eq!(oldest, unit * 2);
    }
    let everything = ctx.store.stats(None).await.unwrap();
    assert!(everything.in_flight >= 2 && everything.completed >= 1);
    assert!(everything.oldest_in_flight.unwrap() >= oldest);
}

/// `list` filters by scope, state and age, orders by `(scope, key)`, and pages with `after`.
async fn list_filters_orders_and_pages<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let unit = ctx.unit();
    let keys: Vec<Key> = (0..6).map(|i| Key::new(format!("k{i}")).unwrap()).collect();
    // k0, k1 in flight for a while; k2..k5 completed later.
    for key in &keys[..2] {
        let _ = ctx.acquire(&ctx.request(key, 1)).await;
    }
    ctx.time.pass(unit * 2).await;
    for key in &keys[2..] {
        let token = ctx.acquire(&ctx.request(key, 1)).await;
        let _ = ctx.complete(key, token, b"0123456789").await;
    }
    let other = Scope::new(format!("{}-other", ctx.scope)).unwrap();
    let _ = ctx
        .store
        .begin(&BeginRequest::new(other.clone(), keys[0].clone(), fp(1)).lease(LONG))
        .await
        .unwrap();

    let mine = ListFilter::default().scope(ctx.scope.clone());
    let all = ctx.store.list(&mine).await.unwrap();
    let listed: Vec<&str> = all.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(listed, ["k0", "k1", "k2", "k3", "k4", "k5"]);
    assert!(all.iter().all(|r| r.scope == ctx.scope));
    assert!(matches!(
        all[3].state,
        SummaryState::Completed { outcome_len: 10, .. }
    ));

    let in_flight = ctx
        .store
        .list(&mine.clone().state(StateFilter::InFlight))
        .await
        .unwrap();
    assert_eq!(
        in_flight.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(),
        ["k0", "k1"]
    );
    assert!(matches!(in_flight[0].state, SummaryState::InFlight { .. }));
    let completed = ctx
        .store
        .list(&mine.clone().state(StateFilter::Completed))
        .await
        .unwrap();
    assert_eq!(completed.len(), 4);

    let stale = ctx.store.list(&mine.clone().older_than(unit * 2)).await.unwrap();
    assert_eq!(
        stale.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(),
        ["k0", "k1"]
    );

    let page1 = ctx.store.list(&mine.clone().limit(4)).await.unwrap();
    assert_eq!(page1.len(), 4);
    let last = page1.last().unwrap();
    let page2 = ctx
        .store
        .list(&mine.clone().limit(4).after(last.scope.clone(), last.key.clone()))
        .await
        .unwrap();
    assert_eq!(
        page2.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(),
        ["k4", "k5"]
    );

    let theirs = ctx.store.list(&ListFilter::default().scope(other)).await.unwrap();
    assert_eq!(theirs.len(), 1);
}

/// How many keys each batch of the batch race claims.
const BATCH_KEYS: usize = 8;
/// How many times the batch race runs per store: each round is 64 batches of 8 keys, twice
/// (claims, then replays), so three rounds are ~3,000 calls; the crossing orders deadlock a
/// store that locks in the batch's own order in the first round.
const BATCH_RACE_ROUNDS: usize = 3;

/// One `begin_many` over keys in every state answers each as its single call would: a new key
/// is acquired, a completed one replays, a live lease is in flight, another fingerprint is a
/// mismatch, an expired lease is taken over, the caller's own token acquires again; and an
/// empty batch gets no answer.
async fn a_batch_answers_each_key_as_its_single_call_would<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    assert!(ctx.store.begin_many(&[]).await.is_empty());
    let (new, done, busy, other, expired, own) = (key(), key(), key(), key(), key(), key());
    let token = ctx.acquire(&ctx.request(&done, 1)).await;
    assert!(!ctx.complete(&done, token, b"kept").await.is_lease_lost());
    let _ = ctx.acquire(&ctx.request(&busy, 1)).await;
    let _ = ctx.acquire(&ctx.request(&other, 1)).await;
    let _ = ctx.acquire(&ctx.request(&expired, 1).lease(ctx.unit() * 2)).await;
    let mine = ctx.request(&own, 1);
    let _ = ctx.acquire(&mine).await;
    ctx.time.pass(ctx.unit() * 3).await;

    let batch = [
        ctx.request(&busy, 1),
        ctx.request(&new, 1),
        ctx.request(&expired, 1),
        ctx.request(&other, 2),
        mine.clone(),
        ctx.request(&done, 1),
    ];
    let claims: Vec<Claim> = ctx
        .store
        .begin_many(&batch)
        .await
        .into_iter()
        .map(|claim| claim.expect("begin_many"))
        .collect();
    assert_eq!(claims.len(), batch.len(), "{claims:?}");
    assert!(
        matches!(claims[0], Claim::InFlight { attempt: 1, .. }),
        "{:?}",
        claims[0]
    );
    assert!(
        matches!(&claims[1], Claim::Acquired(held) if held.token == batch[1].token && held.attempt == 1 && !held.recovered),
        "{:?}",
        claims[1]
    );
    assert!(
        matches!(&claims[2], Claim::Acquired(held) if held.token == batch[2].token && held.attempt == 2 && held.recovered),
        "{:?}",
        claims[2]
    );
    assert_eq!(claims[3], Claim::Mismatch);
    assert!(
        matches!(&claims[4], Claim::Acquired(held) if held.token == mine.token && held.attempt == 1),
        "{:?}",
        claims[4]
    );
    assert!(
        matches!(&claims[5], Claim::Replay(replay) if replay.outcome.as_bytes() == b"kept"),
        "{:?}",
        claims[5]
    );
    // What the batch claimed is held as a single call's claim is.
    for (request, claim) in batch.iter().zip(&claims) {
        if let Claim::Acquired(held) = claim {
            let record = ctx.store.get(&ctx.scope, &request.key).await.unwrap().unwrap();
            assert!(
                matches!(record.state, RecordState::InFlight { token, .. } if token == held.token),
                "{record:?}"
            );
            assert_eq!(record.attempt, held.attempt);
        }
    }
}

/// A key twice in one batch: the first request claims it, the second (another token) finds it
/// in flight, and the same request twice acquires twice (a retry with its own token). Two
/// completions of one key with the held token are both accepted, as a completion retried with
/// its token is.
async fn the_same_key_twice_in_a_batch_is_claimed_by_the_first<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let key = key();
    let (first, second) = (ctx.request(&key, 1), ctx.request(&key, 1));
    let claims = ctx.store.begin_many(&[first.clone(), second]).await;
    assert!(
        matches!(&claims[0], Ok(Claim::Acquired(held)) if held.token == first.token && held.attempt == 1),
        "{claims:?}"
    );
    assert!(
        matches!(claims[1], Ok(Claim::InFlight { attempt: 1, .. })),
        "{claims:?}"
    );

    let twice = ctx.store.begin_many(&[first.clone(), first.clone()]).await;
    assert!(
        twice
            .iter()
            .all(|claim| matches!(claim, Ok(Claim::Acquired(held)) if held.token == first.token)),
        "{twice:?}"
    );

    let held = ctx.held(&key, first.token);
    let done = ctx
        .store
        .complete_many(&[
            Completion::new(held.clone(), Outcome::from(&b"once"[..]), KEEP),
            Completion::new(held, Outcome::from(&b"once"[..]), KEEP),
        ])
        .await;
    assert!(
        done.iter()
            .all(|fenced| matches!(fenced, Ok(Fenced::Accepted(_)))),
        "{done:?}"
    );
    assert!(
        matches!(ctx.begin(&ctx.request(&key, 1)).await, Claim::Replay(replay) if replay.outcome.as_bytes() == b"once")
    );
}

/// A stale token among fresh ones in `complete_many`: only its completion gets `LeaseLost`,
/// the newer attempt's record is untouched, and the others complete.
async fn a_stale_token_in_a_batch_loses_only_its_own_lease<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let (a, b, c) = (key(), key(), key());
    let token_a = ctx.acquire(&ctx.request(&a, 1)).await;
    let stale = ctx.acquire(&ctx.request(&b, 1).lease(ctx.unit() * 2)).await;
    let token_c = ctx.acquire(&ctx.request(&c, 1)).await;
    ctx.time.pass(ctx.unit() * 3).await;
    let newer = ctx.acquire(&ctx.request(&b, 1)).await;

    let done = ctx
        .store
        .complete_many(&[
            Completion::new(ctx.held(&a, token_a), Outcome::from(&b"a"[..]), KEEP),
            Completion::new(ctx.held(&b, stale), Outcome::from(&b"stale"[..]), KEEP),
            Completion::new(ctx.held(&c, token_c), Outcome::from(&b"c"[..]), KEEP),
        ])
        .await;
    assert!(matches!(done[0], Ok(Fenced::Accepted(_))), "{done:?}");
    assert!(matches!(done[1], Ok(Fenced::LeaseLost)), "{done:?}");
    assert!(matches!(done[2], Ok(Fenced::Accepted(_))), "{done:?}");
    assert!(ctx.store.complete_many(&[]).await.is_empty());

    for (key, outcome) in [(&a, &b"a"[..]), (&c, &b"c"[..])] {
        assert!(
            matches!(ctx.begin(&ctx.request(key, 1)).await, Claim::Replay(replay) if replay.outcome.as_bytes() == outcome)
        );
    }
    let record = ctx.store.get(&ctx.scope, &b).await.unwrap().unwrap();
    assert!(
        matches!(record.state, RecordState::InFlight { token, .. } if token == newer),
        "{record:?}"
    );
    assert_eq!(record.attempt, 2);
}

/// 64 concurrent `begin_many`s, each over the same eight new keys in an order of its own:
/// every key is acquired exactly once and in flight for the other 63 (a store that locks per
/// key in a batch must not deadlock or fail a batch here); then the winners complete in
/// batches and 64 more batches all replay. Repeated [`BATCH_RACE_ROUNDS`] times.
async fn race_64_batches_over_the_same_keys_claim_each_key_once<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    for round in 0..BATCH_RACE_ROUNDS {
        let keys: Vec<Key> = (0..BATCH_KEYS).map(|_| key()).collect();
        let answers = race_batches(&ctx, &keys, round).await;
        let mut winners: Vec<Option<Token>> = vec![None; BATCH_KEYS];
        for (order, claims) in &answers {
            for (at, claim) in order.iter().zip(claims) {
                match claim {
                    Claim::Acquired(held) => {
                        assert!(winners[*at].is_none(), "round {round}: key {at} acquired twice");
                        winners[*at] = Some(held.token);
                    }
                    Claim::InFlight { attempt: 1, .. } => {}
                    other => panic!("round {round}: key {at}: {other:?}"),
                }
            }
        }
        let winners: Vec<Token> = winners
            .into_iter()
            .enumerate()
            .map(|(at, token)| token.unwrap_or_else(|| panic!("round {round}: key {at} was never acquired")))
            .collect();
        let completions: Vec<Completion> = keys
            .iter()
            .zip(&winners)
            .map(|(key, token)| Completion::new(ctx.held(key, *token), Outcome::from(&b"once"[..]), KEEP))
            .collect();
        for done in ctx.store.complete_many(&completions).await {
            assert!(matches!(done, Ok(Fenced::Accepted(_))), "round {round}: {done:?}");
        }
        for (_, claims) in race_batches(&ctx, &keys, round).await {
            assert!(
                claims
                    .iter()
                    .all(|c| matches!(c, Claim::Replay(done) if done.outcome.as_bytes() == b"once")),
                "round {round}: {claims:?}"
            );
        }
    }
}

/// [`RACERS`] tasks each `begin_many` over `keys` in an order of its own, released together:
/// each task's order (indexes into `keys`) and its answers in that order.
async fn race_batches<S: StoreAdmin + Clone + 'static>(
    ctx: &Ctx<S>,
    keys: &[Key],
    round: usize,
) -> Vec<(Vec<usize>, Vec<Claim>)> {
    let barrier = Arc::new(Barrier::new(RACERS));
    let mut racers = Vec::with_capacity(RACERS);
    for racer in 0..RACERS {
        let store = ctx.store.clone();
        let barrier = Arc::clone(&barrier);
        // A rotation and a direction of its own: the orders cross in every way a lock could.
        let mut order: Vec<usize> = (0..keys.len())
            .map(|i| (i + racer + round) % keys.len())
            .collect();
        if racer % 2 == 1 {
            order.reverse();
        }
        let batch: Vec<BeginRequest> = order.iter().map(|at| ctx.request(&keys[*at], 1)).collect();
        racers.push(tokio::spawn(async move {
            barrier.wait().await;
            let claims = store
                .begin_many(&batch)
                .await
                .into_iter()
                .map(|claim| claim.expect("begin_many during the race"))
                .collect();
            (order, claims)
        }));
    }
    let mut answers = Vec::with_capacity(RACERS);
    for racer in racers {
        answers.push(racer.await.expect("racer task"));
    }
    answers
}

async fn race_once<S: Store + Clone + 'static>(store: &S, request: &BeginRequest) -> Vec<Claim> {
    let barrier = Arc::new(Barrier::new(RACERS));
    let mut racers = Vec::with_capacity(RACERS);
    for _ in 0..RACERS {
        let store = store.clone();
        let barrier = Arc::clone(&barrier);
        let request = request.clone().token(Token::random());
        racers.push(tokio::spawn(async move {
            barrier.wait().await;
            store.begin(&request).await.expect("begin during the race")
        }));
    }
    let mut claims = Vec::with_capacity(RACERS);
    for racer in racers {
        claims.push(racer.await.expect("racer task"));
    }
    claims
}

/// 64 concurrent `begin`s on one new key: exactly one `Acquired`, 63 `InFlight`; then 64
/// concurrent duplicates after completion all replay. Repeated [`RACE_ROUNDS`] times.
async fn race_64_begins_exactly_one_acquires<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    for round in 0..RACE_ROUNDS {
        let key = key();
        let claims = race_once(&ctx.store, &ctx.request(&key, 1)).await;
        let winners: Vec<Token> = claims
            .iter()
            .filter_map(|claim| match claim {
                Claim::Acquired(Held {
                    token, attempt: 1, ..
                }) => Some(*token),
                _ => None,
            })
            .collect();
        let in_flight = claims
            .iter()
            .filter(|c| matches!(c, Claim::InFlight { attempt: 1, .. }))
            .count();
        assert_eq!(
            winners.len(),
            1,
            "round {round}: {} callers acquired one key: {claims:?}",
            winners.len()
        );
        assert_eq!(in_flight, RACERS - 1, "round {round}: {claims:?}");

        assert!(!ctx.complete(&key, winners[0], b"once").await.is_lease_lost());
        let replays = race_once(&ctx.store, &ctx.request(&key, 1)).await;
        assert!(
            replays
                .iter()
                .all(|c| matches!(c, Claim::Replay(done) if done.outcome.as_bytes() == b"once")),
            "round {round}: {replays:?}"
        );
    }
}

/// 64 concurrent `begin`s on an expired lease: exactly one takes over.
async fn race_64_begins_on_expired_lease_exactly_one_takes_over<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let rounds = if ctx.time.is_exact() { RACE_ROUNDS } else { 10 };
    let mut keys = Vec::new();
    for _ in 0..rounds {
        let key = key();
        let _ = ctx.acquire(&ctx.request(&key, 1).lease(ctx.unit())).await;
        keys.push(key);
    }
    ctx.time.pass(ctx.unit() * 2).await;
    for (round, key) in keys.iter().enumerate() {
        let claims = race_once(&ctx.store, &ctx.request(key, 1)).await;
        let takeovers = claims
            .iter()
            .filter(|c| {
                matches!(
                    c,
                    Claim::Acquired(Held {
                        attempt: 2,
                        recovered: true,
                        ..
                    })
                )
            })
            .count();
        let in_flight = claims
            .iter()
            .filter(|c| matches!(c, Claim::InFlight { attempt: 2, .. }))
            .count();
        assert_eq!(
            (takeovers, in_flight),
            (1, RACERS - 1),
            "round {round}: {claims:?}"
        );
    }
}

/// A stale worker's `complete` racing a takeover: whichever the store orders first wins, and the
/// two answers agree — never both accepted, never a lost result.
async fn race_stale_complete_against_takeover<H: Harness>(harness: &H) {
    let ctx = Ctx::new(harness).await;
    let rounds = if ctx.time.is_exact() { 50 } else { 10 };
    let mut held = Vec::new();
    for _ in 0..rounds {
        let key = key();
        let token = ctx.acquire(&ctx.request(&key, 1).lease(ctx.unit())).await;
        held.push((key, token));
    }
    ctx.time.pass(ctx.unit() * 2).await;
    for (key, stale) in held {
        let completing = {
            let (store, scope, key) = (ctx.store.clone(), ctx.scope.clone(), key.clone());
            tokio::spawn(async move {
                store
                    .complete(
                        &crate::held(&scope, &key, stale),
                        Outcome::from(&b"stale"[..]),
                        KEEP,
                    )
                    .await
                    .unwrap()
            })
        };
        let taking_over = {
            let (store, request) = (ctx.store.clone(), ctx.request(&key, 1));
            tokio::spawn(async move { store.begin(&request).await.unwrap() })
        };
        let completed = completing.await.unwrap();
        let claim = taking_over.await.unwrap();
        match (completed, claim) {
            (Fenced::Accepted(_), Claim::Replay(done)) => assert_eq!(done.outcome.as_bytes(), b"stale"),
            (
                Fenced::LeaseLost,
                Claim::Acquired(Held {
                    attempt: 2,
                    recovered: true,
                    ..
                }),
            ) => {}
            other => panic!("inconsistent race outcome: {other:?}"),
        }
    }
}

crate::__with_cases!(define_cases!());

/// Defines [`Case`] from the one case list ([`crate::__with_cases`]).
macro_rules! define_cases {
    (; $($case:ident),* $(,)?) => {
        /// One conformance case: a variant per case function of this module, each named after
        /// the contract it checks.
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Case {
            $(
                #[doc = concat!("`", stringify!($case), "`")]
                $case,
            )*
        }

        impl Case {
            /// Every case, in the order of the list.
            pub const ALL: &[Case] = &[$(Case::$case),*];

            /// Runs the case against a fresh store of `harness`; panics on a violation.
            pub async fn run<H: Harness>(self, harness: &H) {
                match self {
                    $(Case::$case => $case(harness).await,)*
                }
            }
        }
    };
}
use define_cases;

/// Calls every case once; used to check a store quickly outside the test harness.
pub async fn run_all<H: Harness>(harness: &H) {
    for case in Case::ALL {
        case.run(harness).await;
    }
}

//! Two hosts with different clocks share one table: within the `max_clock_skew` bound a lease is
//! not taken over before it is over on every clock; beyond the bound a takeover can overlap the
//! running attempt, and fencing still refuses the stale attempt's `complete`.

use crate::common;

use std::time::Duration;

use idempotency_core::{BeginRequest, Claim, Fingerprint, Key, ManualClock, Outcome, Scope, Store, Token};

fn request(token: Token) -> BeginRequest {
    BeginRequest::new(
        Scope::new("billing").unwrap(),
        Key::new("invoice-7").unwrap(),
        Fingerprint::of_bytes(b"EUR 10"),
    )
    .lease(Duration::from_secs(10))
    .token(token)
}

fn table(name: &str) -> String {
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("skew-{name}-{run}")
}

/// B's clock runs 1.5 s ahead of A's, within the 2 s bound: B sees A's lease as in flight until
/// it is over on B's clock plus the bound, then takes over; A's late `complete` is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn within_the_bound_no_takeover_starts_before_the_lease_is_over_everywhere() {
    let table = table("within");
    let (clock_a, clock_b) = (ManualClock::new(), ManualClock::new());
    clock_b.advance(Duration::from_millis(1500));
    let a = common::store(&table, &clock_a, Duration::from_secs(2)).await;
    let b = common::store(&table, &clock_b, Duration::from_secs(2)).await;
    let (token_a, token_b) = (Token::random(), Token::random());
    let Claim::Acquired(held_a) = a.begin(&request(token_a)).await.unwrap() else {
        panic!("A acquires")
    };
    // A's lease ends at A-time 10 s; B's clock says 11.5 s, inside the skew bound.
    clock_a.advance(Duration::from_secs(10));
    clock_b.advance(Duration::from_secs(10));
    let claim = b.begin(&request(token_b)).await.unwrap();
    assert!(matches!(claim, Claim::InFlight { .. }), "{claim:?}");
    // Past the lease plus the bound on B's clock: B takes over.
    clock_a.advance(Duration::from_secs(1));
    clock_b.advance(Duration::from_secs(1));
    let Claim::Acquired(held_b) = b.begin(&request(token_b)).await.unwrap() else {
        panic!("B takes over")
    };
    assert!(held_b.recovered);
    assert_eq!(held_b.attempt, 2);
    let late = a
        .complete(&held_a, Outcome::new("A"), Duration::from_secs(60))
        .await
        .unwrap();
    assert!(late.is_lease_lost(), "{late:?}");
    let done = b
        .complete(&held_b, Outcome::new("B"), Duration::from_secs(60))
        .await
        .unwrap();
    assert!(!done.is_lease_lost());
}

/// B's clock runs 5 s ahead of A's, beyond the 2 s bound: B takes over while A's lease is still
/// live on A's clock (both attempts may run, as the crate docs say), and fencing refuses A's
/// `complete`, so only B's outcome is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_the_bound_a_takeover_can_overlap_and_fencing_keeps_one_outcome() {
    let table = table("beyond");
    let (clock_a, clock_b) = (ManualClock::new(), ManualClock::new());
    clock_b.advance(Duration::from_secs(5));
    let a = common::store(&table, &clock_a, Duration::from_secs(2)).await;
    let b = common::store(&table, &clock_b, Duration::from_secs(2)).await;
    let (token_a, token_b) = (Token::random(), Token::random());
    let Claim::Acquired(held_a) = a.begin(&request(token_a)).await.unwrap() else {
        panic!("A acquires")
    };
    // A-time 7.5 s: A's lease has 2.5 s left; B's clock says 12.5 s, past lease plus bound.
    clock_a.advance(Duration::from_millis(7500));
    clock_b.advance(Duration::from_millis(7500));
    let Claim::Acquired(held_b) = b.begin(&request(token_b)).await.unwrap() else {
        panic!("B takes over early")
    };
    assert!(held_b.recovered);
    let late = a
        .complete(&held_a, Outcome::new("A"), Duration::from_secs(60))
        .await
        .unwrap();
    assert!(late.is_lease_lost(), "{late:?}");
    assert!(
        !b.complete(&held_b, Outcome::new("B"), Duration::from_secs(60))
            .await
            .unwrap()
            .is_lease_lost()
    );
    let Claim::Replay(done) = a.begin(&request(Token::random())).await.unwrap() else {
        panic!("replay")
    };
    assert_eq!(done.outcome.as_bytes(), b"B");
}

//! MemoryStore: begin→complete cycles per second on 1 and 2 threads.
//!
//! Each thread cycles over its own 4096 keys with zero retention, so every `begin` finds an
//! expired record and acquires it again: the map stays at a fixed size and every cycle is a
//! full acquire plus complete.

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{BeginRequest, Claim, Fingerprint, Key, MemoryStore, Outcome, Scope, Store, Token};

use crate::measure::{alternate, count_for, per_second, rate};

pub(crate) fn run(window: Duration, rounds: usize) -> Result<(), String> {
    println!("\n## MemoryStore: begin→complete cycles/s\n");
    println!("| threads | cycles/s | per thread | min–max |");
    println!("|---:|---:|---:|---:|");
    let thread_counts = [1usize, 2];
    let rates = alternate(rounds, thread_counts.len(), |variant| {
        Ok::<_, String>(measure(thread_counts[variant], window))
    })?;
    for (threads, rate) in thread_counts.iter().zip(rates) {
        println!(
            "| {threads} | {} | {} | {} |",
            per_second(rate.median),
            per_second(rate.median / *threads as f64),
            rate.spread()
        );
    }
    Ok(())
}

fn measure(threads: usize, window: Duration) -> f64 {
    let store = MemoryStore::new();
    let workers: Vec<_> = (0..threads)
        .map(|thread| {
            let store = store.clone();
            std::thread::spawn(move || cycle_for(&store, thread, window))
        })
        .collect();
    let results: Vec<(u64, Duration)> = workers.into_iter().map(|w| w.join().expect("worker")).collect();
    let cycles: u64 = results.iter().map(|(n, _)| n).sum();
    let longest = results.iter().map(|(_, d)| *d).max().unwrap_or(window);
    rate(cycles, longest)
}

fn cycle_for(store: &MemoryStore, thread: usize, window: Duration) -> (u64, Duration) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let scope = Scope::new(format!("bench-{thread}")).expect("scope");
    let keys: Arc<[Key]> = (0..4096)
        .map(|i| Key::new(format!("key-{i}")).expect("key"))
        .collect();
    let fingerprint = Fingerprint::of_bytes(b"payload");
    let mut next = 0usize;
    runtime.block_on(async {
        let mut requests: Vec<BeginRequest> = keys
            .iter()
            .map(|key| BeginRequest::new(scope.clone(), key.clone(), fingerprint).retention(Duration::ZERO))
            .collect();
        // `count_for` takes a synchronous step; the memory store's futures complete on first
        // poll, so each step drives one cycle to completion.
        let waker = std::task::Waker::noop();
        let mut context = std::task::Context::from_waker(waker);
        count_for(window, || {
            let request = &mut requests[next % 4096];
            next += 1;
            request.token = Token::random();
            let cycle = async {
                let Claim::Acquired(held) = store.begin(request).await.expect("begin") else {
                    panic!("every cycle must acquire")
                };
                let done = store
                    .complete(&held, Outcome::empty(), Duration::ZERO)
                    .await
                    .expect("complete");
                assert!(!done.is_lease_lost());
            };
            let mut cycle = std::pin::pin!(cycle);
            assert!(
                cycle.as_mut().poll(&mut context).is_ready(),
                "memory store operations never wait"
            );
        })
    })
}

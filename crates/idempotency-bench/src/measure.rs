//! Rounds, medians and the report table.

use std::time::{Duration, Instant};

/// The runtime the async figures run on: two worker threads, one for each of the machine's
/// cores the benchmarks are recorded on.
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
}

/// The cells of a row comparing `ours` with `base`: both medians, their ratio, both spreads.
pub(crate) fn versus(ours: &Samples, base: &Samples) -> String {
    format!(
        "{} | {} | {:.2} | {} | {}",
        per_second(ours.median),
        per_second(base.median),
        ours.median / base.median,
        ours.spread(),
        base.spread()
    )
}

/// Operations per second of one measurement.
pub(crate) fn rate(operations: u64, elapsed: Duration) -> f64 {
    operations as f64 / elapsed.as_secs_f64()
}

/// The median of `values` (which must not be empty).
pub(crate) fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    if values.len().is_multiple_of(2) {
        (values[middle - 1] + values[middle]) / 2.0
    } else {
        values[middle]
    }
}

/// The rates measured for one variant over all rounds.
#[derive(Debug, Clone)]
pub(crate) struct Samples {
    /// The median rate.
    pub(crate) median: f64,
    /// The lowest rate.
    pub(crate) min: f64,
    /// The highest rate.
    pub(crate) max: f64,
}

impl Samples {
    /// The summary of one variant's rates (one per round; at least one).
    pub(crate) fn of(mut rates: Vec<f64>) -> Self {
        Self {
            min: rates.iter().copied().fold(f64::INFINITY, f64::min),
            max: rates.iter().copied().fold(0.0, f64::max),
            median: median(&mut rates),
        }
    }

    /// `min–max` as text, to show how noisy the median is.
    pub(crate) fn spread(&self) -> String {
        format!("{}–{}", per_second(self.min), per_second(self.max))
    }
}

/// Runs `measure` on each variant in turn, `rounds` times, and returns each variant's samples.
/// Alternating the variants spreads drift (turbo, page cache, checkpoints, other load) over all
/// of them.
pub(crate) fn alternate<E>(
    rounds: usize,
    variants: usize,
    mut measure: impl FnMut(usize) -> Result<f64, E>,
) -> Result<Vec<Samples>, E> {
    let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); variants];
    for _ in 0..rounds {
        for (variant, samples) in samples.iter_mut().enumerate() {
            samples.push(measure(variant)?);
        }
    }
    Ok(samples.into_iter().map(Samples::of).collect())
}

/// Counts how many times `step` runs before `window` elapses; checks the clock every 64 steps.
pub(crate) fn count_for(window: Duration, mut step: impl FnMut()) -> (u64, Duration) {
    let started = Instant::now();
    let mut done = 0u64;
    loop {
        for _ in 0..64 {
            step();
        }
        done += 64;
        let elapsed = started.elapsed();
        if elapsed >= window {
            return (done, elapsed);
        }
    }
}

/// Formats a rate with thousands separators.
pub(crate) fn per_second(rate: f64) -> String {
    // Rates are positive and far below 2^53: the cast is exact after rounding.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let whole = rate.round() as u64;
    let digits = whole.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Cycles per second of `callers` concurrent tasks, each calling `cycle(caller, n)` for
/// `n = 0, 1, …` until `window` has passed.
pub(crate) async fn cycles_per_second<F, Fut>(
    callers: usize,
    window: Duration,
    cycle: F,
) -> Result<f64, String>
where
    F: Fn(usize, usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), String>> + Send + 'static,
{
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    let cycle = Arc::new(cycle);
    let stop = Arc::new(AtomicBool::new(false));
    let cycles = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..callers)
        .map(|caller| {
            let (cycle, stop, cycles) = (Arc::clone(&cycle), Arc::clone(&stop), Arc::clone(&cycles));
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    cycle(caller, n).await?;
                    n += 1;
                    cycles.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<(), String>(())
            })
        })
        .collect();
    tokio::time::sleep(window).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.map_err(|e| e.to_string())??;
    }
    Ok(rate(cycles.load(Ordering::Relaxed), started.elapsed()))
}

/// [`alternate`] for asynchronous measurements.
pub(crate) async fn alternate_async<F, Fut>(
    rounds: usize,
    variants: usize,
    mut measure: F,
) -> Result<Vec<Samples>, String>
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = Result<f64, String>>,
{
    let mut results = vec![Vec::new(); variants];
    for _ in 0..rounds {
        for (variant, samples) in results.iter_mut().enumerate() {
            samples.push(measure(variant).await?);
        }
    }
    Ok(results.into_iter().map(Samples::of).collect())
}

/// The store's begin→complete cycles per second (variant 0) against `raw`'s (variant 1), the
/// same requests issued bare on the store's client, by `callers` callers for `window`,
/// alternated over `rounds`.
pub(crate) async fn store_versus_raw<S, R, Fut>(
    store: &S,
    raw: R,
    callers: usize,
    window: Duration,
    rounds: usize,
) -> Result<Vec<Samples>, String>
where
    S: idempotency_core::Store + Clone + Send + Sync + 'static,
    R: Fn(S, idempotency_core::Scope, idempotency_core::Key) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<(), String>> + Send + 'static,
{
    alternate_async(rounds, 2, |variant| {
        let (store, raw) = (store.clone(), raw.clone());
        cycles_per_second(callers, window, move |caller, n| {
            let (store, raw) = (store.clone(), raw.clone());
            async move {
                let (scope, key) = cycle_key(caller, n);
                if variant == 0 {
                    store_cycle(&store, scope, key).await
                } else {
                    raw(store, scope, key).await
                }
            }
        })
    })
    .await
}

/// One begin→complete cycle through a store, with zero retention: the next cycle on the same key
/// finds the record expired and acquires it anew, so the table or map keeps a fixed size.
pub(crate) async fn store_cycle<S: idempotency_core::Store>(
    store: &S,
    scope: idempotency_core::Scope,
    key: idempotency_core::Key,
) -> Result<(), String> {
    use idempotency_core::{BeginRequest, Claim, Fingerprint, Outcome};

    let request = BeginRequest::new(scope, key, Fingerprint::of_bytes(b"payload")).retention(Duration::ZERO);
    let Claim::Acquired(held) = store.begin(&request).await.map_err(|e| e.to_string())? else {
        return Err("a cycle did not acquire".into());
    };
    let done = store
        .complete(&held, Outcome::empty(), Duration::ZERO)
        .await
        .map_err(|e| e.to_string())?;
    if done.is_lease_lost() {
        return Err("complete lost its lease".into());
    }
    Ok(())
}

/// The scope and key of a caller's `n`-th cycle: each caller cycles over its own 1024 keys.
pub(crate) fn cycle_key(caller: usize, n: usize) -> (idempotency_core::Scope, idempotency_core::Key) {
    (
        idempotency_core::Scope::new(format!("bench-{caller}")).expect("a valid scope"),
        idempotency_core::Key::new(format!("key-{}", n % 1024)).expect("a valid key"),
    )
}

/// Connections like a sqlx-based store's own (`max` of them, taken back without a ping), for the
/// raw statements a store is compared with.
pub(crate) struct RawConnections<C: sqlx::Connection>(idempotency_core::connections::Connections<C>);

impl<C: sqlx::Connection> Clone for RawConnections<C> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<C: sqlx::Connection> RawConnections<C> {
    pub(crate) fn new(options: std::sync::Arc<C::Options>, max: u32) -> Self {
        Self(idempotency_core::connections::Connections::new(
            "raw",
            options,
            None,
            usize::try_from(max).unwrap_or(usize::MAX),
            Duration::from_secs(5),
            None,
            |_, error| backend(error),
        ))
    }

    /// Runs `statements` on one connection, as a store runs one operation.
    pub(crate) async fn run<T>(
        &self,
        statements: impl AsyncFnOnce(&mut C) -> Result<T, sqlx::Error>,
    ) -> Result<T, String> {
        self.0
            .run(async |connection| statements(connection).await.map_err(backend))
            .await
            .map_err(|e| e.to_string())
    }
}

/// A driver error as the raw statements report it.
fn backend(error: sqlx::Error) -> idempotency_core::StoreError {
    idempotency_core::StoreError::new(idempotency_core::ErrorKind::Backend, error.to_string())
        .with_source(error)
}

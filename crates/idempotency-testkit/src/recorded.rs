//! Metrics recorded while a test runs, for tests that each metric is emitted, with its labels.
//!
//! ```
//! use idempotency_testkit::recorded::record_metrics;
//!
//! let metrics = record_metrics(async {
//!     metrics::counter!("jobs_total", "kind" => "a").increment(2);
//! });
//! assert_eq!(metrics.counter("jobs_total", &[("kind", "a")]), 2);
//! assert_eq!(metrics.counter("jobs_total", &[("kind", "b")]), 0);
//! assert!(metrics.names().contains(&"jobs_total".to_owned()));
//! ```

use std::future::Future;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::registry::{AtomicStorage, Registry};

/// One recorded series: name, labels, value.
type Series = (String, Vec<(String, String)>, DebugValue);

/// What a test recorded: every counter, gauge and histogram series, by name and labels.
#[derive(Debug)]
pub struct Recorded {
    series: Vec<Series>,
}

/// Runs `test` to completion on a current-thread runtime (tasks it spawns run on the same
/// thread, so they record too) with a recorder of its own, and returns what was recorded.
///
/// # Panics
///
/// If the runtime cannot start, or `test` panics.
pub fn record_metrics<F: Future>(test: F) -> Recorded {
    record(test, false)
}

/// [`record_metrics`] on Tokio's paused clock (timers fire as soon as everything waits), for
/// tests whose store reads Tokio's clock: leases of minutes pass at once.
///
/// # Panics
///
/// As [`record_metrics`].
pub fn record_metrics_paused<F: Future>(test: F) -> Recorded {
    record(test, true)
}

/// What the process-wide recorder has recorded so far, for metrics emitted on threads a test
/// does not run (a client library's own threads, the runtime's blocking pool). The recorder
/// is installed as the global one on the first call, so call this before the code under test
/// creates its metrics, and tell tests of one binary apart by their labels. Reading never
/// resets anything: tests running at the same time each see every value.
///
/// # Panics
///
/// If another global recorder was installed first.
#[must_use]
pub fn global() -> Recorded {
    static REGISTRY: std::sync::OnceLock<&'static Registry<metrics::Key, AtomicStorage>> =
        std::sync::OnceLock::new();
    let registry = *REGISTRY.get_or_init(|| {
        let registry: &'static Registry<metrics::Key, AtomicStorage> =
            Box::leak(Box::new(Registry::atomic()));
        metrics::set_global_recorder(Cumulative(registry)).expect("no other global metrics recorder");
        registry
    });
    let mut series = Vec::new();
    let labels = |key: &metrics::Key| {
        key.labels()
            .map(|label| (label.key().to_owned(), label.value().to_owned()))
            .collect::<Vec<_>>()
    };
    registry.visit_counters(|key, counter| {
        let value = DebugValue::Counter(counter.load(std::sync::atomic::Ordering::SeqCst));
        series.push((key.name().to_owned(), labels(key), value));
    });
    registry.visit_gauges(|key, gauge| {
        let value = f64::from_bits(gauge.load(std::sync::atomic::Ordering::SeqCst));
        series.push((
            key.name().to_owned(),
            labels(key),
            DebugValue::Gauge(value.into()),
        ));
    });
    registry.visit_histograms(|key, histogram| {
        let values = histogram.data().into_iter().map(Into::into).collect();
        series.push((key.name().to_owned(), labels(key), DebugValue::Histogram(values)));
    });
    Recorded { series }
}

/// A recorder whose values only move with the metrics (the debugging recorder's snapshots
/// reset them, which would let one test's read erase another's counts).
struct Cumulative(&'static Registry<metrics::Key, AtomicStorage>);

impl metrics::Recorder for Cumulative {
    fn describe_counter(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_gauge(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_histogram(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}

    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        self.0.get_or_create_counter(key, |counter| {
            metrics::Counter::from_arc(std::sync::Arc::clone(counter))
        })
    }

    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        self.0.get_or_create_gauge(key, |gauge| {
            metrics::Gauge::from_arc(std::sync::Arc::clone(gauge))
        })
    }

    fn register_histogram(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        self.0.get_or_create_histogram(key, |histogram| {
            metrics::Histogram::from_arc(std::sync::Arc::clone(histogram))
        })
    }
}

fn record<F: Future>(test: F, paused: bool) -> Recorded {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(paused)
            .build()
            .expect("a runtime")
            .block_on(test)
    });
    Recorded {
        series: series(&snapshotter),
    }
}

fn series(snapshotter: &metrics_util::debugging::Snapshotter) -> Vec<Series> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let key = key.key();
            let labels = key
                .labels()
                .map(|label| (label.key().to_owned(), label.value().to_owned()))
                .collect();
            (key.name().to_owned(), labels, value)
        })
        .collect()
}

impl Recorded {
    fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&str, &str)],
    ) -> impl Iterator<Item = &'a DebugValue> {
        self.series
            .iter()
            .filter(move |(n, l, _)| {
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(_, _, value)| value)
    }

    /// The sum of the counter `name` over the series carrying every label in `labels`.
    #[must_use]
    pub fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.matching(name, labels)
            .map(|value| match value {
                DebugValue::Counter(n) => *n,
                _ => 0,
            })
            .sum()
    }

    /// The sum of the gauge `name` over the series carrying every label in `labels`.
    #[must_use]
    pub fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels)
            .map(|value| match value {
                DebugValue::Gauge(n) => n.into_inner(),
                _ => 0.0,
            })
            .sum()
    }

    /// How many values the histogram `name` recorded over the series carrying `labels`.
    #[must_use]
    pub fn histogram_count(&self, name: &str, labels: &[(&str, &str)]) -> usize {
        self.matching(name, labels)
            .map(|value| match value {
                DebugValue::Histogram(values) => values.len(),
                _ => 0,
            })
            .sum()
    }

    /// The largest value the histogram `name` recorded over the series carrying `labels`.
    #[must_use]
    pub fn histogram_max(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.matching(name, labels)
            .filter_map(|value| match value {
                DebugValue::Histogram(values) => values.iter().map(|v| v.into_inner()).reduce(f64::max),
                _ => None,
            })
            .reduce(f64::max)
    }

    /// The names of every series recorded, sorted, without repeats.
    #[must_use]
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.series.iter().map(|(name, _, _)| name.clone()).collect();
        names.sort();
        names.dedup();
        names
    }
}

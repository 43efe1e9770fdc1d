//! The overview's decisions per second: the process's own counters, read from its Prometheus
//! exposition every [`INTERVAL`], kept for [`WINDOW`], drawn as inline SVG.
//!
//! The counters are read from the text `/metrics` serves rather than from a second metrics
//! recorder: the process keeps one recorder (the exporter's), and the few lines read here are
//! the counters' sums over their labels, which the exposition format states plainly
//! (`name{labels} value`, no timestamps).

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::PrometheusHandle;

/// How often the counters are read.
pub(super) const INTERVAL: Duration = Duration::from_secs(5);
/// How far back the chart and the counts go.
pub(super) const WINDOW: Duration = Duration::from_secs(15 * 60);

/// One line of the chart: a counter (summed over its labels, or over those with one `result`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Series {
    /// What the page calls it.
    pub(super) label: &'static str,
    /// The counter's name.
    pub(super) metric: &'static str,
    /// Only the counter's series with this `result` label.
    pub(super) result: Option<&'static str>,
    /// The line's colour.
    pub(super) colour: &'static str,
}

/// The gateway's decisions.
pub(super) const GATEWAY: &[Series] = &[
    Series {
        label: "executed",
        metric: "idempotency_acquired_total",
        result: None,
        colour: "#2b6cb0",
    },
    Series {
        label: "replayed",
        metric: "idempotency_replayed_total",
        result: None,
        colour: "#2f855a",
    },
    Series {
        label: "in flight (409)",
        metric: "idempotency_in_flight_total",
        result: None,
        colour: "#c05621",
    },
    Series {
        label: "mismatched (422)",
        metric: "idempotency_mismatch_total",
        result: None,
        colour: "#c53030",
    },
];

/// `idem consume`'s decisions.
pub(super) const CONSUMER: &[Series] = &[
    consumer("executed", "executed", "#2b6cb0"),
    consumer("duplicate", "duplicate", "#2f855a"),
    consumer("in flight", "in_flight", "#c05621"),
    consumer("retried", "retried", "#805ad5"),
    consumer("dead-lettered", "dead_lettered", "#c53030"),
    consumer("store unavailable", "store_unavailable", "#718096"),
];

const fn consumer(label: &'static str, result: &'static str, colour: &'static str) -> Series {
    Series {
        label,
        metric: "idempotency_consumer_messages_total",
        result: Some(result),
        colour,
    }
}

/// The sum of `series`' counter in `exposition`.
fn read(exposition: &str, series: &Series) -> f64 {
    let wanted = series.result.map(|result| format!("result=\"{result}\""));
    exposition
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(series.metric)?;
            let (labels, value) = match rest.strip_prefix('{') {
                Some(rest) => rest.rsplit_once('}')?,
                None if rest.starts_with(' ') => ("", rest),
                None => return None,
            };
            if let Some(wanted) = &wanted
                && !labels.split(',').any(|pair| pair == wanted)
            {
                return None;
            }
            value.split_whitespace().next()?.parse::<f64>().ok()
        })
        .sum()
}

/// The samples of the last [`WINDOW`].
#[derive(Debug)]
pub(super) struct Rates {
    metrics: PrometheusHandle,
    series: &'static [Series],
    samples: Mutex<VecDeque<(Instant, Vec<f64>)>>,
}

/// What the overview shows of one series.
#[derive(Debug, Clone)]
pub(super) struct Line {
    pub(super) series: Series,
    /// Counted over the window shown (since the process started, when that is shorter).
    pub(super) count: u64,
    /// Per second over the last interval.
    pub(super) now: f64,
}

impl Rates {
    pub(super) fn new(metrics: PrometheusHandle, series: &'static [Series]) -> Self {
        let rates = Self {
            metrics,
            series,
            samples: Mutex::default(),
        };
        rates.sample();
        rates
    }

    fn read_all(&self) -> Vec<f64> {
        let exposition = self.metrics.render();
        self.series
            .iter()
            .map(|series| read(&exposition, series))
            .collect()
    }

    fn sample(&self) {
        let values = self.read_all();
        let now = Instant::now();
        let mut samples = self
            .samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        samples.push_back((now, values));
        while samples
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > WINDOW + INTERVAL)
        {
            samples.pop_front();
        }
    }

    /// Samples every `interval`, for as long as the process runs.
    pub(super) async fn sample_every(self: Arc<Self>, interval: Duration) {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            self.sample();
        }
    }

    /// The samples with a reading of now at their end.
    fn points(&self) -> Vec<(Instant, Vec<f64>)> {
        let mut points: Vec<_> = self
            .samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .cloned()
            .collect();
        points.push((Instant::now(), self.read_all()));
        points
    }

    /// Each series' count over the window and its rate now, and the chart; how long the window
    /// shown is.
    pub(super) fn overview(&self) -> (Vec<Line>, String, Duration) {
        let points = self.points();
        let (first, last) = (&points[0], &points[points.len() - 1]);
        let window = last.0.duration_since(first.0);
        let before_last = &points[points.len().saturating_sub(2)];
        let lines = self
            .series
            .iter()
            .enumerate()
            .map(|(i, series)| {
                let elapsed = last.0.duration_since(before_last.0).as_secs_f64();
                Line {
                    series: *series,
                    count: counted(last.1[i] - first.1[i]),
                    now: if elapsed > 0.0 {
                        (last.1[i] - before_last.1[i]).max(0.0) / elapsed
                    } else {
                        0.0
                    },
                }
            })
            .collect();
        (lines, chart(self.series, &points), window)
    }
}

/// A counter's increase as a count (counters only grow; a negative difference is a reset).
fn counted(difference: f64) -> u64 {
    if difference.is_finite() && difference > 0.0 {
        // Counters are whole numbers; anything past u64 is clamped.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let count = difference.round().min(u64::MAX as f64) as u64;
        count
    } else {
        0
    }
}

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 180.0;
const LEFT: f64 = 48.0;
const BOTTOM: f64 = 20.0;

/// The rates between samples as one polyline per series, over the window: SVG markup made of
/// numbers and the series' fixed colours only (nothing from a request or the store).
fn chart(series: &[Series], points: &[(Instant, Vec<f64>)]) -> String {
    let end = points[points.len() - 1].0;
    let rates: Vec<(f64, Vec<f64>)> = points
        .windows(2)
        .filter_map(|pair| {
            let elapsed = pair[1].0.duration_since(pair[0].0).as_secs_f64();
            (elapsed > 0.0).then(|| {
                let age = end.duration_since(pair[1].0).as_secs_f64();
                let per_second = pair[1]
                    .1
                    .iter()
                    .zip(&pair[0].1)
                    .map(|(b, a)| (b - a).max(0.0) / elapsed)
                    .collect();
                (age, per_second)
            })
        })
        .collect();
    let top = rates
        .iter()
        .flat_map(|(_, values)| values.iter().copied())
        .fold(1.0_f64, f64::max);
    let window = WINDOW.as_secs_f64();
    let x = |age: f64| LEFT + (WIDTH - LEFT) * (1.0 - (age / window).min(1.0));
    let y = |rate: f64| (HEIGHT - BOTTOM) * (1.0 - rate / top);
    let mut svg = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="decisions per second over the last 15 minutes"><rect x="{LEFT}" y="0" width="{}" height="{}" fill="#fafafa" stroke="#ccc"/>"##,
        WIDTH - LEFT,
        HEIGHT - BOTTOM
    );
    let _ = write!(
        svg,
        r##"<text x="{}" y="12" font-size="11" text-anchor="end" fill="#555">{}/s</text><text x="{}" y="{}" font-size="11" text-anchor="end" fill="#555">0</text><text x="{LEFT}" y="{}" font-size="11" fill="#555">−15 min</text><text x="{WIDTH}" y="{}" font-size="11" text-anchor="end" fill="#555">now</text>"##,
        LEFT - 4.0,
        rate_text(top),
        LEFT - 4.0,
        HEIGHT - BOTTOM,
        HEIGHT - 4.0,
        HEIGHT - 4.0,
    );
    for (i, series) in series.iter().enumerate() {
        let line: Vec<String> = rates
            .iter()
            .map(|(age, values)| format!("{:.1},{:.1}", x(*age), y(values[i])))
            .collect();
        if line.len() == 1 {
            let _ = write!(
                svg,
                r#"<circle cx="{}" r="3" cy="{}" fill="{}"/>"#,
                x(rates[0].0),
                y(rates[0].1[i]),
                series.colour
            );
        } else if !line.is_empty() {
            let _ = write!(
                svg,
                r#"<polyline fill="none" stroke-width="2" stroke="{}" points="{}"/>"#,
                series.colour,
                line.join(" ")
            );
        }
    }
    svg.push_str("</svg>");
    svg
}

/// A rate as the page shows it.
pub(super) fn rate_text(rate: f64) -> String {
    if rate >= 100.0 {
        format!("{rate:.0}")
    } else {
        format!("{rate:.1}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXPOSITION: &str = "\
# TYPE idempotency_consumer_messages_total counter
idempotency_consumer_messages_total{consumer=\"a\",result=\"executed\"} 7
idempotency_consumer_messages_total{consumer=\"b\",result=\"executed\"} 3
idempotency_consumer_messages_total{consumer=\"a\",result=\"executed_later\"} 100
idempotency_consumer_messages_total{consumer=\"a\",result=\"duplicate\"} 2
idempotency_replayed_total{guard=\"x\"} 5
idempotency_replayed_total 1
idempotency_replayed_totally 9
";

    #[test]
    fn counters_are_summed_over_their_labels_and_result() {
        assert_eq!(read(EXPOSITION, &CONSUMER[0]), 10.0);
        assert_eq!(read(EXPOSITION, &CONSUMER[1]), 2.0);
        assert_eq!(read(EXPOSITION, &CONSUMER[4]), 0.0);
        assert_eq!(read(EXPOSITION, &GATEWAY[1]), 6.0);
        assert_eq!(read("", &GATEWAY[0]), 0.0);
    }

    #[test]
    fn the_chart_draws_one_line_per_series_from_numbers_only() {
        let start = Instant::now();
        let points = vec![
            (start, vec![0.0, 0.0, 0.0, 0.0]),
            (start + Duration::from_secs(5), vec![10.0, 5.0, 0.0, 0.0]),
            (start + Duration::from_secs(10), vec![30.0, 5.0, 1.0, 0.0]),
        ];
        let svg = chart(GATEWAY, &points);
        assert_eq!(svg.matches("<polyline").count(), 4, "{svg}");
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
        assert!(
            svg.contains(">4.0/s<"),
            "the scale's top is the highest rate: {svg}"
        );
        assert_eq!(counted(-3.0), 0);
        assert_eq!(counted(f64::NAN), 0);
        assert_eq!(counted(2.4), 2);
    }
}

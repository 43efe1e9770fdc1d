//! Where the machine's time goes during a measurement: the CPU time of the bench itself and of
//! each server it talks to, read from Linux's `/proc` before and after, per message.
//!
//! A ratio such as "the guarded consumer makes 0.5× the bare one's messages per second" says
//! nothing of why. On a machine whose cores the bench shares with its brokers and stores, the
//! split of CPU time says whether a variant is bound by the machine (no idle time left: the
//! extra work per message is the cost) or by waiting (idle time left: more in flight would
//! help), and which process does the extra work.
//!
//! The servers are found by their process names (`/proc/<pid>/comm`), every process of a name
//! summed: PostgreSQL's backends, several Redis servers. The times are `utime + stime` of
//! `/proc/<pid>/stat`, which include the process's exited threads, in clock ticks of 1/100 s
//! (`USER_HZ`, 100 on every Linux architecture the bench runs on): a drain of 20,000 messages
//! lasts long enough for that resolution. A process that starts or exits during the measurement
//! counts only for what it did while both snapshots saw it. Elsewhere than on Linux every figure
//! is zero.

use std::time::{Duration, Instant};

use crate::measure::Samples;

/// Clock ticks per second of `/proc/<pid>/stat`'s times.
const USER_HZ: f64 = 100.0;

/// The processes whose time is counted: a name for the report, and the process names that are
/// part of it (none: the bench's own process).
const GROUPS: [(&str, &[&str]); 5] = [
    ("bench", &[]),
    ("nats-server", &["nats-server"]),
    ("rabbitmq", &["beam.smp"]),
    ("redis-server", &["redis-server"]),
    ("postgres", &["postgres"]),
];

/// The number of processes groups counted.
pub(crate) const COUNTED: usize = GROUPS.len();

/// The report's name of each group, in the order of [`Usage::seconds`].
pub(crate) fn names() -> [&'static str; COUNTED] {
    GROUPS.map(|(name, _)| name)
}

/// CPU ticks of each group at one moment.
pub(crate) struct Snapshot {
    at: Instant,
    ticks: [u64; COUNTED],
}

/// CPU seconds of each group between two snapshots, the wall time between them and the
/// messages handled meanwhile.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Usage {
    /// Messages handled between the snapshots.
    pub(crate) messages: u64,
    /// Wall time.
    pub(crate) wall: Duration,
    /// CPU seconds of each group, in the order of [`names`].
    pub(crate) seconds: [f64; COUNTED],
}

impl Snapshot {
    /// The ticks used so far by each group.
    pub(crate) fn take() -> Self {
        let mut ticks = [0; COUNTED];
        ticks[0] = ticks_of("self").unwrap_or(0);
        if let Ok(entries) = std::fs::read_dir("/proc") {
            for entry in entries.flatten() {
                let pid = entry.file_name();
                let Some(pid) = pid.to_str().filter(|p| p.bytes().all(|b| b.is_ascii_digit())) else {
                    continue;
                };
                let Ok(comm) = std::fs::read_to_string(format!("/proc/{pid}/comm")) else {
                    continue;
                };
                let comm = comm.trim_end();
                if let Some(group) = GROUPS.iter().position(|(_, names)| names.contains(&comm)) {
                    ticks[group] += ticks_of(pid).unwrap_or(0);
                }
            }
        }
        Self {
            at: Instant::now(),
            ticks,
        }
    }

    /// What each group used since `self`, while `messages` messages were handled.
    pub(crate) fn since(&self, messages: u64) -> Usage {
        let now = Self::take();
        let mut seconds = [0.0; COUNTED];
        for (i, seconds) in seconds.iter_mut().enumerate() {
            // Ticks of a second are far below 2^53: the conversion is exact.
            #[allow(clippy::cast_precision_loss)]
            let ticks = now.ticks[i].saturating_sub(self.ticks[i]) as f64;
            *seconds = ticks / USER_HZ;
        }
        Usage {
            messages,
            wall: now.at - self.at,
            seconds,
        }
    }
}

/// `utime + stime` of `/proc/<pid>/stat`.
fn ticks_of(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The name, field 2, is in parentheses and may hold spaces: count from the last `)`.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    // After the name: state (3), …, utime (14), stime (15).
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// Per message: the medians over rounds of each group's CPU microseconds, and of the
/// machine's time left idle by them (`cores` × wall − their sum, at least zero).
pub(crate) struct PerMessage {
    /// CPU µs per message of each group.
    pub(crate) groups: [f64; COUNTED],
    /// The machine's µs per message (`cores` × wall).
    pub(crate) machine: f64,
    /// What no counted process used: idle, or other processes.
    pub(crate) rest: f64,
}

impl PerMessage {
    /// The medians of `usages` (one per round, at least one) on a machine of `cores` cores.
    pub(crate) fn of(usages: &[Usage], cores: usize) -> Self {
        // Counts far below 2^53: exact.
        #[allow(clippy::cast_precision_loss)]
        let cores = cores as f64;
        #[allow(clippy::cast_precision_loss)]
        let micros = |u: &Usage, seconds: f64| seconds * 1e6 / u.messages.max(1) as f64;
        let median_of = |value: &dyn Fn(&Usage) -> f64| {
            let mut values: Vec<f64> = usages.iter().map(value).collect();
            crate::measure::median(&mut values)
        };
        let mut groups = [0.0; COUNTED];
        for (i, group) in groups.iter_mut().enumerate() {
            *group = median_of(&|u| micros(u, u.seconds[i]));
        }
        let machine = median_of(&|u| micros(u, u.wall.as_secs_f64() * cores));
        let rest = median_of(&|u| {
            micros(
                u,
                (u.wall.as_secs_f64() * cores - u.seconds.iter().sum::<f64>()).max(0.0),
            )
        });
        Self {
            groups,
            machine,
            rest,
        }
    }

    /// The cells `machine | group… | rest` of a report row, one decimal each.
    pub(crate) fn cells(&self) -> String {
        let groups: Vec<String> = self.groups.iter().map(|g| format!("{g:.1}")).collect();
        format!("{:.1} | {} | {:.1}", self.machine, groups.join(" | "), self.rest)
    }
}

/// Splits each variant's measurements (a rate and a [`Usage`] per round) into the samples of its
/// rates, returned in the variants' order, and its row of the CPU table, pushed to `rows`:
/// `| {leading} | {name} | cells |`.
pub(crate) fn split<const N: usize>(
    measured: [Vec<(f64, Usage)>; N],
    leading: &str,
    names: [&str; N],
    rows: &mut Vec<String>,
) -> [Samples; N] {
    for (variant, name) in measured.iter().zip(names) {
        let usages: Vec<Usage> = variant.iter().map(|(_, usage)| *usage).collect();
        rows.push(format!(
            "| {leading} | {name} | {} |",
            PerMessage::of(&usages, cores()).cells()
        ));
    }
    measured.map(|m| Samples::of(m.into_iter().map(|(rate, _)| rate).collect()))
}

/// Prints the table of `rows` (each `| leading… | PerMessage::cells |`), headed by the
/// `leading` columns and the groups.
pub(crate) fn print_table(leading: &[&str], rows: &[String]) {
    println!(
        "\n### Where the machine's time went: CPU µs per message (medians over rounds; machine = {} cores × wall time; rest = what no counted process used: idle, or other processes)\n",
        cores()
    );
    println!(
        "| {} | machine | {} | rest |",
        leading.join(" | "),
        names().join(" | ")
    );
    println!(
        "|{}---:|{}---:|",
        "---|".repeat(leading.len()),
        "---:|".repeat(COUNTED)
    );
    for row in rows {
        println!("{row}");
    }
}

/// The cores the machine has, as the report's machine time counts them.
pub(crate) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bench_counts_its_own_time() {
        let before = Snapshot::take();
        let started = Instant::now();
        let mut x = 0u64;
        // Spin until the kernel has counted a tick of this process (a bound, not a timing).
        while before.since(0).seconds[0] == 0.0 && started.elapsed() < Duration::from_secs(60) {
            for _ in 0..100_000 {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        }
        let usage = before.since(0);
        assert!(
            usage.seconds[0] > 0.0,
            "no CPU time of the bench's own process: {usage:?}"
        );
        assert!(usage.seconds.iter().all(|s| *s >= 0.0));
    }

    #[test]
    fn per_message_takes_the_medians_and_leaves_the_rest_idle() {
        let usage = |bench: f64, wall_ms: u64| Usage {
            messages: 1000,
            wall: Duration::from_millis(wall_ms),
            seconds: [bench, 0.5, 0.0, 0.0, 0.0],
        };
        let figures = PerMessage::of(&[usage(1.0, 1000), usage(3.0, 2000), usage(2.0, 1500)], 2);
        assert!((figures.groups[0] - 2000.0).abs() < 1e-6);
        assert!((figures.groups[1] - 500.0).abs() < 1e-6);
        assert!((figures.machine - 3000.0).abs() < 1e-6);
        // Rests: 2000 − 1500 = 500, 4000 − 3500 = 500, 3000 − 2500 = 500.
        assert!((figures.rest - 500.0).abs() < 1e-6);
        assert_eq!(
            figures.cells(),
            "3000.0 | 2000.0 | 500.0 | 0.0 | 0.0 | 0.0 | 500.0"
        );
    }
}

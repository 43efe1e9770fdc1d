//! The gateway side by side with a plain proxy: `idem serve` on each store, nginx with
//! `proxy_pass` to a keepalive upstream pool, and the upstream called directly, each a process
//! of its own, loaded by `wrk` in alternating rounds (`scripts/bench-gateway` installs nginx and
//! wrk and builds the binaries first).
//!
//! - **The upstream** is `idem-bench upstream`: an axum server answering every request with
//!   `201` and a small JSON body, as fast as a handler can be.
//! - **New keys**: every request a `POST` with a fresh `Idempotency-Key` (a wrk Lua script);
//!   **replays**: every request the same key (the first runs, the rest replay); **no key**: the
//!   same `POST` without the header, which the gateway forwards unguarded: its proxying alone,
//!   the floor under the other two. nginx and the direct calls get the same requests and do no
//!   idempotency at all.
//! - **CPU per request**: the proxy's own CPU time (user and system, all its threads and worker
//!   processes, from `/proc`) over a run, divided by the requests wrk counted. The machine's cores
//!   are shared by wrk, the upstream and the proxy, so a proxy's rate follows its cost per
//!   request: this column says where a ratio comes from.
//! - **Memory**: `gateway-memory` sends 200,000 new-key requests with 1 KiB bodies through the
//!   gateway on SQLite and samples its resident memory (`/proc/PID/status`) as they go.

use std::io::{Read, Seek};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::measure::{Samples, median, per_second};

/// What `wrk` reported for one run.
#[derive(Debug, Clone, Copy)]
struct Run {
    requests_per_second: f64,
    /// The proxy's CPU time per request, in microseconds (none for the upstream called directly).
    cpu_us: Option<f64>,
    /// The 99th percentile latency, in milliseconds.
    p99_ms: f64,
    /// Non-2xx/3xx responses and socket errors together.
    errors: u64,
}

/// A process the bench started; stopped when dropped.
pub(crate) struct Process {
    name: String,
    child: Child,
    /// Its standard error, in a file: a pipe nobody reads while the load runs would fill and
    /// stall the process at its next log line (`idem serve` logs every request at `info`).
    stderr: std::fs::File,
}

impl Drop for Process {
    /// Asks the process to stop (SIGTERM) and waits up to 5 s before killing it: nginx's
    /// workers outlive a master that was killed, and would go on holding the port and a core.
    fn drop(&mut self) {
        let asked = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .is_ok_and(|status| status.success());
        let deadline = Instant::now() + Duration::from_secs(5);
        while asked && Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Process {
    pub(crate) fn spawn(name: &str, command: &mut Command) -> Result<Self, String> {
        let stderr = tempfile::tempfile().map_err(|e| format!("a file for {name}'s log: {e}"))?;
        let child = command
            .stdout(Stdio::null())
            .stderr(stderr.try_clone().map_err(|e| e.to_string())?)
            .spawn()
            .map_err(|e| format!("cannot start {name}: {e}"))?;
        Ok(Self {
            name: name.to_owned(),
            child,
            stderr,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// The CPU time, in clock ticks, that process `pid`, its threads and its child processes (nginx's
/// workers) have used so far.
fn cpu_ticks(pid: u32) -> u64 {
    let own = |pid: &str| -> u64 {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| {
                // The fields after the command name, which is in parentheses and may hold spaces.
                let rest = stat.rsplit_once(')')?.1;
                let fields: Vec<&str> = rest.split_whitespace().collect();
                // utime and stime are fields 14 and 15 of the line: 12 and 13 after the name.
                Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
            })
            .unwrap_or(0)
    };
    let children = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|list| list.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
        .collect::<Vec<_>>();
    own(&pid.to_string()) + children.iter().map(|child| own(child)).sum::<u64>()
}

/// The clock ticks per second of `/proc`'s times.
fn ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok()?.trim().parse().ok())
        .unwrap_or(100.0)
}

impl Process {
    /// Waits until `port` accepts connections; fails with the process's stderr if it exits.
    fn wait_for(&mut self, port: u16) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(status) = self.child.try_wait().map_err(|e| e.to_string())? {
                let mut stderr = String::new();
                let _ = self.stderr.seek(std::io::SeekFrom::Start(0));
                let _ = self.stderr.read_to_string(&mut stderr);
                return Err(format!("{} exited ({status}): {stderr}", self.name));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "{} did not listen on port {port} within a minute",
                    self.name
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
}

fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .map_err(|e| e.to_string())
}

/// `idem-bench upstream --listen ADDR`: the fast upstream, until killed.
pub(crate) fn run_upstream(listen: &str) -> Result<(), String> {
    let runtime = crate::measure::runtime()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| format!("upstream: bind {listen}: {e}"))?;
        let app = axum::Router::new().fallback(|| async {
            (
                http::StatusCode::CREATED,
                [(http::header::CONTENT_TYPE, "application/json")],
                r#"{"id":"ch_1","status":"succeeded"}"#,
            )
        });
        axum::serve(listener, app).await.map_err(|e| e.to_string())
    })
}

/// The binaries next to this one (`target/release/idem`).
pub(crate) fn sibling(name: &str) -> Result<PathBuf, String> {
    let path = std::env::current_exe()
        .map_err(|e| e.to_string())?
        .with_file_name(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{} is missing: build it first (scripts/bench-gateway does: cargo build --release -p idem -p idempotency-bench)",
            path.display()
        ))
    }
}

fn require(tool: &str, package: &str) -> Result<(), String> {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if found {
        Ok(())
    } else {
        Err(format!(
            "`{tool}` is not installed (Debian package {package}; scripts/bench-gateway installs it)"
        ))
    }
}

/// nginx with `proxy_pass` to a keepalive pool of connections to the upstream: the cost of a
/// proxy hop with no idempotency at all.
fn start_nginx(dir: &Path, port: u16, upstream: u16) -> Result<Process, String> {
    let conf = dir.join("nginx.conf");
    let prefix = dir.display();
    std::fs::write(
        &conf,
        format!(
            "daemon off;
worker_processes auto;
pid {prefix}/nginx.pid;
error_log stderr warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream app {{ server 127.0.0.1:{upstream}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://app;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
        }}
    }}
}}
"
        ),
    )
    .map_err(|e| e.to_string())?;
    let mut nginx = Process::spawn(
        "nginx",
        Command::new("nginx").args([
            "-p",
            &dir.display().to_string(),
            "-c",
            &conf.display().to_string(),
        ]),
    )?;
    nginx.wait_for(port)?;
    Ok(nginx)
}

/// One thing to put load on.
struct Target {
    name: String,
    port: u16,
    process: Option<Process>,
    /// The process whose CPU time is the proxy's (nginx's master, or the gateway).
    pid: Option<u32>,
}

/// The upstream (`idem-bench upstream`, this program) on a free port, once it listens.
fn start_upstream() -> Result<(Process, u16), String> {
    let port = free_port()?;
    let mut upstream = Process::spawn(
        "upstream",
        Command::new(std::env::current_exe().map_err(|e| e.to_string())?).args([
            "upstream",
            "--listen",
            &format!("127.0.0.1:{port}"),
        ]),
    )?;
    upstream.wait_for(port)?;
    Ok((upstream, port))
}

/// `idem serve` on `store`, in front of the upstream; with `ui`, its dashboard on (`--ui` on an
/// admin listener of its own, with a token), as an operator would run it during an incident.
fn start_gateway(idem: &Path, name: &str, store: &str, upstream: u16, ui: bool) -> Result<Target, String> {
    let port = free_port()?;
    let mut command = Command::new(idem);
    command
        .args([
            "serve",
            "--upstream",
            &format!("http://127.0.0.1:{upstream}"),
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--store",
            store,
            "--retention",
            "10m",
            "--purge-every",
            "off",
            "--max-connections",
            "4096",
        ])
        .env("RUST_LOG", "error");
    if ui {
        command.args([
            "--ui",
            "--admin-listen",
            &format!("127.0.0.1:{}", free_port()?),
            "--admin-token",
            "bench-dashboard-token-0123456789",
        ]);
    }
    let mut process = Process::spawn(name, &mut command)?;
    process.wait_for(port)?;
    Ok(Target {
        name: name.to_owned(),
        port,
        pid: Some(process.pid()),
        process: Some(process),
    })
}

/// The wrk scripts: a fresh key per request, one key for every request, and no key at all.
fn scripts(dir: &Path, body_bytes: usize) -> Result<(PathBuf, PathBuf, PathBuf), String> {
    let body = format!(
        "{{\"amount\":1000,\"note\":\"{}\"}}",
        "x".repeat(body_bytes.saturating_sub(27))
    );
    let common = format!(
        "local body = '{body}'
local headers = {{ [\"Content-Type\"] = \"application/json\" }}
"
    );
    let new_keys = dir.join("new-keys.lua");
    std::fs::write(
        &new_keys,
        format!(
            "{common}
local counter = 0
function setup(thread)
  thread:set(\"prefix\", (os.getenv(\"RUN\") or \"run\") .. \"-\" .. tostring(math.random(1, 1000000000)))
end
request = function()
  counter = counter + 1
  headers[\"Idempotency-Key\"] = prefix .. \"-\" .. counter
  return wrk.format(\"POST\", \"/payments\", headers, body)
end
"
        ),
    )
    .map_err(|e| e.to_string())?;
    let replays = dir.join("replays.lua");
    std::fs::write(
        &replays,
        format!(
            "{common}
headers[\"Idempotency-Key\"] = (os.getenv(\"RUN\") or \"run\") .. \"-replayed\"
request = function()
  return wrk.format(\"POST\", \"/payments\", headers, body)
end
"
        ),
    )
    .map_err(|e| e.to_string())?;
    let no_key = dir.join("no-key.lua");
    std::fs::write(
        &no_key,
        format!(
            "{common}
request = function()
  return wrk.format(\"POST\", \"/payments\", headers, body)
end
"
        ),
    )
    .map_err(|e| e.to_string())?;
    Ok((new_keys, replays, no_key))
}

/// `wrk -t2 -c CONNECTIONS -d SECONDS --latency -s SCRIPT` on `target`, parsed, with the
/// target's CPU time per request.
fn wrk(
    target: &Target,
    script: &Path,
    connections: usize,
    window: Duration,
    run: &str,
) -> Result<Run, String> {
    let port = target.port;
    let before = target.pid.map(cpu_ticks);
    let output = Command::new("wrk")
        .args([
            "-t2",
            &format!("-c{connections}"),
            &format!("-d{}s", window.as_secs().max(1)),
            "--latency",
            "-s",
            &script.display().to_string(),
            &format!("http://127.0.0.1:{port}/payments"),
        ])
        .env("RUN", run)
        .output()
        .map_err(|e| format!("wrk: {e}"))?;
    let after = target.pid.map(cpu_ticks);
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let mut run = parse_wrk(&text).ok_or_else(|| {
        format!(
            "cannot read wrk's output on {} ({}):\n{text}{}",
            target.name,
            output.status,
            String::from_utf8_lossy(&output.stderr)
        )
    })?;
    let requests = text
        .lines()
        .find_map(|line| line.trim().split_once(" requests in "))
        .and_then(|(n, _)| n.trim().parse::<f64>().ok())
        .filter(|n| *n > 0.0);
    if let (Some(before), Some(after), Some(requests)) = (before, after, requests) {
        run.cpu_us = Some(after.saturating_sub(before) as f64 / ticks_per_second() * 1e6 / requests);
    }
    Ok(run)
}

fn parse_wrk(text: &str) -> Option<Run> {
    let requests_per_second = text
        .lines()
        .find_map(|line| line.trim().strip_prefix("Requests/sec:"))?
        .trim()
        .parse()
        .ok()?;
    let p99 = text
        .lines()
        .find_map(|line| line.trim().strip_prefix("99%"))?
        .trim();
    let p99_ms = if let Some(us) = p99.strip_suffix("us") {
        us.parse::<f64>().ok()? / 1000.0
    } else if let Some(ms) = p99.strip_suffix("ms") {
        ms.parse().ok()?
    } else if let Some(s) = p99.strip_suffix('s') {
        s.parse::<f64>().ok()? * 1000.0
    } else {
        return None;
    };
    let count = |label: &str| -> u64 {
        text.lines()
            .find_map(|line| line.trim().strip_prefix(label))
            .and_then(|rest| rest.trim().split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let socket_errors: u64 = text
        .lines()
        .find_map(|line| line.trim().strip_prefix("Socket errors:"))
        .map_or(0, |rest| {
            rest.split(',')
                .filter_map(|part| part.split_whitespace().last()?.parse::<u64>().ok())
                .sum()
        });
    Some(Run {
        requests_per_second,
        cpu_us: None,
        p99_ms,
        errors: count("Non-2xx or 3xx responses:") + socket_errors,
    })
}

/// The variants, from the environment's servers: every store the gateway can use here.
fn targets(
    idem: &Path,
    dir: &Path,
    upstream: u16,
    (nginx, nginx_pid): (u16, u32),
    stores: &[String],
) -> Result<Vec<Target>, String> {
    let mut targets = vec![
        Target {
            name: "upstream called directly".into(),
            port: upstream,
            process: None,
            pid: None,
        },
        Target {
            name: "nginx proxy_pass (keepalive pool, no idempotency)".into(),
            port: nginx,
            process: None,
            pid: Some(nginx_pid),
        },
    ];
    let database =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    // Database 1: the gateways' records (kept for the default 24 h) stay out of database 0, where
    // the tests' `stats` and `list` scan with real-time leases.
    let redis = std::env::var("IDEM_BENCH_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/1".into());
    let mysql = std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    for store in stores {
        let (store, ui) = match store.strip_suffix("-ui") {
            Some(store) => (store, true),
            None => (store.as_str(), false),
        };
        let (name, url) = match store {
            "memory" if ui => ("idem serve, memory, --ui", "memory://".to_owned()),
            "sqlite" if ui => (
                "idem serve, SQLite (group commit), --ui",
                format!("sqlite://{}", dir.join("grouped-ui.db").display()),
            ),
            "memory" => ("idem serve, memory", "memory://".to_owned()),
            "sqlite" => (
                "idem serve, SQLite (group commit)",
                format!("sqlite://{}", dir.join("grouped.db").display()),
            ),
            "sqlite-single" => (
                "idem serve, SQLite (max_batch=1)",
                format!("sqlite://{}?max_batch=1", dir.join("single.db").display()),
            ),
            "redis" => ("idem serve, Redis", redis.clone()),
            "redis-batched" => (
                "idem serve, Redis (batch=on)",
                format!("{redis}{}batch=on", if redis.contains('?') { '&' } else { '?' }),
            ),
            "postgres" => ("idem serve, PostgreSQL", database.clone()),
            "postgres-batched" => (
                "idem serve, PostgreSQL (batch=on)",
                format!(
                    "{database}{}batch=on",
                    if database.contains('?') { '&' } else { '?' }
                ),
            ),
            "mysql" => ("idem serve, MariaDB", mysql.clone()),
            "mysql-batched" => (
                "idem serve, MariaDB (batch=on)",
                format!("{mysql}{}batch=on", if mysql.contains('?') { '&' } else { '?' }),
            ),
            other => {
                return Err(format!(
                    "unknown store {other:?} (memory, sqlite, sqlite-single, redis, redis-batched, postgres, postgres-batched, mysql, mysql-batched; memory-ui and sqlite-ui: with the dashboard on)"
                ));
            }
        };
        targets.push(start_gateway(idem, name, &url, upstream, ui)?);
    }
    Ok(targets)
}

/// Every variant, new keys and replays, `rounds` alternating rounds of `window` each.
pub(crate) fn run(
    window: Duration,
    rounds: usize,
    connections: usize,
    stores: &[String],
) -> Result<(), String> {
    require("wrk", "wrk")?;
    require("nginx", "nginx-light")?;
    let idem = sibling("idem")?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let (_upstream, upstream_port) = start_upstream()?;
    let nginx_port = free_port()?;
    let nginx = start_nginx(dir.path(), nginx_port, upstream_port)?;
    let targets = targets(
        &idem,
        dir.path(),
        upstream_port,
        (nginx_port, nginx.pid()),
        stores,
    )?;
    let (new_keys, replays, no_key) = scripts(dir.path(), 64)?;
    let run_id = format!("{}", std::process::id());

    // Warm up every target once (connections, caches, the replayed key's first run).
    for target in &targets {
        let warm = Duration::from_secs(1);
        wrk(target, &new_keys, connections, warm, &format!("{run_id}-warm"))?;
        wrk(target, &replays, connections, warm, &run_id)?;
        wrk(target, &no_key, connections, warm, &run_id)?;
    }
    let mut new_runs: Vec<Vec<Run>> = vec![Vec::new(); targets.len()];
    let mut replay_runs: Vec<Vec<Run>> = vec![Vec::new(); targets.len()];
    let mut no_key_runs: Vec<Vec<Run>> = vec![Vec::new(); targets.len()];
    for round in 0..rounds {
        // Alternate the order, so that no variant always follows the same one.
        let mut order: Vec<usize> = (0..targets.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for &i in &order {
            let run = wrk(
                &targets[i],
                &new_keys,
                connections,
                window,
                &format!("{run_id}-{round}"),
            )?;
            new_runs[i].push(run);
            let run = wrk(&targets[i], &replays, connections, window, &run_id)?;
            replay_runs[i].push(run);
            let run = wrk(&targets[i], &no_key, connections, window, &run_id)?;
            no_key_runs[i].push(run);
        }
    }

    let rate = |runs: &[Run]| Samples::of(runs.iter().map(|r| r.requests_per_second).collect());
    let p99 = |runs: &[Run]| median(&mut runs.iter().map(|r| r.p99_ms).collect::<Vec<_>>());
    let cpu = |runs: &[Run]| {
        let mut values: Vec<f64> = runs.iter().filter_map(|r| r.cpu_us).collect();
        if values.is_empty() {
            "—".to_owned()
        } else {
            format!("{:.0} µs", median(&mut values))
        }
    };
    let nginx_new = rate(&new_runs[1]).median;
    let nginx_replay = rate(&replay_runs[1]).median;
    let nginx_no_key = rate(&no_key_runs[1]).median;
    println!(
        "\n## Gateway vs nginx vs the upstream: wrk -t2 -c{connections}, {} s a run, {rounds} alternating rounds, medians\n",
        window.as_secs()
    );
    println!(
        "| variant | new keys req/s | / nginx | replays req/s | / nginx | no key req/s | / nginx | new-key p99 | replay p99 | CPU/request: new key | no key | new-key min–max | errors |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (i, target) in targets.iter().enumerate() {
        let (new, replay, no_key) = (rate(&new_runs[i]), rate(&replay_runs[i]), rate(&no_key_runs[i]));
        let errors: u64 = new_runs[i]
            .iter()
            .chain(&replay_runs[i])
            .chain(&no_key_runs[i])
            .map(|r| r.errors)
            .sum();
        println!(
            "| {} | {} | {:.2} | {} | {:.2} | {} | {:.2} | {:.1} ms | {:.1} ms | {} | {} | {} | {errors} |",
            target.name,
            per_second(new.median),
            new.median / nginx_new,
            per_second(replay.median),
            replay.median / nginx_replay,
            per_second(no_key.median),
            no_key.median / nginx_no_key,
            p99(&new_runs[i]),
            p99(&replay_runs[i]),
            cpu(&new_runs[i]),
            cpu(&no_key_runs[i]),
            new.spread(),
        );
    }
    drop(targets);
    Ok(())
}

/// The gateway on SQLite under 200,000 new-key requests with 1 KiB bodies: its resident
/// memory, sampled every second.
pub(crate) fn run_memory(connections: usize, requests: u64) -> Result<(), String> {
    require("wrk", "wrk")?;
    let idem = sibling("idem")?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let (_upstream, upstream_port) = start_upstream()?;
    let gateway = start_gateway(
        &idem,
        "idem serve, SQLite",
        &format!("sqlite://{}", dir.path().join("memory.db").display()),
        upstream_port,
        false,
    )?;
    let pid = gateway.process.as_ref().map_or(0, Process::pid);
    let (new_keys, _, _) = scripts(dir.path(), 1024)?;
    let rss = || -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    let served = || -> Result<u64, String> {
        // The gateway's own count of answered requests, from its metrics.
        let body = ureq_get(gateway.port, "/_idem/metrics")?;
        Ok(body
            .lines()
            .filter(|line| line.starts_with("idempotency_acquired_total"))
            .filter_map(|line| line.split_whitespace().last()?.parse::<u64>().ok())
            .sum())
    };
    println!(
        "\n## Gateway memory on SQLite: {requests} new-key requests with 1 KiB bodies, wrk -t2 -c{connections}\n"
    );
    println!("| seconds | requests answered | resident memory (MiB) |");
    println!("|---:|---:|---:|");
    let start_rss = rss().unwrap_or(0);
    println!("| 0 | 0 | {:.1} |", start_rss as f64 / 1024.0);
    let port = gateway.port;
    let script = new_keys;
    let load = std::thread::spawn(move || {
        // Long enough for the requests; stopped below once they are served.
        Command::new("wrk")
            .args([
                "-t2",
                &format!("-c{connections}"),
                "-d600s",
                "-s",
                &script.display().to_string(),
                &format!("http://127.0.0.1:{port}/payments"),
            ])
            .env("RUN", format!("memory-{}", std::process::id()))
            .stdout(Stdio::null())
            .spawn()
    });
    let mut wrk_child = load
        .join()
        .map_err(|_| "wrk thread panicked".to_owned())?
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut samples = Vec::new();
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let answered = served()?;
        let memory = rss().unwrap_or(0);
        samples.push((started.elapsed().as_secs(), answered, memory));
        if answered >= requests || started.elapsed() > Duration::from_secs(600) {
            break;
        }
    }
    let _ = wrk_child.kill();
    let _ = wrk_child.wait();
    // Every 5 s, and the last sample.
    for (i, (seconds, answered, memory)) in samples.iter().enumerate() {
        if i % 5 == 4 || i == samples.len() - 1 {
            println!("| {seconds} | {answered} | {:.1} |", *memory as f64 / 1024.0);
        }
    }
    Ok(())
}

/// A plain HTTP/1.0 GET on loopback, for the gateway's metrics.
fn ureq_get(port: u16, path: &str) -> Result<String, String> {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").map_err(|e| e.to_string())?;
    let mut text = String::new();
    stream.read_to_string(&mut text).map_err(|e| e.to_string())?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_wrk_reports() {
        let report = "Running 6s test @ http://127.0.0.1:8080/payments
  2 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   812.15us  401.33us  12.01ms   88.41%
    Req/Sec    19.71k     1.12k   22.03k    70.00%
  Latency Distribution
     50%  732.00us
     75%    0.94ms
     90%    1.21ms
     99%    2.64ms
  235277 requests in 6.00s, 36.35MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 7
Requests/sec:  39201.07
Transfer/sec:      6.06MB
";
        let run = parse_wrk(report).unwrap();
        assert!((run.requests_per_second - 39201.07).abs() < 0.01);
        assert!((run.p99_ms - 2.64).abs() < 1e-9);
        assert_eq!(run.errors, 10);
        assert!(parse_wrk("garbage").is_none());
    }
}

//! `idem demo` in the test suite, in short mode: no double charges through the gateway, by the
//! provider's ledger, though the upstream fails after charging and the gateway runs payments
//! again; cross-checked against the store's records. Without key propagation the same storm
//! double-charges, and without the gateway the upstream runs retries again, so the figures are
//! measured, not assumed. The human table and the progress lines are checked too.

use crate::common;

use common::idem;

#[test]
fn the_demo_makes_no_double_charges_and_its_ledger_agrees_with_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("demo.db").display());
    // 600 requests: about 230 payments, so faults after charging (4% of calls) surely happen.
    let (code, out, err) = idem(&["demo", "--requests", "600", "--json", "--store", &store]);
    assert_eq!(code, 0, "{out}\n{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let payments = report["payments"].as_u64().unwrap();
    assert_eq!(report["double_charges"], 0, "{report}");
    assert_eq!(report["failed_payments"], 0, "{report}");
    assert_eq!(
        report["charges"].as_u64(),
        Some(payments),
        "one charge per payment: {report}"
    );
    assert!(
        report["requests"].as_u64().unwrap() > payments,
        "the storm sent duplicates: {report}"
    );
    assert!(report["replays"].as_u64().unwrap() > 0, "{report}");
    // The upstream failed after charging, and the gateway ran those payments again: the key
    // passed on to the provider is what kept them from charging twice.
    assert_eq!(report["key_propagated"], true, "{report}");
    assert!(report["faults_after_charging"].as_u64().unwrap() > 0, "{report}");
    assert!(report["re_executions"].as_u64().unwrap() > 0, "{report}");
    assert!(
        report["upstream_executions"].as_u64().unwrap() > payments,
        "{report}"
    );
    assert!(report["mismatches_rejected"].as_u64().unwrap() > 0, "{report}");
    assert!(report["latency_ms"]["p99"].as_f64().unwrap() > 0.0, "{report}");

    // Every charge in the ledger has its completed record in the store, and nothing else does.
    let (code, stats, err) = idem(&["keys", "stats", "--store", &store, "--json"]);
    assert_eq!(code, 0, "{err}");
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(stats["completed"].as_u64(), Some(payments), "{stats}");
    assert_eq!(stats["in_flight"], 0, "{stats}");
}

#[test]
fn without_key_propagation_the_faults_after_charging_double_charge() {
    let (code, out, err) = idem(&["demo", "--requests", "600", "--json", "--no-key-propagation"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["key_propagated"], false);
    let doubles = report["double_charges"].as_u64().unwrap();
    assert!(doubles > 0, "{report}");
    // Every double is a payment the gateway ran again after a fault that came after charging.
    assert!(doubles <= report["re_executions"].as_u64().unwrap(), "{report}");
    assert_eq!(
        report["charges"].as_u64().unwrap(),
        report["payments"].as_u64().unwrap() + doubles,
        "{report}"
    );
}

/// With `--reconcile`, the gateway asks the upstream's lookup before it runs a payment again:
/// every fault after charging is found and adopted, so nothing is charged twice although the
/// upstream does not pass the key on.
#[test]
fn asking_before_running_again_leaves_no_double_charge_without_the_key() {
    let (code, out, err) = idem(&[
        "demo",
        "--requests",
        "600",
        "--json",
        "--no-key-propagation",
        "--reconcile",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["key_propagated"], false);
    assert_eq!(report["reconcile"], true);
    assert_eq!(report["double_charges"], 0, "{report}");
    let faults = report["faults_after_charging"].as_u64().unwrap();
    assert!(
        faults > 0,
        "the storm must fault after charging for this to show anything: {report}"
    );
    assert_eq!(report["reconciled"].as_u64().unwrap(), faults, "{report}");
    assert_eq!(report["charges"], report["payments"], "{report}");
    let (code, _, err) = idem(&["demo", "--direct", "--reconcile"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--reconcile") && err.contains("--direct"), "{err}");
}

#[test]
fn without_the_gateway_every_retry_runs_the_upstream_again() {
    let (code, out, err) = idem(&["demo", "--requests", "400", "--json", "--direct"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["through_gateway"], false);
    assert_eq!(report["replays"], 0, "{report}");
    assert_eq!(
        report["mismatches_rejected"], 0,
        "nothing rejects a reused key: {report}"
    );
    let (executions, payments) = (
        report["upstream_executions"].as_u64().unwrap(),
        report["payments"].as_u64().unwrap(),
    );
    assert!(executions > payments * 3 / 2, "{report}");
}

/// What a person running the README's command sees: progress on standard error (a line per
/// quarter when it is not a terminal), then the table.
#[test]
fn the_human_report_has_progress_and_the_table() {
    let (code, out, err) = idem(&["demo", "--requests", "400"]);
    assert_eq!(code, 0, "{out}\n{err}");
    for quarter in ["25%", "50%", "75%", "100%"] {
        assert!(
            err.lines()
                .any(|line| line.starts_with("idem demo: ") && line.contains(quarter)),
            "no {quarter} line: {err}"
        );
    }
    // Progress counts payments done, never past their number (the requests, retries
    // included, are shown beside it): `idem demo: 50% (77/154 payments, 205 requests, …)`.
    for line in err.lines().filter(|line| line.starts_with("idem demo: ")) {
        let counts = line
            .split('(')
            .nth(1)
            .and_then(|rest| rest.split(" payments").next());
        let (done, total) = counts
            .and_then(|counts| counts.split_once('/'))
            .map(|(done, total)| (done.parse::<u64>().unwrap(), total.parse::<u64>().unwrap()))
            .unwrap_or_else(|| panic!("not a progress line: {line}"));
        let percent: u64 = line["idem demo: ".len()..]
            .split('%')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(done <= total && done * 100 >= percent * total, "{line}");
        if percent == 100 {
            assert_eq!(done, total, "{line}");
        }
    }
    assert!(out.starts_with("idem demo: "), "{out}");
    assert!(out.contains("through the gateway on sqlite://"), "{out}");
    let row = |name: &str| -> u64 {
        let line = out
            .lines()
            .find(|line| line.starts_with(name))
            .unwrap_or_else(|| panic!("no `{name}` row: {out}"));
        line[name.len()..]
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{line}"))
    };
    let payments = row("payments");
    assert!(payments > 0);
    assert_eq!(row("provider charges"), payments, "{out}");
    assert_eq!(row("DOUBLE CHARGES (provider ledger)"), 0, "{out}");
    assert!(row("upstream executions") >= payments, "{out}");
    assert!(row("re-executions (attempt 2+)") > 0, "{out}");
    assert!(
        !err.contains("WARN"),
        "the demo's expected faults are not logged as warnings: {err}"
    );
}

#[test]
fn demo_consume_makes_no_double_charges_through_the_consumer() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("consume.db").display());
    let args = [
        "demo",
        "consume",
        "--payments",
        "300",
        "--json",
        "--store",
        &store,
    ];
    let (code, out, err) = idem(&args);
    assert_eq!(code, 0, "{out}\n{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let number = |name: &str| {
        report[name]
            .as_u64()
            .unwrap_or_else(|| panic!("{name}: {report}"))
    };
    assert_eq!(number("payments"), 300);
    assert_eq!(number("double_charges"), 0, "{report}");
    assert_eq!(number("charges"), 300, "one charge per payment: {report}");
    // The broker misbehaved: copies, lost acks, a key reused with another payment every 50.
    assert!(number("messages_published") > 300, "{report}");
    assert!(number("deliveries") > number("messages_published"), "{report}");
    assert!(number("lost_acks") > 0, "{report}");
    let dead = report["dead_letters"].as_array().unwrap();
    assert_eq!(dead.len(), 6, "{report}");
    assert!(
        dead.iter()
            .all(|reason| reason.as_str().unwrap().contains("with a different payload")),
        "{report}"
    );
    // Every message was settled: acked or dead-lettered, none lost.
    assert_eq!(number("acked") + 6, number("messages_published"), "{report}");
    // The service failed after charging and timed out; the consumer ran those payments again,
    // and the key passed on to the provider kept them from charging twice.
    assert!(number("faults_after_charging") > 0, "{report}");
    assert!(number("re_executions") > 0, "{report}");
    let (code, stats, err) = idem(&["keys", "stats", "--store", &store, "--json"]);
    assert_eq!(code, 0, "{err}");
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(stats["completed"].as_u64(), Some(300), "{stats}");
    assert_eq!(stats["in_flight"], 0, "{stats}");
}

#[test]
fn demo_consume_without_the_record_or_the_key_double_charges() {
    let args = [
        "demo",
        "consume",
        "--payments",
        "300",
        "--json",
        "--direct",
        "--no-key-propagation",
    ];
    let (code, out, err) = idem(&args);
    assert_eq!(code, 0, "{out}\n{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let doubles = report["double_charges"].as_u64().unwrap();
    assert!(doubles > 0, "{report}");
    assert_eq!(report["through_consumer"], false, "{report}");
    assert_eq!(report["charges"].as_u64().unwrap(), 300 + doubles, "{report}");
    // Without the record every delivery runs the service: at least one run per message.
    assert!(
        report["service_executions"].as_u64().unwrap() >= report["messages_published"].as_u64().unwrap() - 1,
        "{report}"
    );
}

#[test]
fn demo_consume_prints_its_table_and_refuses_bad_flags() {
    let (code, out, err) = idem(&["demo", "consume", "--payments", "100"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("DOUBLE CHARGES (provider ledger)"), "{out}");
    assert!(
        out.contains("through idem consume's consumer on sqlite://"),
        "{out}"
    );
    for bad in [
        vec!["demo", "consume", "--payments", "0"],
        vec!["demo", "consume", "--concurrency", "0"],
        vec!["demo", "consume", "--payments", "many"],
        vec!["demo", "consume", "--requests", "10"],
        vec!["demo", "--requests", "10", "consume"],
    ] {
        let (code, _, err) = idem(&bad);
        assert_eq!(code, 2, "{bad:?}: {err}");
    }
}

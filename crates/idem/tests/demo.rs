//! `idem demo` in the test suite, in short mode: no double charges through the gateway, by the
//! upstream's ledger, cross-checked against the store's records; and, without the gateway, the
//! same storm double-charges, so the figure is measured, not assumed.

mod common;

use common::idem;

#[test]
fn the_demo_makes_no_double_charges_and_its_ledger_agrees_with_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("demo.db").display());
    let (code, out, err) = idem(&["demo", "--requests", "400", "--json", "--store", &store]);
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
fn without_the_gateway_the_same_storm_double_charges() {
    let (code, out, err) = idem(&["demo", "--requests", "400", "--json", "--direct"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["through_gateway"], false);
    assert!(report["double_charges"].as_u64().unwrap() > 0, "{report}");
}

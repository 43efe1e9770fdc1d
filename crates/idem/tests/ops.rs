//! The operations commands against a store with records in every state: list (with paging),
//! get, stats, the stale-lease report, purge and migrate, as tables and as JSON.

mod common;

use std::time::Duration;

use common::idem;
use idempotency::{BeginRequest, Claim, Fingerprint, Key, Outcome, Scope, Store};

fn request(scope: &str, key: &str) -> BeginRequest {
    BeginRequest::new(
        Scope::new(scope).unwrap(),
        Key::new(key).unwrap(),
        Fingerprint::of_bytes(key.as_bytes()),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_see_and_maintain_the_records() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("ops.db").display());
    let (code, out, err) = idem(&["migrate", "--store", &url]);
    assert_eq!(code, 0, "{err}");
    assert!(out.ends_with("schema ready\n"), "{out}");

    let store = idempotency::open(&url).await.unwrap();
    // A crashed worker: in flight, its lease already over.
    let crashed = request("billing", "stuck-1").lease(Duration::from_millis(200));
    assert!(matches!(store.begin(&crashed).await.unwrap(), Claim::Acquired(_)));
    // A running one, with a long lease.
    let running = request("billing", "running-1").lease(Duration::from_secs(600));
    assert!(matches!(store.begin(&running).await.unwrap(), Claim::Acquired(_)));
    // Two completed ones, and one that has already expired.
    for (key, retention) in [("done-1", 3600), ("done-2", 3600), ("gone-1", 0)] {
        let done = request("shipping", key);
        let Claim::Acquired(held) = store.begin(&done).await.unwrap() else {
            panic!("acquire {key}")
        };
        let completed = store
            .complete(
                &held,
                Outcome::new(format!("outcome of {key}")),
                Duration::from_secs(retention),
            )
            .await
            .unwrap();
        assert!(!completed.is_lease_lost());
    }
    drop(store);
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let json = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--store", url.as_str(), "--json"]);
        let (code, out, err) = idem(&all);
        assert_eq!(code, 0, "{args:?}: {err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };

    let stats = json(&["keys", "stats"]);
    assert_eq!(stats["in_flight"], 2, "{stats}");
    assert_eq!(stats["stale_leases"], 1, "{stats}");
    assert_eq!(stats["completed"], 2, "{stats}");
    assert_eq!(stats["expired"], 1, "{stats}");

    // The stale-lease report: both have run for over a second; one lease is over.
    let report = json(&["inflight", "--older-than", "1s"]);
    assert_eq!(report["records"].as_array().unwrap().len(), 2, "{report}");
    assert_eq!(report["stale"], 1, "{report}");
    let (code, table, _) = idem(&["inflight", "--older-than", "1s", "--store", &url]);
    assert_eq!(code, 0);
    assert!(
        table.contains("stuck-1") && table.contains("lease expired"),
        "{table}"
    );
    assert!(table.contains("1 with an expired lease"), "{table}");
    let (_, none, _) = idem(&["inflight", "--older-than", "1h", "--store", &url]);
    assert_eq!(none, "no requests in flight for longer than 1h\n");

    // Listing by state, and paging one record at a time.
    let completed = json(&["keys", "list", "--state", "completed"]);
    let keys: Vec<&str> = completed["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["done-1", "done-2"]);
    let first = json(&["keys", "list", "--state", "completed", "--limit", "1"]);
    let next = &first["next_after"];
    let second = json(&[
        "keys",
        "list",
        "--state",
        "completed",
        "--limit",
        "1",
        "--after-scope",
        next["scope"].as_str().unwrap(),
        "--after-key",
        next["key"].as_str().unwrap(),
    ]);
    assert_eq!(second["records"][0]["key"], "done-2", "{second}");
    let (_, table, _) = idem(&[
        "keys",
        "list",
        "--state",
        "completed",
        "--limit",
        "1",
        "--store",
        &url,
    ]);
    assert!(
        table.contains("--after-scope 'shipping' --after-key 'done-1'"),
        "{table}"
    );

    // One record, with its outcome (not an HTTP response: shown as bytes).
    let record = json(&["keys", "get", "done-1", "--scope", "shipping"]);
    assert_eq!(record["state"], "completed");
    assert_eq!(record["outcome"]["kind"], "bytes");
    assert_eq!(record["outcome"]["text"], "outcome of done-1");

    // Purge removes the expired record only.
    let purged = json(&["keys", "purge"]);
    assert_eq!(purged["purged"], 1, "{purged}");
    let stats = json(&["keys", "stats"]);
    assert_eq!(
        (stats["expired"].as_u64(), stats["completed"].as_u64()),
        (Some(0), Some(2)),
        "{stats}"
    );
}

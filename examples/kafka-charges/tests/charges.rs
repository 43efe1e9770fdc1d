//! The example's run: every payment published twice, a member joining mid-stream, one charge
//! each, on the embedded SQLite store.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_payment_is_charged_once() {
    let dir = std::env::temp_dir().join(format!("kafka-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let store = idempotency::open(&format!("sqlite://{}", dir.join("records.db").display()))
        .await
        .unwrap();
    let summary = kafka_example::run(store, 300).await.unwrap();
    assert_eq!(summary.published, 600);
    assert_eq!(summary.charges.len(), 300);
    let twice: Vec<_> = summary.charges.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "charged twice: {twice:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

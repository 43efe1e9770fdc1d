//! What the DynamoDB tests share: the local server and a store on one of its tables.

#![allow(dead_code, unreachable_pub)] // each test crate uses a part

use std::sync::Arc;
use std::time::Duration;

use aws_sdk_dynamodb::config::{Credentials, Region};
use idempotency_core::ManualClock;
use idempotency_dynamodb::{DynamoDbOptions, DynamoDbStore};

/// The local server: `AWS_ENDPOINT_URL`, or the loopback default `scripts/services` starts.
pub fn endpoint() -> String {
    std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:5000".into())
}

/// A client of the server at `endpoint`, with the placeholder credentials it accepts.
pub fn client(endpoint: &str) -> aws_sdk_dynamodb::Client {
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version_latest()
        .http_client(idempotency_dynamodb::http_client())
        .endpoint_url(endpoint)
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "tests"))
        .build();
    aws_sdk_dynamodb::Client::from_conf(config)
}

/// A store on `table` (created if missing) deciding with `clock` and allowing `skew`; panics
/// when the local server is unreachable.
pub async fn store(table: &str, clock: &ManualClock, skew: Duration) -> DynamoDbStore {
    let options = DynamoDbOptions::table(table)
        .unwrap()
        .clock(Arc::new(clock.clone()))
        .max_clock_skew(skew);
    let store = DynamoDbStore::new(client(&endpoint()), options);
    store.migrate().await.unwrap_or_else(|e| {
        panic!(
            "the local AWS server at {} is needed for this test: {e}",
            endpoint()
        )
    });
    store
}

//! DynamoDB and SQS, against the local AWS server (`AWS_ENDPOINT_URL`, default moto on
//! `http://127.0.0.1:5000`, as `scripts/services` runs it: one request at a time).
//!
//! * DynamoDB: begin→complete cycles per second of the store against the same two requests
//!   (the conditional `PutItem` of `begin`, the token-conditioned `UpdateItem` of `complete`)
//!   issued raw on the store's own client, at 1 and 16 callers.
//! * SQS: messages per second through the same `Worker` with the consumer's guard (on the
//!   memory store, and on the DynamoDB store) against a processor that only acks: receive and
//!   delete with nothing in between.
//!
//! These measure the local server as much as the code: on AWS each request is a network round
//! trip to a fleet, not a call into one Python process.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::{AttributeValue, ReturnValuesOnConditionCheckFailure};
use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use idempotency_consumer::{Consumer, Decisions, Disposition, Handler, HandlerError, Processor};
use idempotency_core::{Attempt, Key, MemoryStore, Outcome, Scope, Token};
use idempotency_dynamodb::{DynamoDbOptions, DynamoDbStore};
use idempotency_sqs::{DeadLetters, SqsMessage, Worker};

use crate::measure::{alternate_async, per_second, runtime, store_versus_raw, versus};

fn endpoint() -> String {
    std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:5000".into())
}

fn credentials() -> aws_sdk_dynamodb::config::Credentials {
    let variable = |name: &str| std::env::var(name).unwrap_or_else(|_| "test".into());
    aws_sdk_dynamodb::config::Credentials::new(
        variable("AWS_ACCESS_KEY_ID"),
        variable("AWS_SECRET_ACCESS_KEY"),
        None,
        None,
        "idem-bench",
    )
}

async fn dynamodb_store(table: &str) -> Result<DynamoDbStore, String> {
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version_latest()
        .http_client(idempotency_dynamodb::http_client())
        .endpoint_url(endpoint())
        .region(aws_sdk_dynamodb::config::Region::new("us-east-1"))
        .credentials_provider(credentials())
        .build();
    let store = DynamoDbStore::new(
        aws_sdk_dynamodb::Client::from_conf(config),
        DynamoDbOptions::table(table).map_err(|e| e.to_string())?,
    );
    store
        .migrate()
        .await
        .map_err(|e| format!("the local AWS server at {}: {e}", endpoint()))?;
    Ok(store)
}

pub(crate) fn run_dynamodb(window: Duration, rounds: usize) -> Result<(), String> {
    runtime()?.block_on(async {
        let store = dynamodb_store(&format!("idem-bench-{}", std::process::id())).await?;
        println!("\n## DynamoDB store vs the same conditional writes issued raw on the same client (local server): begin→complete cycles/s\n");
        println!("| callers | store | raw requests | store / raw | store min–max | raw min–max |");
        println!("|---:|---:|---:|---:|---:|---:|");
        for callers in [1usize, 16] {
            let raw = |store: DynamoDbStore, scope: Scope, key: Key| async move {
                raw_cycle(&store, &scope, &key).await
            };
            let rates = store_versus_raw(&store, raw, callers, window, rounds).await?;
            let (ours, raw) = (&rates[0], &rates[1]);
            println!("| {callers} | {} |", versus(ours, raw));
        }
        Ok(())
    })
}

/// The store's two requests for a begin→complete on a new (or expired) key, with items of the
/// same shape, sent raw: nothing decoded, no state machine.
async fn raw_cycle(store: &DynamoDbStore, scope: &Scope, key: &Key) -> Result<(), String> {
    let client = store.client();
    let pk = format!("raw {} {}", scope.as_str(), key.as_str());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| e.to_string())?
        .as_millis();
    let n = |value: u128| AttributeValue::N(value.to_string());
    let s = |value: &str| AttributeValue::S(value.to_owned());
    let token = format!("{:032x}", Token::random().as_u128());
    client
        .put_item()
        .table_name(store.table())
        .item("pk", s(&pk))
        .item("ver", n(1))
        .item("state", s("in_flight"))
        .item("token", s(&token))
        .item("fingerprint", s(&"f".repeat(64)))
        .item("attempt", n(1))
        .item("created_ms", n(now))
        .item("lease_ms", n(now + 30_000))
        .item("expires_ms", n(now + 30_000))
        .item("ttl", n(now / 1000 + 30))
        .condition_expression("attribute_not_exists(#pk) OR #e <= :now")
        .expression_attribute_names("#pk", "pk")
        .expression_attribute_names("#e", "expires_ms")
        .expression_attribute_values(":now", n(now))
        .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
        .send()
        .await
        .map_err(|e| aws_sdk_dynamodb::error::DisplayErrorContext(e).to_string())?;
    client
        .update_item()
        .table_name(store.table())
        .key("pk", s(&pk))
        .condition_expression("#st = :in_flight AND #tok = :token AND #e > :now")
        .update_expression(
            "SET #v = #v + :one, #st = :completed, #out = :outcome, completed_ms = :now, \
             #e = :now, #ttl = :ttl REMOVE acquired_ms, lease_ms",
        )
        .expression_attribute_names("#st", "state")
        .expression_attribute_names("#tok", "token")
        .expression_attribute_names("#e", "expires_ms")
        .expression_attribute_names("#v", "ver")
        .expression_attribute_names("#out", "outcome")
        .expression_attribute_names("#ttl", "ttl")
        .expression_attribute_values(":in_flight", s("in_flight"))
        .expression_attribute_values(":token", s(&token))
        .expression_attribute_values(":now", n(now))
        .expression_attribute_values(":one", n(1))
        .expression_attribute_values(":completed", s("completed"))
        .expression_attribute_values(
            ":outcome",
            AttributeValue::B(aws_sdk_dynamodb::primitives::Blob::new(Vec::new())),
        )
        .expression_attribute_values(":ttl", n(now / 1000))
        .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
        .send()
        .await
        .map_err(|e| aws_sdk_dynamodb::error::DisplayErrorContext(e).to_string())?;
    Ok(())
}

/// Does nothing: the handler of the guarded variants.
struct Nothing;

impl Handler<SqsMessage> for Nothing {
    async fn handle(&self, _message: &SqsMessage, _attempt: &Attempt) -> Result<Outcome, HandlerError> {
        Ok(Outcome::empty())
    }
}

/// Acks everything: the plain variant.
struct AckAll;

impl Processor<SqsMessage> for AckAll {
    async fn process(&self, _message: &SqsMessage) -> Disposition {
        Disposition::Ack
    }
}

/// Counts the messages a processor has settled.
struct Counted<P> {
    inner: P,
    done: Arc<AtomicU64>,
}

impl<P: Processor<SqsMessage>> Processor<SqsMessage> for Counted<P> {
    async fn process(&self, message: &SqsMessage) -> Disposition {
        let disposition = self.inner.process(message).await;
        self.done.fetch_add(1, Ordering::SeqCst);
        disposition
    }

    async fn process_many(&self, messages: &[&SqsMessage], decided: &Decisions) {
        let before = decided.count();
        self.inner.process_many(messages, decided).await;
        self.done
            .fetch_add((decided.count() - before) as u64, Ordering::SeqCst);
    }
}

/// Messages per round of the SQS figure.
const SQS_MESSAGES: u64 = 600;

pub(crate) fn run_sqs(rounds: usize) -> Result<(), String> {
    runtime()?.block_on(async {
        let config = aws_sdk_sqs::Config::builder()
            .behavior_version_latest()
            .http_client(idempotency_sqs::http_client())
            .endpoint_url(endpoint())
            .region(aws_sdk_sqs::config::Region::new("us-east-1"))
            .credentials_provider(credentials())
            .build();
        let client = aws_sdk_sqs::Client::from_conf(config);
        let name = format!("idem-bench-{}", std::process::id());
        let queue = create_queue(&client, &name).await?;
        let dead = create_queue(&client, &format!("{name}-dead")).await?;
        let dynamodb = dynamodb_store(&format!("idem-bench-sqs-{}", std::process::id())).await?;
        let memory = MemoryStore::new();
        println!("\n## SQS worker with the guard vs plain receive+delete (same worker, local server): messages/s, {SQS_MESSAGES} messages a round, concurrency 10\n");
        println!("| variant | messages/s | / plain | min–max |");
        println!("|---|---:|---:|---:|");
        let mut round = 0_u64;
        let rates = alternate_async(rounds, 5, |variant| {
            round += 1;
            let (client, queue, dead) = (client.clone(), queue.clone(), dead.clone());
            let (memory, dynamodb) = (memory.clone(), dynamodb.clone());
            async move {
                fill(&client, &queue, round).await?;
                // Each receive decided as one batch (the worker's default), or each message alone.
                let batch = if variant % 2 == 1 { 10 } else { 1 };
                match variant {
                    0 => drain(&client, &queue, &dead, AckAll, 1).await,
                    1 | 2 => {
                        let consumer = Consumer::new("bench-sqs-memory", memory, Nothing);
                        drain(&client, &queue, &dead, consumer, batch).await
                    }
                    _ => {
                        let consumer = Consumer::new("bench-sqs-dynamodb", dynamodb, Nothing);
                        drain(&client, &queue, &dead, consumer, batch).await
                    }
                }
            }
        })
        .await?;
        let variants = [
            "plain receive + delete",
            "guard, memory store, batched",
            "guard, memory store, per message",
            "guard, DynamoDB store, batched",
            "guard, DynamoDB store, per message",
        ];
        for (variant, samples) in variants.iter().zip(&rates) {
            println!(
                "| {variant} | {} | {:.2} | {} |",
                per_second(samples.median),
                samples.median / rates[0].median,
                samples.spread()
            );
        }
        Ok(())
    })
}

async fn create_queue(client: &aws_sdk_sqs::Client, name: &str) -> Result<String, String> {
    let created = client.create_queue().queue_name(name).send().await.map_err(|e| {
        format!(
            "the local AWS server at {}: {}",
            endpoint(),
            aws_sdk_sqs::error::DisplayErrorContext(e)
        )
    })?;
    Ok(created.queue_url().unwrap_or_default().to_owned())
}

/// Sends a round's messages, ten a request, each with a key of its own.
async fn fill(client: &aws_sdk_sqs::Client, queue: &str, round: u64) -> Result<(), String> {
    for batch in 0..SQS_MESSAGES / 10 {
        let mut entries = Vec::with_capacity(10);
        for i in 0..10 {
            let key = MessageAttributeValue::builder()
                .data_type("String")
                .string_value(format!("round-{round}-{batch}-{i}"))
                .build()
                .map_err(|e| e.to_string())?;
            entries.push(
                SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body("{\"amount\":1000}")
                    .message_attributes("Idempotency-Key", key)
                    .build()
                    .map_err(|e| e.to_string())?,
            );
        }
        client
            .send_message_batch()
            .queue_url(queue)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| aws_sdk_sqs::error::DisplayErrorContext(e).to_string())?;
    }
    Ok(())
}

/// Runs a worker with `processor` until the round's messages are settled and its deletes
/// flushed; messages per second.
async fn drain<P: Processor<SqsMessage> + 'static>(
    client: &aws_sdk_sqs::Client,
    queue: &str,
    dead: &str,
    processor: P,
    batch: usize,
) -> Result<f64, String> {
    let done = Arc::new(AtomicU64::new(0));
    let processor = Arc::new(Counted {
        inner: processor,
        done: Arc::clone(&done),
    });
    let worker = Worker::new(
        client.clone(),
        queue,
        DeadLetters::Queue(dead.to_owned()),
        processor,
    )
    .concurrency(10)
    .batch(batch)
    .short_polling(Duration::from_millis(20));
    let started = Instant::now();
    let watched = Arc::clone(&done);
    worker
        .run_until(async move {
            while watched.load(Ordering::SeqCst) < SQS_MESSAGES
                && started.elapsed() < Duration::from_secs(600)
            {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .map_err(|e| e.to_string())?;
    let elapsed = started.elapsed();
    let settled = done.load(Ordering::SeqCst);
    if settled < SQS_MESSAGES {
        return Err(format!(
            "only {settled} of {SQS_MESSAGES} SQS messages were settled in 10 minutes"
        ));
    }
    Ok(settled as f64 / elapsed.as_secs_f64())
}

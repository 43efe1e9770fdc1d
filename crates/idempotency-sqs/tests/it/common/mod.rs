//! What the SQS tests share: the local server, queues of their own, a side-effect ledger, and
//! workers that run until told to stop (or are killed).

#![allow(dead_code, unreachable_pub)] // each test crate uses a part

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::config::{Credentials, Region};
use aws_sdk_sqs::types::{Message, MessageSystemAttributeName, QueueAttributeName};
use idempotency_consumer::Processor;
use idempotency_sqs::{DeadLetters, SqsMessage, Worker};
use tokio::sync::oneshot;

/// The local server: `AWS_ENDPOINT_URL`, or the loopback default `scripts/services` starts.
pub fn endpoint() -> String {
    std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:5000".into())
}

/// A client of the local server, with the placeholder credentials it accepts.
pub fn client() -> Client {
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version_latest()
        .http_client(idempotency_sqs::http_client())
        .endpoint_url(endpoint())
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "tests"))
        .build();
    Client::from_conf(config)
}

/// A fresh queue named `name` plus a unique suffix (`.fifo` queues get FIFO attributes); its
/// URL. Panics when the local server is unreachable.
pub async fn queue(client: &Client, name: &str) -> String {
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let (base, fifo) = match name.strip_suffix(".fifo") {
        Some(base) => (base, true),
        None => (name, false),
    };
    let full = format!("{base}-{run}{}", if fifo { ".fifo" } else { "" });
    let mut create = client.create_queue().queue_name(&full);
    if fifo {
        create = create.attributes(QueueAttributeName::FifoQueue, "true");
    }
    let created = create.send().await.unwrap_or_else(|e| {
        panic!(
            "the local AWS server at {} is needed for this test: {}",
            endpoint(),
            aws_sdk_sqs::error::DisplayErrorContext(e)
        )
    });
    created.queue_url().unwrap().to_owned()
}

/// A fresh source queue named after `name` and its dead-letter queue (both FIFO when `name`
/// ends in `.fifo`): `(source, dead)`.
pub async fn queues(client: &Client, name: &str) -> (String, String) {
    let dead = match name.strip_suffix(".fifo") {
        Some(base) => format!("{base}-dead.fifo"),
        None => format!("{name}-dead"),
    };
    (queue(client, name).await, queue(client, &dead).await)
}

/// Visible plus in-flight messages of a queue.
pub async fn depth(client: &Client, url: &str) -> u64 {
    let attributes = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .unwrap();
    let attributes = attributes.attributes().unwrap();
    [
        QueueAttributeName::ApproximateNumberOfMessages,
        QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
    ]
    .iter()
    .map(|name| attributes[name].parse::<u64>().unwrap())
    .sum()
}

/// Every message of a queue (a dead-letter queue, after the run), received and deleted.
pub async fn drain(client: &Client, url: &str) -> Vec<Message> {
    let mut all = Vec::new();
    loop {
        let received = client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await
            .unwrap();
        let messages = received.messages.unwrap_or_default();
        if messages.is_empty() {
            return all;
        }
        for message in &messages {
            client
                .delete_message()
                .queue_url(url)
                .receipt_handle(message.receipt_handle().unwrap())
                .send()
                .await
                .unwrap();
        }
        all.extend(messages);
    }
}

/// A message attribute's string value.
pub fn attribute<'m>(message: &'m Message, name: &str) -> Option<&'m str> {
    message.message_attributes()?.get(name)?.string_value()
}

/// Side effects performed, per key, and the order they happened in.
#[derive(Debug, Default, Clone)]
pub struct Ledger(Arc<Mutex<Effects>>);

/// Effects per key, and every effect's key in the order they happened.
type Effects = (HashMap<String, u32>, Vec<String>);

impl Ledger {
    pub fn record(&self, key: &str) {
        let mut ledger = self.0.lock().unwrap();
        *ledger.0.entry(key.to_owned()).or_default() += 1;
        ledger.1.push(key.to_owned());
    }

    pub fn effects(&self, key: &str) -> u32 {
        self.0.lock().unwrap().0.get(key).copied().unwrap_or(0)
    }

    pub fn keys(&self) -> usize {
        self.0.lock().unwrap().0.len()
    }

    pub fn total(&self) -> u32 {
        self.0.lock().unwrap().0.values().sum()
    }

    pub fn order(&self) -> Vec<String> {
        self.0.lock().unwrap().1.clone()
    }
}

/// A worker running in a task of its own: stop it gracefully, or kill it.
pub struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), idempotency_sqs::AdapterError>>,
}

impl Running {
    pub fn start<P: Processor<SqsMessage> + 'static>(worker: Worker<P>) -> Self {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            worker
                .run_until(async {
                    let _ = stopped.await;
                })
                .await
        });
        Self {
            stop: Some(stop),
            task,
        }
    }

    /// Whether the worker is still running.
    pub fn is_running(&self) -> bool {
        !self.task.is_finished()
    }

    /// Asks the worker to stop and waits until it has settled everything.
    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().unwrap();
    }

    /// Drops the worker mid-flight, as a crash would: nothing more is settled.
    pub fn kill(self) {
        self.task.abort();
    }
}

/// Two workers on `source` sharing `processor`, as two consumer processes would.
pub fn two_workers<P: Processor<SqsMessage> + 'static>(
    client: &Client,
    (source, dead): (&str, &str),
    processor: &Arc<P>,
    visibility: Duration,
) -> [Running; 2] {
    let start = || Running::start(worker(client, source, dead, Arc::clone(processor), visibility));
    [start(), start()]
}

/// Stops every worker of `workers`, letting each settle.
pub async fn stop_all(workers: impl IntoIterator<Item = Running>) {
    for worker in workers {
        worker.stop().await;
    }
}

/// A worker on `queue` with dead letters to `dead`, for tests: short polling (the local server
/// answers one request at a time, and a long poll would hold up every other test's requests).
pub fn worker<P: Processor<SqsMessage> + 'static>(
    client: &Client,
    queue: &str,
    dead: &str,
    processor: Arc<P>,
    visibility: Duration,
) -> Worker<P> {
    Worker::new(
        client.clone(),
        queue,
        DeadLetters::Queue(dead.to_owned()),
        processor,
    )
    .visibility_timeout(visibility)
    .short_polling(Duration::from_millis(100))
    .concurrency(8)
}

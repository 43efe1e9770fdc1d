//! A JetStream stream of a test's own (feature `nats`): a work subject and a dead-letter
//! subject under a fresh id, on the server the tests use (`NATS_URL`, default the loopback
//! server `scripts/services` starts). Every NATS test, in the broker crate and in `idem`'s,
//! starts from one.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use futures_util::StreamExt;
use idempotency_core::Key;

/// The server the tests use: `NATS_URL`, or the loopback default.
#[must_use]
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A stream named `{PREFIX}_{id}` with the subjects `{prefix}.{id}.work` and
/// `{prefix}.{id}.dead` (lower case), its messages kept ten minutes.
#[derive(Debug)]
pub struct TestStream {
    /// The JetStream context it was created on.
    pub js: jetstream::Context,
    /// The stream's handle.
    pub created: jetstream::stream::Stream,
    /// The stream's name.
    pub stream: String,
    /// The subject the tests publish work on.
    pub work: String,
    /// The subject dead letters go to.
    pub dead: String,
}

impl TestStream {
    /// Connects to [`nats_url`] and creates the stream; `configure` adjusts its configuration
    /// (a duplicate window…). Panics when the server is unreachable: a test that cannot reach
    /// its server fails.
    pub async fn new(prefix: &str, configure: impl FnOnce(&mut jetstream::stream::Config)) -> Self {
        let client = async_nats::connect(nats_url())
            .await
            .unwrap_or_else(|e| panic!("NATS JetStream at {} is needed for this test: {e}", nats_url()));
        Self::on(jetstream::new(client), prefix, configure).await
    }

    /// [`TestStream::new`] on a JetStream context of the caller's (a TLS connection…).
    pub async fn on(
        js: jetstream::Context,
        prefix: &str,
        configure: impl FnOnce(&mut jetstream::stream::Config),
    ) -> Self {
        let id = Key::generate().as_str().replace('-', "");
        let subject = prefix.to_lowercase();
        let stream = format!("{}_{id}", prefix.to_uppercase());
        let (work, dead) = (format!("{subject}.{id}.work"), format!("{subject}.{id}.dead"));
        let mut config = jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![work.clone(), dead.clone()],
            max_age: Duration::from_secs(600),
            ..Default::default()
        };
        configure(&mut config);
        let created = js.create_stream(config).await.unwrap();
        Self {
            js,
            created,
            stream,
            work,
            dead,
        }
    }

    /// Publishes `payload` on the work subject with `key` as its `Idempotency-Key` (none when
    /// `None`), and waits for the stream to store it.
    pub async fn publish(&self, key: Option<&str>, payload: &[u8]) {
        let mut headers = HeaderMap::new();
        if let Some(key) = key {
            headers.insert("Idempotency-Key", key);
        }
        self.js
            .publish_with_headers(self.work.clone(), headers, payload.to_vec().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// The headers of every dead letter stored so far, oldest first, read from the start by a
    /// consumer of their own each time (nothing is taken away).
    pub async fn dead_letters(&self) -> Vec<HeaderMap> {
        let reader: jetstream::consumer::PullConsumer = self
            .created
            .create_consumer(jetstream::consumer::pull::Config {
                filter_subject: self.dead.clone(),
                inactive_threshold: Duration::from_secs(30),
                ..Default::default()
            })
            .await
            .unwrap();
        let pending = usize::try_from(reader.cached_info().num_pending).unwrap();
        let mut found = Vec::with_capacity(pending);
        if pending == 0 {
            return found;
        }
        let mut batch = reader
            .fetch()
            .max_messages(pending)
            .expires(Duration::from_secs(2))
            .messages()
            .await
            .unwrap();
        while let Some(Ok(message)) = batch.next().await {
            found.push(message.headers.clone().unwrap_or_default());
        }
        found
    }
}

/// The first value of header `name`, or `""` when there is none.
#[must_use]
pub fn header(headers: &HeaderMap, name: &str) -> String {
    headers
        .get(name)
        .map(|value| value.as_str().to_owned())
        .unwrap_or_default()
}

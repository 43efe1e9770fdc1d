//! The broker suite (`idempotency_testkit::adapter_suite!`) on the local AWS server
//! (`AWS_ENDPOINT_URL`, default `http://127.0.0.1:5000`), each case on a queue of its own with
//! its dead-letter queue and a two-second visibility timeout. Short polling (`wait=0s`): the
//! local server answers one request at a time, and a long poll would hold it for every other
//! test. Credentials come from the environment, as for any AWS tool (`scripts/test` sets
//! placeholders). Workers reach the server through a proxy of their case's own
//! (`endpoint=`), which stalls when the case says so.

use crate::common;

use std::sync::Mutex;
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::MessageAttributeValue;
use common::{client, depth, drain, endpoint, queues};
use idempotency_consumer::source::SourceKind;
use idempotency_testkit::TcpProxy;
use idempotency_testkit::brokers::{
    BrokerHarness, BrokerSource, DeadLetter, Foreign, ForeignKeys, MessageIds,
};

/// The visibility timeout: a handler three times as long needs extensions.
const VISIBILITY: Duration = Duration::from_secs(2);

struct Sqs;

struct Queue {
    /// The workers' way to the server.
    proxy: TcpProxy,
    /// The server's origin through `proxy`.
    endpoint: String,
    client: Client,
    url: String,
    dead_url: String,
    /// The dead letters read so far (reading takes them off the queue).
    dead: Mutex<Vec<DeadLetter>>,
}

impl BrokerHarness for Sqs {
    type Source = Queue;

    async fn source(&self, case: &str) -> Queue {
        let client = client();
        let (url, dead_url) = queues(&client, &format!("suite-{case}")).await;
        let (proxy, endpoint) = TcpProxy::in_front_of(&endpoint()).await.unwrap();
        Queue {
            proxy,
            endpoint,
            client,
            url,
            dead_url,
            dead: Mutex::default(),
        }
    }
}

impl BrokerSource for Queue {
    fn kind(&self) -> SourceKind {
        idempotency_sqs::SOURCE
    }

    fn url(&self) -> String {
        format!(
            "sqs://?queue_url={}&dead_letter_url={}&endpoint={}&visibility={}s&wait=0s",
            self.url,
            self.dead_url,
            self.endpoint,
            VISIBILITY.as_secs()
        )
    }

    fn hold(&self) -> Option<Duration> {
        Some(VISIBILITY)
    }

    async fn publish(&self, key: Option<&str>, payload: &[u8]) {
        let mut send = self
            .client
            .send_message()
            .queue_url(&self.url)
            .message_body(String::from_utf8_lossy(payload));
        if let Some(key) = key {
            let value = MessageAttributeValue::builder()
                .data_type("String")
                .string_value(key)
                .build()
                .unwrap();
            send = send.message_attributes("Idempotency-Key", value);
        }
        send.send().await.unwrap();
    }

    /// A standard queue: SQS assigns each send its `MessageId`.
    async fn publish_foreign(&self, message: Foreign<'_>) {
        let mut send = self
            .client
            .send_message()
            .queue_url(&self.url)
            .message_body(String::from_utf8_lossy(message.payload));
        for (name, value) in message.headers {
            let value = MessageAttributeValue::builder()
                .data_type("String")
                .string_value(*value)
                .build()
                .unwrap();
            send = send.message_attributes(*name, value);
        }
        send.send().await.unwrap();
    }

    fn foreign_keys(&self) -> ForeignKeys {
        ForeignKeys {
            message_id: MessageIds::Assigned,
            record_key: false,
        }
    }

    async fn dead_letters(&self) -> Vec<DeadLetter> {
        for message in drain(&self.client, &self.dead_url).await {
            let attributes = message.message_attributes().into_iter().flatten();
            let headers =
                attributes.filter_map(|(name, value)| Some((name.clone(), value.string_value()?.to_owned())));
            self.dead.lock().unwrap().push(DeadLetter::new(headers));
        }
        self.dead.lock().unwrap().clone()
    }

    async fn outstanding(&self) -> u64 {
        depth(&self.client, &self.url).await
    }

    /// Deletes the dead-letter queue, or creates it again under its name (and so its URL).
    async fn refuse_dead_letters(&self, refuse: bool) {
        if refuse {
            self.client
                .delete_queue()
                .queue_url(&self.dead_url)
                .send()
                .await
                .unwrap();
        } else {
            let name = self.dead_url.rsplit('/').next().unwrap();
            self.client.create_queue().queue_name(name).send().await.unwrap();
        }
    }

    async fn stall(&self, stalled: bool) {
        self.proxy.stall(stalled);
    }
}

idempotency_testkit::adapter_suite!(Sqs);

//! The broker suite (`idempotency_testkit::adapter_suite!`) on the real NATS JetStream server
//! (`NATS_URL`, default `nats://127.0.0.1:4222`), each case on a stream of its own with a
//! durable consumer whose ack wait is one second. Workers reach the server through a proxy of
//! their case's own, which stalls when the case says so.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::PullConsumer};
use idempotency_consumer::source::SourceKind;
use idempotency_testkit::TcpProxy;
use idempotency_testkit::brokers::{
    BrokerHarness, BrokerSource, DeadLetter, Foreign, ForeignKeys, MessageIds,
};

use idempotency_testkit::nats::{TestStream, nats_url};

/// The consumer's ack wait: a handler three times as long needs progress acks.
const ACK_WAIT: Duration = Duration::from_secs(1);

struct JetStream;

struct Stream {
    /// The workers' way to the server.
    proxy: TcpProxy,
    /// [`nats_url`] through `proxy`.
    proxied: String,
    test: TestStream,
    workers: PullConsumer,
}

impl BrokerHarness for JetStream {
    type Source = Stream;

    async fn source(&self, case: &str) -> Stream {
        let test = TestStream::new(&format!("suite_{case}"), |_| {}).await;
        // The durable consumer as the worker would create it, made here so that it counts what
        // is published before the worker starts.
        let workers = test
            .created
            .create_consumer(jetstream::consumer::pull::Config {
                durable_name: Some("workers".into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                filter_subject: test.work.clone(),
                ack_wait: ACK_WAIT,
                ..Default::default()
            })
            .await
            .unwrap();
        let (proxy, proxied) = TcpProxy::in_front_of(&nats_url()).await.unwrap();
        Stream {
            proxy,
            proxied,
            test,
            workers,
        }
    }
}

impl BrokerSource for Stream {
    fn kind(&self) -> SourceKind {
        idempotency_nats::SOURCE
    }

    fn url(&self) -> String {
        format!(
            "{}?stream={}&consumer=workers&subject={}&dead_letter={}&ack_wait={}s",
            self.proxied,
            self.test.stream,
            self.test.work,
            self.test.dead,
            ACK_WAIT.as_secs()
        )
    }

    fn hold(&self) -> Option<Duration> {
        Some(ACK_WAIT)
    }

    async fn publish(&self, key: Option<&str>, payload: &[u8]) {
        self.test.publish(key, payload).await;
    }

    /// The message id is `Nats-Msg-Id`, which the stream also deduplicates publishes by
    /// (within its duplicate window): a second send may be stored once only.
    async fn publish_foreign(&self, message: Foreign<'_>) {
        let mut headers = HeaderMap::new();
        for (name, value) in message.headers {
            headers.insert(*name, *value);
        }
        if let Some(id) = message.message_id {
            headers.insert("Nats-Msg-Id", id);
        }
        self.test
            .js
            .publish_with_headers(self.test.work.clone(), headers, message.payload.to_vec().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    fn foreign_keys(&self) -> ForeignKeys {
        ForeignKeys {
            message_id: MessageIds::Set,
            record_key: false,
        }
    }

    async fn dead_letters(&self) -> Vec<DeadLetter> {
        let dead = self.test.dead_letters().await;
        let letter =
            |headers: &HeaderMap| {
                DeadLetter::new(headers.iter().filter_map(|(name, values)| {
                    Some((name.to_string(), values.first()?.as_str().to_owned()))
                }))
            };
        dead.iter().map(letter).collect()
    }

    async fn outstanding(&self) -> u64 {
        let mut workers = self.workers.clone();
        let info = workers.info().await.unwrap();
        info.num_pending + u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX)
    }

    /// The stream stops (or starts again) storing the dead-letter subject: a publish to it then
    /// has no stream to answer it.
    async fn refuse_dead_letters(&self, refuse: bool) {
        let mut stream = self.test.js.get_stream(&self.test.stream).await.unwrap();
        let mut config = stream.info().await.unwrap().config.clone();
        config.subjects = if refuse {
            vec![self.test.work.clone()]
        } else {
            vec![self.test.work.clone(), self.test.dead.clone()]
        };
        self.test.js.update_stream(config).await.unwrap();
    }

    async fn stall(&self, stalled: bool) {
        self.proxy.stall(stalled);
    }
}

idempotency_testkit::adapter_suite!(JetStream);

/// Independent messages only (see the case's docs): not a case of the four-broker suite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_waiting_for_the_store_does_not_hold_the_next_back() {
    idempotency_testkit::brokers::a_batch_waiting_for_the_store_does_not_hold_the_next_back(&JetStream).await;
}

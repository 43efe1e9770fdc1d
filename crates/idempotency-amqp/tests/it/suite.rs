//! The broker suite (`idempotency_testkit::adapter_suite!`) on the real RabbitMQ server
//! (`AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`), each case on queues of its own
//! that expire ten minutes after the case. Workers reach the server through a proxy of their
//! case's own, which stalls when the case says so.

use std::sync::Mutex;
use std::time::Duration;

use idempotency_amqp::{AmqpMessage, Topology};
use idempotency_consumer::Delivery;
use idempotency_consumer::source::SourceKind;
use idempotency_core::Key;
use idempotency_testkit::TcpProxy;
use idempotency_testkit::brokers::{
    BrokerHarness, BrokerSource, DeadLetter, Foreign, ForeignKeys, MessageIds,
};
use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

const EXPIRES: Duration = Duration::from_secs(600);

struct RabbitMq;

struct Queue {
    /// The workers' way to the server.
    proxy: TcpProxy,
    /// [`amqp_url`] through `proxy`.
    proxied: String,
    _connection: Connection,
    channel: Channel,
    topology: Topology,
    /// The dead letters read so far (reading takes them off the queue).
    dead: Mutex<Vec<DeadLetter>>,
}

impl BrokerHarness for RabbitMq {
    type Source = Queue;

    async fn source(&self, case: &str) -> Queue {
        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("RabbitMQ at {} is needed for this test: {e}", amqp_url()));
        let channel = connection.create_channel().await.unwrap();
        let topology = Topology::for_queue(&format!("suite-{case}-{}", Key::generate())).expires(EXPIRES);
        topology.declare(&channel).await.unwrap();
        let (proxy, proxied) = TcpProxy::in_front_of(&amqp_url()).await.unwrap();
        Queue {
            proxy,
            proxied,
            _connection: connection,
            channel,
            topology,
            dead: Mutex::default(),
        }
    }
}

impl Queue {
    async fn ready(&self, queue: &str) -> u64 {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let declared = self
            .channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await
            .unwrap();
        u64::from(declared.message_count())
    }
}

impl BrokerSource for Queue {
    fn kind(&self) -> SourceKind {
        idempotency_amqp::SOURCE
    }

    fn url(&self) -> String {
        let url = &self.proxied;
        let joint = if url.contains('?') { '&' } else { '?' };
        format!(
            "{url}{joint}queue={}&expires={}s",
            self.topology.queue,
            EXPIRES.as_secs()
        )
    }

    fn hold(&self) -> Option<Duration> {
        None
    }

    async fn publish(&self, key: Option<&str>, payload: &[u8]) {
        let mut headers = FieldTable::default();
        if let Some(key) = key {
            headers.insert("Idempotency-Key".into(), AMQPValue::LongString(key.into()));
        }
        self.channel
            .basic_publish(
                "".into(),
                self.topology.queue.as_str().into(),
                BasicPublishOptions::default(),
                payload,
                BasicProperties::default().with_headers(headers),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    async fn publish_foreign(&self, message: Foreign<'_>) {
        let mut headers = FieldTable::default();
        for (name, value) in message.headers {
            headers.insert((*name).into(), AMQPValue::LongString((*value).into()));
        }
        let mut properties = BasicProperties::default().with_headers(headers);
        if let Some(id) = message.message_id {
            properties = properties.with_message_id(id.into());
        }
        self.channel
            .basic_publish(
                "".into(),
                self.topology.queue.as_str().into(),
                BasicPublishOptions::default(),
                message.payload,
                properties,
            )
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
        while let Some(message) = self
            .channel
            .basic_get(
                self.topology.dead_queue.as_str().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap()
        {
            let message = AmqpMessage::new(message.delivery);
            let headers = message
                .headers()
                .into_iter()
                .map(|(name, value)| (name, String::from_utf8_lossy(&value).into_owned()));
            self.dead.lock().unwrap().push(DeadLetter::new(headers));
        }
        self.dead.lock().unwrap().clone()
    }

    /// Ready messages of the work and retry queues (RabbitMQ does not count the unacknowledged
    /// ones in a declaration's answer; the cases wait for their effects first).
    async fn outstanding(&self) -> u64 {
        self.ready(&self.topology.queue).await + self.ready(&self.topology.retry_queue).await
    }

    async fn refuse_dead_letters(&self, refuse: bool) {
        if refuse {
            let deleted = self
                .channel
                .queue_delete(
                    self.topology.dead_queue.as_str().into(),
                    QueueDeleteOptions::default(),
                )
                .await;
            deleted.unwrap();
        } else {
            self.topology.declare(&self.channel).await.unwrap();
        }
    }

    async fn stall(&self, stalled: bool) {
        self.proxy.stall(stalled);
    }
}

idempotency_testkit::adapter_suite!(RabbitMq);

/// Independent messages only (see the case's docs): not a case of the four-broker suite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_waiting_for_the_store_does_not_hold_the_next_back() {
    idempotency_testkit::brokers::a_batch_waiting_for_the_store_does_not_hold_the_next_back(&RabbitMq).await;
}

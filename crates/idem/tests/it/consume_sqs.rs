//! `idem consume` from SQS: the binary as a process of its own on queues of the local
//! AWS-compatible server `scripts/services` starts (`AWS_ENDPOINT_URL`, by default
//! http://127.0.0.1:5000), and an HTTP handler with a ledger of every call.

use crate::common;

use std::time::Duration;

use common::consume::{self, Broker};
use idempotency::Key;
use idempotency_sqs::aws_sdk_sqs::config::{Credentials, Region};
use idempotency_sqs::aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use idempotency_sqs::aws_sdk_sqs::{Client, Config};

fn endpoint() -> String {
    std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:5000".into())
}

/// The local server over HTTPS (`scripts/services moto-tls`), named as its certificate names it.
fn tls_endpoint() -> String {
    std::env::var("AWS_TLS_ENDPOINT_URL").unwrap_or_else(|_| "https://localhost:5443".into())
}

/// A queue and its dead-letter queue, of the test's own.
struct Sqs {
    client: Client,
    queue_url: String,
    dead_url: String,
    /// `idem consume` reaches the queue over HTTPS with this `ca=` file.
    tls_ca: Option<String>,
}

impl Sqs {
    /// The queues of [`new`](Self::new), consumed over HTTPS verified against the test CA.
    async fn over_tls() -> Self {
        Self {
            tls_ca: Some(idempotency_testkit::tls::file("ca.pem")),
            ..Self::new().await
        }
    }

    /// `idem consume`'s `--from` for the queue over HTTPS, trusting `ca` when given.
    fn source_over_tls(&self, endpoint: &str, ca: Option<&str>) -> String {
        let path = self.queue_url.splitn(4, '/').nth(3).unwrap();
        let mut from = format!("sqs://?queue_url={endpoint}/{path}&wait=0s&visibility=3s");
        if let Some(ca) = ca {
            from.push_str(&format!("&ca={ca}"));
        }
        from
    }

    async fn new() -> Self {
        let config = Config::builder()
            .behavior_version_latest()
            .http_client(idempotency_sqs::http_client())
            .endpoint_url(endpoint())
            .region(Region::new("us-east-1"))
            .credentials_provider(Credentials::new("test", "test", None, None, "tests"))
            .build();
        let client = Client::from_conf(config);
        let name = format!("idem-consume-{}", Key::generate());
        let mut urls = Vec::new();
        for name in [name.clone(), format!("{name}-dead")] {
            let created = client
                .create_queue()
                .queue_name(name)
                .attributes(QueueAttributeName::VisibilityTimeout, "3")
                .send()
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "the local AWS server at {} is needed for this test (scripts/services starts it): {e:?}",
                        endpoint()
                    )
                });
            urls.push(created.queue_url.unwrap());
        }
        let dead_url = urls.pop().unwrap();
        let queue_url = urls.pop().unwrap();
        Self {
            client,
            queue_url,
            dead_url,
            tls_ca: None,
        }
    }
}

impl Broker for Sqs {
    fn source_name(&self) -> String {
        self.queue_url.rsplit('/').next().unwrap().to_owned()
    }

    /// Short polling (the local server answers one request at a time: a long poll would hold
    /// up the heartbeats) and a 3 s visibility timeout; the dead-letter queue is found by its
    /// name (QUEUE-dead) and the endpoint from the queue's URL.
    fn from(&self) -> String {
        match &self.tls_ca {
            Some(ca) => self.source_over_tls(&tls_endpoint(), Some(ca)),
            None => format!("sqs://?queue_url={}&wait=0s&visibility=3s", self.queue_url),
        }
    }

    /// A killed consumer's message comes back after the 3 s visibility timeout; an 8 s lease
    /// is still running then.
    fn kill_lease(&self) -> Duration {
        Duration::from_secs(8)
    }

    /// The credentials the local server accepts, unless the environment has some.
    fn env(&self) -> Vec<(&'static str, String)> {
        ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
            .into_iter()
            .filter(|name| std::env::var_os(name).is_none())
            .map(|name| (name, "test".to_owned()))
            .collect()
    }

    async fn publish(&self, key: &str, payload: &[u8]) {
        let key = MessageAttributeValue::builder()
            .data_type("String")
            .string_value(key)
            .build()
            .unwrap();
        self.client
            .send_message()
            .queue_url(&self.queue_url)
            .message_body(String::from_utf8(payload.to_vec()).unwrap())
            .message_attributes("Idempotency-Key", key)
            .send()
            .await
            .unwrap();
    }

    async fn dead_letters(&self) -> Vec<(String, String)> {
        let received = self
            .client
            .receive_message()
            .queue_url(&self.dead_url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .visibility_timeout(30)
            .message_attribute_names("All")
            .send()
            .await
            .unwrap();
        received
            .messages
            .unwrap_or_default()
            .iter()
            .map(|message| {
                let attribute = |name: &str| {
                    message
                        .message_attributes()
                        .and_then(|attributes| attributes.get(name))
                        .and_then(MessageAttributeValue::string_value)
                        .unwrap_or_default()
                        .to_owned()
                };
                (attribute("Idempotency-Key"), attribute("Idempotency-Dead-Reason"))
            })
            .collect()
    }

    /// Messages in the queue, visible or in flight.
    async fn outstanding(&self) -> u64 {
        let names = [
            QueueAttributeName::ApproximateNumberOfMessages,
            QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
        ];
        let found = self
            .client
            .get_queue_attributes()
            .queue_url(&self.queue_url)
            .set_attribute_names(Some(names.to_vec()))
            .send()
            .await
            .unwrap();
        let attributes = found.attributes().unwrap();
        names
            .iter()
            .map(|name| attributes[name].parse::<u64>().unwrap())
            .sum()
    }

    /// The dead-letter queue's visible messages.
    async fn dead_depth(&self) -> u64 {
        let found = self
            .client
            .get_queue_attributes()
            .queue_url(&self.dead_url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .send()
            .await
            .unwrap();
        found.attributes().unwrap()[&QueueAttributeName::ApproximateNumberOfMessages]
            .parse()
            .unwrap()
    }

    fn missing_source(&self) -> String {
        let missing = format!(
            "{}/idem-missing-{}",
            self.queue_url.rsplit_once('/').unwrap().0,
            Key::generate()
        );
        format!("sqs://?queue_url={missing}&wait=0s")
    }
}

common::consume::scenarios!(_name => Sqs::new().await);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_queues_and_an_unreachable_service_are_clear_errors() {
    let sqs = Sqs::new().await;
    let unreachable = common::free_addr();
    for (from, why) in [
        (
            format!("sqs://?queue_url={}/123456789012/nowhere", endpoint()),
            "does not exist",
        ),
        (
            format!(
                "sqs://?queue_url={}&dead_letter_url={}/123456789012/nowhere-dead",
                sqs.queue_url,
                endpoint()
            ),
            "does not exist",
        ),
        (
            format!("sqs://?queue_url={}&dead_letter=redrive", sqs.queue_url),
            "has no redrive policy",
        ),
        (
            format!("sqs://?queue_url=http://{unreachable}/123456789012/q"),
            "cannot reach SQS",
        ),
    ] {
        consume::refused_at_start(&sqs, &from, &[], &[why], &[]);
    }
}

/// The worker's SQS client over HTTPS (`ca=`, `scripts/services moto-tls`), queue and dead
/// letters alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_https_with_the_ca_every_message_published_three_times_is_handled_once() {
    consume::three_copies_run_once(&Sqs::over_tls().await).await;
}

/// Without `ca` (the system's trust store), with another CA and by an address the certificate
/// does not name, `idem consume` stops at its start check with the TLS cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_queue_of_another_ca_or_name_stops_the_consumer_at_start() {
    let sqs = Sqs::new().await;
    let by_address = tls_endpoint().replace("localhost", "127.0.0.1");
    let other_ca = idempotency_testkit::tls::file("other-ca.pem");
    let ca = idempotency_testkit::tls::file("ca.pem");
    for (from, why) in [
        (sqs.source_over_tls(&tls_endpoint(), None), "UnknownIssuer"),
        (
            sqs.source_over_tls(&tls_endpoint(), Some(&other_ca)),
            "UnknownIssuer",
        ),
        (sqs.source_over_tls(&by_address, Some(&ca)), "not valid for name"),
    ] {
        consume::refused_at_start(&sqs, &from, &[], &["cannot reach SQS", why], &[]);
    }
}

//! `--from`: where `idem consume` takes its messages from, parsed and checked before anything
//! connects.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use super::ConsumeError;
use crate::gateway::bounded_duration;

/// What `--from` accepts, for error messages.
const EXPECTED: &str = "expected amqp://USER:PASSWORD@HOST/VHOST?queue=QUEUE, \
nats://HOST:PORT?stream=STREAM&consumer=CONSUMER, kafka://HOST:PORT?topic=TOPIC&group=GROUP or \
sqs://?queue_url=URL";

/// Client settings of Kafka's that `idem consume` sets itself.
const KAFKA_OWNED: [&str; 4] = [
    "bootstrap.servers",
    "group.id",
    "enable.auto.commit",
    "enable.auto.offset.store",
];

/// Where messages come from.
#[derive(Clone, PartialEq, Eq)]
pub(super) enum Source {
    /// A RabbitMQ queue.
    Amqp {
        /// The broker URL without the `queue` parameter.
        url: String,
        queue: String,
    },
    /// A durable pull consumer of a JetStream stream.
    Nats {
        /// The server URL without the parameters.
        url: String,
        stream: String,
        consumer: String,
        /// Where dead letters are published (a subject some stream stores).
        dead_letter: String,
        /// The subject a consumer created by `idem consume` takes messages from.
        subject: Option<String>,
        /// The ack wait of a consumer created by `idem consume`.
        ack_wait: Option<Duration>,
    },
    /// A topic, consumed as a member of a consumer group.
    Kafka(Kafka),
    /// An SQS queue.
    Sqs(Sqs),
}

/// A `kafka://` source.
#[derive(Clone, PartialEq, Eq)]
pub(super) struct Kafka {
    /// `bootstrap.servers`: HOST:PORT, comma-separated.
    pub(super) brokers: String,
    pub(super) topic: String,
    pub(super) group: String,
    /// Where dead letters are produced.
    pub(super) dead_letter: String,
    /// Any other librdkafka setting (security, SASL, timeouts), the URL's user and password
    /// as `sasl.username` and `sasl.password`.
    pub(super) settings: BTreeMap<String, String>,
}

/// An `sqs://` source.
#[derive(Clone, PartialEq, Eq)]
pub(super) struct Sqs {
    pub(super) queue_url: String,
    /// A dead-letter queue's URL, or `None`: the queue's redrive policy.
    pub(super) dead_letter_url: Option<String>,
    /// The region; the environment's when `None`.
    pub(super) region: Option<String>,
    /// The service endpoint; the SDK's for the region when `None`.
    pub(super) endpoint: Option<String>,
    pub(super) visibility: Duration,
    /// The long poll; zero for short polling.
    pub(super) wait: Duration,
}

impl Source {
    /// Refuses a source this build of `idem` cannot consume from (its feature is off).
    pub(super) fn available(&self, from: &str) -> Result<(), ConsumeError> {
        match self {
            Self::Kafka(_) if !cfg!(feature = "kafka") => Err(not_built(from, "kafka")),
            Self::Sqs(_) if !cfg!(feature = "sqs") => Err(not_built(from, "sqs")),
            _ => Ok(()),
        }
    }
}

/// The refusal of a source whose feature this build of `idem` was built without.
pub(super) fn not_built(from: &str, feature: &str) -> ConsumeError {
    ConsumeError::Source {
        from: idempotency::redact_url(from),
        why: format!(
            "this idem was built without {feature}:// sources; build it with the `{feature}` feature (cargo install --path crates/idem --features {feature})"
        ),
    }
}

impl Sqs {
    /// The queue's name: the last segment of its URL.
    pub(super) fn queue_name(&self) -> String {
        self.queue_url
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or(&self.queue_url)
            .to_owned()
    }
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Amqp { url, queue } => f
                .debug_struct("Amqp")
                .field("url", &idempotency::redact_url(url))
                .field("queue", queue)
                .finish(),
            Self::Nats {
                url,
                stream,
                consumer,
                dead_letter,
                subject,
                ack_wait,
            } => f
                .debug_struct("Nats")
                .field("url", &idempotency::redact_url(url))
                .field("stream", stream)
                .field("consumer", consumer)
                .field("dead_letter", dead_letter)
                .field("subject", subject)
                .field("ack_wait", ack_wait)
                .finish(),
            Self::Kafka(kafka) => kafka.fmt(f),
            Self::Sqs(sqs) => sqs.fmt(f),
        }
    }
}

impl fmt::Debug for Kafka {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let settings: BTreeMap<&str, &str> = self
            .settings
            .iter()
            .map(|(name, value)| {
                let shown = if idempotency_core::is_credential(name) {
                    "***"
                } else {
                    value.as_str()
                };
                (name.as_str(), shown)
            })
            .collect();
        f.debug_struct("Kafka")
            .field("brokers", &self.brokers)
            .field("topic", &self.topic)
            .field("group", &self.group)
            .field("dead_letter", &self.dead_letter)
            .field("settings", &settings)
            .finish()
    }
}

impl fmt::Debug for Sqs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sqs")
            .field("queue_url", &idempotency::redact_url(&self.queue_url))
            .field(
                "dead_letter_url",
                &self.dead_letter_url.as_deref().map(idempotency::redact_url),
            )
            .field("region", &self.region)
            .field("endpoint", &self.endpoint)
            .field("visibility", &self.visibility)
            .field("wait", &self.wait)
            .finish()
    }
}

/// Parses `--from`.
pub(super) fn source(from: &str) -> Result<Source, ConsumeError> {
    let refuse = |why: String| ConsumeError::Source {
        from: idempotency::redact_url(from),
        why,
    };
    // Kafka's brokers are a comma-separated list, which is no URL authority: the two schemes
    // without a URL's host are split by hand.
    if let Some(rest) = strip_scheme(from, "kafka") {
        return kafka(rest).map(Source::Kafka).map_err(refuse);
    }
    if let Some(rest) = strip_scheme(from, "sqs") {
        return sqs(rest).map(Source::Sqs).map_err(refuse);
    }
    let mut url = url::Url::parse(from).map_err(|e| refuse(format!("not a URL ({e}); {EXPECTED}")))?;
    match url.scheme() {
        "amqp" | "amqps" => {
            let mut queue = None;
            let mut rest = Vec::new();
            for (name, value) in url.query_pairs() {
                if name == "queue" {
                    queue = Some(value.into_owned());
                } else {
                    rest.push((name.into_owned(), value.into_owned()));
                }
            }
            let queue = queue
                .filter(|q| !q.is_empty())
                .ok_or_else(|| refuse("names no queue: add ?queue=QUEUE".into()))?;
            if queue.len() > 200 || queue.chars().any(|c| c.is_control()) {
                return Err(refuse(format!(
                    "the queue name {queue:?} is not one RabbitMQ accepts"
                )));
            }
            if rest.is_empty() {
                url.set_query(None);
            } else {
                url.query_pairs_mut().clear().extend_pairs(rest);
            }
            Ok(Source::Amqp {
                url: url.into(),
                queue,
            })
        }
        "nats" => {
            let mut params = Params::new(url.query().unwrap_or_default());
            let stream = params
                .take("stream")
                .ok_or_else(|| refuse("names no stream: add ?stream=STREAM&consumer=CONSUMER".into()))?;
            let consumer = params.take("consumer").ok_or_else(|| {
                refuse(
                    "names no consumer: add &consumer=CONSUMER (a durable pull consumer, created if missing)"
                        .into(),
                )
            })?;
            let dead_letter = params
                .take("dead_letter")
                .unwrap_or_else(|| format!("{stream}.dead"));
            let subject = params.take("subject");
            let ack_wait = params
                .duration(
                    "ack_wait",
                    (Duration::from_secs(1), Duration::from_secs(86_400)),
                    "must be from 1s to 24h",
                )
                .map_err(refuse)?;
            params
                .finish("stream, consumer, subject, dead_letter, ack_wait")
                .map_err(refuse)?;
            url.set_query(None);
            Ok(Source::Nats {
                url: url.into(),
                stream,
                consumer,
                dead_letter,
                subject,
                ack_wait,
            })
        }
        other => Err(refuse(format!("unknown scheme `{other}`; {EXPECTED}"))),
    }
}

/// What follows `scheme://` in `from`, when `from` starts with it (in any case).
fn strip_scheme<'a>(from: &'a str, scheme: &str) -> Option<&'a str> {
    let (head, rest) = from.split_once("://")?;
    head.eq_ignore_ascii_case(scheme).then_some(rest)
}

/// A URL's query parameters, taken one by one; what is left is refused.
struct Params(BTreeMap<String, String>);

impl Params {
    fn new(query: &str) -> Self {
        Self(
            url::form_urlencoded::parse(query.as_bytes())
                .into_owned()
                .collect(),
        )
    }

    /// The parameter `name`, unless absent or empty.
    fn take(&mut self, name: &str) -> Option<String> {
        self.0.remove(name).filter(|value| !value.is_empty())
    }

    /// A duration parameter within `range`.
    fn duration(
        &mut self,
        name: &'static str,
        range: (Duration, Duration),
        why: &'static str,
    ) -> Result<Option<Duration>, String> {
        self.take(name)
            .map(|text| {
                bounded_duration(&text, name, range, why).map_err(|why| format!("{name}={text}: {why}"))
            })
            .transpose()
    }

    /// Refuses any parameter not taken.
    fn finish(self, known: &str) -> Result<(), String> {
        match self.0.keys().next() {
            Some(unknown) => Err(format!("unknown parameter `{unknown}` ({known})")),
            None => Ok(()),
        }
    }
}

/// `kafka://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…]?topic=T&group=G[&dead_letter=D][&SETTING=V…]`
fn kafka(rest: &str) -> Result<Kafka, String> {
    let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
    let authority = authority.trim_end_matches('/');
    if authority.contains('/') {
        return Err("a Kafka URL has no path: kafka://HOST:PORT?topic=TOPIC&group=GROUP".into());
    }
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (Some(userinfo), hosts),
        None => (None, authority),
    };
    for broker in hosts.split(',') {
        let port = broker
            .rsplit_once(':')
            .map(|(host, port)| (host, port.parse::<u16>()));
        match port {
            Some((host, Ok(port))) if !host.is_empty() && port > 0 => {}
            _ => {
                return Err(format!(
                    "`{broker}` is not a broker address: expected HOST:PORT (several separated by commas)"
                ));
            }
        }
    }
    let mut params = Params::new(query);
    let topic = params
        .take("topic")
        .ok_or("names no topic: add ?topic=TOPIC&group=GROUP")?;
    let group = params
        .take("group")
        .ok_or("names no consumer group: add &group=GROUP")?;
    let dead_letter = params
        .take("dead_letter")
        .unwrap_or_else(|| format!("{topic}.dead"));
    for name in [&topic, &dead_letter] {
        let legal = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        if name.len() > 249 || !name.chars().all(legal) || name == "." || name == ".." {
            return Err(format!(
                "`{name}` is not a Kafka topic name (1 to 249 of a-z, A-Z, 0-9, `.`, `_`, `-`)"
            ));
        }
    }
    if dead_letter == topic {
        return Err("the dead-letter topic is the topic itself: name another with &dead_letter=TOPIC".into());
    }
    if group.len() > 255 || group.chars().any(char::is_control) {
        return Err(format!("`{group}` is not a consumer group name Kafka accepts"));
    }
    let mut settings = params.0;
    if let Some(owned) = KAFKA_OWNED.iter().find(|owned| settings.contains_key(**owned)) {
        return Err(format!(
            "`{owned}` is set by idem consume (the brokers are the URL's hosts, the group is group=, offsets are committed once recorded)"
        ));
    }
    if let Some((name, _)) = settings.iter().find(|(_, value)| value.is_empty()) {
        return Err(format!("the setting `{name}` has no value"));
    }
    if let Some(userinfo) = userinfo {
        let decode = |text: &str| {
            percent_encoding::percent_decode_str(text)
                .decode_utf8()
                .map(|text| text.into_owned())
                .map_err(|_| "the user or password is not UTF-8 once decoded".to_owned())
        };
        let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
        settings.insert("sasl.username".into(), decode(user)?);
        if !password.is_empty() {
            settings.insert("sasl.password".into(), decode(password)?);
        }
    }
    Ok(Kafka {
        brokers: hosts.to_owned(),
        topic,
        group,
        dead_letter,
        settings,
    })
}

/// `sqs://[REGION]?queue_url=URL[&dead_letter_url=URL | &dead_letter=redrive][&endpoint=URL][&visibility=30s][&wait=20s]`
fn sqs(rest: &str) -> Result<Sqs, String> {
    let (region, query) = rest.split_once('?').unwrap_or((rest, ""));
    let region = region.trim_end_matches('/');
    let region_name = |text: &str| {
        !text.is_empty() && text.len() <= 32 && text.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    };
    if !region.is_empty() && !region_name(region) {
        return Err(format!(
            "`{region}` is not an AWS region: sqs://REGION?queue_url=URL, or sqs://?queue_url=URL for the environment's"
        ));
    }
    let mut params = Params::new(query);
    let queue_url = params
        .take("queue_url")
        .ok_or("names no queue: add ?queue_url=https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE")?;
    let queue = http_url(&queue_url, "queue_url")?;
    let name = queue
        .path_segments()
        .and_then(|mut segments| segments.rfind(|segment| !segment.is_empty()))
        .map(str::to_owned)
        .ok_or("queue_url names no queue: its path ends in the queue's name")?;
    let dead_letter_url = match (params.take("dead_letter_url"), params.take("dead_letter")) {
        (Some(_), Some(_)) => return Err("give dead_letter_url=URL or dead_letter=redrive, not both".into()),
        (None, Some(mode)) if mode == "redrive" => None,
        (None, Some(other)) => {
            return Err(format!(
                "dead_letter={other}: the only mode is `redrive` (the queue's redrive policy); a queue is dead_letter_url=URL"
            ));
        }
        (Some(url), None) => {
            http_url(&url, "dead_letter_url")?;
            Some(url)
        }
        (None, None) => {
            // The queue's name with `-dead`, before `.fifo` on a FIFO queue.
            let dead = match name.strip_suffix(".fifo") {
                Some(stem) => format!("{stem}-dead.fifo"),
                None => format!("{name}-dead"),
            };
            let mut url = queue.clone();
            url.path_segments_mut()
                .map_err(|()| "queue_url cannot name a dead-letter queue beside it")?
                .pop_if_empty()
                .pop()
                .push(&dead);
            Some(url.into())
        }
    };
    if dead_letter_url.as_deref() == Some(queue_url.as_str()) {
        return Err(
            "the dead-letter queue is the queue itself: name another with &dead_letter_url=URL".into(),
        );
    }
    let endpoint = match params.take("endpoint") {
        Some(endpoint) => {
            http_url(&endpoint, "endpoint")?;
            Some(endpoint)
        }
        // A queue outside AWS (a local server): its own origin is the endpoint.
        None if !is_aws(&queue) => Some(queue.origin().ascii_serialization()),
        None => None,
    };
    let region = match (region, params.take("region")) {
        (_, Some(_)) => return Err("the region goes before the `?`: sqs://REGION?queue_url=URL".into()),
        ("", None) => aws_region(&queue).or_else(|| endpoint.is_some().then(|| "us-east-1".to_owned())),
        (region, None) => Some(region.to_owned()),
    };
    let visibility = params
        .duration(
            "visibility",
            (Duration::from_secs(1), Duration::from_secs(43_200)),
            "must be from 1s to 12h",
        )?
        .unwrap_or(Duration::from_secs(30));
    let wait = params
        .duration(
            "wait",
            (Duration::ZERO, Duration::from_secs(20)),
            "must be from 0s to 20s",
        )?
        .unwrap_or(Duration::from_secs(20));
    params.finish("queue_url, dead_letter_url, dead_letter, endpoint, visibility, wait")?;
    Ok(Sqs {
        queue_url,
        dead_letter_url,
        region,
        endpoint,
        visibility,
        wait,
    })
}

/// `text` as an `http://` or `https://` URL with a host.
fn http_url(text: &str, what: &str) -> Result<url::Url, String> {
    let url = url::Url::parse(text).map_err(|e| format!("{what}: not a URL ({e})"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none_or(str::is_empty) {
        return Err(format!("{what}: not an http:// or https:// URL"));
    }
    Ok(url)
}

/// Whether `url` is on AWS (its SDK then finds the endpoint itself).
fn is_aws(url: &url::Url) -> bool {
    url.host_str()
        .is_some_and(|host| host.ends_with(".amazonaws.com") || host.ends_with(".amazonaws.com.cn"))
}

/// The region in an AWS queue URL's host (`sqs.REGION.amazonaws.com`, or the older
/// `REGION.queue.amazonaws.com`).
fn aws_region(url: &url::Url) -> Option<String> {
    let host = url.host_str().filter(|_| is_aws(url))?;
    let labels: Vec<&str> = host.split('.').collect();
    match labels.as_slice() {
        ["sqs", region, ..] | [region, "queue", ..] => Some((*region).to_owned()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_parsed_and_refused_with_the_reason() {
        let Source::Amqp { url, queue } =
            source("amqp://app:s3cret@127.0.0.1:5672/%2f?queue=payments").unwrap()
        else {
            panic!("not an AMQP source")
        };
        assert_eq!(queue, "payments");
        assert_eq!(url, "amqp://app:s3cret@127.0.0.1:5672/%2f");
        let Source::Amqp { url, .. } = source("amqp://h/v?heartbeat=10&queue=q").unwrap() else {
            panic!("not an AMQP source")
        };
        assert_eq!(url, "amqp://h/v?heartbeat=10");
        for (from, why) in [
            ("amqp://app:s3cret@127.0.0.1/%2f", "names no queue"),
            ("amqp://app:s3cret@127.0.0.1/%2f?queue=", "names no queue"),
            ("nats://127.0.0.1:4222?stream=S", "names no consumer"),
            ("nats://127.0.0.1:4222?consumer=C", "names no stream"),
            (
                "nats://127.0.0.1:4222?stream=S&consumer=C&ack_wait=soon",
                "ack_wait=soon",
            ),
            (
                "nats://127.0.0.1:4222?stream=S&consumer=C&ack_wait=0s",
                "must be from",
            ),
            (
                "nats://127.0.0.1:4222?stream=S&consumer=C&queue=q",
                "unknown parameter `queue`",
            ),
            ("kafka://127.0.0.1:9092?group=g", "names no topic"),
            ("kafka://127.0.0.1:9092?topic=t", "names no consumer group"),
            ("kafka://127.0.0.1:9092?topic=t&group=", "names no consumer group"),
            ("kafka://127.0.0.1?topic=t&group=g", "not a broker address"),
            ("kafka://h:1,h:x?topic=t&group=g", "`h:x` is not a broker address"),
            ("kafka://h:0?topic=t&group=g", "not a broker address"),
            ("kafka://?topic=t&group=g", "not a broker address"),
            ("kafka://h:9092/path?topic=t&group=g", "has no path"),
            ("kafka://h:9092?topic=a%20b&group=g", "not a Kafka topic name"),
            ("kafka://h:9092?topic=t&group=g&dead_letter=t", "the topic itself"),
            (
                "kafka://h:9092?topic=t&group=g&group.id=x",
                "`group.id` is set by idem",
            ),
            (
                "kafka://h:9092?topic=t&group=g&enable.auto.commit=true",
                "`enable.auto.commit` is set by idem",
            ),
            (
                "kafka://h:9092?topic=t&group=g&session.timeout.ms=",
                "has no value",
            ),
            ("sqs://?wait=1s", "names no queue"),
            ("sqs://?queue_url=queue", "queue_url: not a URL"),
            ("sqs://?queue_url=ftp://h/q", "not an http:// or https:// URL"),
            ("sqs://?queue_url=http://127.0.0.1:5000/", "names no queue"),
            ("sqs://eu_west?queue_url=http://h/1/q", "not an AWS region"),
            ("sqs://?queue_url=http://h/1/q&region=x", "the region goes before"),
            (
                "sqs://?queue_url=http://h/1/q&dead_letter=dlq",
                "the only mode is `redrive`",
            ),
            (
                "sqs://?queue_url=http://h/1/q&dead_letter=redrive&dead_letter_url=http://h/1/d",
                "not both",
            ),
            (
                "sqs://?queue_url=http://h/1/q&dead_letter_url=http://h/1/q",
                "the queue itself",
            ),
            ("sqs://?queue_url=http://h/1/q&visibility=0s", "visibility=0s"),
            ("sqs://?queue_url=http://h/1/q&wait=21s", "must be from 0s to 20s"),
            (
                "sqs://?queue_url=http://h/1/q&queue=q",
                "unknown parameter `queue`",
            ),
            ("ftp://app:s3cret@host/x", "unknown scheme `ftp`"),
            ("app:s3cret@host", "unknown scheme"),
            ("not a url", "not a URL"),
        ] {
            let error = source(from).unwrap_err().to_string();
            assert!(error.contains(why), "{from}: {error}");
            assert!(!error.contains("s3cret"), "{from}: {error}");
        }
    }

    #[test]
    fn nats_sources_name_their_stream_consumer_and_dead_letters() {
        let Source::Nats {
            url,
            stream,
            consumer,
            dead_letter,
            ..
        } = source("nats://app:s3cret@127.0.0.1:4222?stream=PAYMENTS&consumer=charges").unwrap()
        else {
            panic!("not a NATS source")
        };
        assert_eq!(url, "nats://app:s3cret@127.0.0.1:4222");
        assert_eq!((stream.as_str(), consumer.as_str()), ("PAYMENTS", "charges"));
        assert_eq!(dead_letter, "PAYMENTS.dead");
        let Source::Nats { dead_letter, .. } =
            source("nats://h:4222?stream=S&consumer=C&dead_letter=x.dead").unwrap()
        else {
            panic!("not a NATS source")
        };
        assert_eq!(dead_letter, "x.dead");
    }

    #[test]
    fn kafka_sources_carry_brokers_group_settings_and_credentials() {
        let from = "kafka://app:s3%2Fcret@k1:9092,k2:9093/?topic=payments&group=charges&security.protocol=SASL_SSL&sasl.mechanisms=PLAIN";
        let Source::Kafka(kafka) = source(from).unwrap() else {
            panic!("not a Kafka source")
        };
        assert_eq!(kafka.brokers, "k1:9092,k2:9093");
        assert_eq!(
            (kafka.topic.as_str(), kafka.group.as_str()),
            ("payments", "charges")
        );
        assert_eq!(kafka.dead_letter, "payments.dead");
        let settings: Vec<(&str, &str)> = kafka
            .settings
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str()))
            .collect();
        assert_eq!(
            settings,
            [
                ("sasl.mechanisms", "PLAIN"),
                ("sasl.password", "s3/cret"),
                ("sasl.username", "app"),
                ("security.protocol", "SASL_SSL"),
            ]
        );
        let shown = format!("{:?}", Source::Kafka(kafka));
        assert!(!shown.contains("s3/cret") && shown.contains("***"), "{shown}");
        let Source::Kafka(kafka) = source("KAFKA://h:1?topic=t&group=g&dead_letter=t.failed").unwrap() else {
            panic!("not a Kafka source")
        };
        assert_eq!(kafka.dead_letter, "t.failed");
        assert!(kafka.settings.is_empty());
    }

    #[test]
    fn sqs_sources_find_their_endpoint_region_and_dead_letter_queue() {
        let Source::Sqs(sqs) =
            source("sqs://?queue_url=http://127.0.0.1:5000/123456789012/payments").unwrap()
        else {
            panic!("not an SQS source")
        };
        assert_eq!(sqs.endpoint.as_deref(), Some("http://127.0.0.1:5000"));
        assert_eq!(sqs.region.as_deref(), Some("us-east-1"));
        assert_eq!(
            sqs.dead_letter_url.as_deref(),
            Some("http://127.0.0.1:5000/123456789012/payments-dead")
        );
        assert_eq!(
            (sqs.visibility, sqs.wait),
            (Duration::from_secs(30), Duration::from_secs(20))
        );
        let aws = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo";
        let Source::Sqs(sqs) = source(&format!("sqs://?queue_url={aws}&wait=0s&visibility=2m")).unwrap()
        else {
            panic!("not an SQS source")
        };
        assert_eq!(sqs.endpoint, None, "the SDK finds AWS's endpoint");
        assert_eq!(sqs.region.as_deref(), Some("eu-west-1"));
        assert_eq!(
            sqs.dead_letter_url.as_deref(),
            Some("https://sqs.eu-west-1.amazonaws.com/123456789012/orders-dead.fifo")
        );
        assert_eq!(
            (sqs.visibility, sqs.wait),
            (Duration::from_secs(120), Duration::ZERO)
        );
        let Source::Sqs(sqs) =
            source(&format!("sqs://us-east-2?queue_url={aws}&dead_letter=redrive")).unwrap()
        else {
            panic!("not an SQS source")
        };
        assert_eq!(sqs.region.as_deref(), Some("us-east-2"), "the URL's region wins");
        assert_eq!(sqs.dead_letter_url, None, "the redrive policy");
        let old = "https://eu-central-1.queue.amazonaws.com/1/q";
        let Source::Sqs(sqs) = source(&format!("sqs://?queue_url={old}")).unwrap() else {
            panic!("not an SQS source")
        };
        assert_eq!(sqs.region.as_deref(), Some("eu-central-1"));
    }
}

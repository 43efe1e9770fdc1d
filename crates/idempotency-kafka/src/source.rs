//! `kafka://` URLs: a topic to consume as a member of a consumer group, as `idem consume
//! --from` and any program with a [`Sources`](idempotency_consumer::source::Sources) registry
//! take it.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind};
use idempotency_consumer::source::{
    AnyProcessor, Params, RunFuture, Shutdown, SourceInfo, SourceKind, SourceSettings, strip_scheme,
};
use rdkafka::ClientConfig;

use crate::{BROKER, KafkaMessage, Worker};

/// Kafka as a kind of source.
pub const SOURCE: SourceKind = SourceKind {
    name: "kafka",
    schemes: &["kafka"],
    example: "kafka://HOST:PORT?topic=TOPIC&group=GROUP",
    parameters: "HOST:PORT,HOST:PORT   the bootstrap brokers; USER:PASSWORD@ before them sets sasl.username and sasl.password\n\
                 topic=TOPIC           the topic (required)\n\
                 group=GROUP           the consumer group (required)\n\
                 dead_letter=TOPIC     where dead letters go (default TOPIC.dead)\n\
                 any librdkafka setting, e.g. security.protocol=SASL_SSL&sasl.mechanisms=SCRAM-SHA-512&ssl.ca.location=FILE&session.timeout.ms=6000\n\
                 (bootstrap.servers, group.id, enable.auto.commit and enable.auto.offset.store are the source's own)",
    parse,
    run,
    dead_letters: crate::dead_letters::open,
};

/// Client settings the source sets itself.
const OWNED: [&str; 4] = [
    "bootstrap.servers",
    "group.id",
    "enable.auto.commit",
    "enable.auto.offset.store",
];

/// Client settings that name PEM files, checked when the URL is parsed so that a missing or
/// malformed file is refused with its path before librdkafka starts.
const PEM_FILES: [&str; 3] = ["ssl.ca.location", "ssl.certificate.location", "ssl.key.location"];

/// The longest `max.poll.interval.ms` librdkafka accepts.
const MAX_POLL_INTERVAL: Duration = Duration::from_secs(86_400);

/// A parsed `kafka://` source.
#[derive(Clone, PartialEq, Eq)]
pub struct KafkaSource {
    /// `bootstrap.servers`: HOST:PORT, comma-separated.
    pub brokers: String,
    /// The topic.
    pub topic: String,
    /// The consumer group.
    pub group: String,
    /// Where dead letters are produced.
    pub dead_letter: String,
    /// Any other librdkafka setting (security, SASL, timeouts), the URL's user and password as
    /// `sasl.username` and `sasl.password`.
    pub settings: ClientSettings,
}

impl fmt::Debug for KafkaSource {
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
        f.debug_struct("KafkaSource")
            .field("brokers", &self.brokers)
            .field("topic", &self.topic)
            .field("group", &self.group)
            .field("dead_letter", &self.dead_letter)
            .field("settings", &settings)
            .finish()
    }
}

impl KafkaSource {
    /// Parses `kafka://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…]?topic=T&group=G[&dead_letter=D][&SETTING=V…]`.
    /// The brokers are a comma-separated list, which is no URL authority: the URL is split by
    /// hand.
    ///
    /// ```
    /// use idempotency_kafka::KafkaSource;
    ///
    /// let source = KafkaSource::from_url("kafka://k1:9092,k2:9093?topic=payments&group=charges&session.timeout.ms=6000")?;
    /// assert_eq!(source.brokers, "k1:9092,k2:9093");
    /// assert_eq!(source.dead_letter, "payments.dead");
    /// assert_eq!(source.settings["session.timeout.ms"], "6000");
    /// # Ok::<(), idempotency_kafka::AdapterError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Config`] saying what is wrong (never echoing the password).
    pub fn from_url(url: &str) -> Result<Self, AdapterError> {
        let refuse = |why: String| AdapterError::new(AdapterErrorKind::Config, BROKER, why);
        let (brokers, userinfo, mut params) = split_url(url, SOURCE.example)?;
        let topic = params
            .take("topic")
            .ok_or_else(|| refuse("names no topic: add ?topic=TOPIC&group=GROUP".into()))?;
        let group = params
            .take("group")
            .ok_or_else(|| refuse("names no consumer group: add &group=GROUP".into()))?;
        let dead_letter = params
            .take("dead_letter")
            .unwrap_or_else(|| format!("{topic}.dead"));
        for name in [&topic, &dead_letter] {
            let legal = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
            if name.len() > 249 || !name.chars().all(legal) || name == "." || name == ".." {
                return Err(refuse(format!(
                    "`{name}` is not a Kafka topic name (1 to 249 of a-z, A-Z, 0-9, `.`, `_`, `-`)"
                )));
            }
        }
        if dead_letter == topic {
            return Err(refuse(
                "the dead-letter topic is the topic itself: name another with &dead_letter=TOPIC".into(),
            ));
        }
        if group.len() > 255 || group.chars().any(char::is_control) {
            return Err(refuse(format!(
                "`{group}` is not a consumer group name Kafka accepts"
            )));
        }
        let settings = client_settings(
            params,
            userinfo,
            &OWNED,
            "is set by the source itself (the brokers are the URL's hosts, the group is group=, offsets are committed once recorded)",
        )?;
        Ok(Self {
            brokers,
            topic,
            group,
            dead_letter,
            settings,
        })
    }

    /// The client settings of a member of the group: the brokers, the group, every setting of
    /// the URL, and a `max.poll.interval.ms` that outlasts `handler_timeout` with room to
    /// settle (librdkafka accepts at most 24 h: a handler timeout that long may see the member
    /// leave the group before a shutdown's last call ends; its message then comes back,
    /// answered by the record).
    #[must_use]
    pub fn client_config(&self, handler_timeout: Duration) -> ClientConfig {
        let settle = settle_timeout(handler_timeout);
        let poll_interval = (settle + Duration::from_secs(60)).min(MAX_POLL_INTERVAL);
        let mut client = ClientConfig::new();
        client
            .set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group)
            .set(
                "max.poll.interval.ms",
                poll_interval.as_millis().max(300_000).to_string(),
            );
        for (name, value) in &self.settings {
            client.set(name, value);
        }
        client
    }

    /// A worker of the group on the topic, dead-lettering to the source's topic, whose
    /// revocations and shutdown give running handlers `handler_timeout` and a bit more to be
    /// recorded.
    pub fn worker<P: idempotency_consumer::Processor<KafkaMessage> + 'static>(
        &self,
        handler_timeout: Duration,
        processor: Arc<P>,
    ) -> Worker<P> {
        Worker::new(self.client_config(handler_timeout), self.topic.clone(), processor)
            .dead_letter_topic(self.dead_letter.clone())
            .settle_timeout(settle_timeout(handler_timeout))
    }
}

/// On a revocation or SIGTERM the running calls get the handler timeout to finish, and a bit
/// more to be recorded; meanwhile the poll thread waits for them, so the group must not count
/// the member as gone before that.
/// A `kafka://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…][?…]` URL split by hand (a list of
/// brokers is no URL authority): the brokers, the user information, the query's parameters.
fn split_url<'u>(url: &'u str, example: &str) -> Result<(String, Option<&'u str>, Params), AdapterError> {
    let refuse = |why: String| AdapterError::new(AdapterErrorKind::Config, BROKER, why);
    let rest = strip_scheme(url, "kafka")
        .ok_or_else(|| refuse(format!("not a kafka:// URL; expected {example}")))?;
    let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
    let authority = authority.trim_end_matches('/');
    if authority.contains('/') {
        return Err(refuse(format!("a Kafka URL has no path: {example}")));
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
                return Err(refuse(format!(
                    "`{broker}` is not a broker address: expected HOST:PORT (several separated by commas)"
                )));
            }
        }
    }
    Ok((hosts.to_owned(), userinfo, Params::new(BROKER, query)))
}

/// librdkafka settings by name, as `ClientConfig::set` takes them.
pub(crate) type ClientSettings = BTreeMap<String, String>;

/// The librdkafka settings a URL's remaining parameters and user information make: none of
/// `owned` (refused with `why_owned`), none empty, the PEM files checked, the user and password
/// as `sasl.username` and `sasl.password`.
fn client_settings(
    params: Params,
    userinfo: Option<&str>,
    owned: &[&str],
    why_owned: &str,
) -> Result<ClientSettings, AdapterError> {
    let refuse = |why: String| AdapterError::new(AdapterErrorKind::Config, BROKER, why);
    let mut settings = params.into_rest();
    if let Some(owned) = owned.iter().find(|owned| settings.contains_key(**owned)) {
        return Err(refuse(format!("`{owned}` {why_owned}")));
    }
    if let Some((name, _)) = settings.iter().find(|(_, value)| value.is_empty()) {
        return Err(refuse(format!("the setting `{name}` has no value")));
    }
    for name in PEM_FILES {
        let Some(path) = settings.get(name).map(std::path::Path::new) else {
            continue;
        };
        // librdkafka also takes a directory of CAs, or `probe` to look for the system's.
        if name == "ssl.ca.location" && (path.as_os_str() == "probe" || path.is_dir()) {
            continue;
        }
        idempotency_core::pem::check_file(path)
            .map_err(|why| refuse(format!("`{name}` {}: {why}", path.display())))?;
    }
    if let Some(userinfo) = userinfo {
        let decode = |text: &str| {
            percent_encoding::percent_decode_str(text)
                .decode_utf8()
                .map(|text| text.into_owned())
                .map_err(|_| refuse("the user or password is not UTF-8 once decoded".into()))
        };
        let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
        settings.insert("sasl.username".into(), decode(user)?);
        if !password.is_empty() {
            settings.insert("sasl.password".into(), decode(password)?);
        }
    }
    Ok(settings)
}

/// Settings an idempotent producer sets itself.
const PRODUCER_OWNED: [&str; 3] = ["bootstrap.servers", "enable.idempotence", "acks"];

/// An idempotent producer ([`idempotent_producer`](crate::idempotent_producer)'s settings)
/// for the brokers a `kafka://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…][?SETTING=V…]` URL names,
/// with the same librdkafka settings as a source's URL (`security.protocol`, `sasl.*`,
/// `ssl.*.location`, checked the same way): for publishers, such as the outbox relay's
/// `KafkaPublisher`.
///
/// With the `tls` feature, `kafka://relay:PASSWORD@k1:9093?security.protocol=SASL_SSL&sasl.mechanism=SCRAM-SHA-512`
/// reaches a managed cluster.
///
/// ```
/// let producer = idempotency_kafka::producer_from_url(
///     "kafka://k1:9092,k2:9092?client.id=orders-relay&message.timeout.ms=30000",
/// )?;
/// # drop(producer);
/// # Ok::<(), idempotency_kafka::AdapterError>(())
/// ```
///
/// # Errors
///
/// [`AdapterErrorKind::Config`] saying what is wrong (never echoing the password), librdkafka's
/// reason for a setting it refuses included.
pub fn producer_from_url(url: &str) -> Result<rdkafka::producer::FutureProducer, AdapterError> {
    producer_from_url_with_defaults(url, &[])
}

/// As [`producer_from_url`], with librdkafka settings of the caller's own that apply unless the
/// URL sets them too (a publisher's `linger.ms`, say).
///
/// ```
/// let producer = idempotency_kafka::producer_from_url_with_defaults(
///     "kafka://k1:9092?linger.ms=20",
///     &[("linger.ms", "0"), ("allow.auto.create.topics", "false")],
/// )?;
/// # drop(producer);
/// # Ok::<(), idempotency_kafka::AdapterError>(())
/// ```
///
/// # Errors
///
/// As [`producer_from_url`]; a default librdkafka refuses too.
pub fn producer_from_url_with_defaults(
    url: &str,
    defaults: &[(&str, &str)],
) -> Result<rdkafka::producer::FutureProducer, AdapterError> {
    let (brokers, userinfo, params) = split_url(url, "kafka://HOST:PORT?SETTING=VALUE")?;
    let settings = client_settings(
        params,
        userinfo,
        &PRODUCER_OWNED,
        "is set by the producer itself (the brokers are the URL's hosts; an idempotent producer waits for every replica)",
    )?;
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", &brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all");
    // The URL's own settings come after, and win.
    for (name, value) in defaults {
        client.set(*name, *value);
    }
    for (name, value) in &settings {
        client.set(name, value);
    }
    client.create().map_err(|e| {
        AdapterError::new(
            AdapterErrorKind::Config,
            BROKER,
            format!("librdkafka refused the producer's settings: {e}"),
        )
    })
}

fn settle_timeout(handler_timeout: Duration) -> Duration {
    handler_timeout.saturating_add(Duration::from_secs(5))
}

fn parse(url: &str) -> Result<SourceInfo, AdapterError> {
    KafkaSource::from_url(url).map(|source| SourceInfo::new(source.topic))
}

fn run(url: String, settings: SourceSettings, processor: AnyProcessor, shutdown: Shutdown) -> RunFuture {
    Box::pin(async move {
        let source = KafkaSource::from_url(&url)?;
        let worker = source
            .worker(settings.handler_timeout, Arc::new(processor))
            .name(settings.name)
            .concurrency(settings.concurrency)
            .prefetch(settings.prefetch)
            .batch(settings.batch)
            .linger(settings.linger);
        worker.check(settings.start_check).await?;
        tracing::info!(topic = %source.topic, group = %source.group, "consuming");
        worker.run_until(shutdown).await
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_carry_brokers_group_settings_and_credentials() {
        let url = "kafka://app:s3%2Fcret@k1:9092,k2:9093/?topic=payments&group=charges&security.protocol=SASL_SSL&sasl.mechanisms=PLAIN";
        let source = KafkaSource::from_url(url).unwrap();
        assert_eq!(source.brokers, "k1:9092,k2:9093");
        assert_eq!(
            (source.topic.as_str(), source.group.as_str()),
            ("payments", "charges")
        );
        assert_eq!(source.dead_letter, "payments.dead");
        let settings: Vec<(&str, &str)> = source
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
        let shown = format!("{source:?}");
        assert!(!shown.contains("s3/cret") && shown.contains("***"), "{shown}");
        let source = KafkaSource::from_url("KAFKA://h:1?topic=t&group=g&dead_letter=t.failed").unwrap();
        assert_eq!(source.dead_letter, "t.failed");
        assert!(source.settings.is_empty());
        let config = source.client_config(Duration::from_secs(30));
        assert_eq!(config.get("max.poll.interval.ms"), Some("300000"));
        let config = source.client_config(Duration::from_secs(86_400));
        assert_eq!(config.get("max.poll.interval.ms"), Some("86400000"));
        // A directory of CAs, or librdkafka's own search of the system's, is passed on as is.
        for ca in ["probe", "/etc/ssl/certs"] {
            let url = format!("kafka://h:1?topic=t&group=g&ssl.ca.location={ca}");
            let source = KafkaSource::from_url(&url).unwrap();
            assert_eq!(source.settings["ssl.ca.location"], ca);
        }
    }

    #[test]
    fn urls_are_refused_with_the_reason() {
        for (url, why) in [
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
                "`group.id` is set by the source",
            ),
            (
                "kafka://h:9092?topic=t&group=g&enable.auto.commit=true",
                "`enable.auto.commit` is set by the source",
            ),
            (
                "kafka://h:9092?topic=t&group=g&session.timeout.ms=",
                "has no value",
            ),
            ("kafka://u:s3cret@h?topic=t&group=g", "not a broker address"),
            ("amqp://h", "not a kafka:// URL"),
            (
                "kafka://h:9092?topic=t&group=g&ssl.ca.location=/nonexistent/ca.pem",
                "`ssl.ca.location` /nonexistent/ca.pem: No such file",
            ),
            (
                concat!(
                    "kafka://h:9092?topic=t&group=g&ssl.certificate.location=",
                    env!("CARGO_MANIFEST_DIR"),
                    "/Cargo.toml"
                ),
                "Cargo.toml: not a PEM file",
            ),
            (
                "kafka://h:9092?topic=t&group=g&ssl.key.location=/nonexistent/client.key",
                "`ssl.key.location` /nonexistent/client.key: No such file",
            ),
        ] {
            let error = KafkaSource::from_url(url).unwrap_err();
            assert_eq!(error.kind(), AdapterErrorKind::Config, "{url}");
            assert!(error.to_string().contains(why), "{url}: {error}");
            assert!(!error.to_string().contains("s3cret"), "{url}: {error}");
        }
    }

    #[test]
    fn producer_urls_take_a_sources_settings_and_refuse_the_producers_own() {
        let producer = producer_from_url("kafka://u:s3cret@k1:9092,k2:9092?client.id=relay&linger.ms=5");
        assert!(producer.is_ok(), "{:?}", producer.err());
        for (url, why) in [
            (
                "kafka://k1:9092?enable.idempotence=false",
                "`enable.idempotence` is set by the producer",
            ),
            ("kafka://k1:9092?acks=1", "`acks` is set by the producer"),
            ("kafka://k1?client.id=x", "not a broker address"),
            ("kafka://k1:9092/orders", "has no path"),
            (
                "kafka://u:s3cret@k1:9092?topic=orders",
                "librdkafka refused the producer's settings",
            ),
            (
                "kafka://k1:9092?ssl.ca.location=/nonexistent/ca.pem",
                "`ssl.ca.location` /nonexistent/ca.pem: No such file",
            ),
            ("nats://k1:9092", "not a kafka:// URL"),
        ] {
            let error = producer_from_url(url).map(drop).unwrap_err();
            assert_eq!(error.kind(), AdapterErrorKind::Config, "{url}");
            assert!(error.to_string().contains(why), "{url}: {error}");
            assert!(!error.to_string().contains("s3cret"), "{url}: {error}");
        }
    }
}

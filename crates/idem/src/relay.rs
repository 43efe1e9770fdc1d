//! `idem relay`: the transactional outbox for services in any language. An application inserts
//! a row into the outbox table in its own transaction, on PostgreSQL or MySQL/MariaDB
//! (`docs/OUTBOX.md` has the table and the `INSERT`); the relay publishes each committed row, in
//! order within its ordering group, with the row's key as its `Idempotency-Key`, waits for the
//! broker's confirmation, and marks it sent. It runs the library's [`Relay`]: several relays on
//! one table share the work without publishing a group's rows out of order or one row twice at
//! once. `--config FILE` runs one relay per `[[relay]]` table of the file.
//!
//! | `--to` | the broker | where each row goes |
//! |---|---|---|
//! | `amqp(s)://USER:PASSWORD@HOST:PORT/VHOST?exchange=EX&routing_key=RK` | RabbitMQ, publisher confirms | exchange `EX` (default: the default exchange, where the routing key is a queue), routing key = the row's `destination`, or `RK` when it is empty |
//! | `nats://HOST:PORT?subject=SUBJECT` (and `tls://`) | NATS JetStream, each publish acknowledged by the stream; `Nats-Msg-Id` = the key | subject = the row's `destination`, or `SUBJECT` |
//! | `kafka://HOST:PORT?topic=TOPIC&SETTING=…` (feature `kafka`) | Kafka, an idempotent producer, `acks=all`; the ordering group as the record key | topic = the row's `destination`, or `TOPIC` |
//! | `sqs://[REGION]?queue_url=URL[&endpoint=URL][&ca=FILE]` (feature `sqs`) | SQS, `SendMessage` answered; the key as the `Idempotency-Key` attribute and, on a FIFO queue, the deduplication id, the ordering group as the message group | the queue at the row's `destination` (a queue URL), or `URL` |
//! | `http(s)://HOST/PATH` | a webhook: `POST` answered with a `2xx` | the URL, with `{destination}` replaced by the row's `destination` (encoded only as it must be to stay one path segment: [`crate::placeholder`]) |
//!
//! The other URL parameters are the broker's, as `idem consume --from` takes them (TLS files,
//! librdkafka settings).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use idempotency_consumer::BoxError;
use idempotency_outbox::{AmqpPublisher, NatsPublisher, Outbox, OutboxMessage, Publisher, Relay, Tables};

use crate::error::Error;
use crate::ops::boxes::Location;
use crate::units;

/// `idem relay`: a relay (or the file's relays), or `idem relay migrate`.
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct Args {
    #[command(subcommand)]
    action: Option<Command>,
    #[command(flatten)]
    config: Box<Config>,
}

/// `idem relay`'s subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Create the outbox table (or upgrade one of version 1), with the trigger that wakes the
    /// relays.
    Migrate {
        /// The database: postgres://…, mysql://… or mariadb://….
        #[arg(long, env = "IDEM_DATABASE")]
        database: String,
        /// The table's schema (on MySQL a database; `public`: the URL's own).
        #[arg(long, env = "IDEM_SCHEMA", default_value = "public")]
        schema: String,
        /// The table.
        #[arg(long, env = "IDEM_OUTBOX_TABLE", default_value = "idempotency_outbox")]
        outbox_table: String,
    },
}

/// Runs `idem relay` until `shutdown` (`command` is the CLI's `idem relay`, for the `[[relay]]`
/// tables' keys), or `idem relay migrate`; what it prints.
///
/// # Errors
///
/// As [`relay`] and [`migrate`].
pub async fn run(
    args: Args,
    command: &clap::Command,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<String, Error> {
    match args.action {
        Some(Command::Migrate {
            database,
            schema,
            outbox_table,
        }) => migrate(&database, &schema, &outbox_table).await,
        None => {
            relay(*args.config, command, shutdown).await?;
            Ok(String::new())
        }
    }
}

/// `idem relay`'s settings; each flag is also an `IDEM_*` environment variable, and the keys of
/// a `[[relay]]` table of `--config`'s file. The settings only the relay has are
/// `IDEM_RELAY_*`; the outbox table's location (`IDEM_DATABASE`, `IDEM_SCHEMA`,
/// `IDEM_OUTBOX_TABLE`) is named as `idem outbox` names it, so one set of variables serves
/// both.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// Run the relays of this TOML file's `[[relay]]` tables, one per table, each with these
    /// flags as its keys (docs/OUTBOX.md); instead of --database and --to.
    #[arg(long, env = "IDEM_RELAY_CONFIG", conflicts_with_all = ["database", "to"])]
    pub config: Option<std::path::PathBuf>,
    /// The database holding the outbox table: postgres://…, or mysql://… and mariadb://… (which
    /// have no notifications: the relay polls every --poll).
    #[arg(long, env = "IDEM_DATABASE", required_unless_present = "config")]
    pub database: Option<String>,
    /// Where rows are published: amqp(s)://…?exchange=…&routing_key=…, nats://…?subject=…,
    /// kafka://…?topic=…, sqs://…?queue_url=…, or an http(s):// webhook (the row's destination,
    /// when set, replaces the routing key, subject, topic or queue URL, or fills the webhook
    /// URL's {destination}).
    #[arg(long, env = "IDEM_RELAY_TO", required_unless_present = "config")]
    pub to: Option<String>,
    /// A private CA (PEM bundle): the only CA trusted for an https:// webhook (without it, the
    /// system's trust store). A broker URL names its CA in its own parameter (cacertfile=,
    /// ca=, ssl.ca.location=).
    #[arg(long, env = "IDEM_RELAY_TO_CA")]
    pub to_ca: Option<std::path::PathBuf>,
    /// A client certificate (PEM chain) presented to an https:// webhook; needs --to-client-key.
    #[arg(long, env = "IDEM_RELAY_TO_CLIENT_CERT", requires = "to_client_key")]
    pub to_client_cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of --to-client-cert.
    #[arg(long, env = "IDEM_RELAY_TO_CLIENT_KEY", requires = "to_client_cert")]
    pub to_client_key: Option<std::path::PathBuf>,
    /// INSECURE: accept any certificate from an https:// webhook, for any name (logged as a
    /// warning at start).
    #[arg(long, env = "IDEM_RELAY_TO_INSECURE_SKIP_VERIFY")]
    pub to_insecure_skip_verify: bool,
    /// The outbox table's schema (on MySQL a database; `public`: the URL's own).
    #[arg(long, env = "IDEM_SCHEMA", default_value = "public")]
    pub schema: String,
    /// The outbox table.
    #[arg(long, env = "IDEM_OUTBOX_TABLE", default_value = "idempotency_outbox")]
    pub outbox_table: String,
    /// The prefix of the keys of rows without one (`NAME:ID`), and the `outbox` label of the
    /// metrics (default: the qualified table name).
    #[arg(long, env = "IDEM_RELAY_NAME")]
    pub name: Option<String>,
    /// Rows published per round at most.
    #[arg(long, env = "IDEM_RELAY_BATCH", default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub batch: u32,
    /// Failed publishes that park a row as dead (`idem outbox replay` sends it again).
    #[arg(long, env = "IDEM_RELAY_MAX_ATTEMPTS", default_value_t = idempotency_outbox::DEFAULT_MAX_ATTEMPTS, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_attempts: u32,
    /// The longest an idle relay waits without a notification from the table's trigger (on
    /// MySQL, which has none, how often it polls).
    #[arg(long, env = "IDEM_RELAY_POLL", default_value = "1s", value_parser = units::parse_duration)]
    pub poll: Duration,
    /// How long sent rows are kept before the relay deletes them.
    #[arg(long, env = "IDEM_RELAY_RETENTION", default_value = "7d", value_parser = units::parse_duration)]
    pub retention: Duration,
    /// Serve /_idem/livez, /_idem/readyz (503 while a relay's database or destination cannot be
    /// reached, and from the first moment of SIGTERM) and /_idem/metrics on this address.
    #[arg(long, env = "IDEM_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
}

/// The publisher `--to` names.
#[allow(
    clippy::large_enum_variant,
    reason = "one per relay process, never moved in a loop; which variant is the largest depends on the features"
)]
enum Destination {
    Amqp(AmqpPublisher),
    Nats(NatsPublisher),
    #[cfg(feature = "kafka")]
    Kafka(idempotency_outbox::KafkaPublisher),
    #[cfg(feature = "sqs")]
    Sqs(idempotency_outbox::SqsPublisher),
    Http(HttpPublisher),
}

/// Posts rows to a webhook and takes a `2xx` as the confirmation.
struct HttpPublisher {
    client: hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        http_body_util::Full<bytes::Bytes>,
    >,
    /// The URL, `{destination}` in it replaced for each row.
    url: String,
    /// `host:port` of the webhook, for the readiness probe.
    address: String,
}

/// How long a webhook may take to answer.
const WEBHOOK_TIMEOUT: Duration = Duration::from_secs(30);

impl HttpPublisher {
    fn new(url: String, address: String, tls: &rustls::ClientConfig) -> Self {
        let mut tls = tls.clone();
        tls.alpn_protocols.clear();
        let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
        connector.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        Self {
            client: hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(connector),
            url,
            address,
        }
    }

    /// The webhook accepts a TCP connection within 5 s (its TLS is checked at start, and on
    /// every call).
    async fn reachable(&self) -> Result<(), BoxError> {
        match tokio::time::timeout(
            Duration::from_secs(5),
            tokio::net::TcpStream::connect(&self.address),
        )
        .await
        {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(error)) => {
                Err(format!("the webhook at {} cannot be reached: {error}", self.address).into())
            }
            Err(_) => Err(format!(
                "the webhook at {} did not accept a connection within 5s",
                self.address
            )
            .into()),
        }
    }

    async fn publish(&self, message: &OutboxMessage) -> Result<(), BoxError> {
        let url = crate::placeholder::fill(&self.url, "{destination}", &message.destination);
        let mut request =
            http::Request::post(url).header(idempotency::IDEMPOTENCY_KEY_HEADER, message.key.as_str());
        let typed = message
            .headers
            .iter()
            .any(|(name, _)| name.eq_ignore_ascii_case("content-type"));
        if !typed {
            request = request.header(http::header::CONTENT_TYPE, "application/octet-stream");
        }
        for (name, value) in &message.headers {
            request = request.header(name.as_str(), value.as_slice());
        }
        let request = request.body(http_body_util::Full::new(bytes::Bytes::from(
            message.payload.clone(),
        )))?;
        let answer = tokio::time::timeout(WEBHOOK_TIMEOUT, self.client.request(request))
            .await
            .map_err(|_| {
                format!(
                    "the webhook did not answer within {}",
                    units::format_duration(WEBHOOK_TIMEOUT)
                )
            })??;
        if answer.status().is_success() {
            Ok(())
        } else {
            Err(format!("the webhook answered {}", answer.status()).into())
        }
    }
}

/// The publisher, and the routing key, subject or topic of rows without a destination.
struct To {
    publisher: Destination,
    default: Option<String>,
}

impl Publisher for To {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), BoxError> {
        let defaulted;
        let message = if message.destination.is_empty() {
            let Some(default) = &self.default else {
                return Err("the row names no destination, and --to gives no default (routing_key=, subject= or topic=)".into());
            };
            defaulted = OutboxMessage {
                destination: default.clone(),
                ..message.clone()
            };
            &defaulted
        } else {
            message
        };
        match &self.publisher {
            Destination::Amqp(publisher) => publisher.publish(message).await,
            Destination::Nats(publisher) => publisher.publish(message).await,
            #[cfg(feature = "kafka")]
            Destination::Kafka(publisher) => publisher.publish(message).await,
            #[cfg(feature = "sqs")]
            Destination::Sqs(publisher) => publisher.publish(message).await,
            Destination::Http(publisher) => publisher.publish(message).await,
        }
    }

    async fn reachable(&self) -> Result<(), BoxError> {
        match &self.publisher {
            Destination::Amqp(publisher) => publisher.reachable().await,
            Destination::Nats(publisher) => publisher.reachable().await,
            #[cfg(feature = "kafka")]
            Destination::Kafka(publisher) => publisher.reachable().await,
            #[cfg(feature = "sqs")]
            Destination::Sqs(publisher) => publisher.reachable().await,
            Destination::Http(publisher) => publisher.reachable().await,
        }
    }
}

/// `url` without the parameter `name`, and its value.
fn take_param(url: &str, name: &str) -> Result<(String, Option<String>), Error> {
    let mut parsed = url::Url::parse(url).map_err(|e| Error::Usage(format!("--to: not a URL ({e})")))?;
    let mut taken = None;
    let kept: Vec<(String, String)> = parsed
        .query_pairs()
        .filter_map(|(key, value)| {
            if key == name {
                taken = Some(value.into_owned());
                None
            } else {
                Some((key.into_owned(), value.into_owned()))
            }
        })
        .collect();
    if kept.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(kept);
    }
    Ok((parsed.into(), taken.filter(|value| !value.is_empty())))
}

/// The publisher `to` names; it connects (or checks its settings) now, so that a wrong URL is an
/// error at start. `files` are the `--to-…` TLS flags, for a webhook.
async fn destination(to: &str, files: &crate::tls::ClientFiles) -> Result<To, Error> {
    let scheme = to.split_once("://").map(|(scheme, _)| scheme).unwrap_or_default();
    let refused = |why: String| Error::Usage(format!("--to {}: {why}", idempotency::redact_url(to)));
    let webhook = matches!(scheme, "http" | "https");
    if !webhook && (files.ca.is_some() || files.cert.is_some() || files.insecure_skip_verify) {
        return Err(refused(
            "--to-ca, --to-client-cert and --to-insecure-skip-verify are for a webhook; a broker's URL names its TLS files in its own parameters (cacertfile=, ca=, ssl.ca.location=)".into(),
        ));
    }
    match scheme {
        "amqp" | "amqps" => {
            let (url, exchange) = take_param(to, "exchange")?;
            let (url, routing_key) = take_param(&url, "routing_key")?;
            let connection = idempotency_amqp::connect_url(&url)
                .await
                .map_err(|e| refused(e.to_string()))?;
            check_amqp(&connection, exchange.as_deref(), routing_key.as_deref())
                .await
                .map_err(|e| refused(e.to_string()))?;
            let _ = connection.close(200, "checked".into()).await;
            Ok(To {
                publisher: Destination::Amqp(AmqpPublisher::new(url, exchange.unwrap_or_default())),
                default: routing_key,
            })
        }
        "nats" | "tls" => {
            let (url, subject) = take_param(to, "subject")?;
            let publisher = NatsPublisher::connect(&url, Duration::from_secs(10))
                .await
                .map_err(|e| refused(e.to_string()))?;
            if let Some(subject) = &subject {
                publisher
                    .check_subject(subject)
                    .await
                    .map_err(|e| refused(e.to_string()))?;
            }
            Ok(To {
                publisher: Destination::Nats(publisher),
                default: subject,
            })
        }
        #[cfg(feature = "kafka")]
        "kafka" => {
            let (url, topic) = take_param(to, "topic")?;
            let publisher =
                idempotency_outbox::KafkaPublisher::from_url(&url).map_err(|e| refused(e.to_string()))?;
            if let Some(topic) = &topic {
                publisher
                    .check_topic(topic, Duration::from_secs(10))
                    .await
                    .map_err(|e| refused(e.to_string()))?;
            }
            Ok(To {
                publisher: Destination::Kafka(publisher),
                default: topic,
            })
        }
        #[cfg(not(feature = "kafka"))]
        "kafka" => Err(refused(
            "this build has no Kafka destinations (build idem with --features kafka)".into(),
        )),
        #[cfg(feature = "sqs")]
        "sqs" => {
            let source = idempotency_sqs::SqsSource::from_url(to).map_err(|e| refused(e.to_string()))?;
            let http_client = match &source.ca {
                Some(ca) => idempotency_sqs::http_client_trusting(ca).map_err(|e| refused(e.to_string()))?,
                None => idempotency_sqs::http_client(),
            };
            let client = idempotency_sqs::client_through(
                source.endpoint.as_deref(),
                source.region.as_deref(),
                http_client,
            )
            .await;
            client
                .get_queue_attributes()
                .queue_url(&source.queue_url)
                .send()
                .await
                .map_err(|e| refused(format!("the queue {} cannot be reached: {e}", source.queue_url)))?;
            Ok(To {
                publisher: Destination::Sqs(idempotency_outbox::SqsPublisher::new(client)),
                default: Some(source.queue_url),
            })
        }
        #[cfg(not(feature = "sqs"))]
        "sqs" => Err(refused(
            "this build has no SQS destinations (build idem with --features sqs)".into(),
        )),
        "http" | "https" => {
            let uri: http::Uri = to
                .replace("{destination}", "d")
                .parse()
                .map_err(|e| refused(format!("not a URL ({e})")))?;
            if uri.host().is_none_or(str::is_empty) {
                return Err(refused("the webhook URL has no host".into()));
            }
            // Without `{destination}`, every row goes to the URL itself.
            let default = (!to.contains("{destination}")).then(String::new);
            let tls = crate::tls::checked_peer(files, &uri, "webhook")
                .await
                .map_err(refused)?;
            let port = uri.port_u16().unwrap_or(if uri.scheme_str() == Some("https") {
                443
            } else {
                80
            });
            let address = format!("{}:{port}", uri.host().unwrap_or_default());
            Ok(To {
                publisher: Destination::Http(HttpPublisher::new(to.to_owned(), address, &tls)),
                default,
            })
        }
        _ => Err(refused(
            "the destination is amqp://, amqps://, nats://, tls://, kafka://, sqs://, http:// or https://"
                .into(),
        )),
    }
}

/// `/_idem/readyz` of `idem relay`: ready once every relay's database and destination answered
/// the last check (made every [`Readiness::EVERY`]), and not from the first moment of SIGTERM.
#[derive(Debug)]
struct Readiness {
    draining: std::sync::atomic::AtomicBool,
    /// `Ok`, or what could not be reached; `None` before the first check ends.
    last: std::sync::Mutex<Option<Result<(), String>>>,
}

impl Readiness {
    /// How often the databases and destinations are asked.
    const EVERY: Duration = Duration::from_secs(2);

    /// Readiness that nothing asks about (no admin listener): it only drains.
    fn unasked() -> Arc<Self> {
        Arc::new(Self {
            draining: std::sync::atomic::AtomicBool::new(false),
            last: std::sync::Mutex::new(None),
        })
    }

    /// Checks `relays` now and every [`Self::EVERY`], on a task of its own.
    fn watch(relays: &[Prepared]) -> Arc<Self> {
        let readiness = Self::unasked();
        let checked: Vec<(String, idempotency_outbox::Database, Arc<To>)> = relays
            .iter()
            .map(|prepared| {
                (
                    prepared.relay.label().to_owned(),
                    prepared.database.clone(),
                    Arc::clone(&prepared.destination),
                )
            })
            .collect();
        let updated = Arc::clone(&readiness);
        tokio::spawn(async move {
            loop {
                let checks = checked.iter().map(|(label, database, destination)| async move {
                    let timeout = Self::EVERY.saturating_mul(2);
                    let database = tokio::time::timeout(timeout, database.reachable()).await;
                    let destination = tokio::time::timeout(timeout, destination.reachable()).await;
                    let mut failed = Vec::new();
                    match database {
                        Ok(Ok(())) => {}
                        Ok(Err(error)) => failed.push(format!("{label}: the database: {error}")),
                        Err(_) => failed.push(format!("{label}: the database did not answer")),
                    }
                    match destination {
                        Ok(Ok(())) => {}
                        Ok(Err(error)) => failed.push(format!(
                            "{label}: the destination: {}",
                            idempotency::redact_url(&error.to_string())
                        )),
                        Err(_) => failed.push(format!("{label}: the destination did not answer")),
                    }
                    failed
                });
                let failed: Vec<String> = futures_util::future::join_all(checks).await.concat();
                let result = if failed.is_empty() {
                    Ok(())
                } else {
                    Err(failed.join("\n"))
                };
                *updated
                    .last
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(result);
                tokio::time::sleep(Self::EVERY).await;
            }
        });
        readiness
    }

    fn drain(&self) {
        self.draining.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// `200 ready`, or `503` with the reason.
    fn answer(&self) -> (http::StatusCode, String) {
        use http::StatusCode;
        if self.draining.load(std::sync::atomic::Ordering::SeqCst) {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                "draining: shutting down\n".into(),
            );
        }
        match &*self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            Some(Ok(())) => (StatusCode::OK, "ready\n".into()),
            Some(Err(why)) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
            None => (
                StatusCode::SERVICE_UNAVAILABLE,
                "starting: the first check has not ended\n".into(),
            ),
        }
    }
}

/// Why an AMQP destination cannot be used.
#[derive(Debug, thiserror::Error)]
enum AmqpUnusable {
    /// No channel could be opened to ask.
    #[error("a channel could not be opened ({0})")]
    Channel(#[source] lapin::Error),
    /// The exchange `--to` names does not exist.
    #[error("the exchange `{exchange}` does not exist ({source})")]
    NoExchange {
        exchange: String,
        #[source]
        source: lapin::Error,
    },
    /// The queue the default exchange would route to does not exist.
    #[error("{0}")]
    NoQueue(#[source] idempotency_amqp::AdapterError),
}

/// Checks that `exchange` exists, or, through the default exchange, that the queue `routing_key`
/// names does (a passive declare; a missing one closes only its channel).
async fn check_amqp(
    connection: &lapin::Connection,
    exchange: Option<&str>,
    routing_key: Option<&str>,
) -> Result<(), AmqpUnusable> {
    let channel = connection.create_channel().await.map_err(AmqpUnusable::Channel)?;
    match (exchange, routing_key) {
        (Some(exchange), _) => {
            channel
                .exchange_declare(
                    exchange.into(),
                    lapin::ExchangeKind::Direct,
                    lapin::options::ExchangeDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    lapin::types::FieldTable::default(),
                )
                .await
                .map_err(|source| AmqpUnusable::NoExchange {
                    exchange: exchange.to_owned(),
                    source,
                })?;
        }
        (None, Some(queue)) => {
            idempotency_amqp::queue_depth(&channel, queue)
                .await
                .map_err(AmqpUnusable::NoQueue)?;
        }
        (None, None) => {}
    }
    let _ = channel.close(200, "checked".into()).await;
    Ok(())
}

/// The outbox table `config` names.
fn tables(config: &Config) -> Result<Tables, Error> {
    Tables::default()
        .schema(&config.schema)
        .and_then(|tables| tables.outbox(&config.outbox_table))
        .map_err(|e| Error::Usage(e.to_string()))
}

/// `idem relay migrate`: creates or upgrades the outbox table alone.
///
/// # Errors
///
/// [`Error::Boxes`] when the database cannot be reached, [`Error::Outbox`] when the table is
/// another application's or a newer version's.
pub async fn migrate(database: &str, schema: &str, table: &str) -> Result<String, Error> {
    let tables = Tables::default()
        .schema(schema)
        .and_then(|tables| tables.outbox(table))
        .map_err(|e| Error::Usage(e.to_string()))?;
    let at = Location {
        database: database.to_owned(),
        tables,
    };
    let database = at.database_of(1, false).await?;
    at.tables.migrate_outbox(&database).await?;
    Ok(format!("{}: ready\n", database.qualified_outbox(&at.tables)))
}

/// The relays `config` asks for: itself, or with `--config` one per `[[relay]]` table of the
/// file (`command` is `idem relay`'s, whose flags are the tables' keys).
///
/// # Errors
///
/// [`Error::Usage`] naming the file, the line and the column of what is wrong; two tables on
/// one outbox table (each row goes to one destination: give it in the row's `destination`).
pub fn configs(config: Config, command: &clap::Command) -> Result<Vec<Config>, Error> {
    let Some(path) = &config.config else {
        return Ok(vec![config]);
    };
    let mut configs: Vec<(usize, Config)> = Vec::new();
    for table in crate::config_file::relays(path, command).map_err(|e| Error::Usage(e.to_string()))? {
        let relay = <Config as clap::FromArgMatches>::from_arg_matches(&table.matches)
            .map_err(|e| Error::Usage(format!("{}:{}: {e}", path.display(), table.line)))?;
        let same = |other: &Config| {
            other.database == relay.database
                && other.schema == relay.schema
                && other.outbox_table == relay.outbox_table
        };
        if let Some((line, _)) = configs.iter().find(|(_, other)| same(other)) {
            return Err(Error::Usage(format!(
                "{}:{}: the [[relay]] at line {line} relays the same outbox table: each row goes to one destination, so one table has one relay (several processes may run it; a row's `destination` picks among the queues, subjects or topics of one --to)",
                path.display(),
                table.line
            )));
        }
        configs.push((table.line, relay));
    }
    Ok(configs.into_iter().map(|(_, config)| config).collect())
}

/// A relay ready to run: its table checked and its destination reached.
struct Prepared {
    relay: Relay<Arc<To>>,
    /// `--to`, redacted.
    to: String,
    /// The relay's database and destination, asked by the readiness probe.
    database: idempotency_outbox::Database,
    destination: Arc<To>,
}

/// Checks `config`'s destination and table, and builds its relay.
async fn prepare(config: &Config) -> Result<Prepared, Error> {
    let tables = tables(config)?;
    let to_url = config.to.clone().unwrap_or_default();
    let files = crate::tls::ClientFiles {
        ca: config.to_ca.clone(),
        cert: config.to_client_cert.clone(),
        key: config.to_client_key.clone(),
        insecure_skip_verify: config.to_insecure_skip_verify,
    };
    let to = destination(&to_url, &files).await?;
    let at = Location {
        database: config.database.clone().unwrap_or_default(),
        tables,
    };
    let database = at.outbox(4, false).await?;
    let destination = Arc::new(to);
    let mut relay = Relay::new(database.clone(), Outbox::new(at.tables), Arc::clone(&destination))
        .batch(config.batch)
        .max_attempts(config.max_attempts)
        .poll(config.poll)
        .retention(config.retention, Duration::from_secs(60));
    if let Some(name) = &config.name {
        relay = relay.name(name.clone());
    }
    Ok(Prepared {
        relay,
        to: idempotency::redact_url(&to_url),
        database,
        destination,
    })
}

/// Runs `idem relay` until `shutdown` completes: then the rounds in progress finish and it
/// returns. With `--config`, every `[[relay]]` of the file in this one process (`command` is
/// `idem relay`'s, for the tables' keys).
///
/// # Errors
///
/// A `--to` that cannot be used, a database that cannot be reached, a table that is missing
/// (`idem relay migrate` creates it) or of another version, a file that is not valid: before
/// any relay starts.
pub async fn relay(
    config: Config,
    command: &clap::Command,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let admin_listen = config.admin_listen;
    let configs = configs(config, command)?;
    // Bound before any database is reached: an address already taken is reported first, and
    // the address is held from the moment the process starts.
    let (admin_listener, admin_bound) = crate::server::bind_optional(admin_listen).await?.unzip();
    let mut relays = Vec::new();
    for config in configs {
        relays.push(prepare(&config).await?);
    }
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(Error::Metrics)?;
    // The databases and destinations are asked only where a probe can ask for the answer.
    let readiness = if admin_listener.is_some() {
        Readiness::watch(&relays)
    } else {
        Readiness::unasked()
    };
    if let Some(listener) = admin_listener {
        let ready = Arc::clone(&readiness);
        let router = axum::Router::new()
            .route("/_idem/livez", axum::routing::get(|| async { "ok\n" }))
            .route(
                "/_idem/readyz",
                axum::routing::get(move || {
                    let ready = Arc::clone(&ready);
                    async move { ready.answer() }
                }),
            )
            .route(
                "/_idem/metrics",
                axum::routing::get(move || {
                    let metrics = metrics.clone();
                    async move { metrics.render() }
                }),
            );
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
    }
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let draining = Arc::clone(&readiness);
    tokio::spawn(async move {
        shutdown.await;
        // Not ready from the first moment of the signal, while the rounds in progress finish.
        draining.drain();
        tracing::info!("shutting down: /readyz answers 503 from now on");
        let _ = stop.send(true);
    });
    let running = relays.iter().map(|prepared| {
        let mut stopped = stopped.clone();
        tracing::info!(
            outbox = %prepared.relay.label(),
            to = %prepared.to,
            admin_listen = admin_bound.map(tracing::field::display),
            "relaying"
        );
        prepared.relay.run_until(async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        })
    });
    for result in futures_util::future::join_all(running).await {
        result?;
    }
    tracing::info!("stopped: the rounds in progress were finished");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_relays_own_parameters_are_taken_out_of_the_url() {
        let (url, exchange) =
            take_param("amqp://u:p@h:5672/%2f?exchange=orders&heartbeat=10", "exchange").unwrap();
        assert_eq!(exchange.as_deref(), Some("orders"));
        assert_eq!(url, "amqp://u:p@h:5672/%2f?heartbeat=10");
        let (url, subject) = take_param("nats://h:4222?subject=orders.created", "subject").unwrap();
        assert_eq!(
            (url.as_str(), subject.as_deref()),
            ("nats://h:4222", Some("orders.created"))
        );
        let (_, none) = take_param("kafka://h:9092?topic=", "topic").unwrap();
        assert_eq!(none, None, "an empty value is no default");
        assert!(take_param("not a url", "topic").is_err());
    }
}

//! `idem consume`: a broker's messages delivered to an HTTP handler, once per key.
//!
//! Each message becomes a `POST` to the handler with the payload as the body. The consumer
//! core (`idempotency-consumer`) decides everything around it: the key (the message's
//! `Idempotency-Key` header, or what `--key-from` names: [`KeyFrom`]), the record and its lease (heartbeated while the call runs), ack
//! only once the outcome is recorded, retries with backoff, dead letters with a reason. The
//! handler's answer decides the disposition:
//!
//! | handler answer | what happens |
//! |---|---|
//! | `2xx` | the body is stored as the outcome, then the message is acked; a redelivered duplicate is acked without calling the handler |
//! | `408`, `409`, `425`, `429`, `5xx`, a timeout, a refused or lost connection | the key is released and the message retried with backoff, dead-lettered after `--max-deliveries` |
//! | another `4xx` (or a `3xx`) | the handler refused the message: dead-lettered at once, with the status and the start of the body as the reason |
//!
//! A message without a key, or whose key was used with another payload, is dead-lettered with
//! the reason; when the store is down, messages are retried (fail closed).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idempotency::{Attempt, Outcome, Watched};
use idempotency_consumer::source::{AnyProcessor, SourceSettings};
use idempotency_consumer::{Consumer, Delivery, Handler, HandlerError};
use tokio::sync::Semaphore;

use crate::admin::{ADMIN_PREFIX, Admin, admin_router};
pub use crate::error::ConsumeError;
use crate::error::Error;
use crate::flags::{FlagError, bounded_duration, parse_lease, parse_retention};
use crate::reconcile::{Meaning, ReconcileTemplate};
use crate::server::bind_optional;
use crate::tls::{self, ClientFiles};
use crate::units;

/// The most of a handler's answer that is read and stored as the outcome (a longer answer is
/// recorded without its body).
const MAX_ANSWER: usize = 1 << 20;

/// The most of a refusing answer's body that goes into a dead letter's reason.
const REASON_BODY: usize = 200;

/// `idem consume`'s settings; each flag is also an `IDEM_*` environment variable.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// Where the messages come from: a broker URL, one of those listed below (`--help-source
    /// NAME` lists a broker's URL parameters).
    #[arg(long, env = "IDEM_FROM", required_unless_present = "help_source")]
    pub from: Option<String>,
    /// The handler each message is POSTed to: http://HOST:PORT/PATH or https://…; https is verified
    /// against --to-ca or, without it, the system's trust store.
    #[arg(long, env = "IDEM_TO", required_unless_present = "help_source")]
    pub to: Option<String>,
    /// A private CA (PEM bundle): the only CA trusted for an https handler (without it, the
    /// system's trust store).
    #[arg(long, env = "IDEM_TO_CA")]
    pub to_ca: Option<PathBuf>,
    /// A client certificate (PEM chain) presented to an https handler; needs --to-client-key.
    #[arg(long, env = "IDEM_TO_CLIENT_CERT", requires = "to_client_key")]
    pub to_client_cert: Option<PathBuf>,
    /// The private key (PEM) of --to-client-cert.
    #[arg(long, env = "IDEM_TO_CLIENT_KEY", requires = "to_client_cert")]
    pub to_client_key: Option<PathBuf>,
    /// INSECURE: accept any certificate from an https handler, for any name (logged as a
    /// warning at start).
    #[arg(long, env = "IDEM_TO_INSECURE_SKIP_VERIFY")]
    pub to_insecure_skip_verify: bool,
    /// Lists the URL parameters of a source (amqp, nats, kafka, sqs) and exits.
    #[arg(long, value_name = "NAME", exclusive = true)]
    pub help_source: Option<String>,
    /// The store: sqlite://PATH, postgres://..., mysql://..., redis://..., memory://
    #[arg(long, env = "IDEM_STORE", default_value = "sqlite://idem.db")]
    pub store: String,
    /// Where a message's key comes from: header:NAME (a header, or an SQS message attribute),
    /// message-id (RabbitMQ's message_id property, NATS's Nats-Msg-Id header, SQS's
    /// deduplication id or else its MessageId), record-key (Kafka's record key), or
    /// json:/POINTER (a member of a JSON payload). A message without a usable key is
    /// dead-lettered with the reason.
    #[arg(long, env = "IDEM_KEY_FROM", default_value = "header:Idempotency-Key", value_parser = KeyFrom::parse)]
    pub key_from: KeyFrom,
    /// The consumer's name: the scope of its keys (two consumers of one message run it once
    /// each) and the source named in its dead letters.
    #[arg(long, env = "IDEM_NAME", default_value = "idem-consume", value_parser = consumer_name)]
    pub name: String,
    /// How many messages the broker hands out at once; they are handled concurrently.
    #[arg(long, env = "IDEM_PREFETCH", default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..))]
    pub prefetch: u16,
    /// At most this many handler calls at once (default: the prefetch).
    #[arg(long, env = "IDEM_CONCURRENCY", value_parser = clap::value_parser!(u16).range(1..))]
    pub concurrency: Option<u16>,
    /// How long a handler call may take, answer included; then it is retried.
    #[arg(long, env = "IDEM_HANDLER_TIMEOUT", default_value = "30s", value_parser = parse_handler_timeout)]
    pub handler_timeout: Duration,
    /// The lease of a running call, renewed while it runs; a consumer that died is taken over
    /// after it.
    #[arg(long, env = "IDEM_LEASE", default_value = "60s", value_parser = parse_lease)]
    pub lease: Duration,
    /// How long a handled key is remembered (duplicates within it are acked unhandled).
    #[arg(long, env = "IDEM_RETENTION", default_value = "7d", value_parser = parse_retention)]
    pub retention: Duration,
    /// How many fetched messages are decided together (their keys claimed in one store round
    /// trip, their outcomes recorded in one more), at most the prefetch; 1 decides each alone.
    /// Kafka: of one partition, handled one after another, in order; RabbitMQ, NATS and SQS
    /// (one receive of a standard queue): handled at once, each acked once its own outcome is
    /// recorded (RabbitMQ and NATS: at most half the concurrency, two batches in flight).
    #[arg(long, env = "IDEM_BATCH", default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub batch: u16,
    /// How long a batch waits for more messages, and how long a handler runs before the
    /// outcomes before it are recorded without waiting for it (0s to 1s).
    #[arg(long, env = "IDEM_LINGER", default_value = "5ms", value_parser = parse_linger)]
    pub linger: Duration,
    /// Deliveries of one message before it is dead-lettered.
    #[arg(long, env = "IDEM_MAX_DELIVERIES", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_deliveries: u32,
    /// Serve /_idem/livez, /_idem/readyz, /_idem/healthz and /_idem/metrics on this address
    /// (until the running calls have been settled at shutdown).
    #[arg(long, env = "IDEM_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// The dashboard (`--ui`) and its settings.
    #[command(flatten)]
    pub dashboard: crate::ui::UiFlags,
    /// How each consumed message's log event shows its key: `hash` (a digest), `plain` or `off`.
    #[arg(long, env = "IDEM_LOG_KEYS", default_value = "hash")]
    pub log_keys: idempotency::KeyLog,
    /// Before an attempt after the first calls the handler, ask whether an earlier one took
    /// effect: `[METHOD ]/path/{key}` (on --to's host) or an http(s):// URL with `{key}`. A 2xx
    /// or a 4xx other than 404 is taken as the handler's answer; 404 lets the handler run;
    /// anything else retries the message later without calling the handler. See
    /// docs/RECONCILE.md.
    #[arg(long, env = "IDEM_RECONCILE", value_parser = crate::reconcile::parse_reconcile)]
    pub reconcile: Option<ReconcileTemplate>,
}

/// `--key-from`: where the key of a message from a producer outside this toolkit (Debezium, a
/// Go or Java service, a Kafka producer keying its records) is found.
///
/// | `--key-from` | RabbitMQ | NATS JetStream | Kafka | SQS |
/// |---|---|---|---|---|
/// | `header:NAME` (default `header:Idempotency-Key`) | a header | a header | a record header | a message attribute |
/// | `message-id` | the `message_id` property | the `Nats-Msg-Id` header | refused: records have none | the FIFO deduplication id, else SQS's `MessageId` |
/// | `record-key` | refused | refused | the record key | refused |
/// | `json:/POINTER` | a member of the JSON payload (a string, or a number's text) | ← | ← | ← |
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyFrom {
    /// A header (a message attribute on SQS).
    Header(String),
    /// The broker's message id.
    MessageId,
    /// Kafka's record key.
    RecordKey,
    /// A member of the JSON payload.
    Json(idempotency::JsonPointer),
}

impl KeyFrom {
    /// Parses `header:NAME`, `message-id`, `record-key` or `json:/POINTER`.
    ///
    /// # Errors
    ///
    /// What is wrong, with the forms it takes.
    pub fn parse(text: &str) -> Result<Self, String> {
        let forms = "header:NAME, message-id, record-key or json:/POINTER";
        match text.trim() {
            "message-id" => Ok(Self::MessageId),
            "record-key" => Ok(Self::RecordKey),
            other => {
                if let Some(name) = other.strip_prefix("header:") {
                    let usable = !name.is_empty()
                        && name.len() <= 256
                        && name.bytes().all(|b| b.is_ascii_graphic() && b != b':');
                    if usable {
                        Ok(Self::Header(name.to_owned()))
                    } else {
                        Err(format!(
                            "`{other}`: a header name is 1 to 256 visible ASCII characters, without ':'"
                        ))
                    }
                } else if let Some(pointer) = other.strip_prefix("json:") {
                    idempotency::JsonPointer::new(pointer)
                        .map(Self::Json)
                        .map_err(|e| format!("`{other}`: {e}"))
                } else {
                    Err(format!("`{other}` is not a key source: it is {forms}"))
                }
            }
        }
    }

    /// The consumer core's key source for a message of the broker `source` (a source kind's
    /// name: `amqp`, `nats`, `kafka`, `sqs`).
    ///
    /// # Errors
    ///
    /// A source this broker's messages do not have, and what to use instead.
    pub fn for_source(&self, source: &str) -> Result<idempotency_consumer::KeySource, String> {
        use idempotency_consumer::KeySource;
        match (self, source) {
            (Self::MessageId, "kafka") => Err(
                "--key-from message-id: Kafka records have no message id; use record-key, or header:NAME for a header your producer sets (CloudEvents: header:ce_id)".into(),
            ),
            (Self::RecordKey, source) if source != "kafka" => Err(format!(
                "--key-from record-key: only Kafka records have a record key, and this source is {source}; use message-id or header:NAME"
            )),
            (Self::Header(name), _) => Ok(KeySource::Header(name.clone())),
            (Self::MessageId, _) => Ok(KeySource::MessageId),
            (Self::RecordKey, _) => Ok(KeySource::RecordKey),
            (Self::Json(pointer), _) => Ok(KeySource::JsonPointer(pointer.clone())),
        }
    }
}

impl std::fmt::Display for KeyFrom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Header(name) => write!(f, "header:{name}"),
            Self::MessageId => f.write_str("message-id"),
            Self::RecordKey => f.write_str("record-key"),
            Self::Json(pointer) => write!(f, "json:{}", pointer.as_str()),
        }
    }
}

fn consumer_name(text: &str) -> Result<String, InvalidName> {
    idempotency::Scope::new(text)
        .map(|_| text.to_owned())
        .map_err(InvalidName)
}

/// `--name` is not a scope.
#[derive(Debug, thiserror::Error)]
#[error("not a valid consumer name: {0}")]
pub struct InvalidName(#[source] idempotency::KeyError);

/// `--linger`: 0 to 1 s (a batch never waits longer for company).
fn parse_linger(text: &str) -> Result<Duration, FlagError> {
    bounded_duration(
        text,
        "--linger",
        (Duration::ZERO, Duration::from_secs(1)),
        "must be from 0s to 1s",
    )
}

/// `--handler-timeout`: 100 ms to 24 h (zero would retry every message without calling).
fn parse_handler_timeout(text: &str) -> Result<Duration, FlagError> {
    let range = (Duration::from_millis(100), Duration::from_secs(86_400));
    bounded_duration(text, "--handler-timeout", range, "must be from 100ms to 24h")
}

/// The sources `idem consume` takes: one line per broker this build has, with its example URL.
#[must_use]
pub fn sources_help() -> String {
    let mut help = String::from("Sources (`--help-source NAME` lists a source's parameters):");
    for kind in idempotency::sources().kinds() {
        help.push_str(&format!("\n  {:<6} {}", kind.name, kind.example));
    }
    help
}

/// `--help-source NAME`: the example URL and every parameter of one source.
///
/// # Errors
///
/// [`ConsumeError::UnknownSource`] when this build has no source of that name.
pub fn source_help(name: &str) -> Result<String, ConsumeError> {
    let sources = idempotency::sources();
    let kind = sources.named(name).ok_or_else(|| ConsumeError::UnknownSource {
        name: name.to_owned(),
        known: sources
            .kinds()
            .iter()
            .map(|kind| kind.name)
            .collect::<Vec<_>>()
            .join(", "),
    })?;
    let mut help = format!("{}\n\n", kind.example);
    for line in kind.parameters.lines() {
        help.push_str("  ");
        help.push_str(line.trim_start());
        help.push('\n');
    }
    Ok(help)
}

/// Parses `--to`.
fn handler_uri(to: &str) -> Result<Uri, ConsumeError> {
    let refuse = |why: &str| ConsumeError::Handler {
        to: idempotency::redact_url(to),
        why: why.to_owned(),
    };
    let uri: Uri = to
        .parse()
        .map_err(|_| refuse("not a URL; expected http[s]://HOST:PORT/PATH"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => {
            return Err(refuse(
                "not an http:// or https:// URL; expected http[s]://HOST:PORT/PATH",
            ));
        }
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(refuse("names no host"));
    }
    Ok(uri)
}

/// What a handler call says of the attempt it is: the `Idempotency-Key`, `-Scope` and
/// `-Attempt` headers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call<'a> {
    /// The message's key.
    pub(crate) key: &'a str,
    /// The consumer's scope.
    pub(crate) scope: &'a str,
    /// 1 for the first attempt, more after a takeover.
    pub(crate) number: u32,
}

/// Calls the handler for each message.
#[derive(derive_more::Debug)]
pub(crate) struct HttpHandler {
    #[debug(skip)]
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    // A handler URL may carry user information.
    #[debug("{:?}", idempotency::redact_url(&to.to_string()))]
    to: Uri,
    timeout: Duration,
    /// The queue (or stream) the messages come from, sent to the handler.
    #[debug(skip)]
    source: String,
    #[debug(skip)]
    calls: Semaphore,
    /// Asked before an attempt after the first, with the consumer's name for the metric.
    #[debug(skip)]
    reconcile: Option<(ReconcileTemplate, String)>,
}

/// The message's content type (see [`Delivery::content_type`]), or `application/octet-stream`.
fn content_type(message: &dyn Delivery) -> &str {
    message
        .content_type()
        .filter(|value| http::HeaderValue::from_str(value).is_ok())
        .unwrap_or("application/octet-stream")
}

impl HttpHandler {
    /// POSTs each message to `to` (an `http://` or `https://` URL; `tls` verifies an https
    /// handler), at most `calls` at once, each answer awaited at most `timeout`; `source` is
    /// sent as `Idempotency-Source`.
    pub(crate) fn new(
        to: Uri,
        timeout: Duration,
        source: String,
        calls: usize,
        tls: &rustls::ClientConfig,
    ) -> Self {
        let mut tls = tls.clone();
        // The connector offers HTTP/1.1 itself.
        tls.alpn_protocols.clear();
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            to,
            timeout,
            source,
            calls: Semaphore::new(calls),
            reconcile: None,
        }
    }

    /// Asks `template` before an attempt after the first runs (see [`crate::reconcile`]);
    /// `consumer` labels the metric.
    pub(crate) fn reconcile(mut self, template: ReconcileTemplate, consumer: String) -> Self {
        self.reconcile = Some((template, consumer));
        self
    }

    /// `builder` with the headers that say which message and attempt a request is about.
    fn about(
        &self,
        builder: http::request::Builder,
        message: &dyn Delivery,
        attempt: &Call<'_>,
    ) -> http::request::Builder {
        let mut builder = builder
            .header("Idempotency-Key", attempt.key)
            .header("Idempotency-Scope", attempt.scope)
            .header("Idempotency-Attempt", attempt.number)
            .header("Idempotency-Delivery-Count", message.delivery_count())
            .header("Idempotency-Source", self.source.as_str());
        if let Some(id) = message
            .message_id()
            .filter(|id| http::HeaderValue::from_str(id).is_ok())
        {
            builder = builder.header("Idempotency-Message-Id", id);
        }
        builder
    }

    fn request(
        &self,
        message: &dyn Delivery,
        attempt: &Call<'_>,
    ) -> Result<Request<Full<Bytes>>, HandlerError> {
        let mut request = self.about(
            Request::post(self.to.clone()).header(header::CONTENT_TYPE, content_type(message)),
            message,
            attempt,
        );
        // The message's trace context goes on to the handler (replaced by the call's own span
        // when traces are exported: see `call`).
        for (name, value) in trace_headers(message) {
            request = request.header(name, value);
        }
        request
            .body(Full::new(Bytes::copy_from_slice(message.payload())))
            .map_err(|e| HandlerError::fatal(format!("the message cannot be sent as an HTTP request: {e}")))
    }

    /// POSTs `message` as `attempt` and reads the answer into a disposition (see the module's
    /// table).
    pub(crate) async fn call<M: Delivery + Sync>(
        &self,
        message: &M,
        attempt: &Call<'_>,
    ) -> Result<Outcome, HandlerError> {
        let _call = self
            .calls
            .acquire()
            .await
            .map_err(|_| HandlerError::retry("idem consume is shutting down"))?;
        let mut request = self.request(message, attempt)?;
        // The call's span continues the message's trace (its `traceparent` header); the
        // handler continues it from the call's. No span when spans are not exported.
        let span = if crate::telemetry::exporting() {
            tracing::info_span!(
                "idem.handler",
                otel.kind = "client",
                messaging.source = %self.source,
                attempt = attempt.number,
                http.response.status_code = tracing::field::Empty,
            )
        } else {
            tracing::Span::none()
        };
        crate::telemetry::continue_from(&span, request.headers());
        span.in_scope(|| crate::telemetry::propagate(request.headers_mut()));
        let deadline = tokio::time::Instant::now() + self.timeout;
        let late = || {
            HandlerError::retry(format!(
                "the handler did not answer within {}",
                units::format_duration(self.timeout)
            ))
        };
        let response = tokio::time::timeout_at(deadline, self.client.request(request))
            .await
            .map_err(|_| late())?
            .map_err(|e| HandlerError::retry(format!("the handler could not be reached: {}", causes(&e))))?;
        let status = response.status();
        span.record("http.response.status_code", status.as_u16());
        // Once the status is in, the handler's answer is known: a 2xx whose body is too long,
        // late or cut off still means the work was done, and is recorded (without the body)
        // rather than run again.
        let body =
            match tokio::time::timeout_at(deadline, Limited::new(response.into_body(), MAX_ANSWER).collect())
                .await
            {
                Ok(Ok(body)) => body.to_bytes(),
                Ok(Err(error)) => {
                    tracing::warn!(%status, %error, "the handler's answer body was not read whole; not kept");
                    Bytes::new()
                }
                Err(_) => {
                    tracing::warn!(%status, "the handler's answer body did not arrive in time; not kept");
                    Bytes::new()
                }
            };
        disposition(status, body)
    }
}

/// The W3C trace context headers of `message` (`traceparent`, `tracestate`) that are valid
/// header values.
fn trace_headers(message: &dyn Delivery) -> Vec<(&'static str, http::HeaderValue)> {
    ["traceparent", "tracestate"]
        .into_iter()
        .filter_map(|name| {
            let value = http::HeaderValue::from_bytes(message.header(name)?).ok()?;
            Some((name, value))
        })
        .collect()
}

/// An error and its causes, outermost first: the client's own message ("client error
/// (Connect)") says nothing of a refused certificate, its source does.
pub(crate) fn causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(cause) = next {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        next = cause.source();
    }
    text
}

/// The handler's TLS, checked at start ([`tls::checked_peer`]).
async fn handler_tls(config: &Config, to: &Uri) -> Result<Arc<rustls::ClientConfig>, Error> {
    let files = ClientFiles {
        ca: config.to_ca.clone(),
        cert: config.to_client_cert.clone(),
        key: config.to_client_key.clone(),
        insecure_skip_verify: config.to_insecure_skip_verify,
    };
    tls::checked_peer(&files, to, "handler").await.map_err(|why| {
        ConsumeError::Handler {
            to: idempotency::redact_url(config.to.as_deref().unwrap_or_default()),
            why,
        }
        .into()
    })
}

/// What the handler's answer means (see the module's table).
fn disposition(status: StatusCode, body: Bytes) -> Result<Outcome, HandlerError> {
    if status.is_success() {
        return Ok(Outcome::new(body));
    }
    let transient = matches!(status.as_u16(), 408 | 409 | 425 | 429) || status.is_server_error();
    if transient {
        return Err(HandlerError::retry(format!("the handler answered {status}")));
    }
    let shown = String::from_utf8_lossy(&body[..body.len().min(REASON_BODY)]).replace(['\r', '\n'], " ");
    Err(HandlerError::fatal(format!(
        "the handler refused the message: {status}{}{shown}",
        if shown.is_empty() { "" } else { ": " }
    )))
}

impl HttpHandler {
    /// Asks the reconcile hook about `attempt` of `message`: `Some` answer to settle the message
    /// with instead of calling the handler, `None` to call it.
    async fn ask(
        &self,
        template: &ReconcileTemplate,
        consumer: &str,
        message: &(dyn Delivery + Sync),
        key: &idempotency::Key,
        attempt: &Call<'_>,
    ) -> Option<Result<Outcome, HandlerError>> {
        let count = |result: &'static str| {
            metrics::counter!("idempotency_reconciled_total", "guard" => consumer.to_owned(), "result" => result)
                .increment(1);
        };
        let unresolved = |why: String| {
            count("unresolved");
            tracing::warn!(attempt = attempt.number, why = %why, "whether an earlier attempt took effect cannot be told: the handler is not called, and the message is retried later");
            Some(Err(HandlerError::retry(format!("reconcile: {why}"))))
        };
        let target = template.target(key);
        let url = match template.origin() {
            Some(origin) => format!("{}{target}", origin.to_string().trim_end_matches('/')),
            None => format!(
                "{}://{}{target}",
                self.to.scheme_str().unwrap_or("http"),
                self.to.authority().map_or("", http::uri::Authority::as_str)
            ),
        };
        let request = self
            .about(
                Request::builder().method(template.method()).uri(url),
                message,
                attempt,
            )
            .body(Full::new(Bytes::new()));
        let request = match request {
            Ok(request) => request,
            Err(error) => return unresolved(format!("the question cannot be made: {error}")),
        };
        let deadline = tokio::time::Instant::now() + self.timeout;
        let response = match tokio::time::timeout_at(deadline, self.client.request(request)).await {
            Ok(Ok(response)) => response,
            Ok(Err(error)) => {
                return unresolved(format!(
                    "the reconcile hook could not be reached: {}",
                    causes(&error)
                ));
            }
            Err(_) => return unresolved("the reconcile hook did not answer in time".into()),
        };
        let status = response.status();
        match Meaning::of(status) {
            Meaning::DidNotHappen => {
                count("did_not_happen");
                tracing::info!(
                    attempt = attempt.number,
                    "the earlier attempt did not take effect: the handler is called"
                );
                return None;
            }
            Meaning::Unknown => {
                return unresolved(format!(
                    "the reconcile hook answered {status}, which says neither what happened nor that nothing did"
                ));
            }
            Meaning::Happened => {}
        }
        let body =
            tokio::time::timeout_at(deadline, Limited::new(response.into_body(), MAX_ANSWER).collect()).await;
        match body {
            Ok(Ok(body)) => {
                count("adopted");
                tracing::info!(attempt = attempt.number, %status, "the earlier attempt took effect: its answer is adopted, and the handler is not called again");
                Some(disposition(status, body.to_bytes()))
            }
            Ok(Err(error)) => unresolved(format!("the reconcile hook's answer could not be read: {error}")),
            Err(_) => unresolved("the reconcile hook's answer did not arrive in time".into()),
        }
    }
}

impl<M: Delivery + Sync> Handler<M> for HttpHandler {
    async fn handle(&self, message: &M, attempt: &Attempt) -> Result<Outcome, HandlerError> {
        let call = Call {
            key: attempt.key().as_str(),
            scope: attempt.scope().as_str(),
            number: attempt.number(),
        };
        if call.number > 1
            && let Some((template, consumer)) = &self.reconcile
            && let Some(answer) = self.ask(template, consumer, message, attempt.key(), &call).await
        {
            return answer;
        }
        self.call(message, &call).await
    }
}

/// The consumer every source runs: the consumer core around the HTTP handler.
type Processor = Consumer<Watched<idempotency::DynStore>, HttpHandler>;

/// `idem consume`'s shutdown signal, awaited by the worker and the admin server alike.
type Shutdown = futures_util::future::Shared<std::pin::Pin<Box<dyn Future<Output = ()> + Send>>>;

/// How long the checks at start wait for a broker to answer.
const START_CHECK: Duration = Duration::from_secs(10);

/// Runs `idem consume` until `shutdown` completes: then it takes no new messages, lets the
/// running calls finish and be recorded and acked, and returns.
///
/// # Errors
///
/// A malformed `--from` or `--to`, a store that cannot be opened, a broker that cannot be
/// reached or refuses the consumer's setup, a listener that cannot be bound.
pub async fn consume(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let from = config.from.clone().unwrap_or_default();
    let shown = idempotency::redact_url(&from);
    let source_error = |error| ConsumeError::Source {
        from: shown.clone(),
        error,
    };
    let kind = idempotency::sources().kind(&from).map_err(source_error)?;
    let info = (kind.parse)(&from).map_err(source_error)?;
    let keys = config
        .key_from
        .for_source(kind.name)
        .map_err(|why| ConsumeError::Source {
            from: shown.clone(),
            error: idempotency_consumer::adapter::AdapterError::new(
                idempotency_consumer::adapter::AdapterErrorKind::Config,
                kind.name,
                why,
            ),
        })?;
    let to = handler_uri(config.to.as_deref().unwrap_or_default())?;
    let handler_tls = handler_tls(&config, &to).await?;
    config.dashboard.check(config.admin_listen)?;
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(Error::Metrics)?;
    // Bound before the store is opened: an address already taken is reported before anything
    // touches the store, and the address is held from the moment the process starts.
    let (admin_listener, admin_bound) = bind_optional(config.admin_listen).await?.unzip();
    let store = idempotency::open_with(&config.store, idempotency::Access::Create)
        .await
        .map_err(|e| Error::open(&config.store, e))?;
    let watched = Watched::new(store.clone());
    let health = watched.health();
    let admin = Admin::new(store, &config.store, health, metrics);
    let draining = admin.draining();
    // `/readyz` answers 503 from the signal on, while the running calls finish.
    let shutdown: std::pin::Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(async move {
        shutdown.await;
        draining.start();
        tracing::info!("shutting down: /readyz answers 503 from now on");
    });
    let shutdown: Shutdown = futures_util::FutureExt::shared(shutdown);
    // Watched on a task of its own: a worker polls the signal only between its calls (a
    // worker whose batches fill its concurrency looks again once one ends), and readiness
    // must say 503 from the signal on.
    tokio::spawn(shutdown.clone());
    // The admin listener answers probes until the worker has settled its last call.
    let (stopped, admin_stop) = tokio::sync::oneshot::channel::<()>();
    if let Some(listener) = admin_listener {
        let router = admin_router(admin.clone(), ADMIN_PREFIX);
        let process = crate::ui::Process::Consumer { from: from.clone() };
        let admin = config.dashboard.serve_beside(router, admin, process)?;
        tokio::spawn(async move {
            let stop = async move {
                let _ = admin_stop.await;
            };
            let _ = axum::serve(listener, admin).with_graceful_shutdown(stop).await;
        });
    }
    let calls = usize::from(config.concurrency.unwrap_or(config.prefetch));
    let name = config.name.clone();
    let mut handler = HttpHandler::new(to, config.handler_timeout, info.source, calls, &handler_tls);
    if let Some(template) = config.reconcile.clone() {
        handler = handler.reconcile(template, config.name.clone());
    }
    let processor: Processor = Consumer::new(name, watched, handler)
        .keys(keys)
        .lease(config.lease)
        .retention(config.retention)
        .max_deliveries(config.max_deliveries)
        .linger(config.linger)
        .log_keys(config.log_keys);
    let settings = SourceSettings::new(config.name.clone())
        .concurrency(calls)
        .prefetch(usize::from(config.prefetch))
        .batch(usize::from(config.batch), config.linger)
        .handler_timeout(config.handler_timeout)
        .start_check(START_CHECK);
    tracing::info!(
        source = kind.name,
        to = %idempotency::redact_url(config.to.as_deref().unwrap_or_default()),
        admin_listen = admin_bound.map(tracing::field::display),
        "starting"
    );
    let ran = (kind.run)(from, settings, AnyProcessor::new(processor), Box::pin(shutdown)).await;
    drop(stopped);
    ran.map_err(|error| ConsumeError::Broker { from: shown, error })?;
    tracing::info!("stopped: the running calls were recorded and settled");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handler_shows_its_url_without_the_password() {
        let tls = tls::client_config(&ClientFiles::default()).unwrap();
        let to: Uri = "http://app:s3cret@127.0.0.1:8080/charge".parse().unwrap();
        let shown = format!(
            "{:?}",
            HttpHandler::new(to, Duration::from_secs(1), "q".into(), 1, &tls)
        );
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("127.0.0.1:8080/charge"), "{shown}");
    }

    #[test]
    fn the_consumer_guide_names_every_source_and_parameter() {
        let guide = include_str!("../../../docs/CONSUMERS.md");
        for kind in idempotency::sources().kinds() {
            assert!(
                guide.contains(kind.example),
                "{} is not in docs/CONSUMERS.md",
                kind.example
            );
            for line in kind.parameters.lines() {
                let parameter = line.trim_start().split(['=', ' ']).next().unwrap_or_default();
                let named = parameter.starts_with("any")
                    || parameter.starts_with('(')
                    || parameter.starts_with("credentials")
                    || parameter.contains(':')
                    || guide.contains(&format!("`{parameter}`"));
                assert!(named, "{}: `{parameter}` is not in docs/CONSUMERS.md", kind.name);
            }
        }
        #[cfg(feature = "kafka")]
        assert!(source_help("kafka").unwrap().contains("topic=TOPIC"));
        assert!(source_help("amqp").unwrap().contains("queue="));
        assert!(source_help("nope").is_err());
    }

    #[test]
    fn handler_urls_must_be_http() {
        assert!(handler_uri("http://127.0.0.1:3000/messages").is_ok());
        assert!(handler_uri("https://handler.internal/messages").is_ok());
        for (to, why) in [
            ("ftp://h/x", "not an http:// or https:// URL"),
            ("/messages", "not an http:// or https:// URL"),
            ("http://", "not a URL"),
        ] {
            let error = handler_uri(to).unwrap_err().to_string();
            assert!(error.contains(why), "{to}: {error}");
        }
    }

    #[test]
    fn answers_decide_the_disposition() {
        assert_eq!(
            disposition(StatusCode::CREATED, Bytes::from_static(b"done"))
                .unwrap()
                .as_bytes(),
            b"done"
        );
        for status in [408, 409, 425, 429, 500, 502, 503, 504] {
            let error = disposition(StatusCode::from_u16(status).unwrap(), Bytes::new()).unwrap_err();
            assert!(!error.is_fatal(), "{status}");
        }
        for status in [301, 400, 403, 404, 410, 413, 422] {
            let error = disposition(
                StatusCode::from_u16(status).unwrap(),
                Bytes::from_static(b"no\nsuch"),
            )
            .unwrap_err();
            assert!(error.is_fatal(), "{status}");
            assert!(error.to_string().contains(&status.to_string()), "{error}");
            assert!(error.to_string().contains("no such"), "{error}");
        }
    }
}

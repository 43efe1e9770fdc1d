//! `nats://` URLs: a durable pull consumer of a JetStream stream to consume from, as
//! `idem consume --from` and any program with a
//! [`Sources`](idempotency_consumer::source::Sources) registry take it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind};
use idempotency_consumer::source::{
    AnyProcessor, Params, RunFuture, Shutdown, SourceInfo, SourceKind, SourceSettings,
};

use crate::{BROKER, NatsMessage, Worker};

/// NATS JetStream as a kind of source.
pub const SOURCE: SourceKind = SourceKind {
    name: "nats",
    schemes: &["nats", "tls"],
    example: "nats://HOST:PORT?stream=STREAM&consumer=CONSUMER",
    parameters: "stream=STREAM        the stream (required)\n\
                 consumer=CONSUMER    the durable pull consumer (required; created with explicit acks if missing)\n\
                 subject=SUBJECT      what a consumer it creates takes (default: the whole stream)\n\
                 dead_letter=SUBJECT  where dead letters go (default STREAM.dead); a stream must store it, the consumer must not take it\n\
                 ack_wait=30s         the ack wait of a consumer it creates, 1s to 24h (progress acks go out every third of it)\n\
                 tls_required=true    refuse a server that does not offer TLS (tls://HOST:PORT says the same)\n\
                 ca=FILE              verify the server against this CA alone (TLS is used whenever the server offers it)\n\
                 cert=FILE, key=FILE  present this client certificate\n\
                 nkey=FILE            authenticate with the NKey seed in FILE\n\
                 creds=FILE           authenticate with a credentials file (a user JWT and its seed, as Synadia's service issues)",
    parse,
    run,
    dead_letters: crate::dead_letters::open,
};

/// A parsed `nats://` source.
#[derive(Clone, PartialEq, Eq)]
pub struct NatsSource {
    /// The server URL, without the parameters.
    pub url: String,
    /// The stream.
    pub stream: String,
    /// The durable pull consumer.
    pub consumer: String,
    /// Where dead letters are published (a subject some stream stores).
    pub dead_letter: String,
    /// The subject a consumer created by the worker takes messages from.
    pub subject: Option<String>,
    /// The ack wait of a consumer created by the worker.
    pub ack_wait: Option<Duration>,
    /// TLS: required (`tls://`, `tls_required=true`), a CA, a client certificate.
    pub tls: NatsTls,
}

/// The TLS and authentication settings of a `nats://` or `tls://` source. The client uses TLS
/// whenever the server offers it, verified against `ca` alone or, without it, the system's trust
/// store; it
/// authenticates with the URL's user and password, an NKey seed or a credentials file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsTls {
    /// Refuse a server that does not offer TLS.
    pub required: bool,
    /// `ca=FILE`: the only CA the server's certificate may be signed by (without it, the
    /// system's trust store).
    pub ca: Option<std::path::PathBuf>,
    /// `cert=FILE` and `key=FILE`: a client certificate.
    pub client: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// `nkey=FILE`: the file holding an NKey seed to authenticate with (read when connecting,
    /// so the seed is never kept in this value).
    pub nkey: Option<std::path::PathBuf>,
    /// `creds=FILE`: a credentials file (a user JWT and its NKey seed).
    pub creds: Option<std::path::PathBuf>,
}

impl NatsTls {
    /// The connection parameters of a `nats://` or `tls://` URL's query (`tls_required`, `ca`,
    /// `cert`, `key`, `nkey`, `creds`), taken off `params`; the files are checked here.
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Config`] naming the parameter and what is wrong with it.
    pub fn take(params: &mut Params, scheme: &str) -> Result<Self, AdapterError> {
        let refuse = |why: String| AdapterError::new(AdapterErrorKind::Config, BROKER, why);
        let required = match params.take("tls_required").as_deref() {
            None | Some("false") => scheme == "tls",
            Some("true") => true,
            Some(other) => return Err(refuse(format!("tls_required={other}: expected true or false"))),
        };
        let ca = params.pem_file("ca")?;
        let client = match (params.pem_file("cert")?, params.pem_file("key")?) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            _ => return Err(refuse("a client certificate needs both `cert` and `key`".into())),
        };
        let nkey = params.take("nkey").map(std::path::PathBuf::from);
        let creds = params.take("creds").map(std::path::PathBuf::from);
        if nkey.is_some() && creds.is_some() {
            return Err(refuse(
                "give `nkey` or `creds`, not both: each says who the client is".into(),
            ));
        }
        for (name, path) in [("nkey", &nkey), ("creds", &creds)] {
            if let Some(path) = path {
                std::fs::metadata(path).map_err(|e| refuse(format!("`{name}` {}: {e}", path.display())))?;
            }
        }
        Ok(Self {
            required,
            ca,
            client,
            nkey,
            creds,
        })
    }

    /// Connects to `url` (the server, without parameters) with these settings; the first
    /// connection must work within `timeout`, after which the client reconnects by itself for
    /// as long as it takes.
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Config`] for an unusable `nkey` or `creds` file,
    /// [`AdapterErrorKind::Unreachable`] when the server does not answer or refuses the
    /// connection (TLS verification, authentication), with the client's reason.
    pub async fn connect(&self, url: &str, timeout: Duration) -> Result<async_nats::Client, AdapterError> {
        let unreachable = |why: String| AdapterError::new(AdapterErrorKind::Unreachable, BROKER, why);
        let refuse = |why: String| AdapterError::new(AdapterErrorKind::Config, BROKER, why);
        let mut options = async_nats::ConnectOptions::new()
            .max_reconnects(None)
            .require_tls(self.required);
        if let Some(ca) = &self.ca {
            options = options.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.client {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        if let Some(path) = &self.nkey {
            let seed = std::fs::read_to_string(path)
                .map_err(|e| refuse(format!("`nkey` {}: {e}", path.display())))?;
            let seed = seed.trim();
            // A seed is an `S…` key; a public key (`U…`) is the usual mix-up.
            if !seed.starts_with('S') {
                return Err(refuse(format!(
                    "`nkey` {}: not an NKey seed (a seed starts with S; a U… key is the public half)",
                    path.display()
                )));
            }
            options = options.nkey(seed.to_owned());
        }
        if let Some(path) = &self.creds {
            options = options
                .credentials_file(path)
                .await
                .map_err(|e| refuse(format!("`creds` {}: {e}", path.display())))?;
        }
        tokio::time::timeout(timeout, options.connect(url))
            .await
            .map_err(|_| unreachable(format!("the server did not answer within {timeout:?}")))?
            .map_err(|e| {
                unreachable(format!(
                    "cannot connect to the server: {}",
                    idempotency_core::redact_url(&e.to_string())
                ))
            })
    }
}

/// A client of the server a `nats://HOST:PORT` or `tls://HOST:PORT` URL names, with the same
/// connection parameters as a source's (`tls_required`, `ca`, `cert`, `key`, `nkey`, `creds`,
/// a user and password in the URL) and no others: for publishers, such as the outbox relay's
/// `NatsPublisher` (`async_nats::jetstream::new(client)`).
///
/// ```no_run
/// # async fn f() -> Result<(), idempotency_nats::AdapterError> {
/// let client = idempotency_nats::connect_url(
///     "tls://nats.example.com:4222?ca=/etc/idem/ca.pem&creds=/run/secrets/nats.creds",
///     std::time::Duration::from_secs(10),
/// )
/// .await?;
/// let jetstream = async_nats::jetstream::new(client);
/// # drop(jetstream); Ok(()) }
/// ```
///
/// # Errors
///
/// [`AdapterErrorKind::Config`] for a malformed URL, an unknown parameter or an unusable file;
/// [`AdapterErrorKind::Unreachable`] as [`NatsTls::connect`] says.
pub async fn connect_url(url: &str, timeout: Duration) -> Result<async_nats::Client, AdapterError> {
    let refuse = |why: String| AdapterError::new(AdapterErrorKind::Config, BROKER, why);
    let mut parsed = url::Url::parse(url).map_err(|e| {
        refuse(format!(
            "`{}` is not a URL ({e}); expected nats://HOST:PORT or tls://HOST:PORT",
            idempotency_core::redact_url(url)
        ))
    })?;
    if !SOURCE.schemes.contains(&parsed.scheme()) {
        return Err(refuse(format!(
            "`{}:` is not a NATS URL; expected nats://HOST:PORT or tls://HOST:PORT",
            parsed.scheme()
        )));
    }
    let mut params = Params::new(BROKER, parsed.query().unwrap_or_default());
    let tls = NatsTls::take(&mut params, parsed.scheme())?;
    params.finish("tls_required, ca, cert, key, nkey, creds")?;
    parsed.set_query(None);
    tls.connect(parsed.as_str(), timeout).await
}

impl fmt::Debug for NatsSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsSource")
            .field("url", &idempotency_core::redact_url(&self.url))
            .field("stream", &self.stream)
            .field("consumer", &self.consumer)
            .field("dead_letter", &self.dead_letter)
            .field("subject", &self.subject)
            .field("ack_wait", &self.ack_wait)
            .field("tls", &self.tls)
            .finish()
    }
}

impl NatsSource {
    /// Parses `nats://HOST:PORT?stream=STREAM&consumer=CONSUMER` with `&subject=`,
    /// `&dead_letter=` and `&ack_wait=`.
    ///
    /// ```
    /// use idempotency_nats::NatsSource;
    ///
    /// let source = NatsSource::from_url("nats://127.0.0.1:4222?stream=PAYMENTS&consumer=charges")?;
    /// assert_eq!(source.url, "nats://127.0.0.1:4222");
    /// assert_eq!(source.dead_letter, "PAYMENTS.dead");
    /// # Ok::<(), idempotency_nats::AdapterError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Config`] saying what is wrong (never echoing the password).
    pub fn from_url(url: &str) -> Result<Self, AdapterError> {
        let refuse = |why: String| AdapterError::new(AdapterErrorKind::Config, BROKER, why);
        let mut parsed = url::Url::parse(url)
            .map_err(|e| refuse(format!("not a URL ({e}); expected {}", SOURCE.example)))?;
        if !SOURCE.schemes.contains(&parsed.scheme()) {
            return Err(refuse(format!("not a nats:// URL; expected {}", SOURCE.example)));
        }
        let mut params = Params::new(BROKER, parsed.query().unwrap_or_default());
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
        let ack_wait = params.duration(
            "ack_wait",
            (Duration::from_secs(1), Duration::from_secs(86_400)),
            "must be from 1s to 24h",
        )?;
        let tls = NatsTls::take(&mut params, parsed.scheme())?;
        params.finish(
            "stream, consumer, subject, dead_letter, ack_wait, tls_required, ca, cert, key, nkey, creds",
        )?;
        parsed.set_query(None);
        Ok(Self {
            url: parsed.into(),
            stream,
            consumer,
            dead_letter,
            subject,
            ack_wait,
            tls,
        })
    }

    /// Where messages come from, as dead letters and handlers name it: `STREAM/CONSUMER`.
    #[must_use]
    pub fn source_name(&self) -> String {
        format!("{}/{}", self.stream, self.consumer)
    }

    /// Connects (the first connection must work within `timeout`; after it the client
    /// reconnects by itself for as long as it takes) and checks that a stream stores the
    /// dead-letter subject; returns a worker on the durable consumer.
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Unreachable`] when the server does not answer or refuses the
    /// connection, [`AdapterErrorKind::Refused`] when no stream stores the dead letters.
    pub async fn connect<P: idempotency_consumer::Processor<NatsMessage>>(
        &self,
        timeout: Duration,
        processor: Arc<P>,
    ) -> Result<Worker<P>, AdapterError> {
        let client = self.tls.connect(&self.url, timeout).await?;
        let jetstream = async_nats::jetstream::new(client);
        if jetstream
            .stream_by_subject(self.dead_letter.as_str())
            .await
            .is_err()
        {
            return Err(AdapterError::new(
                AdapterErrorKind::Refused,
                BROKER,
                format!(
                    "dead letters go to subject `{}`, which no stream stores: add it to a stream's subjects, or name another with &dead_letter=SUBJECT",
                    self.dead_letter
                ),
            ));
        }
        let mut worker = Worker::new(
            jetstream,
            self.stream.clone(),
            self.consumer.clone(),
            self.dead_letter.clone(),
            processor,
        );
        if let Some(subject) = &self.subject {
            worker = worker.filter_subject(subject.clone());
        }
        if let Some(ack_wait) = self.ack_wait {
            worker = worker.ack_wait(ack_wait);
        }
        Ok(worker)
    }
}

fn parse(url: &str) -> Result<SourceInfo, AdapterError> {
    NatsSource::from_url(url).map(|source| SourceInfo::new(source.source_name()))
}

fn run(url: String, settings: SourceSettings, processor: AnyProcessor, shutdown: Shutdown) -> RunFuture {
    Box::pin(async move {
        let source = NatsSource::from_url(&url)?;
        let worker = source
            .connect(settings.start_check, Arc::new(processor))
            .await?
            .name(settings.name)
            .concurrency(settings.concurrency)
            .prefetch(settings.prefetch)
            .batch(settings.batch)
            .linger(settings.linger);
        tracing::info!(stream = %source.stream, consumer = %source.consumer, "consuming");
        worker.run_until(shutdown).await
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_parsed_and_refused_with_the_reason() {
        let source =
            NatsSource::from_url("nats://app:s3cret@127.0.0.1:4222?stream=PAYMENTS&consumer=charges")
                .unwrap();
        assert_eq!(source.url, "nats://app:s3cret@127.0.0.1:4222");
        assert_eq!(
            (source.stream.as_str(), source.consumer.as_str()),
            ("PAYMENTS", "charges")
        );
        assert_eq!(source.dead_letter, "PAYMENTS.dead");
        assert_eq!(source.source_name(), "PAYMENTS/charges");
        assert!(!format!("{source:?}").contains("s3cret"));
        let source = NatsSource::from_url(
            "nats://h:4222?stream=S&consumer=C&dead_letter=x.dead&ack_wait=2m&subject=s.in",
        )
        .unwrap();
        assert_eq!(source.dead_letter, "x.dead");
        assert_eq!(source.ack_wait, Some(Duration::from_secs(120)));
        assert_eq!(source.subject.as_deref(), Some("s.in"));
        for (url, why) in [
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
            ("nats://u:s3cret@h?stream=S", "names no consumer"),
            ("not a url", "not a URL"),
        ] {
            let error = NatsSource::from_url(url).unwrap_err();
            assert_eq!(error.kind(), AdapterErrorKind::Config, "{url}");
            assert!(error.to_string().contains(why), "{url}: {error}");
            assert!(!error.to_string().contains("s3cret"), "{url}: {error}");
        }
    }
}

//! `amqps://` (feature `tls`, rustls on ring) and RabbitMQ's URI parameters `cacertfile`,
//! `certfile` and `keyfile`.
//!
//! Without them, an `amqps://` URL is verified against the system's trust store. With
//! `cacertfile`, against that CA alone; `certfile` and `keyfile` (both) present a client
//! certificate.
//! The other TLS parameters of RabbitMQ's URI specification are refused rather than ignored:
//! `verify=verify_none` would turn verification off, and `server_name_indication` cannot be
//! honoured (connect by the name the certificate carries).

use std::fmt;
use std::path::PathBuf;
#[cfg(feature = "tls")]
use std::sync::Arc;

use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind};
use lapin::{Connection, ConnectionProperties};

use crate::BROKER;

/// The TLS files an `amqps://` URL names. Empty: the system's trust store.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct AmqpTls {
    /// `cacertfile`: the CA the server's certificate is verified against.
    pub ca: Option<PathBuf>,
    /// `certfile`: a client certificate (PEM).
    pub cert: Option<PathBuf>,
    /// `keyfile`: its private key (PKCS#8 PEM).
    pub key: Option<PathBuf>,
}

impl fmt::Debug for AmqpTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpTls")
            .field("ca", &self.ca)
            .field("cert", &self.cert)
            .field("key", &self.key.as_ref().map(|_| "<path>"))
            .finish()
    }
}

impl AmqpTls {
    /// Takes `name=value` if it is one of the TLS parameters: `Ok(true)` when taken.
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Config`] for a TLS parameter that is refused, or a file that cannot
    /// be read or is not PEM.
    pub(crate) fn take(&mut self, scheme: &str, name: &str, value: &str) -> Result<bool, AdapterError> {
        let refuse = |why: String| AdapterError::new(AdapterErrorKind::Config, BROKER, why);
        let slot = match name {
            "cacertfile" => &mut self.ca,
            "certfile" => &mut self.cert,
            "keyfile" => &mut self.key,
            "verify" | "fail_if_no_peer_cert" => {
                return Err(refuse(format!(
                    "`{name}` is refused: the server's certificate is always verified"
                )));
            }
            "server_name_indication" | "password" | "depth" => {
                return Err(refuse(format!(
                    "`{name}` is not supported: connect by the name the server's certificate carries, with an unencrypted key"
                )));
            }
            _ => return Ok(false),
        };
        if scheme != "amqps" {
            return Err(refuse(format!(
                "`{name}` names a TLS file: it is for amqps:// URLs, and this one is {scheme}://"
            )));
        }
        idempotency_core::pem::check_file(value.as_ref())
            .map_err(|why| refuse(format!("`{name}` {value}: {why}")))?;
        *slot = Some(PathBuf::from(value));
        Ok(true)
    }

    /// Checks that a client certificate comes with its key.
    pub(crate) fn check(&self) -> Result<(), AdapterError> {
        if self.cert.is_some() != self.key.is_some() {
            return Err(AdapterError::new(
                AdapterErrorKind::Config,
                BROKER,
                "a client certificate needs both `certfile` and `keyfile`",
            ));
        }
        Ok(())
    }
}

/// Connects to the broker at `url`, an `amqp://` or `amqps://` URL whose TLS parameters
/// (`cacertfile`, `certfile`, `keyfile`) are taken off and used as [`AmqpTls`] describes; the
/// other parameters go to the client. For publishers (the outbox relay, events); a consumer's
/// [`AmqpSource`](crate::AmqpSource) does the same.
///
/// # Errors
///
/// [`AdapterErrorKind::Config`] for a URL that is not one, or a TLS parameter it refuses;
/// [`AdapterErrorKind::Unreachable`] when the broker cannot be reached or its certificate is
/// refused (the message says why, never the password).
pub async fn connect_url(url: &str) -> Result<Connection, AdapterError> {
    let refuse = |why: String| AdapterError::new(AdapterErrorKind::Config, BROKER, why);
    let mut parsed = url::Url::parse(url).map_err(|e| refuse(format!("not a URL ({e})")))?;
    if !matches!(parsed.scheme(), "amqp" | "amqps") {
        return Err(refuse("not an amqp:// or amqps:// URL".into()));
    }
    let mut tls = AmqpTls::default();
    let mut rest = Vec::new();
    for (name, value) in parsed.query_pairs() {
        if !tls.take(parsed.scheme(), &name, &value)? {
            rest.push((name.into_owned(), value.into_owned()));
        }
    }
    tls.check()?;
    if rest.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(rest);
    }
    connect(parsed.as_str(), &tls).await.map_err(|e| {
        AdapterError::new(
            AdapterErrorKind::Unreachable,
            BROKER,
            format!(
                "cannot connect to the broker: {}",
                idempotency_core::redact_url(&e.to_string())
            ),
        )
        .with_source(e)
    })
}

/// Connects to `url`: an `amqp://` URL as `lapin::Connection::connect` does, an `amqps://` one
/// over rustls with the trust [`AmqpTls`] describes.
pub(crate) async fn connect(url: &str, tls: &AmqpTls) -> lapin::Result<Connection> {
    if !url.starts_with("amqps://") {
        return Connection::connect(url, ConnectionProperties::default()).await;
    }
    connect_tls(url, tls).await
}

/// `amqps://` through a TLS configuration of our own rather than lapin's: lapin's rustls
/// connector starts from the system's trust store and *adds* `cacertfile` to it, so a server
/// any system CA vouches for would pass. Here a named CA is the only one trusted
/// ([`idempotency_core::pem::trust_anchors`]). The same connect function serves lapin's
/// reconnections.
#[cfg(feature = "tls")]
async fn connect_tls(url: &str, tls: &AmqpTls) -> lapin::Result<Connection> {
    use lapin::tcp::RustlsConnector;
    use lapin::uri::AMQPUri;

    let io = |why: String| lapin::Error::from(std::io::Error::other(why));
    let uri: AMQPUri = url.parse().map_err(io)?;
    let config = client_config(tls).map_err(io)?;
    let connector = Arc::new(RustlsConnector::from(Arc::new(config)));
    let runtime = lapin::runtime::default_runtime()?;
    Connection::connector(
        uri,
        runtime,
        async move |uri: AMQPUri, runtime| {
            let (host, port) = (uri.authority.host.clone(), uri.authority.port);
            let addresses: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host.as_str(), port))
                .await
                .map_err(lapin::Error::from)?
                .collect();
            let stream = lapin::AsyncTcpStream::connect(&runtime, addresses)
                .await
                .map_err(lapin::Error::from)?;
            stream
                .into_rustls(&connector, &host)
                .await
                .map_err(lapin::Error::from)
        },
        ConnectionProperties::default(),
    )
    .await
}

/// The rustls client configuration of an `amqps://` connection: `cacertfile` alone or the
/// system's trust store, and the client certificate of `certfile` and `keyfile`.
#[cfg(feature = "tls")]
fn client_config(tls: &AmqpTls) -> Result<rustls::ClientConfig, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    let show = |path: &PathBuf| path.display().to_string();
    let roots = idempotency_core::pem::trust_anchors(tls.ca.as_deref()).map_err(|why| {
        format!(
            "`cacertfile` {}: {why}",
            tls.ca.as_ref().map(show).unwrap_or_default()
        )
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    match (&tls.cert, &tls.key) {
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .and_then(Iterator::collect::<Result<Vec<_>, _>>)
                .map_err(|e| format!("`certfile` {}: {e}", show(cert)))?;
            let key =
                PrivateKeyDer::from_pem_file(key).map_err(|e| format!("`keyfile` {}: {e}", show(key)))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("`certfile` and `keyfile` are not a usable pair: {e}"))
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}

/// Without the `tls` feature there is no TLS client at all: refused, never sent in plain.
#[cfg(not(feature = "tls"))]
async fn connect_tls(_url: &str, _tls: &AmqpTls) -> lapin::Result<Connection> {
    Err(lapin::Error::from(std::io::Error::other(
        "amqps:// needs the `tls` feature of idempotency-amqp",
    )))
}

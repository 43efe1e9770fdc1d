//! `amqps://` beyond the system's trust store: RabbitMQ's URI parameters `cacertfile`,
//! `certfile` and `keyfile` (feature `tls`, rustls on ring).
//!
//! Without them, an `amqps://` URL is verified against the system's trust store. With
//! `cacertfile`, against that CA; `certfile` and `keyfile` (both) present a client certificate.
//! The other TLS parameters of RabbitMQ's URI specification are refused rather than ignored:
//! `verify=verify_none` would turn verification off, and `server_name_indication` cannot be
//! honoured (connect by the name the certificate carries).

use std::fmt;
use std::path::PathBuf;

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

    fn is_empty(&self) -> bool {
        self.ca.is_none() && self.cert.is_none()
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

/// Connects to `url` with `tls`'s files (none: as `lapin::Connection::connect`).
pub(crate) async fn connect(url: &str, tls: &AmqpTls) -> lapin::Result<Connection> {
    if tls.is_empty() || !url.starts_with("amqps://") {
        return Connection::connect(url, ConnectionProperties::default()).await;
    }
    connect_with_files(url, tls).await
}

#[cfg(feature = "tls")]
async fn connect_with_files(url: &str, tls: &AmqpTls) -> lapin::Result<Connection> {
    use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
    let read = |path: &PathBuf| std::fs::read(path).map_err(lapin::Error::from);
    let cert_chain = tls
        .ca
        .as_ref()
        .map(|path| read(path).map(|pem| String::from_utf8_lossy(&pem).into_owned()))
        .transpose()?;
    let identity = match (&tls.cert, &tls.key) {
        (Some(cert), Some(key)) => Some(OwnedIdentity::PKCS8 {
            pem: read(cert)?,
            key: read(key)?,
        }),
        _ => None,
    };
    let config = OwnedTLSConfig { identity, cert_chain };
    let runtime = lapin::runtime::default_runtime()?;
    Connection::connect_with_config(url, ConnectionProperties::default(), config, runtime).await
}

/// Without the `tls` feature the files cannot be used, and ignoring them would trust what they
/// were meant to restrict: refused (`AmqpSource::from_url` refuses such a URL first).
#[cfg(not(feature = "tls"))]
async fn connect_with_files(_url: &str, _tls: &AmqpTls) -> lapin::Result<Connection> {
    Err(lapin::Error::from(std::io::Error::other(
        "cacertfile, certfile and keyfile need the `tls` feature of idempotency-amqp",
    )))
}

//! TLS for the binary's own HTTP connections (rustls on the ring provider): the gateway's
//! listener, with client certificates and a certificate swapped on `SIGHUP`, and the client side
//! of `https://` upstreams and handlers, verified against the private CA the user names or,
//! when none is named, the operating system's trust store.
//!
//! Verification is on unless a flag spelled `…-insecure-skip-verify` turns it off, and then a
//! warning says so at start. PEM files are read whole at start (and at each reload): an
//! unreadable or malformed file is refused with its path and the reason.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};

/// Why a TLS setting cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("{what} {path}: {why}")]
    File {
        /// What the file was to hold (`certificate`, `private key`, `CA bundle`).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it is refused.
        why: String,
    },
    /// The certificate and key do not make a usable pair, or a setting is refused by rustls.
    #[error("{0}")]
    Config(String),
    /// A flag needs another one (`--tls-cert` without `--tls-key`, say).
    #[error("{0}")]
    Incomplete(&'static str),
}

/// The process's one crypto provider: ring.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificates of the PEM file at `path` (a chain, or a bundle of CAs), in file order.
///
/// # Errors
///
/// [`TlsError::File`] when the file cannot be read, is not PEM or holds no certificate.
pub fn read_certificates(path: &Path, what: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let refuse = |why: String| TlsError::File {
        what,
        path: path.to_owned(),
        why,
    };
    let text = std::fs::read(path).map_err(|e| refuse(e.to_string()))?;
    let certificates = CertificateDer::pem_slice_iter(&text)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| refuse(format!("not PEM: {e}")))?;
    if certificates.is_empty() {
        return Err(refuse("holds no CERTIFICATE block".into()));
    }
    Ok(certificates)
}

/// The private key of the PEM file at `path` (PKCS#8, PKCS#1 or SEC1).
///
/// # Errors
///
/// [`TlsError::File`] when the file cannot be read or holds no private key. The key's bytes are
/// never part of a message.
pub fn read_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let refuse = |why: String| TlsError::File {
        what: "private key",
        path: path.to_owned(),
        why,
    };
    let text = std::fs::read(path).map_err(|e| refuse(e.to_string()))?;
    PrivateKeyDer::from_pem_slice(&text).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => refuse("holds no PRIVATE KEY block".into()),
        other => refuse(format!("not a PEM private key: {other}")),
    })
}

/// The roots a bundle of CAs gives.
fn roots_of(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for certificate in read_certificates(path, "CA bundle")? {
        roots.add(certificate).map_err(|e| TlsError::File {
            what: "CA bundle",
            path: path.to_owned(),
            why: format!("a certificate that cannot be a trust anchor: {e}"),
        })?;
    }
    Ok(roots)
}

/// The certificate and key of a listener, as files: read again on every reload.
#[derive(Debug, Clone)]
pub struct ServerFiles {
    /// The certificate chain (leaf first).
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// When set, clients must present a certificate signed by one of these CAs.
    pub client_ca: Option<PathBuf>,
}

impl ServerFiles {
    /// The pair as rustls serves it.
    fn certified_key(&self) -> Result<Arc<CertifiedKey>, TlsError> {
        let chain = read_certificates(&self.cert, "certificate")?;
        let key = read_private_key(&self.key)?;
        let certified = CertifiedKey::from_der(chain, key, &provider()).map_err(|e| {
            TlsError::Config(format!(
                "certificate {} and key {} are not a usable pair: {e}",
                self.cert.display(),
                self.key.display()
            ))
        })?;
        Ok(Arc::new(certified))
    }
}

/// The listener's current certificate, swapped by [`ListenerTls::reload`]; handshakes under way
/// keep the pair they started with.
#[derive(Debug)]
struct Current(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(
            &self.0.read().unwrap_or_else(std::sync::PoisonError::into_inner),
        ))
    }
}

/// The gateway listener's TLS: the acceptor for new connections and the files it reloads.
#[derive(Clone, derive_more::Debug)]
pub struct ListenerTls {
    files: ServerFiles,
    #[debug(skip)]
    current: Arc<Current>,
    #[debug(skip)]
    acceptor: tokio_rustls::TlsAcceptor,
}

impl ListenerTls {
    /// Reads the files and builds the listener's TLS (HTTP/1.1 over TLS 1.2 and 1.3).
    ///
    /// # Errors
    ///
    /// [`TlsError`] naming the file or the pair that cannot be used.
    pub fn new(files: ServerFiles) -> Result<Self, TlsError> {
        let current = Arc::new(Current(RwLock::new(files.certified_key()?)));
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let builder = match &files.client_ca {
            Some(path) => {
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots_of(path)?), provider())
                        .build()
                        .map_err(|e| TlsError::Config(format!("client CA {}: {e}", path.display())))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_cert_resolver(Arc::clone(&current) as Arc<dyn ResolvesServerCert>);
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            files,
            current,
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
        })
    }

    /// The acceptor new connections go through.
    #[must_use]
    pub fn acceptor(&self) -> &tokio_rustls::TlsAcceptor {
        &self.acceptor
    }

    /// Reads the certificate and key again; new connections get the new pair, open ones keep
    /// theirs. A pair that cannot be used leaves the current one in place.
    ///
    /// # Errors
    ///
    /// [`TlsError`] saying why the new pair was not taken.
    pub fn reload(&self) -> Result<(), TlsError> {
        let pair = self.files.certified_key()?;
        *self
            .current
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = pair;
        Ok(())
    }
}

/// How a client verifies and presents itself: `--upstream-ca`, `--upstream-client-cert`,
/// `--upstream-client-key`, `--upstream-insecure-skip-verify` (and `--to-…` for handlers).
#[derive(Debug, Clone, Default)]
pub struct ClientFiles {
    /// A private CA, trusted instead of the operating system's store.
    pub ca: Option<PathBuf>,
    /// A client certificate chain to present.
    pub cert: Option<PathBuf>,
    /// Its private key.
    pub key: Option<PathBuf>,
    /// Accept any server certificate (named insecure; a warning at start).
    pub insecure_skip_verify: bool,
}

/// The client configuration `files` describe, speaking HTTP/1.1.
///
/// # Errors
///
/// [`TlsError`] naming the file that cannot be used, or a certificate without its key.
pub fn client_config(files: &ClientFiles) -> Result<Arc<ClientConfig>, TlsError> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = if files.insecure_skip_verify {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider())))
    } else {
        // A named CA alone, or the operating system's store: never both.
        let roots =
            idempotency_core::pem::trust_anchors(files.ca.as_deref()).map_err(|why| TlsError::File {
                what: "CA bundle",
                path: files.ca.clone().unwrap_or_default(),
                why: why.to_string(),
            })?;
        builder.with_root_certificates(roots)
    };
    let mut config = match (&files.cert, &files.key) {
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(
                read_certificates(cert, "client certificate")?,
                read_private_key(key)?,
            )
            .map_err(|e| {
                TlsError::Config(format!(
                    "client certificate {} and key {} are not a usable pair: {e}",
                    cert.display(),
                    key.display()
                ))
            })?,
        (None, None) => builder.with_no_client_auth(),
        (Some(_), None) => return Err(TlsError::Incomplete("a client certificate needs its key")),
        (None, Some(_)) => return Err(TlsError::Incomplete("a client key needs its certificate")),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The client configuration of an `https://` peer `idem` calls (`idem consume`'s handler, the
/// relay's webhook), checked at start: the files must be usable, and a peer that answers must
/// present a certificate this configuration accepts. A peer not listening yet is only warned
/// about: it may start after `idem`, and its certificate is checked on every call. `peer` names
/// it in the messages (`handler`, `webhook`); the flags are the `--to-…` ones.
///
/// # Errors
///
/// Why the configuration cannot be used: TLS flags on an `http://` URL, an insecure flag with a
/// CA, an unusable file, a refused certificate (rustls's reason, and which host presented it).
pub async fn checked_peer(
    files: &ClientFiles,
    to: &http::Uri,
    peer: &str,
) -> Result<Arc<ClientConfig>, String> {
    use std::time::Duration;

    let https = to.scheme_str() == Some("https");
    if !https && (files.ca.is_some() || files.cert.is_some() || files.insecure_skip_verify) {
        return Err(format!(
            "--to-ca, --to-client-cert and --to-insecure-skip-verify are for an https:// {peer}; this one is http://"
        ));
    }
    if files.insecure_skip_verify && files.ca.is_some() {
        return Err(
            "--to-insecure-skip-verify verifies nothing, so --to-ca would be ignored: give one or the other"
                .into(),
        );
    }
    let tls = client_config(files).map_err(|e| format!("TLS: {e}"))?;
    if !https {
        return Ok(tls);
    }
    if files.insecure_skip_verify {
        tracing::warn!(
            to = %to,
            "--to-insecure-skip-verify: the {peer}'s certificate is NOT verified; anyone on the path can read and change the traffic"
        );
    }
    let host = to.host().unwrap_or_default();
    let port = to.port_u16().unwrap_or(443);
    let address = format!("{host}:{port}");
    let name = host.trim_start_matches('[').trim_end_matches(']').to_owned();
    let name = ServerName::try_from(name)
        .map_err(|e| format!("`{host}` cannot be checked against a certificate: {e}"))?;
    match tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(&address)).await {
        Ok(Ok(stream)) => {
            let connector = tokio_rustls::TlsConnector::from(Arc::clone(&tls));
            match tokio::time::timeout(Duration::from_secs(5), connector.connect(name, stream)).await {
                Ok(Ok(_)) => {}
                Ok(Err(error)) => return Err(describe_handshake_error(&address, &error)),
                Err(_) => return Err(format!("the TLS handshake with {address} timed out")),
            }
        }
        Ok(Err(error)) => {
            tracing::warn!(%error, %address, "the {peer} cannot be reached yet; its certificate is checked on the first call");
        }
        Err(_) => {
            tracing::warn!(%address, "the {peer} did not accept a connection within 5s; its certificate is checked on the first call");
        }
    }
    Ok(tls)
}

/// The verifier of `--…-insecure-skip-verify`: any certificate, any name. Signatures are still
/// checked, so the session keys are the server's, whoever it is.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// What a failed TLS handshake says to the user: rustls's reason, and for a refused
/// certificate which host presented it.
#[must_use]
pub fn describe_handshake_error(host: &str, error: &std::io::Error) -> String {
    match error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(rustls::Error::InvalidCertificate(why)) => {
            format!("the certificate of {host} is refused: {why}")
        }
        Some(rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType)) => {
            format!("{host} does not speak TLS (its first bytes were not a TLS record: a plain HTTP server?)")
        }
        Some(other) => format!("TLS with {host} failed: {other}"),
        None => format!("TLS with {host} failed: {error}"),
    }
}

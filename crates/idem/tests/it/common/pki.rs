//! A test PKI made in the test (rcgen): a CA, server and client certificates it signs, and files
//! for the flags that take PEM paths.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
    SerialNumber,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A certificate authority.
pub struct Ca {
    pub cert: rcgen::Certificate,
    key: KeyPair,
}

/// A certificate the CA signed, with its key.
pub struct Leaf {
    pub cert: rcgen::Certificate,
    pub key: KeyPair,
}

impl Leaf {
    pub fn der(&self) -> CertificateDer<'static> {
        self.cert.der().clone()
    }

    pub fn key_der(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key.serialize_der()))
    }

    /// Writes the certificate and key as `NAME.pem` and `NAME.key` in `dir`.
    pub fn write(&self, dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let cert = dir.join(format!("{name}.pem"));
        let key = dir.join(format!("{name}.key"));
        std::fs::write(&cert, self.cert.pem()).unwrap();
        std::fs::write(&key, self.key.serialize_pem()).unwrap();
        (cert, key)
    }
}

/// The validity of a leaf.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Validity {
    Current,
    Expired,
}

impl Ca {
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Self { cert, key }
    }

    /// Writes the CA's certificate as `NAME.pem` in `dir`.
    pub fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(format!("{name}.pem"));
        std::fs::write(&path, self.cert.pem()).unwrap();
        path
    }

    /// A server certificate for `names` (DNS names or IP addresses), with `serial`.
    pub fn server(&self, names: &[&str], serial: u64, validity: Validity) -> Leaf {
        self.leaf(names, serial, validity, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate named `name`.
    pub fn client(&self, name: &str) -> Leaf {
        self.leaf(
            &[name],
            1000,
            Validity::Current,
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }

    fn leaf(&self, names: &[&str], serial: u64, validity: Validity, usage: ExtendedKeyUsagePurpose) -> Leaf {
        let mut params =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(DnType::CommonName, names[0]);
        params.serial_number = Some(SerialNumber::from(serial));
        params.extended_key_usages = vec![usage];
        if validity == Validity::Expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        Leaf { cert, key }
    }

    /// A rustls client that trusts this CA only, optionally presenting `identity`.
    pub fn client_config(&self, identity: Option<&Leaf>) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.cert.der().clone()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let config = match identity {
            Some(leaf) => builder
                .with_client_auth_cert(vec![leaf.der()], leaf.key_der())
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        Arc::new(config)
    }

    /// A rustls server presenting `leaf`.
    pub fn server_config(leaf: &Leaf) -> Arc<rustls::ServerConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![leaf.der()], leaf.key_der())
            .unwrap();
        Arc::new(config)
    }
}

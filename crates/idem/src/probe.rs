//! `idem probe URL`: an HTTP health check from inside the image, which has no shell, `curl` or
//! `wget` (it is built `FROM scratch`): a compose file's or an orchestrator's `healthcheck`
//! runs the binary itself.
//!
//! ```text
//! idem probe http://127.0.0.1:9090/readyz        # exit 0 on a 2xx within --timeout
//! ```
//!
//! Exit code 0 on a `2xx` answer within `--timeout`; 1 otherwise, the reason on standard error
//! (the status and the start of the body, a refused connection, the time out). `https://` is
//! verified against the system's trust store.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};

use crate::error::Error;

/// How much of an answer's body a failure shows.
const SHOWN: usize = 200;

/// `idem probe`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The URL: http://HOST:PORT/PATH or https://….
    url: String,
    /// How long the answer may take.
    #[arg(long, default_value = "2s", value_parser = crate::units::parse_duration)]
    timeout: Duration,
}

/// Runs `idem probe`: `Ok` on a `2xx` within `--timeout`.
///
/// # Errors
///
/// As [`probe`].
pub async fn run(args: Args) -> Result<String, Error> {
    probe(&args.url, args.timeout).await
}

/// `GET url` within `timeout`: the status line of a `2xx` answer.
///
/// # Errors
///
/// [`Error::Usage`] for a URL that is not `http(s)://HOST[:PORT]/PATH`; [`Error::Probe`] for an
/// answer that is not a `2xx`, none within `timeout`, or no connection.
pub async fn probe(url: &str, timeout: Duration) -> Result<String, Error> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| Error::Usage(format!("`{url}` is not a URL: {e}")))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
        return Err(Error::Usage(format!(
            "`{url}`: idem probe takes an http:// or https:// URL with a host"
        )));
    }
    let shown = idempotency::redact_url(url);
    let failed = |why: String| Error::Probe {
        url: shown.clone(),
        why,
    };
    let tls = crate::tls::client_config(&crate::tls::ClientFiles::default())?;
    let mut tls = (*tls).clone();
    tls.alpn_protocols.clear();
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .build();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build::<_, Empty<Bytes>>(connector);
    let asked = async {
        let answer = client
            .get(uri)
            .await
            .map_err(|e| failed(crate::consume::causes(&e)))?;
        let status = answer.status();
        let body = Limited::new(answer.into_body(), SHOWN)
            .collect()
            .await
            .map(|body| body.to_bytes())
            .unwrap_or_default();
        Ok::<_, Error>((status, body))
    };
    let (status, body) = tokio::time::timeout(timeout, asked).await.map_err(|_| {
        failed(format!(
            "no answer within {}",
            crate::units::format_duration(timeout)
        ))
    })??;
    if status.is_success() {
        Ok(format!("{status}"))
    } else {
        let text = String::from_utf8_lossy(&body);
        let text = text.trim();
        Err(failed(if text.is_empty() {
            format!("answered {status}")
        } else {
            format!("answered {status}: {text}")
        }))
    }
}

//! The URLs the DynamoDB store answers to.

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{Access, DynStore, ErrorKind, OpenFuture, StoreError, StoreKind, redact_url};

use crate::{DynamoDbOptions, DynamoDbStore};

/// `dynamodb://TABLE?region=…&endpoint=…&ca=…&max_clock_skew=…`, for a
/// [`Registry`](idempotency_core::Registry); see [`DynamoDbUrl::parse`].
pub const KIND: StoreKind = StoreKind {
    name: "dynamodb",
    schemes: &["dynamodb"],
    example: "dynamodb://TABLE?region=…",
    open: open_url,
    check: |url| DynamoDbUrl::parse(url).map(drop),
};

/// What a `dynamodb://` URL says: the table and its time rules, and where the service is.
#[derive(Debug, Clone)]
pub struct DynamoDbUrl {
    /// The table, and `max_clock_skew` when given.
    pub options: DynamoDbOptions,
    /// `endpoint=`: a local or compatible server (`http://127.0.0.1:5000`); otherwise the
    /// environment's (`AWS_ENDPOINT_URL`) or the region's.
    pub endpoint: Option<String>,
    /// `region=`; otherwise the environment's (`AWS_REGION`, the profile).
    pub region: Option<String>,
    /// `ca=FILE`: the CA certificates an `https://` endpoint is verified against, instead of
    /// the system's trust store.
    pub ca: Option<std::path::PathBuf>,
}

impl DynamoDbUrl {
    /// Parses `dynamodb://TABLE` with the optional parameters `region=NAME`,
    /// `endpoint=URL` (percent-encode it when it has a query of its own), `ca=FILE` (a PEM
    /// file of the CA certificates the endpoint is verified against instead of the system's
    /// trust store; checked here) and `max_clock_skew=DURATION` (`500ms`, `2s`). Credentials never go in the URL: they come
    /// from the usual AWS environment variables, profile or instance role.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::InvalidConfig`] naming what is wrong: another scheme, no table or an invalid
    /// table name, an unknown parameter, a bad value, or credentials in the URL.
    pub fn parse(url: &str) -> Result<Self, StoreError> {
        // Errors show the URL without its credentials: an access key pasted into a parameter
        // must not reach a log.
        let shown = redact_url(url);
        let parsed = url::Url::parse(url).map_err(|e| {
            invalid(format!(
                "not a dynamodb:// URL ({e}); expected dynamodb://TABLE?region=…"
            ))
        })?;
        if parsed.scheme() != "dynamodb" {
            return Err(invalid(format!(
                "`{}:` is not a dynamodb:// URL",
                parsed.scheme()
            )));
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(invalid(
                "a dynamodb:// URL carries no credentials: use the AWS environment variables, profile or role"
                    .to_owned(),
            ));
        }
        if parsed.port().is_some() || !matches!(parsed.path(), "" | "/") {
            return Err(invalid(format!(
                "`{shown}`: a dynamodb:// URL names a table only (dynamodb://TABLE); the server goes in endpoint="
            )));
        }
        let table = parsed.host_str().unwrap_or_default();
        if table.is_empty() {
            return Err(invalid(format!(
                "`{shown}` names no table (expected dynamodb://TABLE)"
            )));
        }
        let mut options = DynamoDbOptions::table(table)?;
        let (mut endpoint, mut region, mut ca) = (None, None, None);
        for (name, value) in parsed.query_pairs() {
            match &*name {
                "region" if !value.is_empty() => region = Some(value.into_owned()),
                "endpoint" => {
                    let valid = url::Url::parse(&value)
                        .is_ok_and(|e| matches!(e.scheme(), "http" | "https") && e.has_host());
                    if !valid {
                        return Err(invalid(format!(
                            "endpoint={:?} in `{shown}`: expected an http:// or https:// URL",
                            redact_url(&value)
                        )));
                    }
                    endpoint = Some(value.into_owned());
                }
                "ca" => {
                    let path = std::path::PathBuf::from(&*value);
                    // Checked here; the client that trusts it is built when the store opens.
                    idempotency_core::pem::read_ca_file(&path)
                        .map_err(|why| invalid(format!("ca={}: {why}", path.display())))?;
                    ca = Some(path);
                }
                "max_clock_skew" => {
                    let skew: Duration = humantime::parse_duration(&value).map_err(|e| {
                        invalid(format!(
                            "max_clock_skew={value:?} in `{shown}`: {e} (expected a duration such as 500ms or 2s)"
                        ))
                    })?;
                    if skew > Duration::from_secs(3600) {
                        return Err(invalid(format!(
                            "max_clock_skew={value:?} in `{shown}`: at most 1h (clocks that far apart need fixing, not a bound)"
                        )));
                    }
                    options = options.max_clock_skew(skew);
                }
                "region" => return Err(invalid(format!("`{shown}`: region= is empty"))),
                other => {
                    return Err(invalid(format!(
                        "unknown parameter `{other}` in `{shown}` (known: region, endpoint, ca, max_clock_skew)"
                    )));
                }
            }
        }
        if ca.is_some() && endpoint.as_deref().is_some_and(|e| e.starts_with("http://")) {
            return Err(invalid(format!(
                "`{shown}`: ca= verifies an https:// endpoint, and endpoint= is http://"
            )));
        }
        Ok(Self {
            options,
            endpoint,
            region,
            ca,
        })
    }
}

/// `Create` makes the table if missing; `Existing` and `ReadOnly` only check that it exists
/// and is a store's (neither ever creates one).
fn open_url(url: String, access: Access) -> OpenFuture {
    Box::pin(async move {
        let DynamoDbUrl {
            options,
            endpoint,
            region,
            ca,
        } = DynamoDbUrl::parse(&url)?;
        let client = match &ca {
            Some(ca) => crate::http_client_trusting(ca)?,
            None => crate::http_client(),
        };
        let store =
            DynamoDbStore::connect_through(options, endpoint.as_deref(), region.as_deref(), client).await;
        match access {
            Access::Create => store.migrate().await?,
            // Existing, ReadOnly, and any stricter access to come: never create.
            _ => store.check().await?,
        }
        Ok(Arc::new(store) as DynStore)
    })
}

fn invalid(message: String) -> StoreError {
    StoreError::new(ErrorKind::InvalidConfig, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_table_and_the_parameters() {
        let parsed = DynamoDbUrl::parse(
            "dynamodb://Idempotency.Records_1?region=eu-west-1&endpoint=http%3A%2F%2F127.0.0.1%3A5000&max_clock_skew=250ms",
        )
        .unwrap();
        assert_eq!(parsed.options.table_name(), "Idempotency.Records_1");
        assert_eq!(parsed.region.as_deref(), Some("eu-west-1"));
        assert_eq!(parsed.endpoint.as_deref(), Some("http://127.0.0.1:5000"));
        assert_eq!(parsed.options.clock_skew(), Duration::from_millis(250));
        let bare = DynamoDbUrl::parse("dynamodb://records").unwrap();
        assert_eq!((bare.region, bare.endpoint), (None, None));
        assert_eq!(bare.options.clock_skew(), Duration::from_secs(1));
        // An unencoded endpoint without a query of its own parses too.
        let plain = DynamoDbUrl::parse("dynamodb://records?endpoint=http://localhost:4566").unwrap();
        assert_eq!(plain.endpoint.as_deref(), Some("http://localhost:4566"));
    }

    #[test]
    fn rejects_malformed_urls_with_the_reason() {
        let cases = [
            ("dynamodb://", "names no table"),
            ("dynamodb://ab", "invalid DynamoDB table name"),
            ("dynamodb://records/extra", "names a table only"),
            ("dynamodb://records:8000", "names a table only"),
            ("dynamodb://records?regoin=x", "unknown parameter `regoin`"),
            ("dynamodb://records?region=", "region= is empty"),
            (
                "dynamodb://records?endpoint=localhost",
                "expected an http:// or https:// URL",
            ),
            ("dynamodb://records?max_clock_skew=soon", "expected a duration"),
            ("dynamodb://records?max_clock_skew=2days", "at most 1h"),
            ("dynamodb://AKIA:s3cret@records", "carries no credentials"),
            (
                "dynamodb://records?aws_secret_access_key=s3cret",
                "unknown parameter `aws_secret_access_key`",
            ),
            ("dynamodb://records/x?token=s3cret", "names a table only"),
            (
                "dynamodb://records?endpoint=ftp://u:s3cret@h&x=1",
                "expected an http:// or https:// URL",
            ),
            ("dynamodb://?password=s3cret", "names no table"),
            (
                "dynamodb://records?ca=/nonexistent/ca.pem",
                "ca=/nonexistent/ca.pem: No such file",
            ),
            ("postgres://records", "is not a dynamodb:// URL"),
            ("dynamodb records", "not a dynamodb:// URL"),
        ];
        for (url, expected) in cases {
            let error = DynamoDbUrl::parse(url).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{url}");
            assert!(error.to_string().contains(expected), "{url}: {error}");
            assert!(!error.to_string().contains("s3cret"), "secret echoed: {error}");
        }
    }
}

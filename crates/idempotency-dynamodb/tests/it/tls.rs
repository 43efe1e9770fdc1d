//! The store over HTTPS to a DynamoDB-compatible server with the test CA's certificate
//! (`scripts/services moto-tls`: TLS in front of the local server, port 5443): `ca=FILE`
//! verifies it, and each way verification must fail fails with its cause before any request.

use idempotency_core::{Access, DynStore, ErrorKind, StoreError};
use idempotency_testkit::tls::{self, file};

/// The HTTPS endpoint, named as its certificate names it.
fn tls_endpoint() -> String {
    std::env::var("AWS_TLS_ENDPOINT_URL").unwrap_or_else(|_| "https://localhost:5443".into())
}

async fn open(url: &str) -> Result<DynStore, StoreError> {
    (idempotency_dynamodb::KIND.open)(url.to_owned(), Access::Create).await
}

fn url(table: &str, endpoint: &str, ca: Option<&str>) -> String {
    let mut url = format!("dynamodb://{table}?region=us-east-1&endpoint={endpoint}");
    if let Some(ca) = ca {
        url.push_str(&format!("&ca={}", file(ca)));
    }
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_https_with_the_ca_the_table_is_made_and_the_protocol_runs() {
    let store = open(&url("tls_records", &tls_endpoint(), Some("ca.pem")))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "the local AWS server over HTTPS at {} is needed (scripts/services moto-tls): {e}",
                tls_endpoint()
            )
        });
    tls::runs_and_replays(&store).await;
}

/// Without `ca` the system's trust store decides, and it does not know the test CA:
/// verification is on by default. Another CA and another name fail too, each with its cause,
/// and none of them creates the table (the server never saw a request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_ca_and_a_wrong_name_are_refused_with_the_cause_before_any_request() {
    let table = "tls_refused_records";
    tls::refused(
        open(&url(table, &tls_endpoint(), None)).await,
        ErrorKind::Unavailable,
        "UnknownIssuer",
    );
    tls::refused(
        open(&url(table, &tls_endpoint(), Some("other-ca.pem"))).await,
        ErrorKind::Unavailable,
        "UnknownIssuer",
    );
    let by_address = tls_endpoint().replace("localhost", "127.0.0.1");
    tls::refused(
        open(&url(table, &by_address, Some("ca.pem"))).await,
        ErrorKind::Unavailable,
        "not valid for name",
    );
    // The plain server behind the TLS front has no such table: no refused attempt made one.
    let plain = std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:5000".into());
    let exists = (idempotency_dynamodb::KIND.open)(url(table, &plain, None), Access::Existing).await;
    tls::refused(exists, ErrorKind::InvalidConfig, "does not exist");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_ca_files_are_refused_when_the_url_is_parsed() {
    let endpoint = tls_endpoint();
    for (ca, cause) in [
        (
            "/nonexistent/ca.pem".to_owned(),
            "ca=/nonexistent/ca.pem: No such file",
        ),
        (file("client.key"), "holds no certificate"),
    ] {
        let url = format!("dynamodb://records?endpoint={endpoint}&ca={ca}");
        tls::refused(open(&url).await, ErrorKind::InvalidConfig, cause);
    }
    let plain = format!(
        "dynamodb://records?endpoint=http://localhost:5000&ca={}",
        file("ca.pem")
    );
    tls::refused(
        open(&plain).await,
        ErrorKind::InvalidConfig,
        "endpoint= is http://",
    );
}

//! `sqs://` URLs: an SQS queue to consume from, as `idem consume --from` and any program with
//! a [`Sources`](idempotency_consumer::source::Sources) registry take it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind};
use idempotency_consumer::source::{
    AnyProcessor, Params, RunFuture, Shutdown, SourceInfo, SourceKind, SourceSettings, strip_scheme,
};

use crate::{BROKER, DeadLetters, SqsMessage, Worker};

/// SQS as a kind of source.
pub const SOURCE: SourceKind = SourceKind {
    name: "sqs",
    schemes: &["sqs"],
    example: "sqs://REGION?queue_url=URL",
    parameters: "REGION                 the region (default: the queue URL's, or the environment's)\n\
                 queue_url=URL          the queue (required)\n\
                 dead_letter_url=URL    where dead letters go (default: the queue's name with -dead beside it)\n\
                 dead_letter=redrive    leave dead letters to the queue's redrive policy instead\n\
                 endpoint=URL           a service outside AWS (default: the queue URL's origin when it is not on AWS)\n\
                 ca=FILE                the CA certificates (PEM) an https:// service is verified against, instead of the system's\n\
                 visibility=30s         the visibility timeout, 1s to 12h, extended every third of it while a handler runs\n\
                 wait=20s               the long poll, 0s (short polling) to 20s\n\
                 credentials come from the environment, as for every AWS tool",
    parse,
    run,
    dead_letters: crate::dead_letters::open,
};

/// Without a long poll, the pause after a receive that found nothing.
const SHORT_POLL_PAUSE: Duration = Duration::from_millis(200);

/// A parsed `sqs://` source.
#[derive(Clone, PartialEq, Eq)]
pub struct SqsSource {
    /// The queue's URL.
    pub queue_url: String,
    /// A dead-letter queue's URL, or `None`: the queue's redrive policy.
    pub dead_letter_url: Option<String>,
    /// The region; the environment's when `None`.
    pub region: Option<String>,
    /// The service endpoint; the SDK's for the region when `None`.
    pub endpoint: Option<String>,
    /// `ca=FILE`: the CA certificates the service is verified against, instead of the system's
    /// trust store.
    pub ca: Option<std::path::PathBuf>,
    /// The visibility timeout.
    pub visibility: Duration,
    /// The long poll; zero for short polling.
    pub wait: Duration,
}

impl fmt::Debug for SqsSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqsSource")
            .field("queue_url", &idempotency_core::redact_url(&self.queue_url))
            .field(
                "dead_letter_url",
                &self.dead_letter_url.as_deref().map(idempotency_core::redact_url),
            )
            .field("region", &self.region)
            .field("endpoint", &self.endpoint)
            .field("ca", &self.ca)
            .field("visibility", &self.visibility)
            .field("wait", &self.wait)
            .finish()
    }
}

impl SqsSource {
    /// Parses `sqs://[REGION]?queue_url=URL[&dead_letter_url=URL | &dead_letter=redrive][&endpoint=URL][&ca=FILE][&visibility=30s][&wait=20s]`.
    ///
    /// ```
    /// use idempotency_sqs::SqsSource;
    ///
    /// let source = SqsSource::from_url("sqs://?queue_url=https://sqs.eu-west-1.amazonaws.com/123456789012/orders")?;
    /// assert_eq!(source.region.as_deref(), Some("eu-west-1"));
    /// assert_eq!(source.dead_letter_url.as_deref(), Some("https://sqs.eu-west-1.amazonaws.com/123456789012/orders-dead"));
    /// # Ok::<(), idempotency_sqs::AdapterError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Config`] saying what is wrong.
    pub fn from_url(url: &str) -> Result<Self, AdapterError> {
        let refuse = |why: String| AdapterError::new(AdapterErrorKind::Config, BROKER, why);
        let rest = strip_scheme(url, "sqs")
            .ok_or_else(|| refuse(format!("not an sqs:// URL; expected {}", SOURCE.example)))?;
        let (region, query) = rest.split_once('?').unwrap_or((rest, ""));
        let region = region.trim_end_matches('/');
        let region_name = |text: &str| {
            !text.is_empty()
                && text.len() <= 32
                && text.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        };
        if !region.is_empty() && !region_name(region) {
            return Err(refuse(format!(
                "`{region}` is not an AWS region: sqs://REGION?queue_url=URL, or sqs://?queue_url=URL for the environment's"
            )));
        }
        let mut params = Params::new(BROKER, query);
        let queue_url = params.take("queue_url").ok_or_else(|| {
            refuse("names no queue: add ?queue_url=https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE".into())
        })?;
        let queue = http_url(&queue_url, "queue_url")?;
        let name = queue
            .path_segments()
            .and_then(|mut segments| segments.rfind(|segment| !segment.is_empty()))
            .map(str::to_owned)
            .ok_or_else(|| refuse("queue_url names no queue: its path ends in the queue's name".into()))?;
        let dead_letter_url = match (params.take("dead_letter_url"), params.take("dead_letter")) {
            (Some(_), Some(_)) => {
                return Err(refuse(
                    "give dead_letter_url=URL or dead_letter=redrive, not both".into(),
                ));
            }
            (None, Some(mode)) if mode == "redrive" => None,
            (None, Some(other)) => {
                return Err(refuse(format!(
                    "dead_letter={other}: the only mode is `redrive` (the queue's redrive policy); a queue is dead_letter_url=URL"
                )));
            }
            (Some(url), None) => {
                http_url(&url, "dead_letter_url")?;
                Some(url)
            }
            (None, None) => {
                // The queue's name with `-dead`, before `.fifo` on a FIFO queue.
                let dead = match name.strip_suffix(".fifo") {
                    Some(stem) => format!("{stem}-dead.fifo"),
                    None => format!("{name}-dead"),
                };
                let mut url = queue.clone();
                url.path_segments_mut()
                    .map_err(|()| refuse("queue_url cannot name a dead-letter queue beside it".into()))?
                    .pop_if_empty()
                    .pop()
                    .push(&dead);
                Some(url.into())
            }
        };
        if dead_letter_url.as_deref() == Some(queue_url.as_str()) {
            return Err(refuse(
                "the dead-letter queue is the queue itself: name another with &dead_letter_url=URL".into(),
            ));
        }
        let endpoint = match params.take("endpoint") {
            Some(endpoint) => {
                http_url(&endpoint, "endpoint")?;
                Some(endpoint)
            }
            // A queue outside AWS (a local server): its own origin is the endpoint.
            None if !is_aws(&queue) => Some(queue.origin().ascii_serialization()),
            None => None,
        };
        let ca = match params.take("ca") {
            Some(path) => {
                let path = std::path::PathBuf::from(path);
                // Checked here; the client that trusts it is built with the worker.
                idempotency_core::pem::read_ca_file(&path)
                    .map_err(|why| refuse(format!("ca={}: {why}", path.display())))?;
                let service = endpoint.clone().unwrap_or_else(|| queue_url.clone());
                if service.starts_with("http://") {
                    return Err(refuse(
                        "ca= verifies an https:// service, and this one is http://".into(),
                    ));
                }
                Some(path)
            }
            None => None,
        };
        let region = match (region, params.take("region")) {
            (_, Some(_)) => {
                return Err(refuse(
                    "the region goes before the `?`: sqs://REGION?queue_url=URL".into(),
                ));
            }
            ("", None) => aws_region(&queue).or_else(|| endpoint.is_some().then(|| "us-east-1".to_owned())),
            (region, None) => Some(region.to_owned()),
        };
        let visibility = params
            .duration(
                "visibility",
                (Duration::from_secs(1), Duration::from_secs(43_200)),
                "must be from 1s to 12h",
            )?
            .unwrap_or(Duration::from_secs(30));
        let wait = params
            .duration(
                "wait",
                (Duration::ZERO, Duration::from_secs(20)),
                "must be from 0s to 20s",
            )?
            .unwrap_or(Duration::from_secs(20));
        params.finish("queue_url, dead_letter_url, dead_letter, endpoint, ca, visibility, wait")?;
        Ok(Self {
            queue_url,
            dead_letter_url,
            region,
            endpoint,
            ca,
            visibility,
            wait,
        })
    }

    /// The queue's name: the last segment of its URL.
    #[must_use]
    pub fn queue_name(&self) -> String {
        crate::queue_name(&self.queue_url).to_string()
    }

    /// A worker on the queue with a client for the source's region and endpoint (credentials
    /// from the environment): its dead letters, visibility and polling as the URL says.
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Config`] when the `ca` file can no longer be used.
    pub async fn worker<P: idempotency_consumer::Processor<SqsMessage> + 'static>(
        &self,
        processor: Arc<P>,
    ) -> Result<Worker<P>, AdapterError> {
        let http_client = match &self.ca {
            Some(ca) => crate::http_client_trusting(ca)?,
            None => crate::http_client(),
        };
        let client =
            crate::client_through(self.endpoint.as_deref(), self.region.as_deref(), http_client).await;
        let dead_letters = match &self.dead_letter_url {
            Some(url) => DeadLetters::Queue(url.clone()),
            None => DeadLetters::RedrivePolicy,
        };
        let worker = Worker::new(client, self.queue_url.clone(), dead_letters, processor)
            .visibility_timeout(self.visibility);
        Ok(if self.wait.is_zero() {
            worker.short_polling(SHORT_POLL_PAUSE)
        } else {
            worker.wait_time(self.wait)
        })
    }
}

/// `text` as an `http://` or `https://` URL with a host.
fn http_url(text: &str, what: &str) -> Result<url::Url, AdapterError> {
    let refuse = |why: String| AdapterError::new(AdapterErrorKind::Config, BROKER, why);
    let url = url::Url::parse(text).map_err(|e| refuse(format!("{what}: not a URL ({e})")))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none_or(str::is_empty) {
        return Err(refuse(format!("{what}: not an http:// or https:// URL")));
    }
    Ok(url)
}

/// Whether `url` is on AWS (its SDK then finds the endpoint itself).
fn is_aws(url: &url::Url) -> bool {
    url.host_str()
        .is_some_and(|host| host.ends_with(".amazonaws.com") || host.ends_with(".amazonaws.com.cn"))
}

/// The region in an AWS queue URL's host (`sqs.REGION.amazonaws.com`, or the older
/// `REGION.queue.amazonaws.com`).
fn aws_region(url: &url::Url) -> Option<String> {
    let host = url.host_str().filter(|_| is_aws(url))?;
    let labels: Vec<&str> = host.split('.').collect();
    match labels.as_slice() {
        ["sqs", region, ..] | [region, "queue", ..] => Some((*region).to_owned()),
        _ => None,
    }
}

fn parse(url: &str) -> Result<SourceInfo, AdapterError> {
    SqsSource::from_url(url).map(|source| SourceInfo::new(source.queue_name()))
}

fn run(url: String, settings: SourceSettings, processor: AnyProcessor, shutdown: Shutdown) -> RunFuture {
    Box::pin(async move {
        let source = SqsSource::from_url(&url)?;
        let worker = source
            .worker(Arc::new(processor))
            .await?
            .name(settings.name)
            .concurrency(settings.concurrency)
            .prefetch(settings.prefetch)
            .batch(settings.batch);
        let unreachable = |why: String| AdapterError::new(AdapterErrorKind::Unreachable, BROKER, why);
        match tokio::time::timeout(settings.start_check, worker.check()).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) if error.is_retryable() => {
                return Err(unreachable(format!("cannot reach SQS: {}", error.message())).with_source(error));
            }
            Ok(Err(error)) => return Err(error),
            Err(_) => {
                return Err(unreachable(format!(
                    "SQS did not answer within {:?}",
                    settings.start_check
                )));
            }
        }
        tracing::info!(queue = %source.queue_name(), "consuming");
        worker.run_until(shutdown).await
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_find_their_endpoint_region_and_dead_letter_queue() {
        let source =
            SqsSource::from_url("sqs://?queue_url=http://127.0.0.1:5000/123456789012/payments").unwrap();
        assert_eq!(source.endpoint.as_deref(), Some("http://127.0.0.1:5000"));
        assert_eq!(source.region.as_deref(), Some("us-east-1"));
        assert_eq!(
            source.dead_letter_url.as_deref(),
            Some("http://127.0.0.1:5000/123456789012/payments-dead")
        );
        assert_eq!(
            (source.visibility, source.wait),
            (Duration::from_secs(30), Duration::from_secs(20))
        );
        assert_eq!(source.queue_name(), "payments");
        let aws = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo";
        let source = SqsSource::from_url(&format!("sqs://?queue_url={aws}&wait=0s&visibility=2m")).unwrap();
        assert_eq!(source.endpoint, None, "the SDK finds AWS's endpoint");
        assert_eq!(source.region.as_deref(), Some("eu-west-1"));
        assert_eq!(
            source.dead_letter_url.as_deref(),
            Some("https://sqs.eu-west-1.amazonaws.com/123456789012/orders-dead.fifo")
        );
        assert_eq!(
            (source.visibility, source.wait),
            (Duration::from_secs(120), Duration::ZERO)
        );
        let source =
            SqsSource::from_url(&format!("sqs://us-east-2?queue_url={aws}&dead_letter=redrive")).unwrap();
        assert_eq!(
            source.region.as_deref(),
            Some("us-east-2"),
            "the URL's region wins"
        );
        assert_eq!(source.dead_letter_url, None, "the redrive policy");
        let old = "https://eu-central-1.queue.amazonaws.com/1/q";
        let source = SqsSource::from_url(&format!("sqs://?queue_url={old}")).unwrap();
        assert_eq!(source.region.as_deref(), Some("eu-central-1"));
    }

    #[test]
    fn urls_are_refused_with_the_reason() {
        for (url, why) in [
            ("sqs://?wait=1s", "names no queue"),
            ("sqs://?queue_url=queue", "queue_url: not a URL"),
            ("sqs://?queue_url=ftp://h/q", "not an http:// or https:// URL"),
            ("sqs://?queue_url=http://127.0.0.1:5000/", "names no queue"),
            ("sqs://eu_west?queue_url=http://h/1/q", "not an AWS region"),
            ("sqs://?queue_url=http://h/1/q&region=x", "the region goes before"),
            (
                "sqs://?queue_url=http://h/1/q&dead_letter=dlq",
                "the only mode is `redrive`",
            ),
            (
                "sqs://?queue_url=http://h/1/q&dead_letter=redrive&dead_letter_url=http://h/1/d",
                "not both",
            ),
            (
                "sqs://?queue_url=http://h/1/q&dead_letter_url=http://h/1/q",
                "the queue itself",
            ),
            ("sqs://?queue_url=http://h/1/q&visibility=0s", "visibility=0s"),
            ("sqs://?queue_url=http://h/1/q&wait=21s", "must be from 0s to 20s"),
            (
                "sqs://?queue_url=http://h/1/q&queue=q",
                "unknown parameter `queue`",
            ),
            (
                "sqs://?queue_url=https://h/1/q&ca=/nonexistent/ca.pem",
                "ca=/nonexistent/ca.pem: No such file",
            ),
            ("amqp://h", "not an sqs:// URL"),
        ] {
            let error = SqsSource::from_url(url).unwrap_err();
            assert_eq!(error.kind(), AdapterErrorKind::Config, "{url}");
            assert!(error.to_string().contains(why), "{url}: {error}");
        }
    }
}

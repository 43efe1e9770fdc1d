//! `amqp://` and `amqps://` URLs: a RabbitMQ queue to consume from, as `idem consume --from`
//! and any program with a [`Sources`](idempotency_consumer::source::Sources) registry take it.

use std::fmt;
use std::sync::Arc;

use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind};
use idempotency_consumer::source::{
    AnyProcessor, RunFuture, Shutdown, SourceInfo, SourceKind, SourceSettings,
};

use crate::{AmqpTls, BROKER, Topology, Worker};

/// RabbitMQ as a kind of source.
pub const SOURCE: SourceKind = SourceKind {
    name: "amqp",
    schemes: &["amqp", "amqps"],
    example: "amqp://USER:PASSWORD@HOST:PORT/VHOST?queue=QUEUE",
    parameters: "queue=QUEUE      the queue (required); QUEUE.retry and QUEUE.dead are declared beside it if missing\n\
                 expires=10m      delete the three queues once unused that long (x-expires), for short-lived environments\n\
                 cacertfile=FILE  amqps: verify the server against this CA (default: the system's trust store)\n\
                 certfile=FILE, keyfile=FILE  amqps: present this client certificate\n\
                 any other        passed on to the client (RabbitMQ's URI parameters, heartbeat=10 …)",
    parse,
    run,
    dead_letters: crate::dead_letters::open,
};

/// A parsed `amqp://` source: the broker's URL and the queue.
#[derive(Clone, PartialEq, Eq)]
pub struct AmqpSource {
    /// The broker URL, without the `queue` parameter.
    pub url: String,
    /// The queue.
    pub queue: String,
    /// Delete the queues once unused this long (`expires=`, RabbitMQ's `x-expires`).
    pub expires: Option<std::time::Duration>,
    /// The TLS files of an `amqps://` URL (`cacertfile`, `certfile`, `keyfile`).
    pub tls: AmqpTls,
}

impl fmt::Debug for AmqpSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpSource")
            .field("url", &idempotency_core::redact_url(&self.url))
            .field("queue", &self.queue)
            .field("expires", &self.expires)
            .field("tls", &self.tls)
            .finish()
    }
}

impl AmqpSource {
    /// Parses `amqp://USER:PASSWORD@HOST:PORT/VHOST?queue=QUEUE` (or `amqps://`); the other
    /// parameters stay in the broker URL.
    ///
    /// ```
    /// use idempotency_amqp::AmqpSource;
    ///
    /// let source = AmqpSource::from_url("amqp://app:s3cret@127.0.0.1:5672/%2f?heartbeat=10&queue=payments")?;
    /// assert_eq!(source.queue, "payments");
    /// assert_eq!(source.url, "amqp://app:s3cret@127.0.0.1:5672/%2f?heartbeat=10");
    /// # Ok::<(), idempotency_amqp::AdapterError>(())
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
            return Err(refuse(format!("not an amqp:// URL; expected {}", SOURCE.example)));
        }
        let mut queue = None;
        let mut expires = None;
        let mut tls = AmqpTls::default();
        let mut rest = Vec::new();
        for (name, value) in parsed.query_pairs() {
            match &*name {
                "queue" => queue = Some(value.into_owned()),
                "expires" => expires = Some(value.into_owned()),
                _ if tls.take(parsed.scheme(), &name, &value)? => {}
                _ => rest.push((name.into_owned(), value.into_owned())),
            }
        }
        tls.check()?;
        if cfg!(not(feature = "tls")) && parsed.scheme() == "amqps" {
            return Err(refuse(
                "amqps:// needs the `tls` feature of idempotency-amqp".into(),
            ));
        }
        let expires = expires
            .map(|text| {
                idempotency_core::units::parse_duration(&text)
                    .ok()
                    .filter(|d| *d >= std::time::Duration::from_millis(1))
                    .ok_or_else(|| refuse(format!("expires={text}: expected a duration such as 10m")))
            })
            .transpose()?;
        let queue = queue
            .filter(|q| !q.is_empty())
            .ok_or_else(|| refuse("names no queue: add ?queue=QUEUE".into()))?;
        if queue.len() > 200 || queue.chars().any(char::is_control) {
            return Err(refuse(format!(
                "the queue name {queue:?} is not one RabbitMQ accepts"
            )));
        }
        if rest.is_empty() {
            parsed.set_query(None);
        } else {
            parsed.query_pairs_mut().clear().extend_pairs(rest);
        }
        Ok(Self {
            url: parsed.into(),
            queue,
            expires,
            tls,
        })
    }

    /// A worker on this queue, its queues declared as [`Topology::for_queue`] does (with
    /// `x-expires` when the URL says `expires=`).
    pub fn worker<P: idempotency_consumer::Processor<crate::AmqpMessage>>(
        &self,
        processor: Arc<P>,
    ) -> Worker<P> {
        let mut topology = Topology::for_queue(&self.queue);
        if let Some(expires) = self.expires {
            topology = topology.expires(expires);
        }
        Worker::new(self.url.clone(), topology, processor).tls(self.tls.clone())
    }

    /// Connects once, so that a wrong address or credentials are a clear error at start rather
    /// than reconnection attempts forever (after a good start, a lost broker is waited for).
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Unreachable`] when the broker did not answer within `timeout` or
    /// refused the connection.
    pub async fn check(&self, timeout: std::time::Duration) -> Result<(), AdapterError> {
        let unreachable = |why: String| AdapterError::new(AdapterErrorKind::Unreachable, BROKER, why);
        let connect = crate::tls::connect(&self.url, &self.tls);
        let connection = tokio::time::timeout(timeout, connect)
            .await
            .map_err(|_| unreachable(format!("the broker did not answer within {timeout:?}")))?
            .map_err(|e| {
                unreachable(format!(
                    "cannot connect to the broker: {}",
                    idempotency_core::redact_url(&e.to_string())
                ))
            })?;
        // The broker answered: its answer to the close does not matter, and may not come.
        let _ = tokio::time::timeout(timeout, connection.close(200, "checked".into())).await;
        Ok(())
    }
}

fn parse(url: &str) -> Result<SourceInfo, AdapterError> {
    AmqpSource::from_url(url).map(|source| SourceInfo::new(source.queue))
}

fn run(url: String, settings: SourceSettings, processor: AnyProcessor, shutdown: Shutdown) -> RunFuture {
    Box::pin(async move {
        let source = AmqpSource::from_url(&url)?;
        source.check(settings.start_check).await?;
        tracing::info!(queue = %source.queue, "consuming");
        source
            .worker(Arc::new(processor))
            .name(settings.name)
            .prefetch(settings.prefetch)
            .concurrency(settings.concurrency)
            .batch(settings.batch)
            .linger(settings.linger)
            .run_until(shutdown)
            .await
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_parsed_and_refused_with_the_reason() {
        let source = AmqpSource::from_url("amqp://h/v?heartbeat=10&queue=q&expires=10m").unwrap();
        assert_eq!(source.url, "amqp://h/v?heartbeat=10");
        assert_eq!(source.expires, Some(std::time::Duration::from_secs(600)));
        let source = AmqpSource::from_url("amqps://app:s3cret@h/%2f?queue=q").unwrap();
        assert_eq!(source.url, "amqps://app:s3cret@h/%2f");
        assert!(!format!("{source:?}").contains("s3cret"));
        for (url, why) in [
            ("amqp://app:s3cret@127.0.0.1/%2f", "names no queue"),
            ("amqp://app:s3cret@127.0.0.1/%2f?queue=", "names no queue"),
            (
                "amqp://app:s3cret@127.0.0.1/%2f?queue=a%00b",
                "not one RabbitMQ accepts",
            ),
            ("not a url", "not a URL"),
            (
                "amqp://h/v?queue=q&expires=soon",
                "expires=soon: expected a duration",
            ),
            ("amqp://h/v?queue=q&expires=0s", "expires=0s: expected a duration"),
        ] {
            let error = AmqpSource::from_url(url).unwrap_err();
            assert_eq!(error.kind(), AdapterErrorKind::Config, "{url}");
            assert!(error.to_string().contains(why), "{url}: {error}");
            assert!(!error.to_string().contains("s3cret"), "{url}: {error}");
        }
    }
}

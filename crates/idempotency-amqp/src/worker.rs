//! A long-running consumer of one queue that survives broker restarts and lost connections.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use std::pin::Pin;

use futures_util::StreamExt;
use futures_util::future::{FutureExt, Shared};
use idempotency_consumer::{Backoff, Processor};
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

use idempotency_consumer::adapter::{AdapterErrorKind, Flow, Pipeline};

use crate::{AdapterError, AmqpMessage, AmqpTls, BROKER, RabbitMq, Topology, amqp};

/// How long a worker's connection set-up may take by default ([`Worker::set_up_timeout`]).
pub const DEFAULT_SET_UP_TIMEOUT: Duration = Duration::from_secs(30);

/// How long closing a channel or a connection may wait for the broker's answer, which a lost
/// connection never sends.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Consumes a queue with a [`Processor`], `prefetch` deliveries handed out at a time and
/// `concurrency` of them processed at once, and reconnects
/// (with backoff) when the connection or the channel is lost.
///
/// Deliveries that were in flight when the connection went are redelivered by the broker; the
/// record makes the ones that completed duplicates, acked without running again.
///
/// ```no_run
/// use std::sync::Arc;
/// use idempotency_amqp::{Topology, Worker};
/// # async fn example<P: idempotency_consumer::Processor<idempotency_amqp::AmqpMessage>>(
/// #     processor: P,
/// #     shutdown: impl Future<Output = ()> + Send,
/// # ) -> Result<(), idempotency_amqp::AdapterError> {
/// let worker = Worker::new("amqp://guest:guest@127.0.0.1:5672/%2f", Topology::for_queue("payments"), Arc::new(processor))
///     .prefetch(32);
/// worker.run_until(shutdown).await?; // SIGTERM, say: stop taking messages, settle the running ones
/// # Ok(())
/// # }
/// ```
pub struct Worker<P> {
    url: String,
    topology: Topology,
    processor: Arc<P>,
    flow: Flow,
    reconnect: Backoff,
    set_up_timeout: Duration,
    tls: AmqpTls,
}

impl<P> fmt::Debug for Worker<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("url", &idempotency_core::redact_url(&self.url))
            .field("topology", &self.topology)
            .field("flow", &self.flow)
            .field("reconnect", &self.reconnect)
            .field("set_up_timeout", &self.set_up_timeout)
            .finish_non_exhaustive()
    }
}

impl<P: Processor<AmqpMessage>> Worker<P> {
    /// A worker on the broker at `url` (an `amqp://` URL) for `topology`. Defaults: prefetch 16,
    /// batches of up to [`DEFAULT_BATCH`](idempotency_consumer::DEFAULT_BATCH) (at most the
    /// prefetch) lingering [`DEFAULT_LINGER`](idempotency_consumer::DEFAULT_LINGER),
    /// reconnection backoff from 100 ms doubling to 5 s, set-up timeout
    /// [`DEFAULT_SET_UP_TIMEOUT`].
    pub fn new(url: impl Into<String>, topology: Topology, processor: Arc<P>) -> Self {
        Self {
            url: url.into(),
            topology,
            processor,
            flow: Flow::default(),
            tls: AmqpTls::default(),
            reconnect: Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_secs(5),
            },
            set_up_timeout: DEFAULT_SET_UP_TIMEOUT,
        }
    }

    idempotency_consumer::flow_setters! {
        messages: "deliveries",
        name: "the queue's name",
        concurrency: "How many deliveries are processed at the same time (by default, the \
                      prefetch: more could never be running, since the broker hands out no more).",
        prefetch: "How many unacknowledged deliveries the broker hands out at once (the \
                   channel's QoS, at most 65,535; default 16): fetched ahead of processing.",
    }

    /// The TLS files of an `amqps://` URL (a private CA, a client certificate); without them
    /// the system's trust store verifies the server. [`AmqpSource::from_url`](crate::AmqpSource::from_url)
    /// reads them from the URL's `cacertfile`, `certfile` and `keyfile`.
    #[must_use]
    pub fn tls(mut self, tls: AmqpTls) -> Self {
        self.tls = tls;
        self
    }

    /// The wait between reconnection attempts.
    #[must_use]
    pub fn reconnect(mut self, backoff: Backoff) -> Self {
        self.reconnect = backoff;
        self
    }

    /// How long connecting, declaring the topology and starting to consume may take before the
    /// attempt counts as failed and the worker reconnects (default
    /// [`DEFAULT_SET_UP_TIMEOUT`]): it bounds a broker (or a load balancer in front of it)
    /// that accepts the connection and then does not answer.
    #[must_use]
    pub fn set_up_timeout(mut self, timeout: Duration) -> Self {
        self.set_up_timeout = timeout;
        self
    }

    /// The channel's QoS: the prefetch set, at most 65,535, or 16.
    fn qos(&self) -> u16 {
        self.flow
            .prefetch
            .map_or(16, |prefetch| u16::try_from(prefetch).unwrap_or(u16::MAX))
    }

    /// The worker's name: set with [`name`](Self::name), or the queue's.
    fn consumer_name(&self) -> String {
        self.flow.name_or(&self.topology.queue)
    }

    /// Consumes until `shutdown` completes, then stops taking deliveries, lets the running ones
    /// settle and closes the connection.
    ///
    /// # Errors
    ///
    /// [`AdapterError`] when the first connection's topology is refused (for example a queue
    /// exists with other arguments): a configuration error that retrying cannot mend. Lost
    /// connections are not errors; the worker reconnects.
    pub async fn run_until<F>(&self, shutdown: F) -> Result<(), AdapterError>
    where
        F: Future<Output = ()> + Send,
    {
        let shutdown = Box::pin(shutdown).shared();
        let mut failures = 0_u32;
        let mut first = true;
        loop {
            let session = self.session(&shutdown).await;
            if shutdown.peek().is_some() {
                return Ok(());
            }
            match session {
                Ok(()) => failures = 0,
                Err(Session::Refused(error)) if first => return Err(error),
                Err(Session::Refused(error) | Session::Lost(error)) => {
                    failures = failures.saturating_add(1);
                    tracing::warn!(queue = %self.topology.queue, %error, "RabbitMQ connection failed");
                }
            }
            first = false;
            metrics::counter!("idempotency_amqp_reconnects_total", "queue" => self.topology.queue.clone())
                .increment(1);
            let wait = if failures == 0 {
                self.reconnect.initial
            } else {
                self.reconnect.delay(failures)
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = shutdown.clone() => return Ok(()),
            }
        }
    }

    /// One connection's life: connect, declare, consume until the connection ends or `shutdown`.
    async fn session<F: Future<Output = ()> + Send>(
        &self,
        shutdown: &Shared<Pin<Box<F>>>,
    ) -> Result<(), Session> {
        // Until deliveries flow, nothing is in flight: a shutdown may simply drop the set-up.
        let set_up = tokio::select! {
            set_up = self.set_up() => set_up?,
            () = shutdown.clone() => return Ok(()),
        };
        let (connection, channel, deliveries) = set_up;
        tracing::info!(queue = %self.topology.queue, prefetch = self.qos(), "consuming");
        let pipeline = Pipeline::new(
            RabbitMq::new(channel.clone(), self.topology.clone()),
            self.consumer_name(),
        );
        let lost = std::sync::Mutex::new(None);
        let deliveries = deliveries
            .take_until(shutdown.clone())
            // A consumer stream does not always end when the socket drops: watch the connection.
            .take_until(disconnected(&connection))
            .take_while(|delivery| {
                if let Err(error) = delivery {
                    *lost.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                        Some(amqp(AdapterErrorKind::Lost, "consuming")(error.clone()));
                }
                std::future::ready(delivery.is_ok())
            })
            .filter_map(|delivery| std::future::ready(delivery.ok().map(AmqpMessage::new)))
            // Boxed: the combinators' closures otherwise keep the future from being proved
            // `Send` for every lifetime.
            .boxed();
        let prefetch = usize::from(self.qos());
        let concurrency = self.flow.concurrency.unwrap_or(prefetch);
        // A failed settlement is logged, counted and handed back by the pipeline; the broker
        // delivers it again, and the record decides again.
        pipeline
            .run(&*self.processor, deliveries, &self.flow, prefetch, concurrency)
            .await;
        let connected = connection.status().connected();
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, channel.close(200, "consumer stopping".into())).await;
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, connection.close(200, "consumer stopping".into())).await;
        match lost
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            Some(error) => Err(Session::Lost(error)),
            None if !connected => Err(Session::Lost(AdapterError::new(
                AdapterErrorKind::Lost,
                BROKER,
                "the connection was lost",
            ))),
            None => Ok(()),
        }
    }

    /// Connects, declares the topology and starts consuming, within the
    /// [set-up timeout](Self::set_up_timeout): a broker that accepts the connection and then
    /// does not answer makes the attempt fail, and the worker tries again.
    ///
    /// Only a declaration the broker refused is [`Session::Refused`]; a connection lost
    /// between two declarations is [`Session::Lost`], even on the first attempt.
    async fn set_up(&self) -> Result<(Connection, Channel, lapin::Consumer), Session> {
        let deadline = tokio::time::Instant::now() + self.set_up_timeout;
        let timed_out = || {
            Session::Lost(AdapterError::new(
                AdapterErrorKind::Unreachable,
                BROKER,
                format!(
                    "connecting to {} and setting up took longer than {:?}",
                    idempotency_core::redact_url(&self.url),
                    self.set_up_timeout
                ),
            ))
        };
        let connection = tokio::time::timeout_at(deadline, crate::tls::connect(&self.url, &self.tls))
            .await
            .map_err(|_| timed_out())?
            .map_err(|e| {
                let what = format!("connecting to {}", idempotency_core::redact_url(&self.url));
                Session::Lost(amqp(AdapterErrorKind::Unreachable, &what)(e))
            })?;
        let steps = async {
            let lost = |what| move |e| Session::Lost(amqp(AdapterErrorKind::Lost, what)(e));
            let channel = connection
                .create_channel()
                .await
                .map_err(lost("opening a channel"))?;
            self.topology.declare(&channel).await.map_err(|error| {
                if error.kind() == AdapterErrorKind::Refused {
                    Session::Refused(error)
                } else {
                    Session::Lost(error)
                }
            })?;
            channel
                .basic_qos(self.qos(), BasicQosOptions::default())
                .await
                .map_err(lost("setting the prefetch"))?;
            let deliveries = channel
                .basic_consume(
                    self.topology.queue.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(lost("starting to consume"))?;
            Ok((channel, deliveries))
        };
        let steps = tokio::time::timeout_at(deadline, steps).await;
        match steps.unwrap_or_else(|_| Err(timed_out())) {
            Ok((channel, deliveries)) => Ok((connection, channel, deliveries)),
            Err(error) => {
                // Dropped, a lapin connection stays open: one more on the broker per attempt.
                let closing = connection.close(200, "set-up failed".into());
                let _ = tokio::time::timeout(CLOSE_TIMEOUT, closing).await;
                Err(error)
            }
        }
    }
}

/// How a connection's life ended, when it ended badly.
enum Session {
    /// The broker refused the topology.
    Refused(AdapterError),
    /// The connection failed or was lost.
    Lost(AdapterError),
}

/// Resolves once `connection` is no longer connected (lost, errored or closed).
async fn disconnected(connection: &Connection) {
    while connection.status().connected() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

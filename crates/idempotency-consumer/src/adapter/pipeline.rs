//! The per-message [`Pipeline`] every broker's worker runs a message through, and the batches
//! and flow a worker's fetch loop hands it.

use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use futures_util::stream::FuturesOrdered;
use futures_util::{FutureExt, StreamExt};

use super::broker::{AdapterError, AdapterErrorKind, Broker, DEFAULT_SETTLE_TIMEOUT, PANIC_RETRY};
use crate::{Decisions, Disposition, Processor};

/// The batches a worker of independent messages (RabbitMQ, JetStream) hands
/// [`Pipeline::process_batch`]: the items of `stream` grouped as they arrive, a batch handed
/// once it holds `most` items or `linger` after its first arrived, whichever comes first (a lone
/// message waits no longer than `linger`), and what is left when the stream ends.
pub fn batches<S: futures_util::Stream>(
    stream: S,
    most: usize,
    linger: Duration,
) -> impl futures_util::Stream<Item = Vec<S::Item>> {
    tokio_stream::StreamExt::chunks_timeout(stream, most.max(1), linger)
}

/// How a worker of independent messages (RabbitMQ, JetStream) runs `concurrency` messages at
/// once in batches of at most `batch` ([`batches`], [`Pipeline::process_batch`]): the size of a
/// batch and how many batches are in flight at once.
///
/// A batch holds at most half of `concurrency`, so that two batches (or more) are in flight
/// whenever two messages may be: while one waits for the store (its claims in one round trip,
/// its outcomes in another), the other's handlers run and its acknowledgements go out, and the
/// broker, which hands out no more than its prefetch of unacknowledged messages, keeps
/// delivering. One batch of the whole concurrency at a time left the store and the broker
/// waiting on each other in turn (`docs/BENCHMARKS.md`, "Consumers: with the guard vs
/// without"). Never more than `concurrency` messages are in process; a plan of size 1 means
/// each message is decided on its own, `concurrency` at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPlan {
    /// The most messages a batch holds.
    pub size: usize,
    /// How many batches are decided at the same time.
    pub in_flight: usize,
}

impl BatchPlan {
    /// The plan for `concurrency` messages at once in batches of at most `batch` (both at
    /// least 1).
    #[must_use]
    pub fn new(batch: usize, concurrency: usize) -> Self {
        let concurrency = concurrency.max(1);
        let size = batch.max(1).min((concurrency / 2).max(1));
        Self {
            size,
            in_flight: concurrency / size,
        }
    }
}

/// How a worker takes messages in: the knobs every broker's worker is tuned by, under one
/// vocabulary (`docs/CONSUMERS.md`). A worker keeps its `Flow` in a field named `flow` and gets
/// its setters from [`flow_setters!`](crate::flow_setters), so that the knobs read and behave
/// alike on every broker; what `None` means (the broker's default) is the worker's to say.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Flow {
    /// The name the metrics and logs carry (`consumer`); the worker's default when `None`.
    pub name: Option<String>,
    /// How many messages are processed at once.
    pub concurrency: Option<usize>,
    /// How many fetched messages may wait ahead of processing.
    pub prefetch: Option<usize>,
    /// How many messages are decided together (at least 1).
    pub batch: usize,
    /// How long a batch waits for more messages when fewer than `batch` arrived.
    pub linger: Duration,
}

impl Default for Flow {
    /// No name, concurrency or prefetch of its own; batches of up to
    /// [`DEFAULT_BATCH`](crate::DEFAULT_BATCH) lingering [`DEFAULT_LINGER`](crate::DEFAULT_LINGER).
    fn default() -> Self {
        Self {
            name: None,
            concurrency: None,
            prefetch: None,
            batch: crate::DEFAULT_BATCH,
            linger: crate::DEFAULT_LINGER,
        }
    }
}

impl Flow {
    /// The worker's name: the one set, or `default`.
    #[must_use]
    pub fn name_or(&self, default: &str) -> String {
        self.name.clone().unwrap_or_else(|| default.to_owned())
    }

    /// The [`BatchPlan`] for `concurrency` messages at once when `prefetch` are fetched ahead:
    /// a batch never waits for more than one fetch can hand out.
    #[must_use]
    pub fn plan(&self, prefetch: usize, concurrency: usize) -> BatchPlan {
        BatchPlan::new(self.batch.min(prefetch), concurrency)
    }
}

/// Writes the [`Flow`] setters of a worker whose `flow` field holds them: `name`,
/// `concurrency`, `prefetch`, `batch` and `linger`, documented once for every broker that
/// decides its messages in overlapping batches ([`BatchPlan`]). The worker says what its
/// messages are called, whose name it carries by default and what concurrency and prefetch
/// mean on its broker.
///
/// ```
/// use idempotency_consumer::adapter::Flow;
///
/// /// A worker.
/// pub struct Worker {
///     flow: Flow,
/// }
///
/// impl Worker {
///     idempotency_consumer::flow_setters! {
///         messages: "messages",
///         name: "the queue's name",
///         concurrency: "How many messages are handled at once (default 16).",
///         prefetch: "How many messages are fetched ahead (default: the concurrency).",
///     }
/// }
///
/// let worker = Worker { flow: Flow::default() }.name("orders").concurrency(0).batch(8);
/// assert_eq!(worker.flow.name.as_deref(), Some("orders"));
/// assert_eq!(worker.flow.concurrency, Some(1));
/// assert_eq!(worker.flow.plan(16, 32).size, 8);
/// ```
#[macro_export]
macro_rules! flow_setters {
    (
        messages: $messages:literal,
        name: $name:literal,
        concurrency: $concurrency:literal,
        prefetch: $prefetch:literal $(,)?
    ) => {
        #[doc = concat!("The name the metrics and logs carry (`consumer`); ", $name, " by default.")]
        #[must_use]
        pub fn name(mut self, name: impl Into<String>) -> Self {
            self.flow.name = Some(name.into());
            self
        }

        #[doc = $concurrency]
        #[must_use]
        pub fn concurrency(mut self, concurrency: usize) -> Self {
            self.flow.concurrency = Some(concurrency.max(1));
            self
        }

        #[doc = $prefetch]
        #[must_use]
        pub fn prefetch(mut self, prefetch: usize) -> Self {
            self.flow.prefetch = Some(prefetch.max(1));
            self
        }

        #[doc = concat!(
                    "How many ", $messages, " are decided together (default [`DEFAULT_BATCH`](",
                    "idempotency_consumer::DEFAULT_BATCH), at most the prefetch): the processor claims ",
                    "their keys in one store round trip and records their outcomes in one more ",
                    "([`Processor::process_many`](idempotency_consumer::Processor::process_many)), each ",
                    "acked once its own outcome is recorded. A nack, a dead letter or a panic of one ",
                    "never changes another's. `1` decides each on its own. ",
                    "[`concurrency`](Self::concurrency) ", $messages, " are processed at once, in ",
                    "batches of this size and of at most half the concurrency, so that two batches ",
                    "overlap ([`BatchPlan`](idempotency_consumer::adapter::BatchPlan): one waits for the ",
                    "store while the other's handlers and acks run)."
                )]
        #[must_use]
        pub fn batch(mut self, size: usize) -> Self {
            self.flow.batch = size.max(1);
            self
        }

        #[doc = concat!(
                    "How long a batch waits for more ", $messages, " when fewer than ",
                    "[`batch`](Self::batch) arrived (default [`DEFAULT_LINGER`](",
                    "idempotency_consumer::DEFAULT_LINGER)): a lone one is not delayed longer than this."
                )]
        #[must_use]
        pub fn linger(mut self, linger: ::std::time::Duration) -> Self {
            self.flow.linger = linger;
            self
        }
    };
}

/// The per-message pipeline of one worker; see the [module docs](crate::adapter).
pub struct Pipeline<B> {
    broker: B,
    consumer: String,
    settle_timeout: Duration,
    metrics: Metrics,
}

impl<B: Broker> fmt::Debug for Pipeline<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pipeline")
            .field("broker", &B::NAME)
            .field("consumer", &self.consumer)
            .field("settle_timeout", &self.settle_timeout)
            .finish_non_exhaustive()
    }
}

/// The pipeline's metrics, registered once.
struct Metrics {
    acked: metrics::Counter,
    nacked: metrics::Counter,
    dead_lettered: metrics::Counter,
    failed: metrics::Counter,
    settle_duration: metrics::Histogram,
    keep_alive_ok: metrics::Counter,
    keep_alive_failed: metrics::Counter,
    panics: metrics::Counter,
}

impl Metrics {
    fn new(consumer: &str, broker: &'static str) -> Self {
        let labels = [("consumer", consumer.to_owned()), ("broker", broker.to_owned())];
        let with = |name: &'static str, result: &'static str| {
            let mut labels = labels.to_vec();
            labels.push(("result", result.to_owned()));
            metrics::counter!(name, &labels)
        };
        Self {
            acked: with("idempotency_consumer_settled_total", "acked"),
            nacked: with("idempotency_consumer_settled_total", "nacked"),
            dead_lettered: with("idempotency_consumer_settled_total", "dead_lettered"),
            failed: with("idempotency_consumer_settled_total", "failed"),
            settle_duration: metrics::histogram!("idempotency_consumer_settle_duration_seconds", &labels),
            keep_alive_ok: with("idempotency_consumer_keep_alives_total", "ok"),
            keep_alive_failed: with("idempotency_consumer_keep_alives_total", "failed"),
            panics: metrics::counter!("idempotency_consumer_processor_panics_total", &labels),
        }
    }
}

impl<B: Broker> Pipeline<B> {
    /// The pipeline of the worker named `consumer` (the metrics' `consumer` label) on `broker`.
    pub fn new(broker: B, consumer: impl Into<String>) -> Self {
        let consumer = consumer.into();
        Self {
            metrics: Metrics::new(&consumer, B::NAME),
            broker,
            consumer,
            settle_timeout: DEFAULT_SETTLE_TIMEOUT,
        }
    }

    /// How long a settlement may take before it is given up (10 s by default).
    #[must_use]
    pub fn settle_timeout(mut self, timeout: Duration) -> Self {
        self.settle_timeout = timeout;
        self
    }

    /// The broker.
    pub fn broker(&self) -> &B {
        &self.broker
    }

    /// The worker's name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// What to do with `message`: `processor`'s answer, or a nack after [`PANIC_RETRY`] if it
    /// panicked. The broker's hold on the message is renewed while the processor runs.
    pub async fn decide<P: Processor<B::Message>>(&self, processor: &P, message: &B::Message) -> Disposition {
        let work = async {
            std::panic::AssertUnwindSafe(processor.process(message))
                .catch_unwind()
                .await
                .unwrap_or_else(|_| self.panicked())
        };
        self.keeping_alive(&[message], work).await
    }

    /// Decides a batch of `messages` that arrived together, in their order, handing each
    /// disposition to `decided` as soon as it is final ([`Processor::process_many`]): at least
    /// one for a non-empty batch, and after a panic of the processor a nack after
    /// [`PANIC_RETRY`] of the first message it had not decided. The broker's hold on every
    /// message of the batch is renewed while the processor runs.
    pub async fn decide_many<P: Processor<B::Message>>(
        &self,
        processor: &P,
        messages: &[&B::Message],
        decided: &Decisions,
    ) {
        if messages.is_empty() {
            return;
        }
        let work = async {
            let finished = std::panic::AssertUnwindSafe(processor.process_many(messages, decided))
                .catch_unwind()
                .await;
            if finished.is_err() && decided.count() < messages.len() {
                decided.send(self.panicked());
            } else if decided.count() == 0 && !decided.is_closed() {
                tracing::error!(
                    consumer = %self.consumer,
                    broker = B::NAME,
                    "the message processor decided none of a batch; its first message comes back"
                );
                decided.send(Disposition::Nack { after: PANIC_RETRY });
            }
        };
        self.keeping_alive(messages, work).await;
    }

    /// The answer for a processor that panicked, counted and logged.
    fn panicked(&self) -> Disposition {
        self.metrics.panics.increment(1);
        tracing::error!(
            consumer = %self.consumer,
            broker = B::NAME,
            "the message processor panicked; the message comes back"
        );
        Disposition::Nack { after: PANIC_RETRY }
    }

    /// Runs `work`, renewing the broker's hold on each of `messages` at its interval meanwhile.
    async fn keeping_alive<T>(&self, messages: &[&B::Message], work: impl Future<Output = T>) -> T {
        let Some(every) = self.broker.keep_alive_every() else {
            return work.await;
        };
        let every = every.max(Duration::from_millis(10));
        let keep_alive = async {
            let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                for message in messages {
                    match self.broker.keep_alive(message).await {
                        Ok(()) => self.metrics.keep_alive_ok.increment(1),
                        Err(error) => {
                            self.metrics.keep_alive_failed.increment(1);
                            tracing::warn!(consumer = %self.consumer, %error, "keeping the message's hold alive failed");
                        }
                    }
                }
            }
        };
        tokio::select! {
            done = work => done,
            never = keep_alive => never,
        }
    }

    /// Carries `disposition` out on `message` within the settle timeout, and counts it.
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Settle`] when the broker refused the settlement or it did not finish
    /// in time: the message was not acknowledged and comes back ([`Broker::give_back`] has been
    /// called).
    pub async fn settle(&self, message: &B::Message, disposition: &Disposition) -> Result<(), AdapterError> {
        let started = Instant::now();
        let settled = tokio::time::timeout(self.settle_timeout, self.broker.settle(message, disposition))
            .await
            .unwrap_or_else(|_| {
                Err(AdapterError::new(
                    AdapterErrorKind::Settle,
                    B::NAME,
                    format!(
                        "a settlement did not finish within {:?}; the message comes back",
                        self.settle_timeout
                    ),
                ))
            });
        self.metrics
            .settle_duration
            .record(started.elapsed().as_secs_f64());
        match &settled {
            Ok(()) => match disposition {
                Disposition::Ack => self.metrics.acked.increment(1),
                Disposition::Nack { .. } => self.metrics.nacked.increment(1),
                Disposition::DeadLetter { reason } => {
                    self.metrics.dead_lettered.increment(1);
                    tracing::warn!(consumer = %self.consumer, broker = B::NAME, %reason, "dead-lettered");
                }
            },
            Err(error) => {
                self.metrics.failed.increment(1);
                tracing::warn!(
                    consumer = %self.consumer,
                    broker = B::NAME,
                    %error,
                    "settlement failed; the message comes back, and the record answers it"
                );
                let given_back = tokio::time::timeout(self.settle_timeout, self.broker.give_back(message));
                if given_back.await.is_err() {
                    tracing::warn!(
                        consumer = %self.consumer,
                        broker = B::NAME,
                        "handing the message back did not finish within the settle timeout; the broker brings it back when the connection goes"
                    );
                }
            }
        }
        settled.map_err(|error| error.into_kind(AdapterErrorKind::Settle))
    }

    /// Decides and settles every message of `messages`, a batch of independent messages that
    /// arrived together (RabbitMQ's prefetch window, a JetStream fetch, an SQS receive):
    /// [`decide_many`](Self::decide_many) with an [unordered](Decisions::unordered) sink, each
    /// disposition settled as soon as it is handed over (so each ack after its outcome is
    /// recorded), the settlements running at once. Messages the processor left undecided (it
    /// panicked) are decided again, until every one is settled. Answers, in the batch's order,
    /// what [`process`](Self::process) answers for each: the disposition carried out, or the
    /// settlement's failure (logged, counted, and the message handed back).
    pub async fn process_batch<P: Processor<B::Message>>(
        &self,
        processor: &P,
        messages: &[&B::Message],
    ) -> Vec<Result<Disposition, AdapterError>> {
        let mut answers = Vec::with_capacity(messages.len());
        let mut rest = messages;
        while !rest.is_empty() {
            let (decided, mut dispositions) = Decisions::unordered();
            // The sink is dropped once the processor is done: the receiver then ends with what
            // was handed.
            let deciding = async move { self.decide_many(processor, rest, &decided).await };
            tokio::pin!(deciding);
            let mut settling: FuturesOrdered<BoxFuture<'_, Result<Disposition, AdapterError>>> =
                FuturesOrdered::new();
            let (mut done, mut received) = (false, 0);
            loop {
                tokio::select! {
                    () = &mut deciding, if !done => done = true,
                    Some(disposition) = dispositions.recv() => {
                        if let Some(message) = rest.get(received) {
                            settling.push_back(Box::pin(async move {
                                self.settle(message, &disposition).await.map(|()| disposition)
                            }));
                        }
                        received += 1;
                    }
                    Some(answer) = settling.next(), if !settling.is_empty() => answers.push(answer),
                    else => break,
                }
            }
            // `decide_many` hands at least one disposition for a non-empty batch.
            rest = &rest[received.clamp(1, rest.len())..];
        }
        answers
    }

    /// [`decide`](Self::decide), then [`settle`](Self::settle); returns the disposition carried
    /// out.
    ///
    /// # Errors
    ///
    /// As [`settle`](Self::settle).
    pub async fn process<P: Processor<B::Message>>(
        &self,
        processor: &P,
        message: &B::Message,
    ) -> Result<Disposition, AdapterError> {
        let disposition = self.decide(processor, message).await;
        self.settle(message, &disposition).await?;
        Ok(disposition)
    }

    /// Runs every message of `messages` through the pipeline until the stream ends, as a worker
    /// of independent messages (RabbitMQ, JetStream) does: `concurrency` at once with `prefetch`
    /// fetched ahead, each on its own ([`process`](Self::process)) when `flow`'s
    /// [`plan`](Flow::plan) has batches of one, otherwise in batches gathered for at most
    /// `flow.linger` ([`batches`]) with `plan.in_flight` of them decided at the same time
    /// ([`process_batch`](Self::process_batch)). A failed settlement is logged and counted
    /// here; the message comes back, and the record answers it.
    pub async fn run<P, S>(
        &self,
        processor: &P,
        messages: S,
        flow: &Flow,
        prefetch: usize,
        concurrency: usize,
    ) where
        P: Processor<B::Message>,
        S: futures_util::Stream<Item = B::Message> + Send,
    {
        let plan = flow.plan(prefetch, concurrency);
        if plan.size <= 1 {
            messages
                .for_each_concurrent(concurrency, |message| async move {
                    let _ = self.process(processor, &message).await;
                })
                .await;
        } else {
            batches(messages, plan.size, flow.linger)
                .for_each_concurrent(plan.in_flight, |messages| async move {
                    let messages: Vec<&B::Message> = messages.iter().collect();
                    self.process_batch(processor, &messages).await;
                })
                .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::super::broker::retry_set_up;
    use super::*;
    use crate::Delivery;

    struct Message;

    impl Delivery for Message {
        fn header(&self, _: &str) -> Option<&[u8]> {
            None
        }
        fn message_id(&self) -> Option<&str> {
            None
        }
        fn payload(&self) -> &[u8] {
            b""
        }
        fn delivery_count(&self) -> u32 {
            1
        }
    }

    /// A broker that records what it was asked (and what it was given back), and settles slowly
    /// or fails when told to.
    #[derive(Default)]
    struct Fake {
        keep_alive: Option<Duration>,
        kept_alive: AtomicU32,
        settled: Mutex<Vec<Disposition>>,
        settle_takes: Duration,
        refuse: bool,
        give_back_takes: Duration,
        given_back: AtomicU32,
    }

    impl Broker for Fake {
        type Message = Message;
        const NAME: &'static str = "fake";

        fn keep_alive_every(&self) -> Option<Duration> {
            self.keep_alive
        }

        async fn keep_alive(&self, _: &Message) -> Result<(), AdapterError> {
            self.kept_alive.fetch_add(1, Ordering::SeqCst);
            if self.refuse {
                return Err(AdapterError::new(
                    AdapterErrorKind::Lost,
                    "fake",
                    "the channel closed",
                ));
            }
            Ok(())
        }

        async fn settle(&self, _: &Message, disposition: &Disposition) -> Result<(), AdapterError> {
            tokio::time::sleep(self.settle_takes).await;
            if self.refuse {
                return Err(AdapterError::new(
                    AdapterErrorKind::Lost,
                    "fake",
                    "the channel closed",
                ));
            }
            self.settled.lock().unwrap().push(disposition.clone());
            Ok(())
        }

        async fn give_back(&self, _: &Message) {
            tokio::time::sleep(self.give_back_takes).await;
            self.given_back.fetch_add(1, Ordering::SeqCst);
        }
    }

    struct Answer(Duration, Option<Disposition>);

    impl Processor<Message> for Answer {
        async fn process(&self, _: &Message) -> Disposition {
            tokio::time::sleep(self.0).await;
            self.1.clone().expect("a processor that panics")
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_panicking_processor_is_a_nack_and_the_hold_is_kept_alive_while_it_runs() {
        let pipeline = Pipeline::new(
            Fake {
                keep_alive: Some(Duration::from_secs(10)),
                ..Fake::default()
            },
            "tests",
        );
        let processed = pipeline
            .process(&Answer(Duration::from_secs(35), None), &Message)
            .await
            .unwrap();
        assert_eq!(processed, Disposition::Nack { after: PANIC_RETRY });
        assert_eq!(pipeline.broker().kept_alive.load(Ordering::SeqCst), 3);
        assert_eq!(
            *pipeline.broker().settled.lock().unwrap(),
            [Disposition::Nack { after: PANIC_RETRY }]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_settlement_that_fails_or_hangs_is_a_settle_error() {
        let hangs = Pipeline::new(
            Fake {
                settle_takes: Duration::from_secs(3600),
                ..Fake::default()
            },
            "tests",
        )
        .settle_timeout(Duration::from_secs(5));
        let error = hangs
            .process(&Answer(Duration::ZERO, Some(Disposition::Ack)), &Message)
            .await
            .unwrap_err();
        assert_eq!(error.kind(), AdapterErrorKind::Settle);
        assert!(
            error
                .to_string()
                .starts_with("fake: a settlement did not finish within 5s"),
            "{error}"
        );
        assert_eq!(hangs.broker().given_back.load(Ordering::SeqCst), 1, "handed back");
        let refused = Pipeline::new(
            Fake {
                refuse: true,
                ..Fake::default()
            },
            "tests",
        );
        let error = refused.settle(&Message, &Disposition::Ack).await.unwrap_err();
        assert_eq!(error.kind(), AdapterErrorKind::Settle);
        assert!(error.is_retryable());
        assert_eq!(error.to_string(), "fake: the channel closed");
        assert_eq!(
            refused.broker().given_back.load(Ordering::SeqCst),
            1,
            "handed back"
        );
        assert!(
            refused
                .process(&Answer(Duration::ZERO, Some(Disposition::Ack)), &Message)
                .await
                .is_err()
        );
        assert_eq!(
            refused.broker().given_back.load(Ordering::SeqCst),
            2,
            "handed back"
        );
    }

    /// A broker that answers neither the settlement nor the hand-back after it (a connection
    /// that hangs): both are given up within the settle timeout each, and the pipeline answers,
    /// so that the worker goes on to notice the loss and connect again.
    #[tokio::test(start_paused = true)]
    async fn a_hand_back_that_hangs_is_abandoned_within_the_settle_timeout() {
        let hangs = Pipeline::new(
            Fake {
                settle_takes: Duration::from_secs(3600),
                give_back_takes: Duration::from_secs(3600),
                ..Fake::default()
            },
            "tests",
        )
        .settle_timeout(Duration::from_secs(5));
        let answered =
            tokio::time::timeout(Duration::from_secs(60), hangs.settle(&Message, &Disposition::Ack)).await;
        let error = answered
            .expect("the pipeline answered while the broker hung")
            .unwrap_err();
        assert_eq!(error.kind(), AdapterErrorKind::Settle);
        assert_eq!(hangs.broker().given_back.load(Ordering::SeqCst), 0, "abandoned");
    }

    /// Every pipeline metric, each provoked by its event: settlements by result and their
    /// duration, keep-alives that worked and failed, a processor's panic.
    #[test]
    fn a_plan_keeps_two_batches_in_flight_within_the_concurrency() {
        for (batch, concurrency, size, in_flight) in [
            (64, 16, 8, 2),
            (64, 64, 32, 2),
            (64, 128, 64, 2),
            (64, 200, 64, 3),
            (10, 100, 10, 10),
            (64, 3, 1, 3),
            (64, 2, 1, 2),
            (64, 1, 1, 1),
            (64, 0, 1, 1),
            (1, 64, 1, 64),
            (0, 64, 1, 64),
            (5, 11, 5, 2),
        ] {
            let plan = BatchPlan::new(batch, concurrency);
            assert_eq!(
                (plan.size, plan.in_flight),
                (size, in_flight),
                "batch {batch}, concurrency {concurrency}"
            );
            assert!(plan.size * plan.in_flight <= concurrency.max(1), "{plan:?}");
        }
    }

    #[test]
    fn every_pipeline_metric_moves_when_its_event_happens() {
        let recorded = idempotency_testkit::recorded::record_metrics_paused(async {
            let pipeline = Pipeline::new(Fake::default(), "counted");
            for disposition in [
                Disposition::Ack,
                Disposition::Ack,
                Disposition::Nack {
                    after: Duration::ZERO,
                },
                Disposition::DeadLetter { reason: "r".into() },
            ] {
                pipeline.settle(&Message, &disposition).await.unwrap();
            }
            let refused = Pipeline::new(
                Fake {
                    refuse: true,
                    keep_alive: Some(Duration::from_secs(10)),
                    ..Fake::default()
                },
                "counted",
            );
            // 25 s of a processor that panics: two keep-alives, both refused, then a failed
            // settlement of its nack.
            assert!(
                refused
                    .process(&Answer(Duration::from_secs(25), None), &Message)
                    .await
                    .is_err()
            );
            let kept = Pipeline::new(
                Fake {
                    keep_alive: Some(Duration::from_secs(10)),
                    ..Fake::default()
                },
                "counted",
            );
            let answer = Answer(Duration::from_secs(15), Some(Disposition::Ack));
            assert_eq!(kept.process(&answer, &Message).await.unwrap(), Disposition::Ack);
        });
        let labels = |result| [("consumer", "counted"), ("broker", "fake"), ("result", result)];
        for (result, count) in [("acked", 3), ("nacked", 1), ("dead_lettered", 1), ("failed", 1)] {
            let settled = recorded.counter("idempotency_consumer_settled_total", &labels(result));
            assert_eq!(settled, count, "{result}");
        }
        let keep_alives =
            |result| recorded.counter("idempotency_consumer_keep_alives_total", &labels(result));
        assert_eq!((keep_alives("ok"), keep_alives("failed")), (1, 2));
        let pipeline = [("consumer", "counted"), ("broker", "fake")];
        assert_eq!(
            recorded.counter("idempotency_consumer_processor_panics_total", &pipeline),
            1
        );
        assert_eq!(
            recorded.histogram_count("idempotency_consumer_settle_duration_seconds", &pipeline),
            6
        );
    }

    fn unreachable() -> AdapterError {
        AdapterError::new(AdapterErrorKind::Unreachable, "fake", "no answer")
    }

    #[test]
    fn a_set_up_is_tried_again_while_it_may_pass_and_the_failures_are_counted() {
        let backoff = crate::Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(4),
        };
        let attempts = AtomicU32::new(0);
        let recorded = idempotency_testkit::recorded::record_metrics_paused(async {
            let started = tokio::time::Instant::now();
            let found = retry_set_up("setting-up", "fake", backoff, std::future::pending(), || {
                let n = attempts.fetch_add(1, Ordering::SeqCst) + 1;
                std::future::ready(if n < 4 { Err(unreachable()) } else { Ok(n) })
            })
            .await;
            assert_eq!(found.unwrap().unwrap(), 4);
            // 1 s, 2 s, then 4 s between the attempts.
            assert_eq!(started.elapsed(), Duration::from_secs(7));
        });
        let labels = [("consumer", "setting-up"), ("broker", "fake")];
        assert_eq!(
            recorded.counter("idempotency_consumer_set_up_failures_total", &labels),
            3
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_set_up_is_returned_at_once() {
        let attempts = AtomicU32::new(0);
        let found: Option<Result<(), _>> = retry_set_up(
            "refused",
            "fake",
            crate::Backoff::default(),
            std::future::pending(),
            || {
                attempts.fetch_add(1, Ordering::SeqCst);
                std::future::ready(Err(AdapterError::new(
                    AdapterErrorKind::Refused,
                    "fake",
                    "no such stream",
                )))
            },
        )
        .await;
        assert_eq!(found.unwrap().unwrap_err().kind(), AdapterErrorKind::Refused);
        assert_eq!(attempts.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_shutdown_ends_a_set_up_that_waits_or_hangs() {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async {
            let _ = stopped.await;
        };
        let attempts = AtomicU32::new(0);
        let setting_up = retry_set_up("stopped", "fake", crate::Backoff::default(), shutdown, || {
            // The first attempt fails, the second never answers.
            let n = attempts.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    Err(unreachable())
                } else {
                    std::future::pending::<Result<(), AdapterError>>().await
                }
            }
        });
        let stopping = async {
            while attempts.load(Ordering::SeqCst) < 2 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            stop.send(()).unwrap();
        };
        let (found, ()) = tokio::join!(setting_up, stopping);
        assert!(found.is_none());
    }
}

//! `idem demo consume`: the payments service of `idem demo` fed from a message broker that
//! delivers at least once, through `idem consume`'s own consumer (the record, the lease,
//! ack after record, dead letters) on the embedded SQLite store.
//!
//! The broker is simulated in the process, so the demo needs no server, and it misbehaves the
//! way real ones do: a producer that publishes a payment again after a timeout (copies of one
//! message), acks that are lost on the way back (the message is delivered again, as RabbitMQ
//! does after a dropped channel or SQS after its visibility timeout), and a key reused with
//! another payment. The service still fails now and then before and after charging, and is
//! slow sometimes: its calls time out, are released and run again as attempt 2 while the first
//! may still charge. The provider's ledger counts the double charges.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use idempotency::Watched;
use idempotency_consumer::{Consumer, Delivery, Disposition, Processor};
use rand::RngExt;
use serde_json::json;
use tokio::sync::Notify;

use super::{Upstream, charge, serve};
use crate::consume::{Call, HttpHandler};
use crate::error::Error;
use crate::units::format_duration;

/// One in this many acks is lost: the broker delivers the message again.
const LOST_ACKS: u32 = 20;

/// How long the consumer waits for the service's answer: the service's slow calls (150 to
/// 300 ms) outlive it now and then.
const HANDLER_TIMEOUT: Duration = Duration::from_millis(250);

/// The consumer's name: its records' scope.
const SCOPE: &str = "demo-consume";

/// The lease of a running call: a call whose answer was lost is taken over within a second.
const LEASE: Duration = Duration::from_secs(1);

/// What `idem demo consume` is asked to do.
#[derive(Debug, Clone)]
pub struct Options {
    /// Payments published (each as one or more messages).
    pub payments: usize,
    /// The store URL; `None`: a fresh SQLite file in a temporary directory.
    pub store: Option<String>,
    /// Messages handled at once.
    pub concurrency: usize,
    /// Feed the service straight from the broker, acking what it answers 2xx, without the
    /// record: what redeliveries do on their own.
    pub direct: bool,
    /// Whether the service passes the message's `Idempotency-Key` on to its payment provider.
    pub propagate: bool,
}

/// A message as the simulated broker delivers it.
#[derive(Debug, Clone)]
struct Message {
    /// The broker's id of this copy.
    id: String,
    key: String,
    payload: Vec<u8>,
    deliveries: u32,
}

impl Delivery for Message {
    fn header(&self, name: &str) -> Option<&[u8]> {
        if name.eq_ignore_ascii_case(idempotency_consumer::IDEMPOTENCY_KEY_HEADER) {
            Some(self.key.as_bytes())
        } else if name.eq_ignore_ascii_case("content-type") {
            Some(b"application/json")
        } else {
            None
        }
    }

    fn message_id(&self) -> Option<&str> {
        Some(&self.id)
    }

    fn payload(&self) -> &[u8] {
        &self.payload
    }

    fn delivery_count(&self) -> u32 {
        self.deliveries
    }
}

/// The simulated broker: a queue delivered at least once.
#[derive(Debug, Default)]
struct Broker {
    queue: Mutex<VecDeque<Message>>,
    ready: Notify,
    /// Messages published and not yet settled (acked or dead-lettered).
    unsettled: AtomicU64,
    deliveries: AtomicU64,
    acked: AtomicU64,
    lost_acks: AtomicU64,
    redelivered: AtomicU64,
    dead_letters: Mutex<Vec<String>>,
}

impl Broker {
    fn publish(&self, message: Message) {
        self.unsettled.fetch_add(1, Ordering::SeqCst);
        self.push(message);
    }

    fn push(&self, message: Message) {
        self.queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(message);
        self.ready.notify_one();
    }

    /// The next message, or `None` once every message is settled.
    async fn next(&self) -> Option<Message> {
        loop {
            let notified = self.ready.notified();
            if let Some(mut message) = self
                .queue
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop_front()
            {
                message.deliveries += 1;
                self.deliveries.fetch_add(1, Ordering::Relaxed);
                return Some(message);
            }
            if self.unsettled.load(Ordering::SeqCst) == 0 {
                return None;
            }
            notified.await;
        }
    }

    /// Carries out a consumer's decision on `message`.
    fn settle(self: &Arc<Self>, message: Message, disposition: Disposition) {
        match disposition {
            Disposition::Ack if rand::rng().random_ratio(1, LOST_ACKS) => {
                // The ack never reaches the broker: the message comes back.
                self.lost_acks.fetch_add(1, Ordering::Relaxed);
                self.redeliver(message, Duration::from_millis(50));
            }
            Disposition::Ack => self.done(|broker| broker.acked.fetch_add(1, Ordering::Relaxed)),
            Disposition::Nack { after } => self.redeliver(message, after),
            Disposition::DeadLetter { reason } => self.done(|broker| {
                let mut dead = broker.dead_letters.lock().unwrap_or_else(PoisonError::into_inner);
                dead.push(format!("{}: {reason}", message.key));
            }),
        }
    }

    fn redeliver(self: &Arc<Self>, message: Message, after: Duration) {
        self.redelivered.fetch_add(1, Ordering::Relaxed);
        let broker = Arc::clone(self);
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            broker.push(message);
        });
    }

    fn done<T>(&self, count: impl FnOnce(&Self) -> T) {
        count(self);
        if self.unsettled.fetch_sub(1, Ordering::SeqCst) == 1 {
            // The last one: every consumer task waiting (each made its `Notified` before it
            // looked) sees that nothing is left.
            self.ready.notify_waiters();
        }
    }
}

/// Without the record: the service called for every delivery, the message acked when it
/// answered 2xx, delivered again otherwise.
struct Direct(HttpHandler);

impl Processor<Message> for Direct {
    async fn process(&self, message: &Message) -> Disposition {
        // Every delivery is a new attempt: nothing remembers the earlier ones.
        let call = Call {
            key: &message.key,
            scope: SCOPE,
            number: message.deliveries,
        };
        match self.0.call(message, &call).await {
            Ok(_) => Disposition::Ack,
            Err(error) if error.is_fatal() => Disposition::DeadLetter {
                reason: error.to_string(),
            },
            Err(_) => Disposition::Nack {
                after: Duration::from_millis(100),
            },
        }
    }
}

/// The outcome of `idem demo consume`.
#[derive(Debug, Clone)]
pub struct Report {
    /// The store the consumer ran on (password redacted); `None` without the record.
    pub store: Option<String>,
    /// Payments published.
    pub payments: u64,
    /// Messages published: the payments, their copies and the reused keys.
    pub messages: u64,
    /// Deliveries the broker made (redeliveries included).
    pub deliveries: u64,
    /// Acks the broker did not get (the message was delivered again).
    pub lost_acks: u64,
    /// Messages acked.
    pub acked: u64,
    /// Messages dead-lettered, with the reasons.
    pub dead_letters: Vec<String>,
    /// Whether the service passed the key on to the provider.
    pub propagated: bool,
    /// Calls of the service that went as far as charging.
    pub executions: u64,
    /// Of those, calls with `Idempotency-Attempt` 2 or more.
    pub re_executions: u64,
    /// Calls that charged and then failed (a 500, a dropped connection).
    pub faults_after_charging: u64,
    /// Charges the provider made.
    pub charges: u64,
    /// Charges beyond the first for one payment, from the provider's ledger.
    pub double_charges: u64,
    /// How long it took.
    pub elapsed: Duration,
}

impl Report {
    /// The report as JSON.
    #[must_use]
    pub fn to_json(&self) -> serde_json::Value {
        json!({
            "store": self.store,
            "through_consumer": self.store.is_some(),
            "payments": self.payments,
            "messages_published": self.messages,
            "deliveries": self.deliveries,
            "lost_acks": self.lost_acks,
            "acked": self.acked,
            "dead_letters": self.dead_letters,
            "key_propagated": self.propagated,
            "service_executions": self.executions,
            "re_executions": self.re_executions,
            "faults_after_charging": self.faults_after_charging,
            "charges": self.charges,
            "double_charges": self.double_charges,
            "elapsed_ms": self.elapsed.as_secs_f64() * 1000.0,
        })
    }

    /// The report as a table.
    #[must_use]
    pub fn to_table(&self) -> String {
        let mut rows = vec![
            vec!["payments".into(), self.payments.to_string()],
            vec![
                "messages published (copies included)".into(),
                self.messages.to_string(),
            ],
            vec!["deliveries by the broker".into(), self.deliveries.to_string()],
            vec!["acks lost (delivered again)".into(), self.lost_acks.to_string()],
            vec!["messages acked".into(), self.acked.to_string()],
            vec!["dead letters".into(), self.dead_letters.len().to_string()],
        ];
        rows.extend(super::ledger_rows(
            "service",
            [
                self.executions,
                self.re_executions,
                self.faults_after_charging,
                self.charges,
                self.double_charges,
            ],
        ));
        let route = match &self.store {
            Some(store) => format!("through idem consume's consumer on {store}"),
            None => "straight to the service, without the record".to_owned(),
        };
        let mut out = format!(
            "idem demo consume: {} payments, {} messages, {} deliveries {route} in {}\n\n",
            self.payments,
            self.messages,
            self.deliveries,
            format_duration(Duration::from_millis(
                u64::try_from(self.elapsed.as_millis()).unwrap_or(u64::MAX)
            ))
        );
        out.push_str(&crate::ops::table(&["", ""], &rows));
        if !self.dead_letters.is_empty() {
            out.push_str("\nDead letters (first 5):\n");
            for letter in self.dead_letters.iter().take(5) {
                out.push_str(&format!("  {letter}\n"));
            }
        }
        if !self.propagated {
            out.push_str(
                "\nThe service did not pass the Idempotency-Key on to the provider: a call that timed \
                 out or failed after charging and ran again charged again. Pass it on, and the \
                 provider deduplicates them.\n",
            );
        }
        out
    }
}

/// Runs the demo: the service, the broker, the consumer (unless `direct`), and the report from
/// the provider's ledger.
///
/// # Errors
///
/// The store cannot be opened, or a local listener cannot be bound.
pub async fn run(options: Options) -> Result<Report, Error> {
    let (store_url, _temp) = super::demo_store(options.store.as_deref())?;
    let service = Arc::new(Upstream {
        propagate: options.propagate,
        ..Upstream::default()
    });
    let addr = serve(
        Router::new()
            .route("/charges", post(charge))
            .with_state(Arc::clone(&service)),
    )
    .await?;
    let to = http::Uri::try_from(format!("http://{addr}/charges"))
        .map_err(|e| Error::Demo(format!("the service's address is not a URL: {e}")))?;
    let concurrency = options.concurrency.max(1);
    let tls = crate::tls::client_config(&crate::tls::ClientFiles::default())?;
    let handler = HttpHandler::new(to, HANDLER_TIMEOUT, "payments".into(), concurrency, &tls);
    let broker = Arc::new(Broker::default());
    let messages = publish(&broker, options.payments);
    let started = Instant::now();
    if options.direct {
        drain(&broker, Arc::new(Direct(handler)), concurrency).await;
    } else {
        let store = idempotency::open_with(&store_url, idempotency::Access::Create)
            .await
            .map_err(|e| Error::open(&store_url, e))?;
        let consumer = Consumer::new(SCOPE, Watched::new(store), handler)
            .lease(LEASE)
            .max_deliveries(8);
        drain(&broker, Arc::new(consumer), concurrency).await;
    }
    let elapsed = started.elapsed();
    let (charges, double_charges) = service.provider.charges();
    let count = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    Ok(Report {
        store: (!options.direct).then(|| idempotency::redact_url(&store_url)),
        payments: options.payments as u64,
        messages,
        deliveries: count(&broker.deliveries),
        lost_acks: count(&broker.lost_acks),
        acked: count(&broker.acked),
        dead_letters: broker
            .dead_letters
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone(),
        propagated: options.propagate,
        executions: count(&service.executions),
        re_executions: count(&service.re_executions),
        faults_after_charging: count(&service.faults_after_charging),
        charges,
        double_charges,
        elapsed,
    })
}

/// Publishes the payments: each once, a quarter of them again (the producer retried after a
/// timeout), one in fifty a third time, and one in fifty followed by another payment under
/// the same key (dead-lettered by the record: the key was used with another payload). Returns
/// how many messages were published.
fn publish(broker: &Broker, payments: usize) -> u64 {
    let mut published = 0;
    let mut rng = rand::rng();
    let mut copy = |n: usize, key: &str, amount: i64| {
        published += 1;
        broker.publish(Message {
            id: format!("m-{n}-{published}"),
            key: key.to_owned(),
            payload: json!({ "amount_cents": amount, "currency": "EUR" })
                .to_string()
                .into_bytes(),
            deliveries: 0,
        });
    };
    for n in 0..payments {
        let key = format!("payment-{n}");
        let amount = 1000 + i64::try_from(n % 500).unwrap_or(0);
        copy(n, &key, amount);
        if rng.random_ratio(1, 4) {
            copy(n, &key, amount);
        }
        if rng.random_ratio(1, 50) {
            copy(n, &key, amount);
        }
    }
    // Another payment under a key already used: after the others, so the first one is there.
    for n in (0..payments).step_by(50) {
        copy(n, &format!("payment-{n}"), 1);
    }
    published
}

/// Runs `concurrency` consumer tasks until every message is settled.
async fn drain<P: Processor<Message> + Send + Sync + 'static>(
    broker: &Arc<Broker>,
    processor: Arc<P>,
    concurrency: usize,
) {
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (broker, processor) = (Arc::clone(broker), Arc::clone(&processor));
            tokio::spawn(async move {
                while let Some(message) = broker.next().await {
                    let disposition = processor.process(&message).await;
                    broker.settle(message, disposition);
                }
            })
        })
        .collect();
    for task in tasks {
        let _ = task.await;
    }
}

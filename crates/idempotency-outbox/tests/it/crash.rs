//! The outbox relay and an inbox worker fed from RabbitMQ run as child processes and are each
//! killed with SIGKILL 20 times, at random points, while 2,000 messages flow from the outbox
//! through RabbitMQ into the inbox. Afterwards every message has exactly one ledger row (the
//! ledger has no unique constraint, so a double would show), none is missing, and nothing is
//! left pending anywhere.

use crate::common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{LedgerHandler, fresh, ledger_counts, pool};
use idempotency_amqp::Topology;
use idempotency_outbox::{
    AmqpPublisher, Inbox, InboxReceiver, InboxWorker, Outbox, OutgoingMessage, Relay, Tables, inbox_stats,
    outbox_stats,
};
use idempotency_testkit::eventually;
use lapin::{Connection, ConnectionProperties};
use rand::RngExt;

const ROLE: &str = "IDEM_OUTBOX_CRASH_ROLE";

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// What a child needs to know, passed in its environment.
struct Setup {
    tables: Tables,
    inbox_table: String,
    outbox_table: String,
    ledger: String,
    queue: String,
}

impl Setup {
    fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).unwrap();
        let (inbox_table, outbox_table) = (var("IDEM_CRASH_INBOX"), var("IDEM_CRASH_OUTBOX"));
        Self {
            tables: Tables::default()
                .schema(common::SCHEMA)
                .unwrap()
                .inbox(&inbox_table)
                .unwrap()
                .outbox(&outbox_table)
                .unwrap(),
            inbox_table,
            outbox_table,
            ledger: var("IDEM_CRASH_LEDGER"),
            queue: var("IDEM_CRASH_QUEUE"),
        }
    }

    fn spawn(&self, role: &str) -> Child {
        Command::new(std::env::current_exe().unwrap())
            .args([
                &format!("crash::{role}_process"),
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, role)
            .env("IDEM_CRASH_INBOX", &self.inbox_table)
            .env("IDEM_CRASH_OUTBOX", &self.outbox_table)
            .env("IDEM_CRASH_LEDGER", &self.ledger)
            .env("IDEM_CRASH_QUEUE", &self.queue)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start a child process")
    }
}

/// Runs `body` forever when this binary was started as `role`; returns at once otherwise.
fn child(role: &str, body: impl AsyncFnOnce(Setup)) {
    if std::env::var(ROLE).as_deref() != Ok(role) {
        return;
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(body(Setup::from_env()));
}

#[test]
#[ignore = "helper: the relay process the crash test starts"]
fn relay_process() {
    child("relay", async |setup| {
        let pool = pool().await;
        let relay = Relay::new(
            pool,
            Outbox::new(setup.tables),
            AmqpPublisher::new(amqp_url(), ""),
        )
        .name("crash")
        .batch(50)
        .poll(Duration::from_millis(100));
        relay.run_until(std::future::pending()).await.unwrap();
    });
}

#[test]
#[ignore = "helper: the inbox process the crash test starts"]
fn inbox_process() {
    child("inbox", async |setup| {
        let pool = pool().await;
        let inbox = Inbox::new(pool, setup.tables, "crash").unwrap();
        let receiving = idempotency_amqp::Worker::new(
            amqp_url(),
            Topology::for_queue(&setup.queue),
            Arc::new(InboxReceiver::new(inbox.clone())),
        );
        let working = InboxWorker::new(inbox, Arc::new(LedgerHandler { ledger: setup.ledger }))
            .workers(2)
            .poll(Duration::from_millis(100));
        let (received, worked) = tokio::join!(
            receiving.run_until(std::future::pending()),
            working.run_until(std::future::pending())
        );
        received.unwrap();
        worked.unwrap();
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_inbox_killed_twenty_times_each_lose_nothing_and_double_nothing() {
    let pool = pool().await;
    let (tables, ledger) = fresh(&pool).await;
    let qualified = tables.qualified_inbox();
    let inbox_table = qualified.rsplit('.').next().unwrap().to_owned();
    let outbox_table = tables.qualified_outbox().rsplit('.').next().unwrap().to_owned();
    let queue = format!("crash-{outbox_table}");
    // The queue exists before the first publish: the default exchange drops what it cannot route.
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("RabbitMQ at {} is needed for this test: {e}", amqp_url()));
    let channel = connection.create_channel().await.unwrap();
    let topology = Topology::for_queue(&queue);
    topology.declare(&channel).await.unwrap();
    let setup = Setup {
        tables: tables.clone(),
        inbox_table,
        outbox_table,
        ledger: ledger.clone(),
        queue: queue.clone(),
    };
    let mut relay = setup.spawn("relay");
    let mut inbox = setup.spawn("inbox");

    let outbox = Outbox::new(tables.clone());
    let enqueueing = async {
        for batch in 0..100 {
            let mut tx = pool.begin().await.unwrap();
            for n in 0..20 {
                let message =
                    OutgoingMessage::new(&queue, format!("order-{}", n % 7), format!("event {batch}/{n}"));
                outbox.enqueue(&mut tx, &message).await.unwrap();
            }
            tx.commit().await.unwrap();
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
    };
    let killing = async {
        for kill in 0..40 {
            let pause = rand::rng().random_range(50..400);
            tokio::time::sleep(Duration::from_millis(pause)).await;
            let victim = if kill % 2 == 0 { &mut relay } else { &mut inbox };
            victim.kill().unwrap();
            victim.wait().unwrap();
            *victim = setup.spawn(if kill % 2 == 0 { "relay" } else { "inbox" });
        }
    };
    tokio::join!(enqueueing, killing);

    eventually(Duration::from_secs(180), "every message handled", || {
        let (pool, tables, ledger) = (pool.clone(), tables.clone(), ledger.clone());
        async move {
            let outbox = outbox_stats(&pool, &tables).await.unwrap();
            let inbox = inbox_stats(&pool, &tables, Some("crash")).await.unwrap();
            outbox.pending == 0 && inbox.pending == 0 && ledger_counts(&pool, &ledger).await.1 == 2000
        }
    })
    .await;
    // A last look after the pipeline has been quiet: nothing arrives late.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for child in [&mut relay, &mut inbox] {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    assert_eq!(
        ledger_counts(&pool, &ledger).await,
        (2000, 2000),
        "(rows, distinct keys)"
    );
    let inbox = inbox_stats(&pool, &tables, Some("crash")).await.unwrap();
    assert_eq!((inbox.pending, inbox.dead, inbox.processed), (0, 0, 2000));
    for name in [&topology.queue, &topology.retry_queue, &topology.dead_queue] {
        let _ = channel
            .queue_delete(
                name.as_str().into(),
                lapin::options::QueueDeleteOptions::default(),
            )
            .await;
    }
}

//! The payments example: the API and the charger in one process.
//!
//! ```sh
//! scripts/services                      # PostgreSQL and RabbitMQ on loopback
//! cargo run -p payments-example         # API on 127.0.0.1:3000, 2 charger workers
//! ```
//!
//! Environment: `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`), `AMQP_URL`
//! (default `amqp://guest:guest@127.0.0.1:5672/%2f`), `LISTEN` (default `127.0.0.1:3000`),
//! `WORKERS` (default 2). See README.md for what to try.
#![allow(clippy::print_stdout)] // telling the user where it listens is the point

use std::sync::Arc;

use idempotency_amqp::{Topology, Worker};
use idempotency_postgres::{PostgresOptions, PostgresStore};
use payments_example::{Charger, Gateway, Publisher, QUEUE};

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let database = env_or("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let broker = env_or("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let listen = env_or("LISTEN", "127.0.0.1:3000");
    let workers: usize = env_or("WORKERS", "2")
        .parse()
        .map_err(|e| format!("WORKERS must be a number: {e}"))?;

    let store =
        PostgresStore::connect_with(PostgresOptions::from_url(&database)?.table("payment_keys")?).await?;
    payments_example::create_charges_table(store.pool(), "charges").await?;

    let topology = Topology::for_queue(QUEUE);
    let connection = lapin::Connection::connect(&broker, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    topology.declare(&channel).await?;

    let gateway = Arc::new(Gateway::new(std::time::Duration::from_millis(20)));
    let consumer = Arc::new(payments_example::charger(
        store.clone(),
        Charger::new(Arc::clone(&gateway), "charges"),
    ));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut running = Vec::new();
    for _ in 0..workers {
        let worker = Worker::new(broker.clone(), topology.clone(), Arc::clone(&consumer));
        let mut stopped = stopped.clone();
        running.push(tokio::spawn(async move {
            worker
                .run_until(async move {
                    let _ = stopped.wait_for(|stop| *stop).await;
                })
                .await
        }));
    }

    let api = payments_example::api(
        store,
        Publisher {
            channel,
            queue: topology.queue.clone(),
        },
    );
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("payments API on http://{listen}, {workers} charger workers on queue {QUEUE}");
    axum::serve(listener, api)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    let _ = stop.send(true);
    for worker in running {
        worker.await??;
    }
    println!("stopped; the gateway made {} charges", gateway.charges());
    Ok(())
}

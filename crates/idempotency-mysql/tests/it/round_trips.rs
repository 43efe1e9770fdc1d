//! A statement through the store costs the server what the statement alone costs: the store's
//! connections go back to its pool without a ping. (sqlx's pool sent `COM_PING` on every
//! connection it took back, a second round trip for each statement: a replay cost twice its
//! read.) Counted in bytes on the wire, which no timing changes.

use crate::common;

use std::time::Duration;

use idempotency_core::{BeginRequest, Fingerprint, Key, Scope};
use idempotency_mysql::sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlPoolOptions};
use idempotency_mysql::sqlx::{self, AssertSqlSafe, Connection};
use idempotency_mysql::{MysqlStore, Operation};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_sends_the_server_exactly_what_its_read_alone_sends() {
    let store = common::fresh_store().await;
    let scope = Scope::new("wire").unwrap();
    let key = Key::new("paid").unwrap();
    let request = BeginRequest::new(scope.clone(), key.clone(), Fingerprint::of_bytes(b"a"));
    idempotency_testkit::completed(&store, &request, "charged").await;

    let proxy = common::start_proxy().await;
    // One connection: with a ping on release, each begin would wait for the previous one's.
    let through = common::proxied(&store, &proxy, 1).await;
    // The same read on a bare connection through the same proxy: no pool at all.
    let options: MySqlConnectOptions = common::database_url().parse().unwrap();
    let mut bare = MySqlConnection::connect_with(&options.host("127.0.0.1").port(proxy.addr().port()))
        .await
        .unwrap();
    let peek = store.sql(Operation::Peek);
    idempotency_testkit::a_replay_costs_its_read(&through, &request, &proxy, async || {
        sqlx::query(AssertSqlSafe(peek.to_owned()))
            .bind(scope.as_str())
            .bind(key.as_str())
            .fetch_one(&mut bare)
            .await
            .unwrap();
    })
    .await;
}

/// A connection whose statement was abandoned mid-way (the caller's future dropped) is closed,
/// not handed to the next caller with an answer still on its way; the next caller gets a new
/// connection and the right answer. So is one whose statement failed. The metrics say so.
#[test]
fn a_connection_left_mid_statement_or_failed_is_replaced_not_reused() {
    idempotency_testkit::replaced_when_abandoned_or_failed("mysql", async || {
        let store = common::fresh_store().await;
        let proxy = common::start_proxy().await;
        let through = common::proxied_waiting(&store, &proxy, 1, Duration::from_secs(30)).await;
        (through, proxy)
    });
}

/// A connection older than the pool's `max_lifetime` is closed when the next operation
/// would take it, and that operation opens a new one, as sqlx's own pool does.
#[test]
fn a_connection_past_the_pools_lifetime_is_replaced() {
    idempotency_testkit::replaced_past_lifetime("mysql", async |lifetime| {
        let store = common::fresh_store().await;
        let proxy = common::start_proxy().await;
        let options = common::proxied_options(&store, &proxy).max_connections(1);
        let pool = MySqlPoolOptions::new()
            .max_connections(1)
            .max_lifetime(lifetime)
            .connect_lazy_with(options.connect.clone());
        (MysqlStore::from_pool(pool, &options), proxy)
    });
}

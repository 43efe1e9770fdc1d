//! The server goes away mid-run (`idempotency_testkit::outage`): the store reaches PostgreSQL
//! through a loopback proxy that cuts every connection and refuses new ones for 1.5 s; every
//! key still completes once, through the guard and in same-transaction mode
//! (`idempotency_testkit::sql_outage_suite`).

use crate::common;

use idempotency_postgres::PostgresStore;
use idempotency_testkit::TcpProxy;

/// A store on a table of its own that reaches the server through `proxy`.
async fn proxied_store(proxy: &TcpProxy) -> PostgresStore {
    common::proxied(&common::fresh_store().await, proxy, 8).await
}

idempotency_testkit::sql_outage_suite!(common::Sql, common::start_proxy, proxied_store);

//! Same-transaction mode against the real server (`idempotency_testkit::same_transaction`):
//! the record and the business rows commit together or not at all, on the test kit's charges
//! table in PostgreSQL's SQL (`common::Sql`).

use crate::common;

idempotency_testkit::same_transaction_suite!(
    common::fresh_store(),
    idempotency_testkit::sql::Charges::<common::Sql>::new()
);

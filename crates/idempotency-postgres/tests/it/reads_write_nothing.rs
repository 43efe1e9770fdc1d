//! A `begin` that finds a completed record, a live in-flight one or another payload reads and
//! writes nothing: it answers while another transaction holds the row locked (the claiming
//! upsert it used to run first locked the row even when it changed nothing, so it waited).

use crate::common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_conflicts_and_mismatches_answer_while_the_row_is_locked() {
    let store = common::fresh_store().await;
    idempotency_testkit::sql::reads_answer_while_the_rows_are_locked::<common::Sql>(&store).await;
}

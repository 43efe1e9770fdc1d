//! The Redis idempotency store, on a single server or a Redis Cluster.
//!
//! * **One atomic script per operation, on one key.** `begin`, `complete`, `release`, `extend`
//!   and `get` are Lua scripts run with `EVALSHA` (reloaded transparently after `NOSCRIPT`). Each
//!   touches only the record's own key, so each is atomic on a single server and on a cluster.
//!   There is no check-then-act window between a read and a write.
//! * **Batching, when asked for** (`redis://host:6379?batch=on`, single server only): `begin`s
//!   (and `complete`s) issued while two script calls are on the wire go out together as one call
//!   of a batch script, which runs the same function for each key in turn, so each key gets the
//!   answer it would have got alone. A lone call is sent at once; nothing waits for company. The
//!   histogram `idempotency_redis_batch_size` (label `op`) shows how many rode together. It
//!   saves Redis CPU (the fixed cost of a script call, about a third of a `begin`'s) where Redis
//!   is the bottleneck: 1.16–1.20× the one-call-per-operation cycles at 64 callers in the store
//!   benchmark. It costs the caller a hop through a dispatcher task and limits the calls on the
//!   wire, so where the client's CPU is the bottleneck it is slower: the `idem serve` gateway
//!   measured 0.68× the new keys per second with it. By default (`batch=off`), and always on a
//!   cluster (the keys of one script must share a slot), each call is its own script, pipelined
//!   on the multiplexed connection.
//! * **Fencing.** `complete`, `release` and `extend` compare the caller's token in the script. A
//!   stale worker whose lease was taken over cannot overwrite the newer attempt's outcome nor
//!   delete its record. Recipes that end with an unconditional `SET` of the result do exactly
//!   that.
//! * **Server time.** Scripts read `TIME`; leases and retention never depend on the callers'
//!   clocks. The record key expires at the record's expiry (`PEXPIREAT`), so expired records
//!   vanish by themselves and [`purge_expired`](idempotency_core::StoreAdmin::purge_expired) has
//!   nothing to do.
//! * **Safe to retry.** The connection manager reconnects in the background, but a command whose
//!   reply was lost is not re-sent for you, on a single server or a cluster: it fails with a
//!   retryable error, and the caller, who holds the token, decides. A repeated `begin` or
//!   `complete` with the same token gets the first answer again; a repeated `release` finds the
//!   lease gone and answers `LeaseLost`, which is why the client library's own re-sending is off.
//!   Only a command the cluster refused without running it (`MOVED`, `ASK`, `TRYAGAIN`,
//!   `CLUSTERDOWN`, while slots move or a failover settles) is sent again, at most twice.
//! * **Readable for operators.** The key is the prefix plus 32 hex digits of a hash of the scope
//!   and key, so every record has one key of bounded length in any cluster slot. The value is a
//!   hash that keeps the raw scope and key (`HGETALL idem:…`).
//! * **Inspection cost.** `stats` and `list` scan every record key (`SCAN MATCH prefix*` on each
//!   master, then a read of each record): O(records) work, meant for operators, not for request
//!   paths.
//!
//! # Durability: what a payments user should run
//!
//! A record is only as durable as the server's persistence:
//!
//! * **No persistence** (the default of many installs, and of this project's test server): a
//!   restart forgets every record. A late duplicate (a client retry, a redelivered message)
//!   arriving after the restart runs again: a double charge.
//! * **`appendonly yes` with `appendfsync everysec`**: a crash of the server process loses
//!   nothing. A power loss or OS crash can lose the last second of records; duplicates of those
//!   run again.
//! * **`appendonly yes` with `appendfsync always`**: every write is fsynced before the reply, so
//!   no acknowledged record is lost. Throughput is bound by the disk.
//!
//! Payments and anything else where one duplicate costs money: run `appendfsync always`. On a
//! cluster, also run with replicas and `min-replicas-to-write`, since a failover loses writes a
//! replica had not received. Or keep the idempotency record in the same PostgreSQL transaction as
//! the charge (`idempotency-postgres`, same-transaction mode).
//!
//! ```no_run
//! use idempotency_core::Guard;
//! use idempotency_redis::RedisStore;
//! # async fn example() -> Result<(), idempotency_core::StoreError> {
//! let store = RedisStore::connect("redis://127.0.0.1:6379").await?.prefix("payments:")?;
//! let cluster = RedisStore::connect_cluster(&["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"]).await?;
//! let guard = Guard::new(store);
//! # let _ = (guard, cluster);
//! # Ok(())
//! # }
//! ```

mod batch;
mod error;
mod options;
mod scripts;
mod store;

pub use options::KIND;
pub use store::{Connection, Operation, RedisStore};

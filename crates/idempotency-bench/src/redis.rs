//! Redis store: begin→complete cycles per second at 1, 16 and 64 callers against the same two
//! scripts sent as bare `EVALSHA` round trips on the same connection, in the same run, on a
//! single server and on a cluster.
//!
//! Servers: `REDIS_URL` (default `redis://127.0.0.1:6379`) and `REDIS_CLUSTER_URLS` (default
//! the three loopback masters on 7000-7002 that `scripts/services` starts). Records use a prefix
//! of their own and zero retention, so they expire as the bench goes.

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{Fingerprint, Key, Scope, Token};
use idempotency_redis::{Operation, RedisStore};

use crate::measure::{runtime, store_versus_raw, versus};

pub(crate) fn run(window: Duration, rounds: usize) -> Result<(), String> {
    let runtime = runtime()?;
    runtime.block_on(async {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let cluster: Vec<String> = std::env::var("REDIS_CLUSTER_URLS")
            .unwrap_or_else(|_| "redis://127.0.0.1:7000,redis://127.0.0.1:7001,redis://127.0.0.1:7002".into())
            .split(',')
            .map(str::to_owned)
            .collect();
        let prefix = format!("idem-bench:{}:", std::process::id());
        let single = RedisStore::connect(&url)
            .await
            .and_then(|s| s.prefix(&prefix))
            .map_err(|e| format!("Redis at {url}: {e}"))?;
        let batched_url = format!("{url}{}batch=on", if url.contains('?') { '&' } else { '?' });
        let batched = RedisStore::connect(&batched_url)
            .await
            .and_then(|s| s.prefix(&prefix))
            .map_err(|e| format!("Redis at {url}: {e}"))?;
        let clustered = RedisStore::connect_cluster(&cluster)
            .await
            .and_then(|s| s.prefix(&prefix))
            .map_err(|e| format!("Redis Cluster at {cluster:?}: {e}"))?;
        println!("\n## Redis store vs the same scripts as bare EVALSHA on the same connection: begin→complete cycles/s\n");
        println!("| server | callers | store | raw EVALSHA | store / raw | store min–max | raw min–max |");
        println!("|---|---:|---:|---:|---:|---:|---:|");
        let servers = [
            ("single", single),
            ("single, `?batch=on`", batched),
            ("cluster (3 masters)", clustered),
        ];
        for (name, store) in servers {
            for callers in [1usize, 16, 64] {
                let raw = |store: RedisStore, scope, key| async move { raw_cycle(&store, scope, key).await };
                let rates = store_versus_raw(&store, raw, callers, window, rounds).await?;
                let (ours, raw) = (&rates[0], &rates[1]);
                println!("| {name} | {callers} | {} |", versus(ours, raw));
            }
        }
        Ok(())
    })
}

/// The same two scripts with the same arguments, as bare `EVALSHA`s on the store's connection;
/// the replies are not decoded.
async fn raw_cycle(store: &RedisStore, scope: Scope, key: Key) -> Result<(), String> {
    let record_key = store.record_key(&scope, &key);
    let token = format!("{:032x}", Token::random().as_u128());
    let fingerprint: Arc<str> = Fingerprint::of_bytes(b"payload").to_hex().into();
    let mut connection = store.connection();
    let _: redis::Value = store
        .script(Operation::Begin)
        .key(&record_key)
        .arg(scope.as_str())
        .arg(key.as_str())
        .arg(&*fingerprint)
        .arg(&token)
        .arg("60000")
        .arg("0")
        .invoke_async(&mut connection)
        .await
        .map_err(|e| e.to_string())?;
    let _: redis::Value = store
        .script(Operation::Complete)
        .key(&record_key)
        .arg(&token)
        .arg("")
        .arg("0")
        .invoke_async(&mut connection)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

//! Bad input gets a clear, typed error: malformed URLs, an unreachable server, a value of the
//! wrong type (or another application's hash) at a record's key, an unsafe key prefix.

use crate::common;

use std::time::Duration;

use idempotency_core::{BeginRequest, Claim, ErrorKind, Fingerprint, Key, Outcome, Scope, Store, Token};
use idempotency_redis::RedisStore;
use idempotency_testkit::refusals;

#[tokio::test]
async fn malformed_urls_are_invalid_config() {
    let urls = [
        "",
        "127.0.0.1:6379",
        "postgres://u:secret@h/db",
        "redis://h:notaport",
        "redis://u:secret@[::1",
        "redis://u:secret@127.0.0.1:6379?batch=maybe",
        "redis://u:secret@127.0.0.1:6379?batch",
    ];
    refusals::malformed_urls(&urls, "secret", RedisStore::connect).await;
    let error = RedisStore::connect_cluster::<&str>(&[]).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidConfig);
}

#[tokio::test]
async fn an_unreachable_server_is_retryable() {
    // Port 1 on loopback: nothing listens there.
    let error = RedisStore::connect("redis://127.0.0.1:1").await.unwrap_err();
    assert!(error.is_retryable(), "{error}");
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
}

#[tokio::test]
async fn unsafe_prefixes_are_refused() {
    let store = common::single().await;
    for prefix in ["{tag}:", "a b", "idem*", "x?", "é:"] {
        let error = store.clone().prefix(prefix).map(|_| ()).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{prefix:?}");
    }
}

async fn a_foreign_value_at_the_record_key_is_refused_and_kept(store: RedisStore, raw: redis::Client) {
    let scope = Scope::global();
    let key = Key::generate();
    let record_key = store.record_key(&scope, &key);
    let mut connection = raw.get_multiplexed_async_connection().await.unwrap();
    let request = BeginRequest::new(scope.clone(), key.clone(), Fingerprint::of_bytes(b"x"));

    // A string where a record should be.
    common::plant_foreign(&mut connection, &record_key).await;
    for error in [
        store.begin(&request).await.unwrap_err(),
        store.get(&scope, &key).await.unwrap_err(),
        store
            .complete(
                &idempotency_testkit::held(&scope, &key, Token::random()),
                Outcome::empty(),
                Duration::from_secs(1),
            )
            .await
            .unwrap_err(),
    ] {
        assert_eq!(error.kind(), ErrorKind::Protocol, "{error}");
        assert!(error.to_string().contains("WRONGTYPE"), "{error}");
        assert!(!error.is_retryable());
    }
    common::assert_foreign_kept(&mut connection, &record_key).await;

    // A hash that is not a record.
    let _: () = redis::cmd("DEL")
        .arg(&record_key)
        .query_async(&mut connection)
        .await
        .unwrap();
    common::plant_foreign_hash(&mut connection, &record_key).await;
    let error = store.begin(&request).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Protocol, "{error}");
    assert!(error.to_string().contains("not an idempotency record"), "{error}");
    common::assert_foreign_hash_kept_then_delete(&mut connection, &record_key).await;
}

#[tokio::test]
async fn a_foreign_value_at_the_record_key_is_refused_on_a_single_server() {
    let raw = redis::Client::open(common::redis_url()).unwrap();
    a_foreign_value_at_the_record_key_is_refused_and_kept(common::single().await, raw).await;
}

#[tokio::test]
async fn a_foreign_value_at_the_record_key_is_refused_on_a_cluster() {
    let store = common::cluster().await;
    // The cluster client writes the foreign value on whichever master owns the key's slot.
    let raw = redis::cluster::ClusterClient::new(common::cluster_urls()).unwrap();
    let scope = Scope::global();
    let key = Key::generate();
    let record_key = store.record_key(&scope, &key);
    let mut connection = raw.get_async_connection().await.unwrap();
    let _: () = redis::cmd("SET")
        .arg(&record_key)
        .arg("foreign")
        .query_async(&mut connection)
        .await
        .unwrap();
    let request = BeginRequest::new(scope.clone(), key.clone(), Fingerprint::of_bytes(b"x"));
    let error = store.begin(&request).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Protocol, "{error}");
    let kept: String = redis::cmd("GET")
        .arg(&record_key)
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(kept, "foreign");
    let _: () = redis::cmd("DEL")
        .arg(&record_key)
        .query_async(&mut connection)
        .await
        .unwrap();
}

/// A batch of claims in which two keys hold something that is not a record (a string, another
/// application's hash): those two keys answer their errors, the others their claims as single
/// calls would (a new key acquired, a completed key replayed, a held key in flight), and the
/// foreign values are kept. The batch script's `begin` asks whether a key exists before it
/// reads it, so each kind of key goes down its own branch of it here.
#[tokio::test]
async fn a_batch_answers_each_foreign_value_as_that_keys_error_and_the_rest_as_claims() {
    let store = common::single().await;
    let raw = redis::Client::open(common::redis_url()).unwrap();
    let mut connection = raw.get_multiplexed_async_connection().await.unwrap();
    let scope = Scope::global();
    let request = |key: &Key| BeginRequest::new(scope.clone(), key.clone(), Fingerprint::of_bytes(b"x"));
    let [new, string, hash, completed, held] = std::array::from_fn(|_| Key::generate());
    common::plant_foreign(&mut connection, &store.record_key(&scope, &string)).await;
    common::plant_foreign_hash(&mut connection, &store.record_key(&scope, &hash)).await;
    for key in [&completed, &held] {
        let Claim::Acquired(claimed) = store.begin(&request(key)).await.unwrap() else {
            panic!("a new key is acquired");
        };
        if key == &completed {
            let completed = store
                .complete(&claimed, Outcome::new(b"done".to_vec()), Duration::from_secs(60))
                .await
                .unwrap();
            assert!(completed.accepted().is_some(), "the holder completes");
        }
    }

    let answers = store
        .begin_many(&[new, string.clone(), hash.clone(), completed, held].map(|key| request(&key)))
        .await;

    let [new, string_answer, hash_answer, completed, held] =
        <[_; 5]>::try_from(answers).expect("five answers");
    assert!(
        matches!(new, Ok(Claim::Acquired(ref h)) if h.attempt == 1),
        "{new:?}"
    );
    let error = string_answer.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Protocol, "{error}");
    assert!(error.to_string().contains("WRONGTYPE"), "{error}");
    let error = hash_answer.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Protocol, "{error}");
    assert!(error.to_string().contains("not an idempotency record"), "{error}");
    assert!(
        matches!(completed, Ok(Claim::Replay(ref done)) if done.outcome.as_bytes() == b"done"),
        "{completed:?}"
    );
    assert!(matches!(held, Ok(Claim::InFlight { attempt: 1, .. })), "{held:?}");
    common::assert_foreign_kept(&mut connection, &store.record_key(&scope, &string)).await;
    common::assert_foreign_hash_kept_then_delete(&mut connection, &store.record_key(&scope, &hash)).await;
    let _: () = redis::cmd("DEL")
        .arg(store.record_key(&scope, &string))
        .query_async(&mut connection)
        .await
        .unwrap();
}

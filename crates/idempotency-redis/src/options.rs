//! The URLs the Redis store answers to.

use std::sync::Arc;

use idempotency_core::{Access, DynStore, ErrorKind, OpenFuture, StoreError, StoreKind, redact_url};

use crate::RedisStore;

/// `redis://host:port` and `rediss://…` (one server), and `redis-cluster://h1:p1,h2:p2` or, over
/// TLS, `rediss-cluster://h1:p1,h2:p2?ca=FILE` (a Redis Cluster, reached through any of the
/// listed nodes), for a [`Registry`](idempotency_core::Registry).
pub const KIND: StoreKind = StoreKind {
    name: "redis",
    schemes: &["redis", "rediss", "redis-cluster", "rediss-cluster"],
    example: "redis://…",
    open: open_url,
    check: check_url,
};

/// Redis has no schema to create, and the operations commands only read: every access opens
/// the same way.
fn open_url(url: String, _access: Access) -> OpenFuture {
    Box::pin(async move {
        // Malformed URLs are refused here, with errors that name a cluster node by its place in
        // the whole URL.
        check_url(&url)?;
        let store = match cluster(&url)? {
            Some((nodes, options)) => RedisStore::connect_cluster_with(&nodes, &options).await?,
            None => RedisStore::connect(&url).await?,
        };
        Ok(Arc::new(store) as DynStore)
    })
}

/// A cluster URL's nodes (as `redis://` or `rediss://` URLs) and its TLS files; `None` for a
/// single server's URL.
fn cluster(url: &str) -> Result<Option<(Vec<String>, crate::store::UrlOptions)>, StoreError> {
    let (scheme, rest) = match url.split_once("://") {
        Some(("redis-cluster", rest)) => ("redis", rest),
        Some(("rediss-cluster", rest)) => ("rediss", rest),
        _ => return Ok(None),
    };
    let (nodes, query) = rest.split_once('?').unwrap_or((rest, ""));
    // The parameters read as a single server's of the same scheme would be: `ca`, `cert`, `key`.
    let options = crate::store::split_options(&format!("{scheme}://node?{query}"))?;
    if options.batch || options.url != format!("{scheme}://node") {
        return Err(StoreError::new(
            ErrorKind::InvalidConfig,
            format!(
                "`{}`: a cluster URL takes only the TLS parameters ca, cert and key",
                redact_url(url)
            ),
        ));
    }
    Ok(Some((cluster_nodes(nodes, scheme)?, options)))
}

/// Parses the URL as `open_url` does, connecting to nothing.
fn check_url(url: &str) -> Result<(), StoreError> {
    match cluster(url)? {
        Some((nodes, _)) => {
            for (index, node) in nodes.iter().enumerate() {
                let shown = format!("(node {} of `{}`)", index + 1, redact_url(url));
                crate::store::parse_shown(node, &shown)?;
            }
        }
        None => {
            let options = crate::store::split_options(url)?;
            crate::store::parse_url(&options.url)?;
        }
    }
    Ok(())
}

/// `h1:p1,h2:p2` as `SCHEME://` URLs, one a node.
fn cluster_nodes(nodes: &str, scheme: &str) -> Result<Vec<String>, StoreError> {
    let nodes: Vec<String> = nodes
        .split(',')
        .filter(|node| !node.is_empty())
        .map(|node| format!("{scheme}://{node}"))
        .collect();
    if nodes.is_empty() {
        return Err(StoreError::new(
            ErrorKind::InvalidConfig,
            "a redis-cluster:// URL lists no nodes (expected redis-cluster://host:port,host:port)",
        ));
    }
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_cluster_node_is_named_by_its_place_and_no_secret_is_shown() {
        for (url, node) in [
            ("redis-cluster://h1:7000,app:s3cret@h2:notaport", "node 2 of"),
            ("redis-cluster://app:s3cret@h1:notaport,h2:7001", "node 1 of"),
        ] {
            let error = check_url(url).unwrap_err().to_string();
            assert!(error.contains(node), "{error}");
            assert!(!error.contains("s3cret"), "a secret is shown: {error}");
        }
        assert!(check_url("redis-cluster://127.0.0.1:7000,127.0.0.1:7001").is_ok());
        assert!(check_url("redis-cluster://").is_err());
    }

    #[test]
    fn batch_is_the_stores_option_and_the_rest_of_the_url_is_the_clients() {
        use crate::store::split_options;
        for (url, rest, batch) in [
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379", false),
            (
                "redis://127.0.0.1:6379/2?batch=off",
                "redis://127.0.0.1:6379/2",
                false,
            ),
            ("redis://127.0.0.1:6379?batch=on", "redis://127.0.0.1:6379", true),
            (
                "redis://u:p@127.0.0.1:6379?protocol=resp3&batch=off",
                "redis://u:p@127.0.0.1:6379?protocol=resp3",
                false,
            ),
        ] {
            let options = split_options(url).unwrap();
            assert_eq!((options.url.as_str(), options.batch), (rest, batch), "{url}");
        }
        for url in [
            "redis://h?batch=no",
            "redis://h?batch=",
            "redis://h?batch=OFF",
            "redis://h?ca=/etc/ca.pem",
            "rediss://h?ca=/nonexistent/ca.pem",
            "rediss://h?cert=/nonexistent/c.pem",
        ] {
            let error = split_options(url).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{url}");
            assert!(check_url(url).is_err(), "{url}");
        }
    }
}

//! The store: a multiplexed connection (single node) or a cluster connection, and the scripts.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::{
    BeginRequest, Claim, Completed, Completion, DecodeError, ErrorKind, Fenced, Fingerprint, Held, Key,
    ListFilter, Outcome, Record, RecordParts, RecordSummary, Scope, Stats, Store, StoreAdmin, StoreError,
    Timestamp, Token, begin_each, complete_each, redact_url, stored_millis,
};
use redis::Value;
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo, Slot};
use sha2::{Digest, Sha256};

use crate::batch::{Batcher, Kind, MAX_BATCH, run_many};
use crate::error::map_error;
use crate::scripts;

/// How many keys `stats` and `list` read per batch while scanning.
const SCAN_BATCH: usize = 500;

/// The store's connection: a multiplexed connection manager to one server, or a cluster
/// connection. Clones share it. It implements [`ConnectionLike`], so the application can run its
/// own commands on it ([`RedisStore::connection`]).
#[derive(Clone)]
pub enum Connection {
    /// One server, through a reconnecting multiplexed connection.
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Single(_) => "Connection::Single",
            Self::Cluster(_) => "Connection::Cluster",
        })
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            Self::Single(connection) => connection.req_packed_command(cmd),
            Self::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(connection) => connection.req_packed_commands(cmd, offset, count),
            Self::Cluster(connection) => connection.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(connection) => connection.get_db(),
            Self::Cluster(connection) => connection.get_db(),
        }
    }
}

/// An operation whose script [`RedisStore::script`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Operation {
    /// `begin`: ARGV scope, key, fingerprint (hex), token (hex), lease ms, retention ms.
    Begin,
    /// `complete`: ARGV token (hex), outcome, retention ms.
    Complete,
    /// `release`: ARGV token, [`Token::NONE`] (hex).
    Release,
    /// `extend`: ARGV token (hex), lease ms.
    Extend,
    /// `get`: no ARGV.
    Get,
    /// `forget` (an operator's delete): ARGV token (hex).
    Forget,
}

struct Scripts {
    begin: redis::Script,
    complete: redis::Script,
    release: redis::Script,
    forget: redis::Script,
    extend: redis::Script,
    get: redis::Script,
    /// The batch scripts, for `begin_many` and `complete_many`.
    begin_many: redis::Script,
    complete_many: redis::Script,
}

/// The Redis store. Clones share the connection.
///
/// See the [crate docs](crate) for the data layout, the guarantees and the durability trade-off.
#[derive(Clone)]
pub struct RedisStore {
    connection: Connection,
    prefix: Arc<str>,
    scripts: Arc<Scripts>,
    /// On a single server with `?batch=on`, `begin` and `complete` go through the batcher (see
    /// [`crate::batch`]).
    batcher: Option<Batcher>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field(
                "mode",
                &match self.connection {
                    Connection::Single(_) => "single",
                    Connection::Cluster(_) => "cluster",
                },
            )
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connects to one Redis server (`redis://[user:password@]host:port[/db]`, or `rediss://`).
    ///
    /// Each `begin` and `complete` is its own script call, pipelined on the multiplexed
    /// connection; `?batch=on` batches concurrent ones (see the crate docs).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::InvalidConfig`] for a malformed URL, a `batch` other than `on` or `off`, or
    /// rejected credentials; [`ErrorKind::Unavailable`] when the server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options = split_options(url)?;
        let batch = options.batch;
        let info = parse_url(&options.url)?;
        let client = client_for(&options, info.clone())?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(5)))
            .set_number_of_retries(1);
        let manager = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(|e| map_error("connect to Redis", e))?;
        let connection = Connection::Single(manager);
        let batcher = batch.then(|| Batcher::start(connection.clone()));
        Ok(Self::with(connection, batcher))
    }

    /// Connects to a Redis Cluster through any of its nodes.
    ///
    /// # Errors
    ///
    /// As [`RedisStore::connect`].
    pub async fn connect_cluster<S: AsRef<str>>(urls: &[S]) -> Result<Self, StoreError> {
        Self::connect_cluster_with(urls, &UrlOptions::default()).await
    }

    /// Connects to a Redis Cluster through any of its nodes (`rediss://` URLs for TLS), with
    /// `options`' TLS files for every node.
    pub(crate) async fn connect_cluster_with<S: AsRef<str>>(
        urls: &[S],
        options: &UrlOptions,
    ) -> Result<Self, StoreError> {
        let infos = urls
            .iter()
            .map(|u| parse_url(u.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        if infos.is_empty() {
            return Err(StoreError::new(
                ErrorKind::InvalidConfig,
                "a Redis Cluster needs at least one node URL",
            ));
        }
        let builder = redis::cluster::ClusterClientBuilder::new(infos)
            .connection_timeout(Duration::from_secs(2))
            .response_timeout(Duration::from_secs(5))
            // The client's own retries re-send a command whose connection dropped after it was
            // sent: a `release` that ran would run again and answer `LeaseLost`. Only redirects
            // are retried, in `with_redirects`, where the server said the command did not run.
            .retries(0);
        let builder = cluster_tls(builder, options)?;
        let client = builder
            .build()
            .map_err(|e| map_error("configure the Redis Cluster client", e))?;
        let connection = client
            .get_async_connection()
            .await
            .map_err(|e| map_error("connect to the Redis Cluster", e))?;
        Ok(Self::with(Connection::Cluster(connection), None))
    }

    fn with(connection: Connection, batcher: Option<Batcher>) -> Self {
        Self {
            batcher,
            connection,
            prefix: Arc::from("idem:"),
            scripts: Arc::new(Scripts {
                begin: redis::Script::new(&scripts::begin()),
                complete: redis::Script::new(&scripts::complete()),
                begin_many: redis::Script::new(&scripts::begin_many()),
                complete_many: redis::Script::new(&scripts::complete_many()),
                release: redis::Script::new(&scripts::release()),
                forget: redis::Script::new(&scripts::forget()),
                extend: redis::Script::new(&scripts::extend()),
                get: redis::Script::new(&scripts::get()),
            }),
        }
    }

    /// Sets the prefix of every record key (default `idem:`), to share a server between
    /// applications or environments.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::InvalidConfig`] for a prefix with characters other than visible ASCII, or with
    /// `{` or `}`: a hash tag would put every record in one cluster slot.
    pub fn prefix(mut self, prefix: &str) -> Result<Self, StoreError> {
        if let Some(c) = prefix
            .chars()
            .find(|c| !c.is_ascii_graphic() || matches!(c, '{' | '}' | '*' | '?' | '['))
        {
            return Err(StoreError::new(
                ErrorKind::InvalidConfig,
                format!(
                    "Redis key prefix {prefix:?} contains {c:?} (visible ASCII only, no braces or glob characters)"
                ),
            ));
        }
        self.prefix = Arc::from(prefix);
        Ok(self)
    }

    /// The Redis key of a record: the prefix, 16 hex digits of SHA-256 over the scope, `:`, and
    /// 32 hex digits of SHA-256 over the length-prefixed scope and key. The scope part lets
    /// `stats` and `list` for one scope scan only that scope's keys. The raw scope and key are
    /// kept in the hash for operators.
    #[must_use]
    pub fn record_key(&self, scope: &Scope, key: &Key) -> String {
        let mut hasher = Sha256::new();
        hasher.update((scope.as_str().len() as u64).to_be_bytes());
        hasher.update(scope.as_str());
        hasher.update(key.as_str());
        let digest = hasher.finalize();
        let mut out = self.scope_prefix(scope);
        out.reserve(32);
        out.push_str(&hex::encode(&digest[..16]));
        out
    }

    /// The prefix of every record key of `scope`.
    fn scope_prefix(&self, scope: &Scope) -> String {
        let mut out = String::with_capacity(self.prefix.len() + 17 + 32);
        out.push_str(&self.prefix);
        out.push_str(&hex::encode(&Sha256::digest(scope.as_str())[..8]));
        out.push(':');
        out
    }

    /// The store's connection, to run the application's own commands on it.
    #[must_use]
    pub fn connection(&self) -> Connection {
        self.connection.clone()
    }

    /// The Lua script behind `operation` (for review, `SCRIPT LOAD`, or issuing it directly:
    /// the benchmark's baseline does). Each takes the record key ([`RedisStore::record_key`]) as
    /// its only key.
    #[must_use]
    pub fn script(&self, operation: Operation) -> &redis::Script {
        match operation {
            Operation::Begin => &self.scripts.begin,
            Operation::Complete => &self.scripts.complete,
            Operation::Release => &self.scripts.release,
            Operation::Extend => &self.scripts.extend,
            Operation::Get => &self.scripts.get,
            Operation::Forget => &self.scripts.forget,
        }
    }

    async fn run(&self, script: &redis::Script, key: &str, args: &[&[u8]]) -> Result<Value, StoreError> {
        let mut invocation = script.key(key);
        for arg in args {
            invocation.arg(*arg);
        }
        with_redirects(|| async { invocation.invoke_async(&mut self.connection.clone()).await })
            .await
            .map_err(|e| map_error("run a script", e))
    }

    /// Runs `begin` or `complete`: through the batcher when there is one (`?batch=on` on a single
    /// server), else as its own script call.
    async fn run_batched(&self, kind: Kind, key: String, args: &[&[u8]]) -> Result<Value, StoreError> {
        match &self.batcher {
            Some(batcher) => {
                batcher
                    .call(kind, key, args.iter().map(|a| a.to_vec()).collect())
                    .await
            }
            None => {
                let script = match kind {
                    Kind::Begin => &self.scripts.begin,
                    Kind::Complete => &self.scripts.complete,
                };
                self.run(script, &key, args).await
            }
        }
    }

    /// Runs the batch script of `kind` over `calls` (record key, one-key arguments): in
    /// chunks of [`MAX_BATCH`] one after another on a single server; on a cluster grouped by
    /// slot (a script's keys must share one), the groups at once and each group's chunks in
    /// order, so that a key's calls keep the batch's order. One reply per call, in order.
    async fn run_many<const N: usize>(
        &self,
        kind: Kind,
        calls: &[(String, [&[u8]; N])],
    ) -> Vec<Result<Value, StoreError>> {
        let script = match kind {
            Kind::Begin => &self.scripts.begin_many,
            Kind::Complete => &self.scripts.complete_many,
        };
        let groups: Vec<Vec<usize>> = match &self.connection {
            Connection::Single(_) => vec![(0..calls.len()).collect()],
            Connection::Cluster(_) => {
                let mut by_slot: Vec<(Slot, Vec<usize>)> = Vec::new();
                for (at, (key, _)) in calls.iter().enumerate() {
                    let slot = Slot::for_key(key);
                    match by_slot.iter_mut().find(|(s, _)| *s == slot) {
                        Some((_, group)) => group.push(at),
                        None => by_slot.push((slot, vec![at])),
                    }
                }
                by_slot.into_iter().map(|(_, group)| group).collect()
            }
        };
        let runs = groups.iter().map(async |group| {
            let mut replies = Vec::with_capacity(group.len());
            for chunk in group.chunks(MAX_BATCH) {
                let chunk: Vec<(&str, &[&[u8]])> = chunk
                    .iter()
                    .map(|at| (calls[*at].0.as_str(), &calls[*at].1[..]))
                    .collect();
                replies.extend(run_many(&self.connection, script, kind, &chunk).await);
            }
            replies
        });
        let mut answers: Vec<Option<Result<Value, StoreError>>> =
            std::iter::repeat_with(|| None).take(calls.len()).collect();
        for (group, replies) in groups.iter().zip(futures_util::future::join_all(runs).await) {
            for (at, reply) in group.iter().zip(replies) {
                answers[*at] = Some(reply);
            }
        }
        answers
            .into_iter()
            .map(|answer| answer.unwrap_or_else(|| unreachable!("every call is in one group")))
            .collect()
    }

    async fn query<T: redis::FromRedisValue>(&self, command: &redis::Cmd) -> Result<T, StoreError> {
        with_redirects(|| async { command.query_async(&mut self.connection.clone()).await })
            .await
            .map_err(|e| map_error("query Redis", e))
    }

    /// Every record key (of one scope, or of all), scanning each master.
    async fn scan_keys(&self, scope: Option<&Scope>) -> Result<Vec<String>, StoreError> {
        let pattern = match scope {
            Some(scope) => format!("{}*", self.scope_prefix(scope)),
            None => format!("{}*", self.prefix),
        };
        let mut keys = HashSet::new();
        match self.connection.clone() {
            Connection::Single(mut connection) => {
                scan_node(&mut keys, &mut Node::Single(&mut connection), &pattern).await?;
            }
            Connection::Cluster(mut connection) => {
                let nodes: String = redis::cmd("CLUSTER")
                    .arg("NODES")
                    .query_async(&mut connection)
                    .await
                    .map_err(|e| map_error("read the cluster topology", e))?;
                for (host, port) in masters(&nodes)? {
                    let mut node = Node::Routed(&mut connection, host, port);
                    scan_node(&mut keys, &mut node, &pattern).await?;
                }
            }
        }
        let mut keys: Vec<String> = keys.into_iter().collect();
        keys.sort_unstable();
        Ok(keys)
    }

    /// Every live record (of one scope, or of all), with the server's time; reads in batches of
    /// concurrent `get`s.
    async fn all_records(&self, scope: Option<&Scope>) -> Result<(Timestamp, Vec<Record>), StoreError> {
        let keys = self.scan_keys(scope).await?;
        let mut records = Vec::with_capacity(keys.len());
        let mut now = self.server_time().await?;
        for batch in keys.chunks(SCAN_BATCH) {
            let reads = batch.iter().map(|key| self.run(&self.scripts.get, key, &[]));
            for value in futures_util::future::join_all(reads).await {
                if let Some((at, record)) = decode_get(value?)? {
                    now = now.max(at);
                    records.push(record);
                }
            }
        }
        Ok((now, records))
    }

    async fn server_time(&self) -> Result<Timestamp, StoreError> {
        let (seconds, micros): (i64, i64) = self.query(&redis::cmd("TIME")).await?;
        Ok(Timestamp::from_unix_millis(seconds * 1000 + micros / 1000))
    }
}

/// One node to scan: the single server, or a master of a cluster.
enum Node<'c> {
    Single(&'c mut ConnectionManager),
    /// A master by its address, reached through the cluster connection, so that the connection
    /// is made as the cluster's are: over TLS, with the URL's CA and client certificate.
    Routed(&'c mut ClusterConnection, String, u16),
}

impl Node<'_> {
    async fn query(&mut self, command: redis::Cmd) -> Result<(u64, Vec<String>), StoreError> {
        match self {
            Self::Single(connection) => command
                .query_async(*connection)
                .await
                .map_err(|e| map_error("scan record keys", e)),
            Self::Routed(connection, host, port) => {
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                });
                let reply = connection
                    .route_command(command, routing)
                    .await
                    .map_err(|e| map_error(&format!("scan record keys on {host}:{port}"), e))?;
                redis::from_redis_value(reply).map_err(|e| {
                    StoreError::new(ErrorKind::Protocol, format!("a SCAN answer that is not one: {e}"))
                })
            }
        }
    }
}

/// Every key matching `pattern` on `node`, `SCAN` by `SCAN`.
async fn scan_node(keys: &mut HashSet<String>, node: &mut Node<'_>, pattern: &str) -> Result<(), StoreError> {
    let mut cursor: u64 = 0;
    loop {
        let mut command = redis::cmd("SCAN");
        command
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000);
        let (next, batch) = node.query(command).await?;
        keys.extend(batch);
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// The address of every master in `CLUSTER NODES` output, as the cluster's clients name it: the
/// node's announced hostname when it has one (`ip:port@cport,hostname`, the name its TLS
/// certificate carries), else its IP address.
fn masters(nodes: &str) -> Result<Vec<(String, u16)>, StoreError> {
    let mut masters = Vec::new();
    for line in nodes.lines() {
        let mut fields = line.split_whitespace();
        let (Some(_id), Some(address), Some(flags)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        if !flags.split(',').any(|f| f == "master") || flags.contains("fail") {
            continue;
        }
        let bad = || StoreError::new(ErrorKind::Protocol, format!("bad node address {address:?}"));
        let (endpoint, hostname) = match address.split_once(',') {
            Some((endpoint, hostname)) => (endpoint, Some(hostname)),
            None => (address, None),
        };
        let endpoint = endpoint.split('@').next().unwrap_or(endpoint);
        let (ip, port) = endpoint.rsplit_once(':').ok_or_else(bad)?;
        let port = port.parse::<u16>().map_err(|_| bad())?;
        let host = hostname.filter(|name| !name.is_empty()).unwrap_or(ip);
        masters.push((
            host.trim_start_matches('[').trim_end_matches(']').to_owned(),
            port,
        ));
    }
    Ok(masters)
}

/// The store's own parameters of a single server's URL, taken off before the rest reaches the
/// Redis client.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct UrlOptions {
    /// The URL without the store's parameters.
    pub(crate) url: String,
    /// `batch=on`: concurrent calls batched into one script call.
    pub(crate) batch: bool,
    /// `ca=FILE`: the CA a `rediss://` server's certificate is verified against (instead of the
    /// system's trust store).
    pub(crate) ca: Option<String>,
    /// `cert=FILE` and `key=FILE`: a client certificate for a `rediss://` server.
    pub(crate) cert: Option<String>,
    /// See `cert`.
    pub(crate) key: Option<String>,
}

/// Takes the store's own options off a single server's URL: `batch=off` (the default) or
/// `batch=on`, and for `rediss://` the TLS files `ca`, `cert` and `key`. The rest of the URL,
/// other query parameters included, is the Redis client's.
pub(crate) fn split_options(url: &str) -> Result<UrlOptions, StoreError> {
    // A URL this cannot parse is left whole, for the client's parser to refuse with its reason.
    let Ok(mut parsed) = url::Url::parse(url) else {
        return Ok(UrlOptions {
            url: url.to_owned(),
            ..UrlOptions::default()
        });
    };
    let refuse = |why: String| StoreError::new(ErrorKind::InvalidConfig, why);
    let mut options = UrlOptions::default();
    let mut rest = Vec::new();
    for (name, value) in parsed.query_pairs() {
        match &*name {
            "batch" => {
                options.batch = match &*value {
                    "on" => true,
                    "off" => false,
                    other => {
                        return Err(refuse(format!(
                            "`batch` in a Redis URL is `on` or `off`, not `{other}`"
                        )));
                    }
                };
            }
            "ca" | "cert" | "key" => {
                if parsed.scheme() != "rediss" {
                    return Err(refuse(format!(
                        "`{name}` names a TLS file: it is for rediss:// URLs, and this one is {}://",
                        parsed.scheme()
                    )));
                }
                let path = value.into_owned();
                check_pem(&name, &path)?;
                match &*name {
                    "ca" => options.ca = Some(path),
                    "cert" => options.cert = Some(path),
                    _ => options.key = Some(path),
                }
            }
            _ => rest.push((name.into_owned(), value.into_owned())),
        }
    }
    if options.cert.is_some() != options.key.is_some() {
        return Err(refuse(
            "a client certificate needs both `cert` and `key` in the rediss:// URL".into(),
        ));
    }
    if rest.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(rest);
    }
    // Only a URL that had a query is rebuilt: the others reach the client exactly as given.
    options.url = if url.contains('?') {
        parsed.to_string()
    } else {
        url.to_owned()
    };
    Ok(options)
}

/// A TLS file a `rediss://` URL names must be a readable PEM file.
fn check_pem(name: &str, path: &str) -> Result<(), StoreError> {
    idempotency_core::pem::check_file(path.as_ref())
        .map_err(|why| StoreError::new(ErrorKind::InvalidConfig, format!("`{name}` {path}: {why}")))
}

/// The client for one server: a `rediss://` URL's files, when it names some, verify the server
/// and present the client's certificate.
fn client_for(options: &UrlOptions, info: redis::ConnectionInfo) -> Result<redis::Client, StoreError> {
    // The Redis client builds its TLS configuration with the process's default provider: ring,
    // unless the application chose one.
    #[cfg(feature = "tls")]
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    let tls = options.url.starts_with("rediss://");
    if tls && cfg!(not(feature = "tls")) {
        return tls_client(options, info);
    }
    if options.ca.is_none() && options.cert.is_none() {
        return redis::Client::open(info).map_err(|e| map_error("open the Redis client", e));
    }
    tls_client(options, info)
}

#[cfg(feature = "tls")]
fn tls_client(options: &UrlOptions, info: redis::ConnectionInfo) -> Result<redis::Client, StoreError> {
    redis::Client::build_with_tls(info, tls_files(options)?).map_err(|e| map_error("set up TLS for Redis", e))
}

/// The CA and client certificate `options` name, read.
#[cfg(feature = "tls")]
fn tls_files(options: &UrlOptions) -> Result<redis::TlsCertificates, StoreError> {
    let read = |path: &String| {
        std::fs::read(path).map_err(|e| StoreError::new(ErrorKind::InvalidConfig, format!("{path}: {e}")))
    };
    let client_tls = match (&options.cert, &options.key) {
        (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
            client_cert: read(cert)?,
            client_key: read(key)?,
        }),
        _ => None,
    };
    Ok(redis::TlsCertificates {
        client_tls,
        root_cert: options.ca.as_ref().map(read).transpose()?,
    })
}

/// The cluster client with `options`' TLS files, when the URL names some.
#[cfg(feature = "tls")]
fn cluster_tls(
    builder: redis::cluster::ClusterClientBuilder,
    options: &UrlOptions,
) -> Result<redis::cluster::ClusterClientBuilder, StoreError> {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    if options.ca.is_none() && options.cert.is_none() {
        return Ok(builder);
    }
    Ok(builder.certs(tls_files(options)?))
}

#[cfg(not(feature = "tls"))]
fn cluster_tls(
    builder: redis::cluster::ClusterClientBuilder,
    options: &UrlOptions,
) -> Result<redis::cluster::ClusterClientBuilder, StoreError> {
    if options.ca.is_some() || options.cert.is_some() {
        return Err(StoreError::new(
            ErrorKind::InvalidConfig,
            "rediss-cluster:// needs the `tls` feature of idempotency-redis",
        ));
    }
    Ok(builder)
}

#[cfg(not(feature = "tls"))]
fn tls_client(_options: &UrlOptions, _info: redis::ConnectionInfo) -> Result<redis::Client, StoreError> {
    Err(StoreError::new(
        ErrorKind::InvalidConfig,
        "rediss:// needs the `tls` feature of idempotency-redis",
    ))
}

pub(crate) fn parse_url(url: &str) -> Result<redis::ConnectionInfo, StoreError> {
    parse_shown(url, &format!("`{}`", redact_url(url)))
}

/// Parses `url`, naming it `shown` in errors: a cluster node is shown as its place in the
/// whole `redis-cluster://` URL, redacted as a whole (the node alone would be redacted by
/// another reading of where its secrets are).
pub(crate) fn parse_shown(url: &str, shown: &str) -> Result<redis::ConnectionInfo, StoreError> {
    use redis::IntoConnectionInfo;
    let scheme = url.split_once("://").map(|(s, _)| s);
    if !matches!(scheme, Some("redis" | "rediss")) {
        return Err(StoreError::new(
            ErrorKind::InvalidConfig,
            format!("{shown} is not a redis:// URL"),
        ));
    }
    url.into_connection_info().map_err(|e| {
        StoreError::new(
            ErrorKind::InvalidConfig,
            format!("malformed Redis URL {shown}: {e}"),
        )
    })
}

fn protocol(what: &str) -> StoreError {
    StoreError::new(
        ErrorKind::Protocol,
        format!("unexpected reply from a script: {what}"),
    )
}

fn int(value: &Value) -> Result<i64, StoreError> {
    match value {
        Value::Int(n) => Ok(*n),
        Value::BulkString(bytes) => std::str::from_utf8(bytes)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| protocol("a number that does not parse")),
        other => Err(protocol(&format!("expected a number, got {other:?}"))),
    }
}

fn bytes(value: &Value) -> Result<Option<&[u8]>, StoreError> {
    match value {
        Value::Nil => Ok(None),
        Value::BulkString(bytes) => Ok(Some(bytes)),
        Value::SimpleString(s) => Ok(Some(s.as_bytes())),
        other => Err(protocol(&format!("expected a string, got {other:?}"))),
    }
}

fn text(value: &Value) -> Result<&str, StoreError> {
    bytes(value)?
        .and_then(|b| std::str::from_utf8(b).ok())
        .ok_or_else(|| protocol("a missing or non-UTF-8 field"))
}

fn array(value: Value) -> Result<Vec<Value>, StoreError> {
    match value {
        Value::Array(items) => Ok(items),
        other => Err(protocol(&format!("expected an array, got {other:?}"))),
    }
}

fn ms(value: &Value) -> Result<Timestamp, StoreError> {
    int(value).map(Timestamp::from_unix_millis)
}

/// Decodes the `get` script's reply: `None` for an absent or expired record.
fn decode_get(value: Value) -> Result<Option<(Timestamp, Record)>, StoreError> {
    let fields = array(value)?;
    if fields.is_empty() {
        return Ok(None);
    }
    if fields.len() != 13 {
        return Err(protocol("a record with the wrong number of fields"));
    }
    let optional_ms = |value: &Value| match value {
        Value::Nil => Ok(None),
        other => int(other).map(Some),
    };
    let parts = RecordParts {
        scope: text(&fields[1])?.to_owned(),
        key: text(&fields[2])?.to_owned(),
        fingerprint: Fingerprint::from_hex(text(&fields[3])?)?,
        attempt: int(&fields[4])?,
        created_at: int(&fields[5])?,
        expires_at: int(&fields[6])?,
        completed: match text(&fields[8])? {
            "f" => false,
            "c" => true,
            other => return Err(DecodeError::UnknownState(other.to_owned()).into()),
        },
        acquired_at: optional_ms(&fields[9])?,
        lease_until: optional_ms(&fields[10])?,
        completed_at: optional_ms(&fields[11])?,
    };
    let outcome = Outcome::new(bytes(&fields[12])?.unwrap_or_default().to_vec());
    let record = parts.into_record(Token::from_hex(text(&fields[7])?)?, Some(outcome))?;
    Ok(Some((ms(&fields[0])?, record)))
}

/// The one-key `begin` script's arguments of a request that are not already text in it.
struct BeginArgs {
    fingerprint: String,
    token: String,
    lease: String,
    retention: String,
}

impl BeginArgs {
    fn of(request: &BeginRequest) -> Self {
        Self {
            fingerprint: request.fingerprint.to_hex(),
            token: request.token.to_hex(),
            lease: stored_millis(request.lease).to_string(),
            retention: stored_millis(request.retention).to_string(),
        }
    }

    /// The script's six arguments, borrowed from `request` and these.
    fn with<'a>(&'a self, request: &'a BeginRequest) -> [&'a [u8]; 6] {
        [
            request.scope.as_str().as_bytes(),
            request.key.as_str().as_bytes(),
            self.fingerprint.as_bytes(),
            self.token.as_bytes(),
            self.lease.as_bytes(),
            self.retention.as_bytes(),
        ]
    }
}

/// The one-key `complete` script's arguments of a completion that are not already bytes in it.
struct CompleteArgs {
    token: String,
    retention: String,
}

impl CompleteArgs {
    fn of(held: &Held, retention: Duration) -> Self {
        Self {
            token: held.token.to_hex(),
            retention: stored_millis(retention).to_string(),
        }
    }

    /// The script's three arguments, borrowed from these and `outcome` (never copied).
    fn with<'a>(&'a self, outcome: &'a Outcome) -> [&'a [u8]; 3] {
        [
            self.token.as_bytes(),
            outcome.as_bytes(),
            self.retention.as_bytes(),
        ]
    }
}

/// The claim a `begin` script's reply to `request` makes.
fn claim_of(request: &BeginRequest, reply: Value) -> Result<Claim, StoreError> {
    let fields = array(reply)?;
    let tag = fields.first().map(text).transpose()?.unwrap_or_default();
    match (tag, fields.len()) {
        ("acquired", 4) => Ok(Claim::Acquired(Held::acquired(
            request,
            attempt_of(&fields[1])?,
            ms(&fields[2])?,
        ))),
        ("in_flight", 4) => Ok(Claim::InFlight {
            attempt: attempt_of(&fields[1])?,
            retry_after: Duration::from_millis(u64::try_from(int(&fields[2])?).unwrap_or(1)),
        }),
        ("replay", 6) => Ok(Claim::Replay(Completed {
            attempt: attempt_of(&fields[1])?,
            completed_at: ms(&fields[2])?,
            expires_at: ms(&fields[3])?,
            outcome: Outcome::new(bytes(&fields[4])?.unwrap_or_default().to_vec()),
        })),
        ("mismatch", 2) => Ok(Claim::Mismatch),
        _ => Err(protocol(&format!("begin answered {fields:?}"))),
    }
}

fn attempt_of(value: &Value) -> Result<u32, StoreError> {
    u32::try_from(int(value)?).map_err(|_| protocol("an attempt out of range"))
}

#[async_trait]
impl Store for RedisStore {
    async fn begin(&self, request: &BeginRequest) -> Result<Claim, StoreError> {
        let key = self.record_key(&request.scope, &request.key);
        let args = BeginArgs::of(request);
        claim_of(
            request,
            self.run_batched(Kind::Begin, key, &args.with(request)).await?,
        )
    }

    async fn complete(
        &self,
        held: &Held,
        outcome: Outcome,
        retention: Duration,
    ) -> Result<Fenced<Timestamp>, StoreError> {
        if held.token == Token::NONE {
            return Ok(Fenced::LeaseLost);
        }
        let key = self.record_key(&held.scope, &held.key);
        let args = CompleteArgs::of(held, retention);
        fenced(
            self.run_batched(Kind::Complete, key, &args.with(&outcome))
                .await?,
        )
    }

    /// The batch script for the whole batch: one script call per 32 requests on a
    /// single server; on a cluster, one per slot the keys fall in (the calls of different slots
    /// at once, those of one slot in order).
    async fn begin_many(&self, requests: &[BeginRequest]) -> Vec<Result<Claim, StoreError>> {
        if requests.len() < 2 {
            return begin_each(self, requests).await;
        }
        let args: Vec<BeginArgs> = requests.iter().map(BeginArgs::of).collect();
        let calls: Vec<(String, [&[u8]; 6])> = requests
            .iter()
            .zip(&args)
            .map(|(request, args)| (self.record_key(&request.scope, &request.key), args.with(request)))
            .collect();
        let replies = self.run_many(Kind::Begin, &calls).await;
        requests
            .iter()
            .zip(replies)
            .map(|(request, reply)| claim_of(request, reply?))
            .collect()
    }

    /// As [`Store::begin_many`]; a completion with [`Token::NONE`] is answered without a call.
    async fn complete_many(&self, completions: &[Completion]) -> Vec<Result<Fenced<Timestamp>, StoreError>> {
        if completions.len() < 2 {
            return complete_each(self, completions).await;
        }
        let sent: Vec<&Completion> = completions
            .iter()
            .filter(|c| c.held.token != Token::NONE)
            .collect();
        let args: Vec<CompleteArgs> = sent
            .iter()
            .map(|c| CompleteArgs::of(&c.held, c.retention))
            .collect();
        let calls: Vec<(String, [&[u8]; 3])> = sent
            .iter()
            .zip(&args)
            .map(|(c, args)| (self.record_key(&c.held.scope, &c.held.key), args.with(&c.outcome)))
            .collect();
        let mut replies = self.run_many(Kind::Complete, &calls).await.into_iter();
        completions
            .iter()
            .map(|c| {
                if c.held.token == Token::NONE {
                    return Ok(Fenced::LeaseLost);
                }
                fenced(
                    replies
                        .next()
                        .unwrap_or_else(|| unreachable!("a reply per call sent"))?,
                )
            })
            .collect()
    }

    async fn release(&self, held: &Held) -> Result<Fenced<()>, StoreError> {
        if held.token == Token::NONE {
            return Ok(Fenced::LeaseLost);
        }
        let reply = self
            .run(
                &self.scripts.release,
                &self.record_key(&held.scope, &held.key),
                &[held.token.to_hex().as_bytes(), Token::NONE.to_hex().as_bytes()],
            )
            .await?;
        Ok(if int(&reply)? == 1 {
            Fenced::Accepted(())
        } else {
            Fenced::LeaseLost
        })
    }

    async fn extend(&self, held: &Held, lease: Duration) -> Result<Fenced<Timestamp>, StoreError> {
        if held.token == Token::NONE {
            return Ok(Fenced::LeaseLost);
        }
        let lease = stored_millis(lease).to_string();
        let reply = self
            .run(
                &self.scripts.extend,
                &self.record_key(&held.scope, &held.key),
                &[held.token.to_hex().as_bytes(), lease.as_bytes()],
            )
            .await?;
        fenced(reply)
    }

    async fn get(&self, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
        let reply = self
            .run(&self.scripts.get, &self.record_key(scope, key), &[])
            .await?;
        Ok(decode_get(reply)?.map(|(_, record)| record))
    }
}

fn fenced(reply: Value) -> Result<Fenced<Timestamp>, StoreError> {
    let fields = array(reply)?;
    match fields.as_slice() {
        [ok, at] if int(ok)? == 1 => Ok(Fenced::Accepted(ms(at)?)),
        [not] if int(not)? == 0 => Ok(Fenced::LeaseLost),
        other => Err(protocol(&format!("{other:?}"))),
    }
}

/// Inspection scans the record keys (`SCAN MATCH` on each master, in steps of 1000: the scope's
/// keys when a scope is given, else every key under the prefix) and reads the matching records in
/// concurrent batches. The server walks its whole keyspace either way; only matching records
/// cross the network. No index has to be kept consistent.
#[async_trait]
impl StoreAdmin for RedisStore {
    async fn now(&self) -> Result<Timestamp, StoreError> {
        self.server_time().await
    }

    async fn stats(&self, scope: Option<&Scope>) -> Result<Stats, StoreError> {
        let (now, records) = self.all_records(scope).await?;
        let mut stats = Stats::default();
        for record in records.iter().filter(|r| scope.is_none_or(|s| &r.scope == s)) {
            stats.count(record, now);
        }
        Ok(stats)
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordSummary>, StoreError> {
        let (now, records) = self.all_records(filter.scope.as_ref()).await?;
        let found = records
            .iter()
            .filter(|record| filter.matches(record, now))
            .map(Record::summary)
            .collect();
        Ok(filter.page(found))
    }

    /// Redis deletes expired records by itself (`PEXPIREAT`): there is never anything to purge.
    async fn purge_expired(&self, _limit: u64) -> Result<u64, StoreError> {
        Ok(0)
    }

    async fn forget(&self, scope: &Scope, key: &Key, token: Token) -> Result<Fenced<()>, StoreError> {
        let reply = self
            .run(
                &self.scripts.forget,
                &self.record_key(scope, key),
                &[token.to_hex().as_bytes()],
            )
            .await?;
        Ok(Fenced::accepted_if(int(&reply)? == 1))
    }

    /// Every record key carries its expiry (`PEXPIREAT`): Redis deletes it by itself.
    fn expires_by_itself(&self) -> bool {
        true
    }
}

/// How many times a command refused with a redirect is sent again.
const REDIRECT_RETRIES: u32 = 2;

/// Runs `send` again when the server refused the command without running it: `MOVED` or `ASK`
/// while a cluster's slots move, `TRYAGAIN`, `CLUSTERDOWN`. Nothing else is re-sent: after a
/// dropped connection or a timeout the command may have run, and the caller, who holds the
/// token, decides (every script answers a retry with the same token, except `release`, whose
/// second run finds the lease gone).
async fn with_redirects<T, F, Fut>(mut send: F) -> redis::RedisResult<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = redis::RedisResult<T>>,
{
    let mut attempt = 0;
    loop {
        match send().await {
            Err(error) if attempt < REDIRECT_RETRIES && not_run(&error) => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(20 * u64::from(attempt))).await;
            }
            result => return result,
        }
    }
}

/// Whether the server refused the command before running it.
fn not_run(error: &redis::RedisError) -> bool {
    use redis::ServerErrorKind as K;
    matches!(
        error.kind(),
        redis::ErrorKind::Server(K::Moved | K::Ask | K::TryAgain | K::ClusterDown)
    )
}

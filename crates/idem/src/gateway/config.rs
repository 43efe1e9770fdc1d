//! `idem serve`'s settings: its flags (each also an `IDEM_*` variable and a key of the
//! configuration file) are the fields of [`Config`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use http::header::HeaderName;
use http::{Method, Uri};
use idempotency::ScopeSecret;

use crate::flags::{
    FlagError, PurgeEvery, SecretParser, StatusSet, parse_client_timeout, parse_drain_delay,
    parse_drain_timeout, parse_header_name, parse_lease, parse_limit, parse_method, parse_purge_every,
    parse_retention, parse_status_set, parse_upstream, parse_upstream_timeout, parse_wait,
};
use crate::tls::{ClientFiles, ServerFiles};

/// Everything `idem serve` is configured with: the command line's flags (each also an `IDEM_*`
/// environment variable) are these fields, so a setting is added in one place. `Default` is the
/// command line's defaults, with an upstream on `http://127.0.0.1:3000`.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// The upstream's base URL (http://host:port[/base], or https://…); https is verified against
    /// --upstream-ca or, without it, the system's trust store.
    #[arg(long, env = "IDEM_UPSTREAM", value_parser = parse_upstream)]
    pub upstream: Uri,
    /// A private CA (PEM bundle): the only CA trusted for an https upstream (without it, the
    /// system's trust store).
    #[arg(long, env = "IDEM_UPSTREAM_CA")]
    pub upstream_ca: Option<PathBuf>,
    /// A client certificate (PEM chain) presented to an https upstream; needs
    /// --upstream-client-key.
    #[arg(long, env = "IDEM_UPSTREAM_CLIENT_CERT", requires = "upstream_client_key")]
    pub upstream_client_cert: Option<PathBuf>,
    /// The private key (PEM) of --upstream-client-cert.
    #[arg(long, env = "IDEM_UPSTREAM_CLIENT_KEY", requires = "upstream_client_cert")]
    pub upstream_client_key: Option<PathBuf>,
    /// INSECURE: accept any certificate from an https upstream, for any name (logged as a
    /// warning at start). For tests against a server whose CA you cannot get.
    #[arg(long, env = "IDEM_UPSTREAM_INSECURE_SKIP_VERIFY")]
    pub upstream_insecure_skip_verify: bool,
    /// Where the gateway listens.
    #[arg(long, env = "IDEM_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Serve HTTPS on --listen with this certificate chain (PEM, leaf first); needs --tls-key.
    /// SIGHUP reads the pair again (new connections get it; a bad pair keeps the old one).
    #[arg(long, env = "IDEM_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "IDEM_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (PEM bundle): mutual TLS.
    #[arg(long, env = "IDEM_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// Serve /metrics and /healthz here instead of under /_idem/ on the main listener.
    #[arg(long, env = "IDEM_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// The dashboard (`--ui`) and its settings.
    #[command(flatten)]
    pub dashboard: crate::ui::UiFlags,
    /// A TOML file with these settings (the flags' long names as keys) and per-route policies
    /// (`[[route]]` tables); the flags and IDEM_* variables win over it. See docs/HTTP.md.
    #[arg(long, env = "IDEM_CONFIG")]
    pub config: Option<PathBuf>,
    /// Check the --config file, print the effective settings and routes and where each comes
    /// from, and exit.
    #[arg(long, requires = "config")]
    pub check: bool,
    /// The routes of the --config file, in file order.
    #[arg(skip)]
    pub routes: Vec<super::route::RouteSpec>,
    /// The process's command line, when its settings come from a --config file: SIGHUP merges
    /// the file with it again.
    #[arg(skip)]
    pub reload_args: Option<Vec<std::ffi::OsString>>,
    /// The store: sqlite://PATH, postgres://..., mysql://..., redis://..., redis-cluster://h:p,h:p, memory://
    #[arg(long, env = "IDEM_STORE", default_value = "sqlite://idem.db")]
    pub store: String,
    /// How long a request may run without a heartbeat before a retry may take over.
    #[arg(long, env = "IDEM_LEASE", default_value = "30s", value_parser = parse_lease)]
    pub lease: Duration,
    /// Do not create or upgrade the store's schema on start: refuse to start on a store that
    /// `idem migrate` has not prepared (for a role that may not run DDL, or a deployment that
    /// migrates in a step of its own).
    #[arg(long, env = "IDEM_NO_MIGRATE")]
    pub no_migrate: bool,
    /// How long a completed request's response is replayed.
    #[arg(long, env = "IDEM_RETENTION", default_value = "24h", value_parser = parse_retention)]
    pub retention: Duration,
    /// The largest request body (413 beyond it).
    #[arg(long, env = "IDEM_MAX_BODY", default_value = "1MiB", value_parser = parse_limit)]
    pub max_body: usize,
    /// The most memory all guarded request bodies may hold at once (503 beyond it, nothing
    /// runs); at least --max-body.
    #[arg(long, env = "IDEM_MAX_BUFFERED", default_value = "128MiB", value_parser = parse_limit)]
    pub max_buffered: usize,
    /// The largest response that is stored for replay (larger ones pass through, not replayable).
    #[arg(long, env = "IDEM_MAX_RESPONSE", default_value = "1MiB", value_parser = parse_limit)]
    pub max_response: usize,
    /// The guarded methods, comma-separated.
    #[arg(long, env = "IDEM_METHODS", default_value = "POST,PATCH", value_delimiter = ',', value_parser = parse_method)]
    pub methods: Vec<Method>,
    /// Answer 400 to guarded requests without an Idempotency-Key.
    #[arg(long, env = "IDEM_REQUIRE_KEY")]
    pub require_key: bool,
    /// Scope keys by a keyed hash of this header's value (for example Authorization).
    #[arg(long, env = "IDEM_SCOPE_HEADER", value_parser = parse_header_name)]
    pub scope_header: Option<HeaderName>,
    /// The secret (16 bytes or more) the scope hash is keyed with; every gateway on one store
    /// needs the same. Without it, the first gateway generates one and keeps it in the store.
    #[arg(long, env = "IDEM_SCOPE_SECRET", hide_env_values = true, value_parser = SecretParser::SCOPE_SECRET)]
    pub scope_secret: Option<ScopeSecret>,
    /// Wait mode: a duplicate of a running request waits up to this long for its response.
    #[arg(long, env = "IDEM_WAIT", value_parser = parse_wait)]
    pub wait: Option<Duration>,
    /// Forward requests without the guard while the store is unreachable (default: 503).
    #[arg(long, env = "IDEM_FAIL_OPEN")]
    pub fail_open: bool,
    /// How long the upstream may take to answer, body included (504 after it; the outcome is
    /// unknown, so the key stays in flight until its lease ends).
    #[arg(long, env = "IDEM_UPSTREAM_TIMEOUT", default_value = "60s", value_parser = parse_upstream_timeout)]
    pub upstream_timeout: Duration,
    /// The upstream statuses that release the key, so that a retry runs again: classes (`5xx`)
    /// and codes (`429`), comma-separated, or `none`; every other answer is stored and replayed.
    /// Stripe's choice, a 5xx is final: `--release-on 408,409,425,429`.
    #[arg(long, env = "IDEM_RELEASE_ON", default_value = "1xx,3xx,5xx,408,409,425,429", value_parser = parse_status_set)]
    pub release_on: StatusSet,
    /// Before an attempt after the first runs (an earlier one's answer was lost or timed out,
    /// or released the key), ask the upstream whether it took effect: `[METHOD ]/path/{key}` or
    /// an `http(s)://` URL with `{key}`. A 2xx or a 4xx other than 404 is adopted as the key's
    /// outcome and nothing runs again; 404 lets the attempt run; anything else keeps the key in
    /// flight (503). See docs/RECONCILE.md.
    #[arg(long, env = "IDEM_RECONCILE", value_parser = crate::reconcile::parse_reconcile)]
    pub reconcile: Option<crate::reconcile::ReconcileTemplate>,
    /// How long a client may take to send a request's headers (the connection is closed after).
    #[arg(long, env = "IDEM_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_client_timeout)]
    pub header_timeout: Duration,
    /// How long a client may take to send a request's body (408 after it; nothing runs).
    #[arg(long, env = "IDEM_BODY_TIMEOUT", default_value = "30s", value_parser = parse_client_timeout)]
    pub body_timeout: Duration,
    /// How many client connections are served at once (more wait to be accepted).
    #[arg(long, env = "IDEM_MAX_CONNECTIONS", default_value = "512", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_connections: u32,
    /// How often expired records are purged, in batches of 1000 (`off`: never; the store's
    /// table then grows until `idem keys purge` runs). Ignored by stores that expire records by
    /// themselves (Redis).
    #[arg(long, env = "IDEM_PURGE_EVERY", default_value = "1m", value_parser = parse_purge_every)]
    pub purge_every: PurgeEvery,
    /// How long shutdown waits for running requests; what still runs after it is abandoned to
    /// its lease, and a retry takes it over.
    #[arg(long, env = "IDEM_DRAIN_TIMEOUT", default_value = "30s", value_parser = parse_drain_timeout)]
    pub drain_timeout: Duration,
    /// After SIGTERM, how long the gateway goes on serving while `/_idem/readyz` answers 503,
    /// before it stops accepting and drains: time for load balancers to take it out of
    /// rotation (Kubernetes removes a terminating pod's endpoints in parallel with the signal).
    #[arg(long, env = "IDEM_DRAIN_DELAY", default_value = "0s", value_parser = parse_drain_delay)]
    pub drain_delay: Duration,
    /// How each guarded request's log event shows its key: `hash` (a digest: lines of one key
    /// can be found together, and nothing a client sent is written down), `plain` or `off`.
    #[arg(long, env = "IDEM_LOG_KEYS", default_value = "hash")]
    pub log_keys: idempotency_http::KeyLog,
}

impl Config {
    /// The checks that involve more than one flag.
    ///
    /// # Errors
    ///
    /// [`FlagError::Conflict`] saying which flags and why.
    pub fn check(&self) -> Result<(), FlagError> {
        if self.max_buffered < self.max_body {
            return Err(FlagError::Conflict(
                "--max-buffered is smaller than --max-body: a body of the largest size allowed could never be buffered",
            ));
        }
        let upstream_tls = self.upstream_ca.is_some()
            || self.upstream_client_cert.is_some()
            || self.upstream_insecure_skip_verify;
        if upstream_tls && self.upstream.scheme_str() != Some("https") {
            return Err(FlagError::Conflict(
                "--upstream-ca, --upstream-client-cert and --upstream-insecure-skip-verify are for an https:// upstream; this one is http://",
            ));
        }
        if self.upstream_insecure_skip_verify && self.upstream_ca.is_some() {
            return Err(FlagError::Conflict(
                "--upstream-insecure-skip-verify verifies nothing, so --upstream-ca would be ignored: give one or the other",
            ));
        }
        if self.routes.iter().any(|route| {
            route
                .max_body
                .is_some_and(|max_body| max_body > self.max_buffered)
        }) {
            return Err(FlagError::Conflict(
                "a route's max-body is larger than --max-buffered: a body of the largest size it allows could never be buffered",
            ));
        }
        Ok(())
    }

    /// How the gateway verifies an https upstream and presents itself to it.
    #[must_use]
    pub fn upstream_tls(&self) -> ClientFiles {
        ClientFiles {
            ca: self.upstream_ca.clone(),
            cert: self.upstream_client_cert.clone(),
            key: self.upstream_client_key.clone(),
            insecure_skip_verify: self.upstream_insecure_skip_verify,
        }
    }

    /// The listener's certificate files, when it serves HTTPS.
    #[must_use]
    pub fn listener_tls(&self) -> Option<ServerFiles> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(ServerFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.tls_client_ca.clone(),
            }),
            _ => None,
        }
    }
}

impl Default for Config {
    /// The defaults clap holds for the flags (nothing is written twice), read without the
    /// `IDEM_*` environment, with an upstream on `http://127.0.0.1:3000`.
    fn default() -> Self {
        use clap::{Args, FromArgMatches};
        let command = Self::augment_args(clap::Command::new("idem serve")).mut_args(|arg| arg.env(None));
        command
            .try_get_matches_from(["idem serve", "--upstream", "http://127.0.0.1:3000"])
            .and_then(|matches| Self::from_arg_matches(&matches))
            .expect("the flags' defaults parse (tested)")
    }
}

/// `idem serve`'s command line as the binary parses it: what a reload merges the configuration
/// file with again.
pub(super) fn command() -> clap::Command {
    use clap::Args;
    clap::Command::new("idem").subcommand(Config::augment_args(clap::Command::new("serve")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flags::UpstreamError;

    #[test]
    fn the_default_is_the_flags_defaults_whatever_the_environment() {
        let config = Config::default();
        assert_eq!(config.listen, SocketAddr::from(([127, 0, 0, 1], 8080)));
        assert_eq!(config.store, "sqlite://idem.db");
        assert_eq!(config.lease, Duration::from_secs(30));
        assert_eq!(config.retention, Duration::from_secs(86_400));
        assert_eq!((config.max_body, config.max_response), (1 << 20, 1 << 20));
        assert_eq!(config.methods, vec![Method::POST, Method::PATCH]);
        assert_eq!(config.upstream_timeout, Duration::from_secs(60));
        assert!(!config.require_key && !config.fail_open);
        assert!(config.scope_header.is_none() && config.wait.is_none() && config.admin_listen.is_none());
        assert_eq!(config.upstream, "http://127.0.0.1:3000");
    }

    #[test]
    fn upstreams_and_flags_are_refused_with_the_reason() {
        assert!(parse_upstream("https://a").is_ok());
        assert_eq!(
            parse_upstream("ftp://a").unwrap_err().to_string(),
            "`ftp://a`: the upstream must be an http:// or https:// URL"
        );
        assert!(matches!(
            parse_upstream("http://a/?q=1"),
            Err(UpstreamError::Query(_))
        ));
        assert!(matches!(
            parse_upstream("ftp://a"),
            Err(UpstreamError::NotHttp(_))
        ));
        assert!(matches!(
            parse_upstream("not a url"),
            Err(UpstreamError::NotAUrl { .. })
        ));
        assert_eq!(parse_method("patch"), Ok(Method::PATCH));
        assert!(parse_method("FETCH").is_err());
        assert!(parse_header_name("bad header").is_err());
    }

    #[test]
    fn release_on_takes_classes_codes_or_none() {
        use http::StatusCode;
        let default = Config::default().release_on;
        for (code, released) in [(500, true), (503, true), (429, true), (408, true), (302, true)] {
            assert_eq!(
                default.contains(StatusCode::from_u16(code).unwrap()),
                released,
                "{code}"
            );
        }
        for code in [200, 201, 400, 404, 422] {
            assert!(!default.contains(StatusCode::from_u16(code).unwrap()), "{code}");
        }
        let stripe = parse_status_set("408, 409,425,429").unwrap();
        assert!(!stripe.contains(StatusCode::INTERNAL_SERVER_ERROR));
        assert!(stripe.contains(StatusCode::TOO_MANY_REQUESTS));
        assert!(
            !parse_status_set("none")
                .unwrap()
                .contains(StatusCode::BAD_GATEWAY)
        );
        for bad in ["", "6xx", "0xx", "55xx", "5x", "99", "600", "abc", "429,", "4290"] {
            assert_eq!(
                parse_status_set(bad),
                Err(FlagError::Status(
                    bad.rsplit(',').next().unwrap().trim().to_owned()
                )),
                "{bad}"
            );
        }
    }
}

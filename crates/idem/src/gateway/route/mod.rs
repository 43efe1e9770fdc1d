//! A `[[route]]` of the configuration file: what it may set ([`RouteSpec`], [`ROUTE_KEYS`]),
//! how the file's table is read into it (`parse`) and the defaults of the settings the gateway
//! has no flag for ([`own_default`]); `effect.rs` beside it says what it falls back to where it
//! sets nothing (the gateway's settings: `Effective::of`) and what each setting does (the
//! route's layer, `layer`, and its published policy, `policy`).
//!
//! A new per-route setting is a field of [`RouteSpec`] and of the table as written (`RawRoute`),
//! a key of [`ROUTE_KEYS`] and its parse in `parse`, here; its fallback in `Effective::of` and
//! its effect in `layer` (or the proxy's), in `effect.rs`; a setting the gateway also has as a
//! flag adds that flag to [`Config`](super::Config).

pub(crate) mod effect;

use std::fmt;
use std::ops::Range;
use std::time::Duration;

use http::{HeaderName, Method, Uri};
use idempotency::{FingerprintMode, JsonPointer};
use serde::Deserialize;
use toml::Spanned;

use crate::flags::{
    StatusSet, parse_header_name, parse_lease, parse_limit, parse_method, parse_retention, parse_status_set,
    parse_upstream, parse_upstream_timeout, parse_wait,
};
use crate::reconcile::ReconcileTemplate;

/// How a route fingerprints the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteFingerprint {
    /// The whole body, as the gateway's default does.
    Body,
    /// Not the body: method, path and query only.
    Nothing,
    /// The members at these JSON pointers (a member the body lacks counts as `null`).
    Members(Vec<JsonPointer>),
}

impl RouteFingerprint {
    /// The layer's mode.
    #[must_use]
    pub fn mode(&self) -> FingerprintMode {
        match self {
            Self::Body => FingerprintMode::Raw,
            Self::Nothing => FingerprintMode::Ignore,
            Self::Members(pointers) => FingerprintMode::JsonPointers(pointers.clone()),
        }
    }
}

/// A `[[route]]`: which requests it takes (a path and, optionally, methods) and the settings
/// that differ from the gateway's for them. `None` is "as the gateway's".
#[derive(Debug, Clone)]
pub struct RouteSpec {
    /// The route's name in logs and metrics: `name`, or the path.
    pub name: String,
    /// A segment prefix: `/v1/payments` takes `/v1/payments` and `/v1/payments/42`, never
    /// `/v1/payments-export`. No trailing slash (but `/`, which takes every path).
    pub path: String,
    /// The methods it takes (and guards); `None`: every method, the gateway's guarded.
    pub methods: Option<Vec<Method>>,
    /// `false`: forwarded untouched, never recorded.
    pub guard: bool,
    /// Whether a key is required.
    pub require_key: Option<bool>,
    /// The lease.
    pub lease: Option<Duration>,
    /// The retention.
    pub retention: Option<Duration>,
    /// Wait mode's deadline.
    pub wait: Option<Duration>,
    /// The statuses that release the key.
    pub release_on: Option<StatusSet>,
    /// The largest request body.
    pub max_body: Option<usize>,
    /// The largest stored response.
    pub max_response: Option<usize>,
    /// The key's header.
    pub key_header: Option<HeaderName>,
    /// Where in a JSON body the key is, when the header is absent.
    pub key_from: Option<JsonPointer>,
    /// How the body is fingerprinted.
    pub fingerprint: Option<RouteFingerprint>,
    /// The header whose value scopes the keys.
    pub scope_header: Option<HeaderName>,
    /// Another upstream.
    pub upstream: Option<Uri>,
    /// The upstream's timeout.
    pub upstream_timeout: Option<Duration>,
    /// The reconcile hook's question.
    pub reconcile: Option<ReconcileTemplate>,
    /// The line of the `[[route]]` header.
    pub line: usize,
    /// The keys the route sets, with their values as written, in the order of [`ROUTE_KEYS`].
    pub written: Vec<(&'static str, String)>,
}

/// The settings a route may set, besides `name` and `path`, in the order `--check` prints them.
pub const ROUTE_KEYS: [&str; 16] = [
    "methods",
    "guard",
    "require-key",
    "lease",
    "retention",
    "wait",
    "release-on",
    "max-body",
    "max-response",
    "key-header",
    "key-from",
    "fingerprint",
    "scope-header",
    "upstream",
    "upstream-timeout",
    "reconcile",
];

/// The default of a route setting that the gateway has no flag for, as `--check` prints it;
/// `None` for the settings that fall back to the gateway's flag of the same name.
#[must_use]
pub fn own_default(key: &str) -> Option<&'static str> {
    match key {
        "guard" => Some("true"),
        "key-header" => Some("Idempotency-Key"),
        "key-from" => Some("none"),
        "fingerprint" => Some("body"),
        _ => None,
    }
}

impl RouteSpec {
    /// Whether the route takes a request to `path` with `method`.
    #[must_use]
    pub fn matches(&self, method: &Method, path: &str) -> bool {
        self.takes_path(path)
            && self
                .methods
                .as_ref()
                .is_none_or(|methods| methods.contains(method))
    }

    fn takes_path(&self, path: &str) -> bool {
        self.path == "/"
            || path
                .strip_prefix(self.path.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    }

    /// Whether every request this route takes is taken by `earlier` first.
    pub(crate) fn shadowed_by(&self, earlier: &Self) -> bool {
        let methods = match (&earlier.methods, &self.methods) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(earlier), Some(these)) => these.iter().all(|method| earlier.contains(method)),
        };
        methods && earlier.takes_path(&self.path)
    }
}

/// A `[[route]]` table as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct RawRoute {
    name: Option<Spanned<String>>,
    path: Spanned<String>,
    methods: Option<Spanned<Vec<Spanned<String>>>>,
    guard: Option<bool>,
    require_key: Option<bool>,
    lease: Option<Spanned<String>>,
    retention: Option<Spanned<String>>,
    wait: Option<Spanned<String>>,
    release_on: Option<Spanned<String>>,
    max_body: Option<Spanned<RawSize>>,
    max_response: Option<Spanned<RawSize>>,
    key_header: Option<Spanned<String>>,
    key_from: Option<Spanned<String>>,
    fingerprint: Option<Spanned<RawFingerprint>>,
    scope_header: Option<Spanned<String>>,
    upstream: Option<Spanned<String>>,
    upstream_timeout: Option<Spanned<String>>,
    reconcile: Option<Spanned<String>>,
}

/// A size: `"1MiB"` as the flags take it, or a number of bytes.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawSize {
    Bytes(u64),
    Text(String),
}

impl RawSize {
    /// As the flags take it.
    fn text(&self) -> String {
        match self {
            Self::Bytes(bytes) => bytes.to_string(),
            Self::Text(text) => text.clone(),
        }
    }
}

/// `"body"`, `"none"`, or a list of JSON pointers.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawFingerprint {
    Named(String),
    Pointers(Vec<String>),
}

/// What `raw` sets, as written.
fn written(raw: &RawRoute) -> Vec<(&'static str, String)> {
    let text = |value: &Option<Spanned<String>>| value.as_ref().map(|value| value.get_ref().clone());
    let size = |value: &Option<Spanned<RawSize>>| value.as_ref().map(|value| value.get_ref().text());
    let values = [
        raw.methods.as_ref().map(|methods| {
            methods
                .get_ref()
                .iter()
                .map(|method| method.get_ref().clone())
                .collect::<Vec<_>>()
                .join(",")
        }),
        raw.guard.map(|guard| guard.to_string()),
        raw.require_key.map(|require| require.to_string()),
        text(&raw.lease),
        text(&raw.retention),
        text(&raw.wait),
        text(&raw.release_on),
        size(&raw.max_body),
        size(&raw.max_response),
        text(&raw.key_header),
        text(&raw.key_from),
        raw.fingerprint
            .as_ref()
            .map(|fingerprint| match fingerprint.get_ref() {
                RawFingerprint::Named(name) => name.clone(),
                RawFingerprint::Pointers(pointers) => pointers.join(","),
            }),
        text(&raw.scope_header),
        text(&raw.upstream),
        text(&raw.upstream_timeout),
        text(&raw.reconcile),
    ];
    ROUTE_KEYS
        .into_iter()
        .zip(values)
        .filter_map(|(key, value)| value.map(|value| (key, value)))
        .collect()
}

/// The route the table `raw` (at `line`) describes; an error names the span of the value it
/// refuses and why.
pub(crate) fn parse(raw: RawRoute, line: usize) -> Result<RouteSpec, (Range<usize>, String)> {
    let written = written(&raw);
    fn parsed<T, E: fmt::Display>(
        value: Option<Spanned<String>>,
        key: &str,
        parse: impl Fn(&str) -> Result<T, E>,
    ) -> Result<Option<T>, (Range<usize>, String)> {
        value
            .map(|value| parse(value.get_ref()).map_err(|error| (value.span(), format!("`{key}`: {error}"))))
            .transpose()
    }
    let size = |value: Option<Spanned<RawSize>>, key: &str| {
        value
            .map(|value| {
                parse_limit(&value.get_ref().text())
                    .map_err(|error| (value.span(), format!("`{key}`: {error}")))
            })
            .transpose()
    };
    let pointer = |text: &str| {
        JsonPointer::new(text)
            .map_err(|_| format!("`{text}` is not a JSON pointer (RFC 6901: empty, or starting with /)"))
    };
    let path_span = raw.path.span();
    let path = raw.path.into_inner();
    if !path.starts_with('/') || path.contains(['?', '#', ' ']) {
        return Err((
            path_span,
            format!("`path`: `{path}` is not a path: it starts with / and has no query"),
        ));
    }
    // No trailing slash, but `/` itself.
    let trimmed = path.trim_end_matches('/');
    let path = if trimmed.is_empty() { "/" } else { trimmed }.to_owned();
    let methods = match raw.methods {
        None => None,
        Some(methods) => {
            let span = methods.span();
            let methods: Vec<Method> = methods
                .into_inner()
                .into_iter()
                .map(|method| {
                    parse_method(method.get_ref())
                        .map_err(|error| (method.span(), format!("`methods`: {error}")))
                })
                .collect::<Result<_, _>>()?;
            if methods.is_empty() {
                return Err((
                    span,
                    "`methods`: an empty list takes no request; leave `methods` out to take every method"
                        .into(),
                ));
            }
            Some(methods)
        }
    };
    let fingerprint = match raw.fingerprint {
        None => None,
        Some(value) => {
            let span = value.span();
            Some(match value.into_inner() {
                RawFingerprint::Named(name) if name == "body" => RouteFingerprint::Body,
                RawFingerprint::Named(name) if name == "none" => RouteFingerprint::Nothing,
                RawFingerprint::Named(name) => {
                    return Err((
                        span,
                        format!(
                            "`fingerprint`: `{name}` is none of \"body\", \"none\" or a list of JSON pointers"
                        ),
                    ));
                }
                RawFingerprint::Pointers(pointers) => RouteFingerprint::Members(
                    pointers
                        .iter()
                        .map(|text| pointer(text))
                        .collect::<Result<_, _>>()
                        .map_err(|why| (span.clone(), format!("`fingerprint`: {why}")))?,
                ),
            })
        }
    };
    Ok(RouteSpec {
        name: raw.name.map_or_else(|| path.clone(), Spanned::into_inner),
        methods,
        guard: raw.guard.unwrap_or(true),
        require_key: raw.require_key,
        lease: parsed(raw.lease, "lease", parse_lease)?,
        retention: parsed(raw.retention, "retention", parse_retention)?,
        wait: parsed(raw.wait, "wait", parse_wait)?,
        release_on: parsed(raw.release_on, "release-on", parse_status_set)?,
        max_body: size(raw.max_body, "max-body")?,
        max_response: size(raw.max_response, "max-response")?,
        key_header: parsed(raw.key_header, "key-header", parse_header_name)?,
        key_from: parsed(raw.key_from, "key-from", pointer)?,
        fingerprint,
        scope_header: parsed(raw.scope_header, "scope-header", parse_header_name)?,
        upstream: parsed(raw.upstream, "upstream", parse_upstream)?,
        upstream_timeout: parsed(raw.upstream_timeout, "upstream-timeout", parse_upstream_timeout)?,
        reconcile: parsed(raw.reconcile, "reconcile", crate::reconcile::parse_reconcile)?,
        path,
        line,
        written,
    })
}

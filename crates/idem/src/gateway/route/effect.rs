//! What a route's settings do: its fallback to the gateway's where it sets nothing
//! ([`Effective`]), the layer built from them ([`layer`]) and the policy they publish
//! ([`policy`]).

use std::time::Duration;

use http::{HeaderName, Method, Uri};
use idempotency::{DynStore, JsonPointer, ScopeSecret};
use idempotency_http::IdempotencyLayer;

use super::{RouteFingerprint, RouteSpec};
use crate::flags::StatusSet;
use crate::gateway::config::Config;
use crate::reconcile::ReconcileTemplate;

/// A route's settings over the gateway's (or the gateway's alone): what its layer is built
/// with, and what its policy publishes.
pub(crate) struct Effective<'a> {
    name: &'a str,
    /// The methods guarded.
    methods: &'a [Method],
    require_key: bool,
    max_body: usize,
    pub(crate) max_response: usize,
    lease: Duration,
    retention: Duration,
    wait: Option<Duration>,
    release_on: &'a StatusSet,
    key_header: Option<&'a HeaderName>,
    key_from: Option<&'a JsonPointer>,
    fingerprint: Option<&'a RouteFingerprint>,
    scope_header: Option<&'a HeaderName>,
    pub(crate) upstream: &'a Uri,
    pub(crate) upstream_timeout: Duration,
    pub(crate) reconcile: Option<&'a ReconcileTemplate>,
}

impl<'a> Effective<'a> {
    /// `route`'s settings over `config`'s, or `config`'s alone.
    pub(crate) fn of(config: &'a Config, route: Option<&'a RouteSpec>) -> Self {
        Self {
            name: route.map_or("gateway", |route| route.name.as_str()),
            methods: route
                .and_then(|route| route.methods.as_deref())
                .unwrap_or(&config.methods),
            require_key: route.and_then(|r| r.require_key).unwrap_or(config.require_key),
            max_body: route.and_then(|r| r.max_body).unwrap_or(config.max_body),
            max_response: route.and_then(|r| r.max_response).unwrap_or(config.max_response),
            lease: route.and_then(|r| r.lease).unwrap_or(config.lease),
            retention: route.and_then(|r| r.retention).unwrap_or(config.retention),
            wait: route.and_then(|r| r.wait).or(config.wait),
            release_on: route
                .and_then(|r| r.release_on.as_ref())
                .unwrap_or(&config.release_on),
            key_header: route.and_then(|r| r.key_header.as_ref()),
            key_from: route.and_then(|r| r.key_from.as_ref()),
            fingerprint: route.and_then(|r| r.fingerprint.as_ref()),
            scope_header: route
                .and_then(|r| r.scope_header.as_ref())
                .or(config.scope_header.as_ref()),
            upstream: route
                .and_then(|r| r.upstream.as_ref())
                .unwrap_or(&config.upstream),
            upstream_timeout: route
                .and_then(|r| r.upstream_timeout)
                .unwrap_or(config.upstream_timeout),
            reconcile: route
                .and_then(|r| r.reconcile.as_ref())
                .or(config.reconcile.as_ref()),
        }
    }
}

/// The gateway's layer with `route`'s settings over `config`'s, or `config`'s alone.
pub(crate) fn layer(
    config: &Config,
    store: &DynStore,
    route: Option<&RouteSpec>,
) -> IdempotencyLayer<DynStore> {
    let settings = Effective::of(config, route);
    let mut layer = IdempotencyLayer::new(store.clone())
        .name(settings.name.to_owned())
        .methods(settings.methods.iter().cloned())
        .require_key(settings.require_key)
        .max_body(settings.max_body)
        .max_response(settings.max_response)
        // The upstream chunks as it likes: store what ends within the limit all the same.
        .buffer_streamed_responses(true)
        .lease(settings.lease)
        .retention(settings.retention)
        .fail_open(config.fail_open)
        .log_keys(config.log_keys);
    if let Some(header) = settings.key_header {
        layer = layer.key_header(header.clone());
    }
    if let Some(pointer) = settings.key_from {
        layer = layer.key_from(pointer.clone());
    }
    if let Some(fingerprint) = settings.fingerprint {
        layer = layer.fingerprint(fingerprint.mode());
    }
    if let Some(name) = settings.scope_header {
        // `serve` fills the secret in from the store when the flag is absent; a router built
        // without one (a test) gets a fresh secret of its own.
        let secret = config.scope_secret.clone().unwrap_or_else(ScopeSecret::generate);
        layer = layer.scope_from_header(name.clone(), secret);
    }
    let release_on = settings.release_on.clone();
    layer = layer.final_status(move |status| !release_on.contains(status));
    if let Some(deadline) = settings.wait {
        layer = layer.wait(deadline);
    }
    layer
}

/// The published policy (`/_idem/policy`): for each route in file order, then for the requests
/// no route takes, what a client may rely on. The schema is in `docs/HTTP.md`.
pub(crate) fn policy(config: &Config) -> serde_json::Value {
    let entry = |route: Option<&RouteSpec>| {
        let settings = Effective::of(config, route);
        let guarded = route.is_none_or(|route| route.guard);
        let names = |methods: &[Method]| methods.iter().map(ToString::to_string).collect::<Vec<_>>();
        let seconds = |duration: Duration| duration.as_secs_f64();
        let (body, members) = match settings.fingerprint {
            None | Some(RouteFingerprint::Body) => ("whole", Vec::new()),
            Some(RouteFingerprint::Nothing) => ("none", Vec::new()),
            Some(RouteFingerprint::Members(pointers)) => (
                "members",
                pointers
                    .iter()
                    .map(|pointer| pointer.as_str().to_owned())
                    .collect(),
            ),
        };
        serde_json::json!({
            "name": settings.name,
            "path": route.map(|route| route.path.as_str()),
            "methods": route.and_then(|route| route.methods.as_deref()).map(names),
            "guarded": guarded,
            "guarded_methods": if guarded { names(settings.methods) } else { Vec::new() },
            "key_header": settings
                .key_header
                .map_or("Idempotency-Key".to_owned(), |header| canonical_header(header.as_str())),
            "key_from": settings.key_from.map(|pointer| pointer.as_str()),
            "require_key": settings.require_key,
            "retention_seconds": seconds(settings.retention),
            "lease_seconds": seconds(settings.lease),
            "wait_seconds": settings.wait.map(seconds),
            "release_on": settings.release_on.items(),
            "fingerprint": {
                "method_and_target": true,
                "body": body,
                "members": members,
            },
        })
    };
    serde_json::json!({
        "routes": config.routes.iter().map(|route| entry(Some(route))).collect::<Vec<_>>(),
        "default": entry(None),
    })
}

/// `x-request-id` as `X-Request-Id`: header names are case-insensitive, and this is how people
/// write them.
fn canonical_header(name: &str) -> String {
    name.split('-')
        .map(|word| {
            let mut chars = word.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_ascii_uppercase().to_string() + chars.as_str()
            })
        })
        .collect::<Vec<_>>()
        .join("-")
}

//! A `tower` layer that gives any HTTP service Stripe-grade `Idempotency-Key` semantics
//! (draft-ietf-httpapi-idempotency-key-header), on any store of the idempotency toolkit.
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use idempotency_core::MemoryStore;
//! use idempotency_http::IdempotencyLayer;
//!
//! let store = MemoryStore::new(); // or SqliteStore, PostgresStore, RedisStore
//! let app: Router = Router::new()
//!     .route("/charges", post(|| async { "charged" }))
//!     .layer(IdempotencyLayer::new(store).require_key(true));
//! # let _ = app;
//! ```
//!
//! # What a request goes through
//!
//! | request | answer |
//! |---|---|
//! | method not guarded (default: not POST or PATCH) | passed through untouched |
//! | no `Idempotency-Key` | passed through, or `400` when the route requires a key |
//! | malformed key, or two `Idempotency-Key` headers | `400` |
//! | body over the limit (`Content-Length` first, then while reading) | `413`, the handler does not run |
//! | first use of the key | the handler runs under a lease kept alive by a heartbeat, and finishes even if the client goes away; a final response is stored, a retryable one releases the key |
//! | same key, same request, completed | the stored status, headers and body, plus `Idempotent-Replayed: true` |
//! | same key, same request, still running | `409` with `Retry-After`, or in wait mode the replay once it completes |
//! | same key, other payload, method or path | `422`, nothing runs |
//! | store unreachable | `503` with `Retry-After`, nothing runs (or, with fail-open, the handler runs) |
//! | handler panics, 5xx, 408, 409, 425, 429 | the key is released; the retry runs again |
//! | response too large to store, or streamed | passed through; the key is completed as not replayable, and a retry gets `409` (never a second run) |
//! | same key, after an attempt whose outcome is unknown and whose lease ended | runs again as a recovered attempt; with a [reconcile function](IdempotencyLayer::reconcile), only once it said the earlier attempt did not take effect (else its answer is adopted, or `503` and nothing runs) |
//!
//! A client that disconnects cannot cancel the handler halfway: if the request's future is
//! dropped before the guarded run is done, the run moves onto a task of its own and finishes
//! there, its outcome is stored, and the client's retry gets the replay. (It is polled in place
//! otherwise, which saves a task switch per request.) The layer owns those runs
//! ([`IdempotencyLayer::detached_runs`]): a server waits for them before it exits.
//!
//! Every stored response carries `Idempotency-Key-Expires` (an HTTP-date): retries after that run
//! again. Hop-by-hop headers are never stored; `Set-Cookie` and other credential headers are not
//! stored unless allowed with [`IdempotencyLayer::store_header`].
//!
//! The handler finds the [`IdempotencyKey`] in the request's extensions. Its
//! [`IdempotencyKey::message_key`] goes on the messages the handler publishes (the
//! `Idempotency-Key` header that consumers read by default) and the calls it makes downstream,
//! so an API retry and a broker redelivery meet at one idempotency boundary.
//!
//! Errors are RFC 9457 `application/problem+json` documents with a stable `type` per
//! [`Problem`].
//!
//! Response bodies are stored when their size is known and within the limit; a body of unknown
//! length (a stream) is passed through as not replayable.

/// The HTTP guide (`docs/HTTP.md`): what a request goes through, keys, fingerprints, outcomes
/// and the problem documents.
#[doc = include_str!("../../../docs/HTTP.md")]
pub mod guide {}

/// The reconcile guide (`docs/RECONCILE.md`): the hook that asks a service whether an attempt
/// whose answer was lost took effect, and the contract for the lookup that answers it.
#[doc = include_str!("../../../docs/RECONCILE.md")]
pub mod reconcile_guide {}

mod body;
mod capture;
mod config;
mod fingerprint;
mod future;
mod key;
mod layer;
pub mod log;
mod outcome;
mod policy;
mod problem;
pub mod reconcile;
mod replay;
mod run;
mod service;
mod stored;

pub use body::{BoxError, ResponseBody};
pub use config::default_is_final;
pub use future::{DetachedRuns, ResponseFuture};
pub use key::{IDEMPOTENCY_KEY, IdempotencyKey, KeyHeaderError, key_from_header, key_from_headers};
pub use layer::IdempotencyLayer;
pub use log::KeyLog;
pub use outcome::OutcomeUnknown;
pub use policy::{HOP_BY_HOP, strip_hop_by_hop};
pub use problem::Problem;
pub use reconcile::{IDEMPOTENCY_RECONCILED, Reconcile, Reconciled};
pub use replay::{IDEMPOTENCY_KEY_EXPIRES, IDEMPOTENT_REPLAYED};
pub use service::IdempotencyService;
pub use stored::Stored as StoredOutcome;

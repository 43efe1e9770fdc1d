//! The marks a response carries in its extensions to say what its outcome is, whatever its
//! status: set by a handler or by the layer's own steps, read by the outcome policy.

/// Marks a response whose request may have taken effect although the response says it failed
/// (a proxy that sent the request and lost the answer, a handler whose remote call timed out):
/// the layer then neither stores nor releases the key, but leaves it in flight until its lease
/// ends ([`Decision::Unknown`](idempotency_core::Decision::Unknown)), so that a retry cannot run the request again while the first
/// may still be taking effect.
///
/// A handler inserts it into the response's extensions; [`Problem`](crate::Problem)s with an
/// unknown outcome carry it already.
///
/// ```
/// use http::{Response, StatusCode};
/// use idempotency_http::OutcomeUnknown;
///
/// let mut response = Response::new("the payment provider did not answer in time");
/// *response.status_mut() = StatusCode::GATEWAY_TIMEOUT;
/// response.extensions_mut().insert(OutcomeUnknown);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutcomeUnknown;

/// Marks a captured response that was adopted from a reconcile function: stored whatever the
/// outcome policy says of its status.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Adopted;

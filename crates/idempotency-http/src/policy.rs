//! What is stored of a response: whether it is final (the outcome policy), and which of its
//! headers are kept.

use http::{HeaderMap, header};
use idempotency_core::Decision;

use crate::capture::Captured;
use crate::config::Config;
use crate::outcome::{Adopted, OutcomeUnknown};
use crate::stored;

/// The outcome policy of the layer: a response marked [`OutcomeUnknown`], a service error and a
/// body that failed midway are unknown; otherwise a final status is stored and any other
/// releases the key.
pub(crate) fn decide<B, E>(captured: &Captured<B, E>, config: &Config) -> Decision {
    match captured {
        Captured::Buffered { parts, .. } | Captured::Streaming { parts, .. }
            if parts.extensions.get::<OutcomeUnknown>().is_some() =>
        {
            Decision::Unknown
        }
        // A final answer is stored; a reconcile function's is the key's outcome whatever its
        // status.
        Captured::Buffered { parts, body }
            if (config.is_final)(parts.status) || parts.extensions.get::<Adopted>().is_some() =>
        {
            Decision::Complete(stored::encode_response(
                parts.status,
                &storable_headers(&parts.headers, config),
                body,
            ))
        }
        Captured::Streaming { parts, .. } if (config.is_final)(parts.status) => {
            Decision::Complete(stored::encode_not_replayable())
        }
        // The service's error does not say whether the request took effect, and a body that
        // failed midway comes from a handler that already ran.
        Captured::Failed(_) | Captured::BodyFailed(_) => Decision::Unknown,
        Captured::Buffered { .. } | Captured::Streaming { .. } => Decision::Release,
    }
}

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1, with the older
/// `Keep-Alive`, `Proxy-Connection`, `Proxy-Authenticate` and `Proxy-Authorization`): never
/// stored by the layer, and never forwarded by a proxy (the `idem` gateway strips them).
pub const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Never stored besides the hop-by-hop headers: framing and date, which the server sets anew,
/// and this layer's own headers.
const NOT_REPLAYED: [&str; 4] = [
    "content-length",
    "date",
    "idempotent-replayed",
    "idempotency-key-expires",
];

/// The headers the `Connection` header names: hop-by-hop for this message.
fn named_by_connection(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .collect()
}

/// Removes the hop-by-hop headers ([`HOP_BY_HOP`], and those the `Connection` header names),
/// as a proxy must before it forwards a message.
///
/// One pass over the names the message has, removing only those it must: most messages have
/// none, and removing each of the nine by its text parsed and hashed every name on every
/// request, in each direction (a twentieth of the gateway's instructions per request).
///
/// ```
/// use http::{HeaderMap, HeaderValue};
/// use idempotency_http::strip_hop_by_hop;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("connection", HeaderValue::from_static("close, x-trace"));
/// headers.insert("x-trace", HeaderValue::from_static("1"));
/// headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
/// headers.insert("content-type", HeaderValue::from_static("application/json"));
/// strip_hop_by_hop(&mut headers);
/// assert_eq!(headers.keys().map(|k| k.as_str()).collect::<Vec<_>>(), ["content-type"]);
/// ```
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named = named_by_connection(headers);
    let doomed: Vec<header::HeaderName> = headers
        .keys()
        .filter(|name| HOP_BY_HOP.contains(&name.as_str()) || named.iter().any(|n| n == name.as_str()))
        .cloned()
        .collect();
    for name in doomed {
        headers.remove(name);
    }
}

/// Not stored unless allowed ([`crate::IdempotencyLayer::store_header`]): credentials.
const CREDENTIALS: [&str; 5] = [
    "set-cookie",
    "set-cookie2",
    "authorization",
    "proxy-authorization",
    "cookie",
];

fn storable_headers(headers: &HeaderMap, config: &Config) -> HeaderMap {
    let listed_by_connection = named_by_connection(headers);
    let mut kept = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let name_str = name.as_str();
        let hop = HOP_BY_HOP.contains(&name_str)
            || NOT_REPLAYED.contains(&name_str)
            || listed_by_connection.iter().any(|n| n == name_str);
        let secret = CREDENTIALS.contains(&name_str) && !config.allowed_headers.contains(name);
        if !hop && !secret {
            kept.append(name.clone(), value.clone());
        }
    }
    kept
}

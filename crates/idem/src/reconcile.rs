//! The reconcile hook's request: `--reconcile 'GET /payments/by-key/{key}'`.
//!
//! Before an attempt after the first runs (an earlier attempt's answer was lost, timed out, or
//! released the key), `idem serve` and `idem consume` ask the service whether that attempt took
//! effect, with the request this template makes for the key. The contract for the service's
//! authors is in `docs/RECONCILE.md`:
//!
//! | the hook answers | the key |
//! |---|---|
//! | `2xx`, or a `4xx` other than `404` | the answer is what the earlier attempt answered: stored as the key's outcome, nothing runs again |
//! | `404` | the earlier attempt did not take effect: this attempt runs |
//! | anything else, nothing within the timeout, garbage | nothing runs; the key stays in flight until this attempt's lease ends |
//!
//! A template is `[METHOD ]TARGET` (the method defaults to `GET`): a path and query, sent to
//! the upstream (the route's, for a route), or an absolute `http(s)://` URL. `{key}` stands for
//! the key the upstream receives in `Idempotency-Key` (the scoped key), encoded only as much as
//! it must be to stay one path segment or query value (see [`crate::placeholder`]); it must
//! appear, and no other placeholder may.

use std::fmt;

use http::{Method, Uri};
use idempotency::Key;

/// The placeholder for the key.
const KEY: &str = "{key}";

/// A parsed `--reconcile` template.
#[derive(Clone, PartialEq, Eq)]
pub struct ReconcileTemplate {
    /// As written, for messages and `--check`.
    written: String,
    /// The method of the question.
    method: Method,
    /// `scheme://authority` for an absolute URL; `None` for the upstream's own.
    origin: Option<Uri>,
    /// The path and query, with each `{key}` in it.
    target: String,
}

impl fmt::Debug for ReconcileTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.written)
    }
}

impl fmt::Display for ReconcileTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.written)
    }
}

/// Why a template is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// Nothing in it.
    #[error(
        "the reconcile template is empty; it is `[METHOD ]/path/{{key}}` or `[METHOD ]https://host/path/{{key}}`"
    )]
    Empty,
    /// No `{key}`: every key would be asked the same question.
    #[error("`{0}` has no {{key}}: the question must name the key it asks about")]
    NoKey(String),
    /// A placeholder other than `{key}`, or an unmatched brace.
    #[error("`{template}`: `{placeholder}` is not a placeholder; the only one is {{key}}")]
    Placeholder {
        /// The template.
        template: String,
        /// What was found.
        placeholder: String,
    },
    /// The method is not one.
    #[error("`{0}` is not an HTTP method (GET, POST, ...)")]
    Method(String),
    /// The target is neither a path nor an `http(s)` URL, or is not a valid one.
    #[error("`{template}`: {why}")]
    Target {
        /// The template.
        template: String,
        /// What is wrong.
        why: String,
    },
}

impl ReconcileTemplate {
    /// Parses `[METHOD ]TARGET`.
    ///
    /// # Errors
    ///
    /// [`TemplateError`] for a template without `{key}`, with another placeholder, with a
    /// method that is not one, or whose target is not a path or an `http(s)://` URL.
    pub fn parse(text: &str) -> Result<Self, TemplateError> {
        let written = text.trim();
        if written.is_empty() {
            return Err(TemplateError::Empty);
        }
        let (method, target) = match written.split_once(char::is_whitespace) {
            Some((method, target)) => (
                Method::from_bytes(method.as_bytes())
                    .map_err(|_| TemplateError::Method(method.to_owned()))?,
                target.trim_start(),
            ),
            None => (Method::GET, written),
        };
        if !method.as_str().bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(TemplateError::Method(method.to_string()));
        }
        let target_error = |why: &str| TemplateError::Target {
            template: written.to_owned(),
            why: why.to_owned(),
        };
        let (origin, path) = if target.starts_with('/') {
            (None, target)
        } else if let Some(rest) = target
            .strip_prefix("http://")
            .or_else(|| target.strip_prefix("https://"))
        {
            let scheme_len = target.len() - rest.len();
            let path_at = rest.find('/').map_or(target.len(), |at| scheme_len + at);
            let origin: Uri = target[..path_at]
                .parse()
                .map_err(|_| target_error("the URL's host is not valid"))?;
            if origin.host().is_none_or(str::is_empty) {
                return Err(target_error("the URL has no host"));
            }
            if origin.authority().is_some_and(|a| a.as_str().contains('@')) {
                return Err(target_error(
                    "credentials in the URL would be sent in the clear to logs; pass them as the request's own headers",
                ));
            }
            (
                Some(origin),
                if path_at == target.len() {
                    "/"
                } else {
                    &target[path_at..]
                },
            )
        } else {
            return Err(target_error(
                "the target is a path starting with / or an http:// or https:// URL",
            ));
        };
        if path.contains(char::is_whitespace) || path.contains('#') {
            return Err(target_error("the target has whitespace or a fragment"));
        }
        let pieces: Vec<String> = path.split(KEY).map(str::to_owned).collect();
        for piece in &pieces {
            if let Some(at) = piece.find(['{', '}']) {
                let rest = &piece[at..];
                let end = rest.find('}').map_or(rest.len(), |end| end + 1);
                return Err(TemplateError::Placeholder {
                    template: written.to_owned(),
                    placeholder: rest[..end].to_owned(),
                });
            }
        }
        if pieces.len() < 2 {
            return Err(TemplateError::NoKey(written.to_owned()));
        }
        let template = Self {
            written: written.to_owned(),
            method,
            origin,
            target: path.to_owned(),
        };
        // Any key makes a valid target: the pieces do, and the key is encoded.
        template
            .target(&Key::new("k").expect("a valid key"))
            .parse::<http::uri::PathAndQuery>()
            .map_err(|error| target_error(&format!("not a valid path and query ({error})")))?;
        Ok(template)
    }

    /// The method of the question.
    #[must_use]
    pub fn method(&self) -> &Method {
        &self.method
    }

    /// The absolute URL's `scheme://authority`, or `None` when the question goes to the
    /// upstream.
    #[must_use]
    pub fn origin(&self) -> Option<&Uri> {
        self.origin.as_ref()
    }

    /// The path and query asking about `key`.
    #[must_use]
    pub fn target(&self, key: &Key) -> String {
        crate::placeholder::fill(&self.target, KEY, key.as_str())
    }
}

/// What the hook's answer status says (the table in the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Meaning {
    /// `2xx`, or a `4xx` other than `404`: the earlier attempt took effect, and this is its
    /// answer.
    Happened,
    /// `404`: it did not.
    DidNotHappen,
    /// Anything else: cannot tell now.
    Unknown,
}

impl Meaning {
    /// What `status` means.
    pub(crate) fn of(status: http::StatusCode) -> Self {
        if status == http::StatusCode::NOT_FOUND {
            Self::DidNotHappen
        } else if status.is_success() || status.is_client_error() {
            Self::Happened
        } else {
            Self::Unknown
        }
    }
}

/// `--reconcile`: a [`ReconcileTemplate`].
///
/// # Errors
///
/// [`TemplateError`], for the flag's message.
pub fn parse_reconcile(text: &str) -> Result<ReconcileTemplate, TemplateError> {
    ReconcileTemplate::parse(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(text: &str) -> Key {
        Key::new(text).unwrap()
    }

    #[test]
    fn a_template_asks_about_the_key_it_is_given() {
        let template = ReconcileTemplate::parse("GET /payments/by-key/{key}").unwrap();
        assert_eq!(template.method(), Method::GET);
        assert_eq!(template.origin(), None);
        assert_eq!(template.target(&key("pay-1")), "/payments/by-key/pay-1");
        // A key cannot become a separator, a query, a fragment or a dot-segment; what a path
        // segment may hold stays as it is.
        assert_eq!(
            template.target(&key("a/../b?c=d#e%f&g")),
            "/payments/by-key/a%2F..%2Fb%3Fc=d%23e%25f&g"
        );
        assert_eq!(template.target(&key("..")), "/payments/by-key/%2E%2E");
        assert_eq!(
            template.target(&key("order:12345.v3")),
            "/payments/by-key/order:12345.v3"
        );
        let template = ReconcileTemplate::parse("/lookup?id={key}&again={key}").unwrap();
        assert_eq!(template.method(), Method::GET);
        assert_eq!(
            template.target(&key("t:k&x=1")),
            "/lookup?id=t:k%26x%3D1&again=t:k%26x%3D1"
        );
        let template = ReconcileTemplate::parse("POST https://ledger.internal:8443/find/{key}").unwrap();
        assert_eq!(template.method(), Method::POST);
        assert_eq!(
            template.origin().map(ToString::to_string).as_deref(),
            Some("https://ledger.internal:8443/")
        );
        assert_eq!(template.target(&key("k")), "/find/k");
        assert_eq!(
            template.to_string(),
            "POST https://ledger.internal:8443/find/{key}"
        );
    }

    #[test]
    fn a_status_says_what_happened() {
        use http::StatusCode;
        for (status, meaning) in [
            (200, Meaning::Happened),
            (201, Meaning::Happened),
            (204, Meaning::Happened),
            (402, Meaning::Happened),
            (409, Meaning::Happened),
            (422, Meaning::Happened),
            (404, Meaning::DidNotHappen),
            (301, Meaning::Unknown),
            (500, Meaning::Unknown),
            (503, Meaning::Unknown),
            (101, Meaning::Unknown),
        ] {
            assert_eq!(
                Meaning::of(StatusCode::from_u16(status).unwrap()),
                meaning,
                "{status}"
            );
        }
    }

    #[test]
    fn a_template_that_cannot_ask_is_refused() {
        let refused = |text: &str| ReconcileTemplate::parse(text).unwrap_err().to_string();
        assert!(refused("").contains("empty"));
        assert!(
            refused("GET /payments").contains("has no {key}"),
            "{}",
            refused("GET /payments")
        );
        let unknown = refused("GET /payments/{id}");
        assert!(unknown.contains("`{id}` is not a placeholder"), "{unknown}");
        assert!(refused("GET /p/{key}/{attempt}").contains("`{attempt}`"));
        assert!(refused("GET /p/{key").contains("not a placeholder"));
        assert!(refused("GET /p/key}/{key}").contains("`}`"));
        assert!(refused("get /p/{key}").contains("not an HTTP method"));
        assert!(refused("G@T /p/{key}").contains("not an HTTP method"));
        assert!(refused("GET payments/{key}").contains("starting with /"));
        assert!(refused("GET ftp://host/{key}").contains("starting with /"));
        assert!(refused("GET http:///{key}").contains("host"));
        assert!(refused("GET https://user:pw@host/{key}").contains("credentials"));
        assert!(refused("GET /p/{key} extra").contains("whitespace"));
        assert!(refused("GET /p/{key}#frag").contains("fragment"));
    }
}

//! The dashboard's state: the process it belongs to, its sessions and the access a request
//! carries, shared by the access check ([`super`]) and the pages.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderValue, header};
use subtle::ConstantTimeEq as _;

use super::rates;
use super::token::AdminToken;
use crate::admin::Admin;

/// What the dashboard shows besides the store: which process it is part of.
#[derive(Debug, Clone)]
pub enum Process {
    /// `idem serve`.
    Gateway,
    /// `idem consume`, reading `from` (its URL is never shown: it may hold a password).
    Consumer {
        /// The consumer's `--from`, where its dead letters are found.
        from: String,
    },
}

/// The dashboard's state.
#[derive(Clone)]
pub struct Ui {
    pub(super) admin: Admin,
    pub(super) process: Process,
    pub(super) token: Option<AdminToken>,
    pub(super) sessions: Arc<Mutex<Sessions>>,
    /// The CSRF token of the forms a bearer-token request gets (it has no session).
    pub(super) bearer_csrf: Arc<str>,
    pub(super) rates: Arc<rates::Rates>,
    /// The database whose inbox and outbox the dashboard shows, when one is configured.
    pub(super) boxes: Option<crate::ops::boxes::Location>,
}

impl std::fmt::Debug for Ui {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ui")
            .field(
                "process",
                &match self.process {
                    Process::Gateway => "gateway",
                    Process::Consumer { .. } => "consumer",
                },
            )
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

impl Ui {
    /// The dashboard over `admin`'s store and metrics; starts sampling the metrics for the
    /// overview's chart (on the current Tokio runtime).
    #[must_use]
    pub fn new(admin: Admin, process: Process, token: Option<AdminToken>) -> Self {
        let series = match process {
            Process::Gateway => rates::GATEWAY,
            Process::Consumer { .. } => rates::CONSUMER,
        };
        let rates = Arc::new(rates::Rates::new(admin.metrics().clone(), series));
        tokio::spawn(Arc::clone(&rates).sample_every(rates::INTERVAL));
        Self {
            admin,
            process,
            token,
            sessions: Arc::default(),
            bearer_csrf: random_token().into(),
            rates,
            boxes: None,
        }
    }
}

/// How long a dashboard session lasts after its login.
pub(super) const SESSION_LIFETIME: Duration = Duration::from_secs(8 * 3600);
/// The most sessions kept at once; a new one beyond it ends the oldest.
pub(super) const MAX_SESSIONS: usize = 1024;
/// The session cookie.
pub(super) const COOKIE: &str = "idem_ui";

/// A logged-in browser: the CSRF token its forms carry.
#[derive(Debug, Clone)]
pub(super) struct Session {
    pub(super) csrf: String,
    pub(super) expires: Instant,
}

#[derive(Debug, Default)]
pub(super) struct Sessions(pub(super) HashMap<String, Session>);

impl Sessions {
    /// A new session; returns its id.
    pub(super) fn open(&mut self) -> (String, Session) {
        let now = Instant::now();
        self.0.retain(|_, session| session.expires > now);
        if self.0.len() >= MAX_SESSIONS
            && let Some(oldest) = self
                .0
                .iter()
                .min_by_key(|(_, session)| session.expires)
                .map(|(id, _)| id.clone())
        {
            self.0.remove(&oldest);
        }
        let session = Session {
            csrf: random_token(),
            expires: now + SESSION_LIFETIME,
        };
        let id = random_token();
        self.0.insert(id.clone(), session.clone());
        (id, session)
    }

    pub(super) fn find(&self, id: &str) -> Option<&Session> {
        self.0.get(id).filter(|session| session.expires > Instant::now())
    }
}

/// 32 random bytes, hex: a session id or a CSRF token.
pub(super) fn random_token() -> String {
    use std::fmt::Write as _;
    rand::random::<[u8; 32]>()
        .iter()
        .fold(String::new(), |mut out, byte| {
            let _ = write!(out, "{byte:02x}");
            out
        })
}

/// Who a request is, once authorised: what its forms' CSRF token is.
#[derive(Debug, Clone)]
pub(super) struct Access {
    pub(super) csrf: String,
    /// Whether it came with the bearer token (else a session cookie).
    pub(super) bearer: bool,
}

impl Access {
    /// Whether `given` is this request's CSRF token.
    pub(super) fn csrf_ok(&self, given: Option<&str>) -> bool {
        given.is_some_and(|given| bool::from(self.csrf.as_bytes().ct_eq(given.as_bytes())))
    }
}

pub(super) fn cookie_value<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v)
}

pub(super) fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
}

pub(super) fn session_cookie(id: &str) -> HeaderValue {
    HeaderValue::from_str(&format!(
        "{COOKIE}={id}; Path=/ui; HttpOnly; SameSite=Strict; Max-Age={}",
        SESSION_LIFETIME.as_secs()
    ))
    .unwrap_or_else(|_| HeaderValue::from_static(""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_end_and_are_bounded() {
        let mut sessions = Sessions::default();
        let (id, session) = sessions.open();
        assert_eq!(sessions.find(&id).map(|s| s.csrf.clone()), Some(session.csrf));
        assert!(sessions.find("not-a-session").is_none());
        for _ in 0..MAX_SESSIONS + 10 {
            sessions.open();
        }
        assert_eq!(sessions.0.len(), MAX_SESSIONS);
        assert!(sessions.find(&id).is_none(), "the oldest session ended");
    }

    #[test]
    fn cookies_and_bearer_tokens_are_read_from_their_headers() {
        let mut headers = HeaderMap::new();
        headers.append(header::COOKIE, HeaderValue::from_static("a=1; idem_ui=abc"));
        headers.append(header::AUTHORIZATION, HeaderValue::from_static("Bearer t0k"));
        assert_eq!(cookie_value(&headers, COOKIE), Some("abc"));
        assert_eq!(cookie_value(&headers, "b"), None);
        assert_eq!(bearer(&headers), Some("t0k"));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic eDp5"));
        assert_eq!(bearer(&headers), None);
    }
}

//! The dashboard of `idem serve` and `idem consume` (`--ui`): server-rendered pages at `/ui` on
//! the admin listener, for an operator during an incident. **Overview** (the decisions of the
//! last minutes from the process's own metrics, the store's health and latency), **In flight**
//! (keys held longer than a threshold, by the store's clock, with a `Release` action), **Key
//! lookup** (a record and its stored response), for `idem consume` **Dead letters** (grouped
//! by reason, replayed or purged), and with `--ui-database` **Inbox / outbox** (pending, dead,
//! the oldest pending row's age; dead rows replayed).
//!
//! Every action runs the code of the matching command (`idem keys release`, `idem dlq
//! replay|purge`, `idem inbox replay`, `idem outbox replay`), is a POST carrying the session's CSRF token, asks for a confirmation on a page
//! of its own, and writes an audit line (target `idem::audit`). A store whose role may not
//! write refuses the action, and the page says so.
//!
//! Access: with `--admin-token` (or `IDEM_ADMIN_TOKEN_FILE`), a request carries it as
//! `Authorization: Bearer TOKEN`, or logs in once with a form that sets a session cookie
//! (`HttpOnly`, `SameSite=Strict`, path `/ui`). Without a token the dashboard starts on a
//! loopback address only, and anyone who can reach that address gets a session. The pages load
//! nothing from elsewhere (one stylesheet, embedded in the binary; no script), and are served
//! with a `Content-Security-Policy` that allows nothing else. See `docs/OPERATIONS.md`.

mod pages;
mod rates;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::{HeaderMap, HeaderValue, StatusCode, header};
use subtle::ConstantTimeEq as _;

use crate::admin::Admin;

/// The token `--admin-token` takes: at least 16 characters, never printed (its `Debug` says
/// only that it is set).
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken(String);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(set)")
    }
}

/// The fewest characters an admin token may have.
pub const MIN_TOKEN_LEN: usize = 16;

/// Why an admin token is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// Shorter than [`MIN_TOKEN_LEN`].
    #[error(
        "--admin-token: the token has {0} characters; at least 16 are needed (e.g. `openssl rand -hex 32`)"
    )]
    TooShort(usize),
    /// It holds a space or a control character, which an `Authorization` header cannot carry
    /// whole.
    #[error("--admin-token: the token may not hold spaces or control characters")]
    Unprintable,
}

impl AdminToken {
    /// `text` as a token.
    ///
    /// # Errors
    ///
    /// [`TokenError`] when it is too short or holds a space or control character.
    pub fn new(text: &str) -> Result<Self, TokenError> {
        if text.chars().count() < MIN_TOKEN_LEN {
            return Err(TokenError::TooShort(text.chars().count()));
        }
        if text.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(TokenError::Unprintable);
        }
        Ok(Self(text.to_owned()))
    }

    /// Whether `given` is this token, compared in constant time.
    fn matches(&self, given: &str) -> bool {
        self.0.as_bytes().ct_eq(given.as_bytes()).into()
    }
}

impl crate::flags::SecretParser<AdminToken> {
    /// `--admin-token`, with [`AdminToken::new`].
    pub const ADMIN_TOKEN: Self = Self::new("--admin-token", |text| Ok(AdminToken::new(text)?));
}

/// The dashboard's flags, the same on `idem serve` and `idem consume`.
#[derive(Debug, Clone, clap::Args)]
pub struct UiFlags {
    /// Serve the dashboard at /ui on --admin-listen (docs/OPERATIONS.md); without
    /// --admin-token, on a loopback address only.
    #[arg(long, env = "IDEM_UI")]
    pub ui: bool,
    /// The token the dashboard asks for, at least 16 characters: sent as `Authorization: Bearer
    /// TOKEN`, or typed into its login form. IDEM_ADMIN_TOKEN_FILE keeps it out of the process
    /// list.
    #[arg(long, env = "IDEM_ADMIN_TOKEN", hide_env_values = true, value_parser = crate::flags::SecretParser::ADMIN_TOKEN)]
    pub admin_token: Option<AdminToken>,
    /// The database whose inbox and outbox the dashboard shows (--ui): postgres://… (both) or
    /// mysql://… and mariadb://… (the outbox); read in read-only sessions.
    #[arg(long, env = "IDEM_UI_DATABASE", requires = "ui")]
    pub ui_database: Option<String>,
    /// The schema of --ui-database's tables (`idempotency_inbox`, `idempotency_outbox`).
    #[arg(long, env = "IDEM_UI_SCHEMA", default_value = "public")]
    pub ui_schema: String,
}

impl UiFlags {
    /// Checks the settings before anything starts: see [`check`]; the schema must be a valid
    /// SQL identifier.
    ///
    /// # Errors
    ///
    /// [`crate::Error::Ui`], [`crate::Error::Boxes`].
    pub fn check(&self, admin_listen: Option<SocketAddr>) -> Result<(), crate::Error> {
        check(self.ui, admin_listen, self.admin_token.as_ref())?;
        self.boxes_at().map(drop)
    }

    /// Where `--ui-database` and `--ui-schema` put the inbox and outbox the dashboard shows.
    fn boxes_at(&self) -> Result<Option<crate::boxes::Location>, crate::Error> {
        let Some(database) = &self.ui_database else {
            return Ok(None);
        };
        let tables = idempotency_outbox::Tables::default()
            .schema(&self.ui_schema)
            .map_err(|e| crate::Error::Boxes(format!("--ui-schema: {e}")))?;
        Ok(Some(crate::boxes::Location {
            database: database.clone(),
            tables,
        }))
    }

    /// `router` with the dashboard's routes when `--ui` is given; the dashboard shows `admin`'s
    /// store and metrics.
    ///
    /// # Errors
    ///
    /// [`crate::Error::Boxes`] when `--ui-schema` is not a valid SQL identifier.
    pub fn serve_beside(
        &self,
        router: Router,
        admin: Admin,
        process: Process,
    ) -> Result<Router, crate::Error> {
        if !self.ui {
            return Ok(router);
        }
        let mut ui = Ui::new(admin, process, self.admin_token.clone());
        ui.boxes = self.boxes_at()?;
        Ok(router.merge(self::router(ui)))
    }
}

/// Why the dashboard cannot start as configured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UiError {
    /// `--ui` without `--admin-listen`: the dashboard is served on the admin listener only.
    #[error(
        "--ui needs --admin-listen: the dashboard is served on the admin listener, apart from the traffic"
    )]
    NoAdminListener,
    /// No token, and an address other hosts can reach.
    #[error(
        "--ui on {0}: without --admin-token (or IDEM_ADMIN_TOKEN_FILE) the dashboard listens on a loopback address only"
    )]
    NoToken(SocketAddr),
}

/// Checks the dashboard's settings before anything starts.
///
/// # Errors
///
/// [`UiError`] when `--ui` is given without an admin listener, or without a token on an
/// address that is not loopback.
pub fn check(ui: bool, admin_listen: Option<SocketAddr>, token: Option<&AdminToken>) -> Result<(), UiError> {
    if !ui {
        return Ok(());
    }
    let addr = admin_listen.ok_or(UiError::NoAdminListener)?;
    if token.is_none() && !addr.ip().is_loopback() {
        return Err(UiError::NoToken(addr));
    }
    Ok(())
}

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
    admin: Admin,
    process: Process,
    token: Option<AdminToken>,
    sessions: Arc<Mutex<Sessions>>,
    /// The CSRF token of the forms a bearer-token request gets (it has no session).
    bearer_csrf: Arc<str>,
    rates: Arc<rates::Rates>,
    /// The database whose inbox and outbox the dashboard shows, when one is configured.
    boxes: Option<crate::boxes::Location>,
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
const SESSION_LIFETIME: Duration = Duration::from_secs(8 * 3600);
/// The most sessions kept at once; a new one beyond it ends the oldest.
const MAX_SESSIONS: usize = 1024;
/// The session cookie.
const COOKIE: &str = "idem_ui";

/// A logged-in browser: the CSRF token its forms carry.
#[derive(Debug, Clone)]
struct Session {
    csrf: String,
    expires: Instant,
}

#[derive(Debug, Default)]
struct Sessions(HashMap<String, Session>);

impl Sessions {
    /// A new session; returns its id.
    fn open(&mut self) -> (String, Session) {
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

    fn find(&self, id: &str) -> Option<&Session> {
        self.0.get(id).filter(|session| session.expires > Instant::now())
    }
}

/// 32 random bytes, hex: a session id or a CSRF token.
fn random_token() -> String {
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
struct Access {
    csrf: String,
    /// Whether it came with the bearer token (else a session cookie).
    bearer: bool,
}

impl Access {
    /// Whether `given` is this request's CSRF token.
    fn csrf_ok(&self, given: Option<&str>) -> bool {
        given.is_some_and(|given| bool::from(self.csrf.as_bytes().ct_eq(given.as_bytes())))
    }
}

fn cookie_value<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v)
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
}

fn session_cookie(id: &str) -> HeaderValue {
    HeaderValue::from_str(&format!(
        "{COOKIE}={id}; Path=/ui; HttpOnly; SameSite=Strict; Max-Age={}",
        SESSION_LIFETIME.as_secs()
    ))
    .unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// Lets a request in with the bearer token or a live session; without a token configured,
/// opens a session for a browser that has none. Otherwise a page is not served: a `GET` is
/// sent to the login form, anything else gets `401`.
async fn authorise(State(ui): State<Ui>, mut request: Request, next: Next) -> Response {
    let headers = request.headers();
    if let Some(given) = bearer(headers) {
        return match &ui.token {
            Some(token) if token.matches(given) => {
                request.extensions_mut().insert(Access {
                    csrf: ui.bearer_csrf.to_string(),
                    bearer: true,
                });
                next.run(request).await
            }
            _ => {
                tracing::warn!(target: "idem::audit", "a dashboard request with a wrong bearer token was refused");
                pages::refused(
                    StatusCode::UNAUTHORIZED,
                    "The bearer token is not this dashboard's.",
                )
            }
        };
    }
    let session = cookie_value(headers, COOKIE).and_then(|id| {
        let sessions = ui
            .sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        sessions.find(id).cloned()
    });
    if let Some(session) = session {
        request.extensions_mut().insert(Access {
            csrf: session.csrf,
            bearer: false,
        });
        return next.run(request).await;
    }
    if ui.token.is_none() && request.method() == http::Method::GET {
        let (id, session) = ui
            .sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .open();
        request.extensions_mut().insert(Access {
            csrf: session.csrf,
            bearer: false,
        });
        let mut response = next.run(request).await;
        response
            .headers_mut()
            .append(header::SET_COOKIE, session_cookie(&id));
        return response;
    }
    if request.method() == http::Method::GET && ui.token.is_some() {
        return (StatusCode::SEE_OTHER, [(header::LOCATION, "/ui/login")]).into_response();
    }
    pages::refused(
        StatusCode::UNAUTHORIZED,
        "This needs a dashboard session: log in again (sessions end after 8 hours, and when the process restarts).",
    )
}

/// The headers of every dashboard answer: nothing may be loaded from elsewhere, framed, cached
/// or sniffed.
async fn secured(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    for (name, value) in [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-store"),
        (header::X_FRAME_OPTIONS, "DENY"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// The dashboard's routes, under `/ui`: merge them into the admin listener's router.
pub fn router(ui: Ui) -> Router {
    let pages = Router::new()
        .route("/ui", get(pages::overview))
        .route("/ui/inflight", get(pages::inflight))
        .route("/ui/inflight/release", post(pages::release))
        .route("/ui/key", get(pages::key))
        .route("/ui/dead-letters", get(pages::dead_letters))
        .route("/ui/dead-letters/settle", post(pages::settle))
        .route("/ui/boxes", get(pages::boxes))
        .route("/ui/boxes/replay", post(pages::boxes_replay))
        .route("/ui/logout", post(pages::logout))
        .route_layer(axum::middleware::from_fn_with_state(ui.clone(), authorise));
    Router::new()
        // `/ui/` is where a person types or a link leads as often as `/ui`: the same page.
        .route(
            "/ui/",
            get(|| async { axum::response::Redirect::permanent("/ui") }),
        )
        .route("/ui/login", get(pages::login_form).post(pages::login))
        .route("/ui/ui.css", get(pages::stylesheet))
        .merge(pages)
        .layer(axum::middleware::from_fn(secured))
        .with_state(ui)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_long_printable_and_never_shown() {
        assert_eq!(AdminToken::new("short"), Err(TokenError::TooShort(5)));
        assert_eq!(AdminToken::new("sixteen chars ok"), Err(TokenError::Unprintable));
        let token = AdminToken::new("0123456789abcdef").unwrap();
        assert_eq!(format!("{token:?}"), "AdminToken(set)");
        assert!(token.matches("0123456789abcdef"));
        assert!(!token.matches("0123456789abcdeF"));
        assert!(!token.matches("0123456789abcdef0"));
        assert!(!token.matches(""));
    }

    #[test]
    fn the_dashboard_needs_an_admin_listener_and_off_loopback_a_token() {
        let token = AdminToken::new("0123456789abcdef").unwrap();
        let public: SocketAddr = "0.0.0.0:9090".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:9090".parse().unwrap();
        let local6: SocketAddr = "[::1]:9090".parse().unwrap();
        assert_eq!(check(false, None, None), Ok(()));
        assert_eq!(check(true, None, Some(&token)), Err(UiError::NoAdminListener));
        assert_eq!(check(true, Some(public), None), Err(UiError::NoToken(public)));
        assert_eq!(check(true, Some(public), Some(&token)), Ok(()));
        assert_eq!(check(true, Some(local), None), Ok(()));
        assert_eq!(check(true, Some(local6), None), Ok(()));
    }

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

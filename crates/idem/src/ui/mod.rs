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
mod state;
mod token;

use std::net::SocketAddr;

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::{HeaderValue, StatusCode, header};

use crate::admin::Admin;
pub use crate::error::UiError;
use state::{Access, COOKIE, bearer, cookie_value, session_cookie};
pub use state::{Process, Ui};
pub use token::{AdminToken, MIN_TOKEN_LEN, TokenError};

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
    fn boxes_at(&self) -> Result<Option<crate::ops::boxes::Location>, crate::Error> {
        let Some(database) = &self.ui_database else {
            return Ok(None);
        };
        let tables = idempotency_outbox::Tables::default()
            .schema(&self.ui_schema)
            .map_err(|e| crate::Error::Boxes(format!("--ui-schema: {e}")))?;
        Ok(Some(crate::ops::boxes::Location {
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
}

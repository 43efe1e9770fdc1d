//! The dashboard's pages and actions. The templates are under `crates/idem/templates/ui/`;
//! everything they show from a request, a record or a dead letter is HTML-escaped by askama.

use std::time::{Duration, Instant};

use askama::Template;
use axum::extract::{Extension, Form, Query, State};
use axum::response::{Html, IntoResponse, Response};
use http::{HeaderMap, HeaderValue, StatusCode, header};
use idempotency::{Key, ListFilter, Scope, StateFilter, SummaryState};
use idempotency_consumer::dead_letters::{Selection, Settle};
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use serde::Deserialize;
use serde_json::Value;

use super::rates;
use super::state::{Access, COOKIE, Process, Ui, cookie_value, session_cookie};
use crate::ops::Confirm;
use crate::ops::age_text;
use crate::ops::key_actions::KeyAction;
use crate::units::{format_duration, parse_duration};

/// What every page's frame shows.
#[derive(Debug)]
pub(super) struct PageInfo {
    title: &'static str,
    process: &'static str,
    csrf: String,
    /// A session that can log out (not a bearer token, not a dashboard without a token).
    logout: bool,
    dead_letters: bool,
    /// Whether a database's inbox and outbox are shown.
    boxes: bool,
    store_kind: String,
}

fn frame(ui: &Ui, access: &Access, title: &'static str) -> PageInfo {
    PageInfo {
        title,
        process: match ui.process {
            Process::Gateway => "serve",
            Process::Consumer { .. } => "consume",
        },
        csrf: access.csrf.clone(),
        logout: ui.token.is_some() && !access.bearer,
        dead_letters: matches!(ui.process, Process::Consumer { .. }),
        boxes: ui.boxes.is_some(),
        store_kind: ui.admin.store_kind().to_owned(),
    }
}

/// `template` as an HTML answer with `status`.
fn html(status: StatusCode, template: &impl Template) -> Response {
    match template.render() {
        Ok(body) => (status, Html(body)).into_response(),
        Err(error) => {
            tracing::error!(%error, "a dashboard page could not be rendered");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "the page could not be rendered",
            )
                .into_response()
        }
    }
}

#[derive(Template)]
#[template(path = "ui/refused.html")]
struct RefusedPage<'a> {
    why: &'a str,
}

/// A page that says why nothing is shown, with `status`.
pub(super) fn refused(status: StatusCode, why: &str) -> Response {
    html(status, &RefusedPage { why })
}

/// The answer to a POST whose CSRF token is missing or not the session's.
fn bad_csrf() -> Response {
    tracing::warn!(target: "idem::audit", "a dashboard action without its CSRF token was refused");
    refused(
        StatusCode::FORBIDDEN,
        "The form did not carry this session's CSRF token, so nothing was changed. Reload the page and try again.",
    )
}

#[derive(Template)]
#[template(path = "ui/message.html")]
struct MessagePage {
    page: PageInfo,
    ok: bool,
    message: String,
    back: &'static str,
}

fn message(page: PageInfo, result: Result<String, crate::Error>, back: &'static str) -> Response {
    let (status, ok, message) = match result {
        Ok(done) => (StatusCode::OK, true, done.trim_end().to_owned()),
        Err(error @ crate::Error::Store(_)) => (
            StatusCode::CONFLICT,
            false,
            format!(
                "The store refused the change, so nothing was changed: {error}. A store role that may only read can look but not act."
            ),
        ),
        Err(error) => (StatusCode::CONFLICT, false, error.to_string()),
    };
    html(
        status,
        &MessagePage {
            page,
            ok,
            message,
            back,
        },
    )
}

#[derive(Template)]
#[template(path = "ui/confirm.html")]
struct ConfirmPage {
    page: PageInfo,
    question: String,
    action: &'static str,
    fields: Vec<(&'static str, String)>,
    button: &'static str,
    back: &'static str,
}

/// What an action's form posts: the CSRF token, `confirm=yes` once confirmed, and the fields
/// of the action (a key and its scope; a reason and `replay` or `purge`; a table).
#[derive(Debug, Deserialize)]
pub(super) struct ActionForm {
    csrf: Option<String>,
    confirm: Option<String>,
    scope: Option<String>,
    key: Option<String>,
    reason: Option<String>,
    action: Option<String>,
    table: Option<String>,
}

/// An action's form whose CSRF token is this request's: a handler that takes it runs only
/// then (otherwise the answer is `403` and nothing runs).
pub(super) struct Checked(ActionForm, Access);

impl<S: Send + Sync> axum::extract::FromRequest<S> for Checked {
    type Rejection = Response;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, Response> {
        let access = request
            .extensions()
            .get::<Access>()
            .cloned()
            .ok_or_else(|| refused(StatusCode::UNAUTHORIZED, "This needs a dashboard session."))?;
        let Form(form) = Form::<ActionForm>::from_request(request, state)
            .await
            .map_err(IntoResponse::into_response)?;
        if !access.csrf_ok(form.csrf.as_deref()) {
            return Err(bad_csrf());
        }
        Ok(Self(form, access))
    }
}

impl ActionForm {
    /// Whether the confirmation page was answered.
    fn confirmed(&self) -> bool {
        self.confirm.as_deref() == Some("yes")
    }
}

/// The page that asks to confirm `question`: a POST of `fields` to `action` with
/// `confirm=yes`.
fn confirm(
    page: PageInfo,
    question: String,
    action: &'static str,
    fields: Vec<(&'static str, String)>,
    button: &'static str,
    back: &'static str,
) -> Response {
    let page = ConfirmPage {
        page,
        question,
        action,
        fields,
        button,
        back,
    };
    html(StatusCode::OK, &page)
}

/// The dashboard's audit line for a confirmed action (the action's own code writes another,
/// saying what changed).
fn audit(action: &str, what: &str, access: &Access) {
    tracing::warn!(
        target: "idem::audit",
        action,
        what,
        via = "dashboard",
        bearer = access.bearer,
        "a dashboard action was confirmed"
    );
}

/// How long a key is held before the overview counts it as stuck.
const STUCK: Duration = Duration::from_secs(30);
/// The most rows a listing shows.
const ROWS: usize = 200;

struct LineView {
    label: &'static str,
    colour: &'static str,
    count: u64,
    now: String,
}

#[derive(Template)]
#[template(path = "ui/overview.html")]
struct OverviewPage {
    page: PageInfo,
    window: String,
    lines: Vec<LineView>,
    chart: String,
    store_ok: bool,
    store_health: String,
    stuck: usize,
    stuck_more: bool,
    threshold: String,
}

/// `GET /ui`: the decisions of the last minutes, the store's health, the stuck keys' count.
pub(super) async fn overview(State(ui): State<Ui>, Extension(access): Extension<Access>) -> Response {
    let (lines, chart, window) = ui.rates.overview();
    let started = Instant::now();
    let check = crate::admin::store_check(&ui.admin).await;
    let took = started.elapsed();
    let (store_ok, store_health) = match check {
        Ok(()) => (
            true,
            format!(
                "The store answers: a read in {:.1} ms; its writes work.",
                took.as_secs_f64() * 1000.0
            ),
        ),
        Err(why) => (false, format!("The store does not answer as it should: {why}")),
    };
    let stuck = ui
        .admin
        .store()
        .list(
            &ListFilter::default()
                .state(StateFilter::InFlight)
                .older_than(STUCK)
                .limit(ROWS + 1),
        )
        .await
        .map_or(0, |records| records.len());
    let page = OverviewPage {
        page: frame(&ui, &access, "Overview"),
        window: format_duration(Duration::from_secs(window.as_secs().max(1))),
        lines: lines
            .into_iter()
            .map(|line| LineView {
                label: line.series.label,
                colour: line.series.colour,
                count: line.count,
                now: rates::rate_text(line.now),
            })
            .collect(),
        chart,
        store_ok,
        store_health,
        stuck: stuck.min(ROWS),
        stuck_more: stuck > ROWS,
        threshold: format_duration(STUCK),
    };
    html(StatusCode::OK, &page)
}

struct InflightRow {
    scope: String,
    scope_shown: String,
    scope_query: String,
    key: String,
    key_query: String,
    attempt: u32,
    age: String,
    lease: String,
    expired: bool,
}

#[derive(Template)]
#[template(path = "ui/inflight.html")]
struct InflightPage {
    page: PageInfo,
    older_than: String,
    error: Option<String>,
    rows: Vec<InflightRow>,
    more: bool,
}

#[derive(Debug, Deserialize)]
pub(super) struct InflightQuery {
    older_than: Option<String>,
}

fn query_text(text: &str) -> String {
    utf8_percent_encode(text, NON_ALPHANUMERIC).to_string()
}

/// `GET /ui/inflight?older_than=10s`: the keys held longer than that, by the store's clock.
pub(super) async fn inflight(
    State(ui): State<Ui>,
    Extension(access): Extension<Access>,
    Query(query): Query<InflightQuery>,
) -> Response {
    let asked = query.older_than.unwrap_or_else(|| "10s".into());
    let (older_than, error) = match parse_duration(&asked) {
        Ok(duration) => (duration, None),
        Err(why) => (
            Duration::from_secs(10),
            Some(format!("`{asked}` is not a duration ({why}): showing 10s")),
        ),
    };
    let store = ui.admin.store();
    let listed = async {
        let filter = ListFilter::default()
            .state(StateFilter::InFlight)
            .older_than(older_than)
            .limit(ROWS + 1);
        Ok::<_, idempotency::StoreError>((store.list(&filter).await?, store.now().await?))
    };
    let (records, now, error) = match listed.await {
        Ok((records, now)) => (records, Some(now), error),
        Err(why) => (
            Vec::new(),
            None,
            Some(format!("The store could not list its records: {why}")),
        ),
    };
    let more = records.len() > ROWS;
    let mut records: Vec<_> = records.into_iter().take(ROWS).collect();
    // The longest held first: the ones an operator is looking for.
    records.sort_by_key(|record| match record.state {
        SummaryState::InFlight { acquired_at, .. } => acquired_at,
        SummaryState::Completed { completed_at, .. } => completed_at,
    });
    let rows = records
        .iter()
        .filter_map(|record| {
            let now = now?;
            let SummaryState::InFlight {
                acquired_at,
                lease_until,
            } = record.state
            else {
                return None;
            };
            let expired = lease_until <= now;
            Some(InflightRow {
                scope: record.scope.as_str().to_owned(),
                scope_shown: if record.scope.as_str().is_empty() {
                    "(global)".into()
                } else {
                    record.scope.redacted().to_string()
                },
                scope_query: query_text(record.scope.as_str()),
                key: record.key.as_str().to_owned(),
                key_query: query_text(record.key.as_str()),
                attempt: record.attempt,
                age: age_text(now.since(acquired_at)),
                lease: if expired {
                    "ended: the worker crashed or hung; the next retry takes over".into()
                } else {
                    format!("ends in {}", age_text(lease_until.since(now)))
                },
                expired,
            })
        })
        .collect();
    html(
        StatusCode::OK,
        &InflightPage {
            page: frame(&ui, &access, "In flight"),
            older_than: asked,
            error,
            rows,
            more,
        },
    )
}

/// The scope and key a form or query names (an empty scope is the global one).
fn scope_and_key(scope: &str, key: &str) -> Result<(Scope, Key), crate::Error> {
    fn invalid(what: &'static str, text: &str) -> impl FnOnce(idempotency::KeyError) -> crate::Error {
        let text = text.to_owned();
        move |source| crate::Error::Invalid { what, text, source }
    }
    let scope = if scope.is_empty() {
        Scope::global()
    } else {
        Scope::new(scope).map_err(invalid("scope", scope))?
    };
    Ok((scope, Key::new(key).map_err(invalid("key", key))?))
}

/// `POST /ui/inflight/release`: asks for a confirmation, then runs `idem keys release`'s code.
pub(super) async fn release(State(ui): State<Ui>, Checked(form, access): Checked) -> Response {
    let page = frame(&ui, &access, "In flight");
    let scope_text = form.scope.clone().unwrap_or_default();
    let key_text = form.key.clone().unwrap_or_default();
    let (scope, key) = match scope_and_key(&scope_text, &key_text) {
        Ok(parsed) => parsed,
        Err(why) => return message(page, Err(why), "/ui/inflight"),
    };
    if !form.confirmed() {
        let question = match ui.admin.store().get(&scope, &key).await {
            Ok(Some(record)) => format!(
                "End the lease of attempt {} of key {} now? Its completion will be refused, and the next retry runs as attempt {}.",
                record.attempt,
                key.as_str(),
                record.attempt + 1
            ),
            Ok(None) => {
                let gone = crate::Error::NoRecord {
                    key: key.as_str().into(),
                    scope: scope.as_str().into(),
                };
                return message(page, Err(gone), "/ui/inflight");
            }
            Err(error) => return message(page, Err(error.into()), "/ui/inflight"),
        };
        let fields = vec![("scope", scope_text), ("key", key_text)];
        return confirm(
            page,
            question,
            "/ui/inflight/release",
            fields,
            "Release",
            "/ui/inflight",
        );
    }
    audit(
        "release",
        &format!("key {} in scope {:?}", key.as_str(), scope.as_str()),
        &access,
    );
    let result = crate::ops::key_actions::act(
        ui.admin.store(),
        &scope,
        &key,
        &KeyAction::Release,
        Confirm::Yes,
        false,
    )
    .await;
    message(page, result, "/ui/inflight")
}

#[derive(Debug, Deserialize)]
pub(super) struct KeyQuery {
    scope: Option<String>,
    key: Option<String>,
}

#[derive(Template)]
#[template(path = "ui/key.html")]
struct KeyPage {
    page: PageInfo,
    key: String,
    scope: String,
    error: Option<String>,
    fields: Vec<(&'static str, String)>,
    status: Option<u64>,
    headers: Vec<(String, String)>,
    body: Option<String>,
    body_cut: bool,
    body_limit: usize,
}

/// How much of a stored body the key page shows.
const BODY_PREVIEW: usize = 4096;

/// `GET /ui/key?key=K&scope=S`: the record, as `idem keys get` shows it.
pub(super) async fn key(
    State(ui): State<Ui>,
    Extension(access): Extension<Access>,
    Query(query): Query<KeyQuery>,
) -> Response {
    let mut page = KeyPage {
        page: frame(&ui, &access, "Key lookup"),
        key: query.key.clone().unwrap_or_default(),
        scope: query.scope.clone().unwrap_or_default(),
        error: None,
        fields: Vec::new(),
        status: None,
        headers: Vec::new(),
        body: None,
        body_cut: false,
        body_limit: BODY_PREVIEW,
    };
    let Some(key_text) = query.key.filter(|key| !key.is_empty()) else {
        return html(StatusCode::OK, &page);
    };
    let value = match scope_and_key(&page.scope, &key_text) {
        Ok((scope, key)) => crate::ops::keys::record_json(ui.admin.store(), &scope, &key).await,
        Err(why) => Err(why),
    };
    let value = match value {
        Ok(value) => value,
        Err(why) => {
            page.error = Some(why.to_string());
            return html(StatusCode::NOT_FOUND, &page);
        }
    };
    let text = |v: &Value| v.as_str().map_or_else(|| v.to_string(), str::to_owned);
    for field in crate::ops::keys::RECORD_FIELDS {
        if let Some(v) = value.get(field) {
            page.fields.push((field, text(v)));
        }
    }
    let outcome = &value["outcome"];
    let body = match outcome["kind"].as_str() {
        Some("http_response") => {
            page.status = outcome["status"].as_u64();
            page.headers = outcome["headers"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|pair| (text(&pair[0]), text(&pair[1])))
                .collect();
            outcome["body"].as_str()
        }
        Some("http_not_replayable") => {
            page.fields.push((
                "outcome",
                "an HTTP response too large to store (retries get 409)".into(),
            ));
            None
        }
        Some(_) => outcome["text"].as_str(),
        None => None,
    };
    if let Some(body) = body {
        page.body_cut = body.chars().count() > BODY_PREVIEW;
        page.body = Some(body.chars().take(BODY_PREVIEW).collect());
    }
    html(StatusCode::OK, &page)
}

#[derive(Template)]
#[template(path = "ui/dead_letters.html")]
struct DeadLettersPage {
    page: PageInfo,
    name: String,
    total: usize,
    error: Option<String>,
    groups: Vec<(String, usize, String)>,
    listing_note: &'static str,
}

/// The most dead letters a page reads.
const DEAD_LETTERS_READ: usize = 10_000;

/// `GET /ui/dead-letters`: `idem consume`'s dead letters by reason, as `idem dlq list` groups
/// them.
pub(super) async fn dead_letters(State(ui): State<Ui>, Extension(access): Extension<Access>) -> Response {
    let Process::Consumer { from } = &ui.process else {
        return refused(StatusCode::NOT_FOUND, "The gateway has no dead letters.");
    };
    let mut page = DeadLettersPage {
        page: frame(&ui, &access, "Dead letters"),
        name: String::new(),
        total: 0,
        error: None,
        groups: Vec::new(),
        listing_note: "reads up to 10,000 dead letters and takes none (RabbitMQ and SQS count it as a delivery of each).",
    };
    match crate::ops::dlq::groups(from, None, DEAD_LETTERS_READ).await {
        Ok(groups) => {
            page.name = groups.name;
            page.total = groups.total;
            page.groups = groups
                .reasons
                .into_iter()
                .map(|(reason, count, oldest)| (reason, count, age_text(oldest)))
                .collect();
        }
        Err(error) => page.error = Some(error.to_string()),
    }
    html(StatusCode::OK, &page)
}

/// `POST /ui/dead-letters/settle`: asks for a confirmation, then runs `idem dlq replay` or
/// `idem dlq purge` on the dead letters of one reason.
pub(super) async fn settle(State(ui): State<Ui>, Checked(form, access): Checked) -> Response {
    let Process::Consumer { from } = &ui.process else {
        return refused(StatusCode::NOT_FOUND, "The gateway has no dead letters.");
    };
    let page = frame(&ui, &access, "Dead letters");
    let back = "/ui/dead-letters";
    let (settle, verb) = match form.action.as_deref() {
        Some("replay") => (Settle::Replay, "Replay"),
        Some("purge") => (Settle::Purge, "Purge"),
        _ => {
            let why = crate::Error::Usage("the action must be `replay` or `purge`".into());
            return message(page, Err(why), back);
        }
    };
    let reason = form.reason.clone().unwrap_or_default();
    if reason.is_empty() {
        let why = crate::Error::Usage("no reason was given: nothing was changed".into());
        return message(page, Err(why), back);
    }
    if !form.confirmed() {
        let groups = match crate::ops::dlq::groups(from, Some(&reason), DEAD_LETTERS_READ).await {
            Ok(groups) => groups,
            Err(error) => return message(page, Err(error), back),
        };
        let question = format!(
            "{verb} the {} dead letter(s) of {} whose reason contains “{reason}”{}?",
            groups.total,
            groups.name,
            if settle == Settle::Replay {
                ", to their source: each runs once more"
            } else {
                " (deleted for good)"
            }
        );
        let fields = vec![("reason", reason), ("action", verb.to_lowercase())];
        return confirm(page, question, "/ui/dead-letters/settle", fields, verb, back);
    }
    audit(
        verb,
        &format!("dead letters whose reason contains {reason:?}"),
        &access,
    );
    let selection = Selection::all(usize::MAX).reason(reason);
    let result = crate::ops::dlq::settle(from, &selection, settle, Confirm::Yes, false).await;
    message(page, result, back)
}

/// One table's counts, as the page shows them.
struct BoxCounts {
    pending: i64,
    /// The third count: sent (outbox) or processed (inbox).
    done: i64,
    dead: i64,
    oldest_pending: String,
}

#[derive(Template)]
#[template(path = "ui/boxes.html")]
struct BoxesPage {
    page: PageInfo,
    database: String,
    outbox: Result<BoxCounts, crate::Error>,
    /// `None` on MySQL, which has no inbox.
    inbox: Option<Result<BoxCounts, crate::Error>>,
}

impl From<idempotency_outbox::OutboxStats> for BoxCounts {
    fn from(stats: idempotency_outbox::OutboxStats) -> Self {
        Self::new(
            stats.pending,
            stats.sent,
            stats.dead,
            stats.oldest_pending_seconds,
        )
    }
}

impl From<idempotency_outbox::InboxStats> for BoxCounts {
    fn from(stats: idempotency_outbox::InboxStats) -> Self {
        Self::new(
            stats.pending,
            stats.processed,
            stats.dead,
            stats.oldest_pending_seconds,
        )
    }
}

impl BoxCounts {
    fn new(pending: i64, done: i64, dead: i64, oldest_pending_seconds: Option<f64>) -> Self {
        Self {
            pending,
            done,
            dead,
            oldest_pending: oldest_pending_seconds.map_or_else(
                || "-".to_owned(),
                |seconds| age_text(Duration::try_from_secs_f64(seconds).unwrap_or_default()),
            ),
        }
    }
}

/// `GET /ui/boxes`: the counts of `--ui-database`'s outbox and inbox, as `idem outbox stats`
/// and `idem inbox stats` read them (read-only sessions).
pub(super) async fn boxes(State(ui): State<Ui>, Extension(access): Extension<Access>) -> Response {
    let Some(at) = &ui.boxes else {
        return refused(
            StatusCode::NOT_FOUND,
            "No database is configured (--ui-database).",
        );
    };
    let outbox = async {
        let database = at.outbox(1, true).await?;
        let stats = idempotency_outbox::outbox_stats(&database, &at.tables).await?;
        Ok::<_, crate::Error>(BoxCounts::from(stats))
    };
    let inbox = async {
        let pool = at.checked(true).await?;
        let stats = idempotency_outbox::inbox_stats(&pool, &at.tables, None).await?;
        Ok::<_, crate::Error>(BoxCounts::from(stats))
    };
    let page = BoxesPage {
        page: frame(&ui, &access, "Inbox / outbox"),
        database: idempotency::redact_url(&at.database),
        outbox: outbox.await,
        inbox: if at.is_mysql() { None } else { Some(inbox.await) },
    };
    html(StatusCode::OK, &page)
}

/// `POST /ui/boxes/replay`: asks for a confirmation, then runs `idem inbox replay` or `idem
/// outbox replay` on every dead row of the table.
pub(super) async fn boxes_replay(State(ui): State<Ui>, Checked(form, access): Checked) -> Response {
    let Some(at) = &ui.boxes else {
        return refused(
            StatusCode::NOT_FOUND,
            "No database is configured (--ui-database).",
        );
    };
    let page = frame(&ui, &access, "Inbox / outbox");
    let back = "/ui/boxes";
    let table = match form.table.as_deref() {
        Some(table @ ("inbox" | "outbox")) => table,
        _ => {
            let why = crate::Error::Usage("the table must be `inbox` or `outbox`".into());
            return message(page, Err(why), back);
        }
    };
    if !form.confirmed() {
        let question = if table == "inbox" {
            format!(
                "Put every dead row of {} back to pending? The inbox workers run each again.",
                at.tables.qualified_inbox()
            )
        } else {
            format!(
                "Put every dead row of {} back to pending? The relays publish each again, in its group's order.",
                at.tables.qualified_outbox()
            )
        };
        return confirm(
            page,
            question,
            "/ui/boxes/replay",
            vec![("table", table.to_owned())],
            "Replay",
            back,
        );
    }
    audit("replay", &format!("the dead rows of the {table}"), &access);
    let result = if table == "inbox" {
        crate::ops::boxes::inbox_replay(at, None, None, false).await
    } else {
        crate::ops::boxes::outbox_replay(at, None, false).await
    };
    message(page, result, back)
}

#[derive(Template)]
#[template(path = "ui/login.html")]
struct LoginPage {
    error: Option<&'static str>,
}

/// `GET /ui/login`: the login form (the overview, when the dashboard has no token).
pub(super) async fn login_form(State(ui): State<Ui>) -> Response {
    if ui.token.is_none() {
        return (StatusCode::SEE_OTHER, [(header::LOCATION, "/ui")]).into_response();
    }
    html(StatusCode::OK, &LoginPage { error: None })
}

#[derive(Debug, Deserialize)]
pub(super) struct LoginForm {
    token: Option<String>,
}

/// `POST /ui/login`: a session for the right token.
pub(super) async fn login(State(ui): State<Ui>, Form(form): Form<LoginForm>) -> Response {
    let Some(token) = &ui.token else {
        return (StatusCode::SEE_OTHER, [(header::LOCATION, "/ui")]).into_response();
    };
    if !form.token.as_deref().is_some_and(|given| token.matches(given)) {
        tracing::warn!(target: "idem::audit", "a dashboard login with a wrong token was refused");
        return html(
            StatusCode::UNAUTHORIZED,
            &LoginPage {
                error: Some("That is not the admin token."),
            },
        );
    }
    let (id, _) = ui
        .sessions
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .open();
    tracing::warn!(target: "idem::audit", "a dashboard session was opened");
    (
        StatusCode::SEE_OTHER,
        [
            (header::LOCATION, HeaderValue::from_static("/ui")),
            (header::SET_COOKIE, session_cookie(&id)),
        ],
    )
        .into_response()
}

/// `POST /ui/logout`: ends the session.
pub(super) async fn logout(State(ui): State<Ui>, headers: HeaderMap, Checked(..): Checked) -> Response {
    if let Some(id) = cookie_value(&headers, COOKIE) {
        ui.sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0
            .remove(id);
    }
    (
        StatusCode::SEE_OTHER,
        [
            (header::LOCATION, HeaderValue::from_static("/ui/login")),
            (
                header::SET_COOKIE,
                HeaderValue::from_static("idem_ui=; Path=/ui; HttpOnly; SameSite=Strict; Max-Age=0"),
            ),
        ],
    )
        .into_response()
}

/// `GET /ui/ui.css`: the stylesheet, from the binary.
pub(super) async fn stylesheet() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("ui.css"),
    )
        .into_response()
}

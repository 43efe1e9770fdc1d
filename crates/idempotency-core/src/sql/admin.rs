//! The reads, the operators' writes and the release of a sqlx-based store, written once:
//! [`get`], [`now`], [`stats`], [`list`], [`purge_expired`], [`forget`] and [`release`] run a
//! store's statement on one of its connections, bind the parameters in the order its
//! placeholders take them and decode the rows (see the column table in [`crate::sql`]).
//!
//! A store implements [`SqlActions`]: what it runs on ([`Pools`]) and its [`Statements`], each
//! with which parameter each placeholder takes ([`Statements::placeholders`]): PostgreSQL numbers its
//! placeholders (`$1` stands wherever the scope does), MySQL's `?` are bound one by one, so
//! a statement that tests a parameter for NULL and compares with it names it twice.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Type};

use super::Pools;
use crate::{
    Fenced, Held, Key, ListFilter, Record, RecordSummary, Scope, StateFilter, Stats, StoreError, Timestamp,
    Token,
};

/// A value bound to a placeholder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param<'a> {
    /// Text, or NULL.
    Text(Option<&'a str>),
    /// Bytes, or NULL.
    Bytes(Option<&'a [u8]>),
    /// A 64-bit integer, or NULL.
    Int(Option<i64>),
    /// A boolean, or NULL.
    Bool(Option<bool>),
}

/// What [`Statements::of`] is asked for, with the parameters each statement takes, in this
/// order (a placeholder takes one of them by its index, [`Statements::placeholders`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// A live record by scope and key: scope, key. Selects the record's twelve columns.
    Get,
    /// The server's clock: no parameters. Selects Unix milliseconds (`i64`).
    Now,
    /// The statistics of a scope or of every scope: scope or NULL.
    Stats,
    /// One page of live records: scope or NULL, completed or NULL, older-than ms or NULL, the
    /// scope and the key to resume after (or NULL), the page's size.
    List,
    /// Deletes expired records, oldest first: how many at most.
    Purge,
    /// Deletes a live record if it holds a token: scope, key, token.
    Forget,
    /// Ends the lease of a live, uncompleted record that holds a token, keeping the record
    /// (the next `begin` takes it over as the next attempt): scope, key, token, the token of
    /// no attempt ([`Token::NONE`]).
    Release,
    /// Deletes the record of a first attempt's claim made in a caller's transaction while it
    /// holds a token and is not completed: scope, key, token.
    Withdraw,
}

impl Action {
    /// Every action, in declaration order.
    pub const ALL: [Self; 8] = [
        Self::Get,
        Self::Now,
        Self::Stats,
        Self::List,
        Self::Purge,
        Self::Forget,
        Self::Release,
        Self::Withdraw,
    ];

    /// How many parameters the action's statement is given.
    #[must_use]
    pub const fn parameters(self) -> usize {
        match self {
            Self::Now => 0,
            Self::Stats | Self::Purge => 1,
            Self::Get => 2,
            Self::Forget | Self::Withdraw => 3,
            Self::Release => 4,
            Self::List => 6,
        }
    }

    /// Each of the action's parameters once, in their order: the [`Statements::placeholders`]
    /// of an engine whose placeholders are numbered (`$1` … `$6`) in [`Action`]'s order.
    ///
    /// ```
    /// use idempotency_core::sql::admin::Action;
    ///
    /// assert_eq!(Action::Release.in_order(), &[0, 1, 2, 3]);
    /// assert!(Action::Now.in_order().is_empty());
    /// ```
    #[must_use]
    pub fn in_order(self) -> &'static [usize] {
        const ORDER: &[usize] = &[0, 1, 2, 3, 4, 5];
        &ORDER[..self.parameters()]
    }
}

/// The statement of each [`Action`], built by the store from its table's name.
#[derive(Debug)]
pub struct Statements {
    /// [`Action::Get`].
    pub get: Arc<str>,
    /// [`Action::Now`].
    pub now: Arc<str>,
    /// [`Action::Stats`].
    pub stats: Arc<str>,
    /// [`Action::List`].
    pub list: Arc<str>,
    /// [`Action::Purge`].
    pub purge: Arc<str>,
    /// [`Action::Forget`].
    pub forget: Arc<str>,
    /// [`Action::Release`].
    pub release: Arc<str>,
    /// [`Action::Withdraw`].
    pub withdraw: Arc<str>,
    /// Which of `action`'s parameters (see [`Action`]) each of its statement's placeholders
    /// takes, in the order the driver binds them: written beside the statements' text, since
    /// it depends on how the text names its parameters.
    pub placeholders: fn(Action) -> &'static [usize],
}

impl Statements {
    /// The statement for `action`.
    #[must_use]
    pub fn of(&self, action: Action) -> Arc<str> {
        Arc::clone(match action {
            Action::Get => &self.get,
            Action::Now => &self.now,
            Action::Stats => &self.stats,
            Action::List => &self.list,
            Action::Purge => &self.purge,
            Action::Forget => &self.forget,
            Action::Release => &self.release,
            Action::Withdraw => &self.withdraw,
        })
    }
}

/// A sqlx database whose types carry what the stores bind and decode: implemented for every
/// such database (PostgreSQL, MySQL), so that the functions of this module are written once.
pub trait Engine: Database {
    /// Runs `statement` on `connection` with the parameters `order` picks from `params` bound
    /// in that order; its rows.
    fn fetch_all<'c>(
        connection: &'c mut Self::Connection,
        statement: Arc<str>,
        params: &'c [Param<'c>],
        order: &'static [usize],
    ) -> BoxFuture<'c, Result<Vec<Self::Row>, sqlx::Error>>;

    /// As [`fetch_all`](Self::fetch_all), for a statement that selects one row at most.
    fn fetch_optional<'c>(
        connection: &'c mut Self::Connection,
        statement: Arc<str>,
        params: &'c [Param<'c>],
        order: &'static [usize],
    ) -> BoxFuture<'c, Result<Option<Self::Row>, sqlx::Error>>;

    /// As [`fetch_all`](Self::fetch_all), for a statement that writes: what it did.
    fn execute<'c>(
        connection: &'c mut Self::Connection,
        statement: Arc<str>,
        params: &'c [Param<'c>],
        order: &'static [usize],
    ) -> BoxFuture<'c, Result<Self::QueryResult, sqlx::Error>>;

    /// The record whose twelve columns start at column `at` ([`crate::sql::record`]).
    ///
    /// # Errors
    ///
    /// As [`crate::sql::record`].
    fn record(row: &Self::Row, at: usize) -> Result<Record, StoreError>;

    /// A `list` row ([`crate::sql::summary`]).
    ///
    /// # Errors
    ///
    /// As [`crate::sql::summary`].
    fn summary(row: &Self::Row) -> Result<RecordSummary, StoreError>;

    /// A `stats` row ([`crate::sql::stats`]).
    ///
    /// # Errors
    ///
    /// As [`crate::sql::stats`].
    fn stats(row: &Self::Row) -> Result<Stats, StoreError>;

    /// Column `at` of `row` as an `i64`.
    ///
    /// # Errors
    ///
    /// [`crate::ErrorKind::Protocol`] when it does not decode.
    fn int(row: &Self::Row, at: usize) -> Result<i64, StoreError>;

    /// Column `at` of `row` as text.
    ///
    /// # Errors
    ///
    /// [`crate::ErrorKind::Protocol`] when it does not decode.
    fn text(row: &Self::Row, at: usize) -> Result<String, StoreError>;
}

impl<DB> Engine for DB
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> Option<&'q str>: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q [u8]>: Encode<'q, DB> + Type<DB>,
    for<'q> Option<i64>: Encode<'q, DB> + Type<DB>,
    for<'q> Option<bool>: Encode<'q, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    for<'r> Vec<u8>: Decode<'r, DB> + Type<DB>,
    for<'r> i64: Decode<'r, DB> + Type<DB>,
    for<'r> bool: Decode<'r, DB> + Type<DB>,
{
    fn fetch_all<'c>(
        connection: &'c mut Self::Connection,
        statement: Arc<str>,
        params: &'c [Param<'c>],
        order: &'static [usize],
    ) -> BoxFuture<'c, Result<Vec<Self::Row>, sqlx::Error>> {
        Box::pin(bound::<DB>(statement, params, order).fetch_all(connection))
    }

    fn fetch_optional<'c>(
        connection: &'c mut Self::Connection,
        statement: Arc<str>,
        params: &'c [Param<'c>],
        order: &'static [usize],
    ) -> BoxFuture<'c, Result<Option<Self::Row>, sqlx::Error>> {
        Box::pin(bound::<DB>(statement, params, order).fetch_optional(connection))
    }

    fn execute<'c>(
        connection: &'c mut Self::Connection,
        statement: Arc<str>,
        params: &'c [Param<'c>],
        order: &'static [usize],
    ) -> BoxFuture<'c, Result<Self::QueryResult, sqlx::Error>> {
        Box::pin(bound::<DB>(statement, params, order).execute(connection))
    }

    fn record(row: &Self::Row, at: usize) -> Result<Record, StoreError> {
        crate::sql::record(row, at)
    }

    fn summary(row: &Self::Row) -> Result<RecordSummary, StoreError> {
        crate::sql::summary(row)
    }

    fn stats(row: &Self::Row) -> Result<Stats, StoreError> {
        crate::sql::stats(row)
    }

    fn int(row: &Self::Row, at: usize) -> Result<i64, StoreError> {
        crate::sql::column(row, at, "decode an integer")
    }

    fn text(row: &Self::Row, at: usize) -> Result<String, StoreError> {
        crate::sql::column(row, at, "decode a text")
    }
}

/// `statement` with the parameters `order` picks from `params`, bound in that order.
fn bound<'q, DB>(
    statement: Arc<str>,
    params: &[Param<'q>],
    order: &[usize],
) -> sqlx::query::Query<'q, DB, DB::Arguments>
where
    DB: Database,
    for<'v> Option<&'v str>: Encode<'v, DB> + Type<DB>,
    for<'v> Option<&'v [u8]>: Encode<'v, DB> + Type<DB>,
    for<'v> Option<i64>: Encode<'v, DB> + Type<DB>,
    for<'v> Option<bool>: Encode<'v, DB> + Type<DB>,
{
    order
        .iter()
        .map(|&at| params[at])
        .fold(
            sqlx::query(sqlx::AssertSqlSafe(statement)),
            |query, param| match param {
                Param::Text(text) => query.bind(text),
                Param::Bytes(bytes) => query.bind(bytes),
                Param::Int(int) => query.bind(int),
                Param::Bool(flag) => query.bind(flag),
            },
        )
}

/// What a sqlx-based store gives the functions of this module.
pub trait SqlActions: Send + Sync {
    /// The store's database.
    type Engine: Engine;

    /// What the store runs on: its operations run on [`Pools::connections`], and new work
    /// waits for its lane ([`Lanes::new_work`](crate::Lanes::new_work)) in [`Pools::lanes`];
    /// the connections' [`map_error`](crate::connections::Connections::map_error) classifies
    /// the server's errors.
    fn pools(&self) -> &Pools<Self::Engine>;

    /// The statements of the actions.
    fn statements(&self) -> &Statements;

    /// How many rows a statement wrote (sqlx has no trait for it; [`sql_store_admin!`]
    /// forwards to the driver's own `rows_affected`).
    ///
    /// [`sql_store_admin!`]: crate::sql_store_admin
    fn rows_affected(done: &<Self::Engine as Database>::QueryResult) -> u64;
}

/// The driver call an action makes: [`Engine::fetch_all`], [`Engine::fetch_optional`] or
/// [`Engine::execute`].
type Call<S, T> = for<'c> fn(
    &'c mut <<S as SqlActions>::Engine as Database>::Connection,
    Arc<str>,
    &'c [Param<'c>],
    &'static [usize],
) -> BoxFuture<'c, Result<T, sqlx::Error>>;

/// Runs `action` with `params` (in [`Action`]'s order, bound in the store's placeholder order)
/// through `call` on a connection of `store`'s, after a lane for new work.
async fn run<S: SqlActions, T>(
    store: &S,
    action: Action,
    doing: &str,
    params: &[Param<'_>],
    call: Call<S, T>,
) -> Result<T, StoreError> {
    let statements = store.statements();
    let (statement, order) = (statements.of(action), (statements.placeholders)(action));
    let map_error = store.pools().connections.map_error();
    store
        .pools()
        .run_new(async |connection| {
            call(connection, statement, params, order)
                .await
                .map_err(|e| map_error(doing, e))
        })
        .await
}

/// The live record of `scope` and `key`, if any ([`Store::get`](crate::Store::get)).
///
/// # Errors
///
/// The store's: no connection, the server's error, a row that does not decode.
pub async fn get<S: SqlActions>(store: &S, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
    let params = [Param::Text(Some(scope.as_str())), Param::Text(Some(key.as_str()))];
    let row = run(store, Action::Get, "get", &params, S::Engine::fetch_optional).await?;
    row.map(|row| S::Engine::record(&row, 0)).transpose()
}

/// The server's clock ([`StoreAdmin::now`](crate::StoreAdmin::now)).
///
/// # Errors
///
/// As [`get`].
pub async fn now<S: SqlActions>(store: &S) -> Result<Timestamp, StoreError> {
    let row = run(
        store,
        Action::Now,
        "read the server's clock",
        &[],
        S::Engine::fetch_optional,
    )
    .await?;
    let row = row.ok_or_else(|| no_row("read the server's clock"))?;
    Ok(Timestamp::from_unix_millis(S::Engine::int(&row, 0)?))
}

/// The statistics of `scope`, or of every scope ([`StoreAdmin::stats`](crate::StoreAdmin::stats)).
///
/// # Errors
///
/// As [`get`].
pub async fn stats<S: SqlActions>(store: &S, scope: Option<&Scope>) -> Result<Stats, StoreError> {
    let params = [Param::Text(scope.map(Scope::as_str))];
    let row = run(store, Action::Stats, "stats", &params, S::Engine::fetch_optional).await?;
    S::Engine::stats(&row.ok_or_else(|| no_row("stats"))?)
}

/// One page of the live records `filter` selects ([`StoreAdmin::list`](crate::StoreAdmin::list)).
///
/// # Errors
///
/// As [`get`].
pub async fn list<S: SqlActions>(store: &S, filter: &ListFilter) -> Result<Vec<RecordSummary>, StoreError> {
    let (after_scope, after_key) = match &filter.after {
        Some((scope, key)) => (Some(scope.as_str()), Some(key.as_str())),
        None => (None, None),
    };
    let params = [
        Param::Text(filter.scope.as_ref().map(Scope::as_str)),
        Param::Bool(filter.state.map(|state| state == StateFilter::Completed)),
        Param::Int(filter.older_than.map(crate::duration_millis)),
        Param::Text(after_scope),
        Param::Text(after_key),
        Param::Int(Some(i64::try_from(filter.limit).unwrap_or(i64::MAX))),
    ];
    let rows = run(store, Action::List, "list", &params, S::Engine::fetch_all).await?;
    rows.iter().map(S::Engine::summary).collect()
}

/// Deletes at most `limit` expired records, oldest first; how many it deleted
/// ([`StoreAdmin::purge_expired`](crate::StoreAdmin::purge_expired)).
///
/// # Errors
///
/// The store's: no connection, the server's error.
pub async fn purge_expired<S: SqlActions>(store: &S, limit: u64) -> Result<u64, StoreError> {
    let limit = [Param::Int(Some(i64::try_from(limit).unwrap_or(i64::MAX)))];
    let done = run(
        store,
        Action::Purge,
        "purge expired records",
        &limit,
        S::Engine::execute,
    )
    .await?;
    Ok(S::rows_affected(&done))
}

/// Deletes the live record of `scope` and `key` if it holds `token`
/// ([`StoreAdmin::forget`](crate::StoreAdmin::forget)).
///
/// # Errors
///
/// As [`purge_expired`].
pub async fn forget<S: SqlActions>(
    store: &S,
    scope: &Scope,
    key: &Key,
    token: Token,
) -> Result<Fenced<()>, StoreError> {
    let token = token.to_bytes();
    let params = [
        Param::Text(Some(scope.as_str())),
        Param::Text(Some(key.as_str())),
        Param::Bytes(Some(&token[..])),
    ];
    let done = run(
        store,
        Action::Forget,
        "forget a record",
        &params,
        S::Engine::execute,
    )
    .await?;
    Ok(crate::sql::fenced_by_rows(S::rows_affected(&done)))
}

/// Ends the lease `held` holds, keeping the record ([`Store::release`](crate::Store::release)),
/// on a connection of `store`'s without a lane: lease-keeping never waits behind new work.
///
/// # Errors
///
/// As [`purge_expired`].
pub async fn release<S: SqlActions>(store: &S, held: &Held) -> Result<Fenced<()>, StoreError> {
    if held.token == Token::NONE {
        return Ok(Fenced::LeaseLost);
    }
    store
        .pools()
        .run(async |connection| release_on(store, connection, held).await)
        .await
}

/// [`release`] on `connection` (a transaction's, for
/// [`TransactionalStore::withdraw_in`](crate::TransactionalStore::withdraw_in) of a later
/// attempt).
///
/// # Errors
///
/// As [`purge_expired`].
pub async fn release_on<S: SqlActions>(
    store: &S,
    connection: &mut <S::Engine as Database>::Connection,
    held: &Held,
) -> Result<Fenced<()>, StoreError> {
    if held.token == Token::NONE {
        return Ok(Fenced::LeaseLost);
    }
    let (token, none) = (held.token.to_bytes(), Token::NONE.to_bytes());
    let params = [
        Param::Text(Some(held.scope.as_str())),
        Param::Text(Some(held.key.as_str())),
        Param::Bytes(Some(&token[..])),
        Param::Bytes(Some(&none[..])),
    ];
    fenced_write(store, connection, Action::Release, "release", &params).await
}

/// Runs `store`'s statement for `action` on `connection` with `params` (in [`Action`]'s order,
/// bound in the store's placeholder order): a write conditioned on a token, accepted when it
/// wrote the one row ([`fenced_by_rows`](crate::sql::fenced_by_rows)).
pub(crate) async fn fenced_write<S: SqlActions>(
    store: &S,
    connection: &mut <S::Engine as Database>::Connection,
    action: Action,
    doing: &str,
    params: &[Param<'_>],
) -> Result<Fenced<()>, StoreError> {
    let statements = store.statements();
    let done = S::Engine::execute(
        connection,
        statements.of(action),
        params,
        (statements.placeholders)(action),
    )
    .await
    .map_err(|e| store.pools().connections.map_error()(doing, e))?;
    Ok(crate::sql::fenced_by_rows(S::rows_affected(&done)))
}

fn no_row(doing: &str) -> StoreError {
    StoreError::new(
        crate::ErrorKind::Protocol,
        format!("{doing}: the server answered no row"),
    )
}

#[doc(hidden)]
pub use async_trait::async_trait as __async_trait;
#[doc(hidden)]
pub use sqlx::Database as __Database;

/// Implements [`SqlActions`] for a store from its engine and where it keeps its [`Pools`] and
/// its [`Statements`], and [`StoreAdmin`](crate::StoreAdmin) with this module's functions. (A
/// blanket `impl<S: SqlActions> StoreAdmin for S` would conflict with the forwarding impls for
/// `Box<S>` and `Arc<S>`, hence a macro.) As the PostgreSQL store expands it:
///
/// ```text
/// idempotency_core::sql_store_admin!(PostgresStore {
///     engine: sqlx::Postgres,
///     pools: |store| &store.pools,
///     statements: |store| &store.sql.admin,
/// });
/// ```
#[macro_export]
macro_rules! sql_store_admin {
    ($store:ty { engine: $engine:ty, pools: $pools:expr, statements: $statements:expr $(,)? }) => {
        impl $crate::sql::admin::SqlActions for $store {
            type Engine = $engine;

            fn pools(&self) -> &$crate::sql::Pools<$engine> {
                let pools: fn(&Self) -> &$crate::sql::Pools<$engine> = $pools;
                pools(self)
            }

            fn statements(&self) -> &$crate::sql::admin::Statements {
                let statements: fn(&Self) -> &$crate::sql::admin::Statements = $statements;
                statements(self)
            }

            fn rows_affected(done: &<$engine as $crate::sql::admin::__Database>::QueryResult) -> u64 {
                done.rows_affected()
            }
        }

        #[$crate::sql::admin::__async_trait]
        impl $crate::StoreAdmin for $store {
            async fn now(&self) -> ::std::result::Result<$crate::Timestamp, $crate::StoreError> {
                $crate::sql::admin::now(self).await
            }

            async fn stats(
                &self,
                scope: ::std::option::Option<&$crate::Scope>,
            ) -> ::std::result::Result<$crate::Stats, $crate::StoreError> {
                $crate::sql::admin::stats(self, scope).await
            }

            async fn list(
                &self,
                filter: &$crate::ListFilter,
            ) -> ::std::result::Result<::std::vec::Vec<$crate::RecordSummary>, $crate::StoreError> {
                $crate::sql::admin::list(self, filter).await
            }

            async fn purge_expired(&self, limit: u64) -> ::std::result::Result<u64, $crate::StoreError> {
                $crate::sql::admin::purge_expired(self, limit).await
            }

            async fn forget(
                &self,
                scope: &$crate::Scope,
                key: &$crate::Key,
                token: $crate::Token,
            ) -> ::std::result::Result<$crate::Fenced<()>, $crate::StoreError> {
                $crate::sql::admin::forget(self, scope, key, token).await
            }
        }
    };
}

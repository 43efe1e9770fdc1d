//! The store: a writer thread that owns the write connection and commits transitions in groups,
//! and a reader thread whose connection answers what needs no write.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idempotency_core::machine::{self, Effect};
use idempotency_core::{
    Access, BatchCall, BeginRequest, Claim, Clock, Completion, ErrorKind, Fenced, Fingerprint, Held, Key,
    ListFilter, Outcome, Record, RecordColumns, RecordParts, RecordSummary, Scope, StateFilter, Stats, Store,
    StoreAdmin, StoreError, Timestamp, Token, begin_each, duration_millis,
};
use rusqlite::{Connection, OpenFlags, OptionalExtension, Row, TransactionBehavior, params};

use crate::options::{Location, SqliteOptions};
use crate::sql;

/// Work for a connection's thread.
enum Job {
    /// A state-machine transition: it joins the next write transaction with the transitions
    /// queued beside it (group commit).
    Transition(Box<dyn Pending>),
    /// Anything else, on the connection alone.
    Alone(Box<dyn FnOnce(&mut Connection) + Send>),
}

/// A transition waiting for its write transaction.
trait Pending: Send {
    /// Reads the record, decides with the machine and writes the effect, inside the open write
    /// transaction; an error here is rolled back to the transition's own savepoint.
    fn apply(&mut self, connection: &Connection, clock: &dyn Clock) -> Result<(), StoreError>;

    /// Answers the caller once the transaction's fate is known: the decision if it committed,
    /// the error otherwise (or the transition's own error).
    fn answer(self: Box<Self>, committed: Result<(), StoreError>);
}

/// A transition deciding with `step` on the record of (`scope`, `key`).
struct Step<R, F> {
    scope: Scope,
    key: Key,
    step: Option<F>,
    decided: Option<Result<R, StoreError>>,
    reply: tokio::sync::oneshot::Sender<Result<R, StoreError>>,
}

impl<R, F> Pending for Step<R, F>
where
    R: Send + 'static,
    F: FnOnce(Timestamp, Option<&Record>) -> (R, Effect) + Send + 'static,
{
    fn apply(&mut self, connection: &Connection, clock: &dyn Clock) -> Result<(), StoreError> {
        let step = self.step.take().expect("a transition applies once");
        let decided = (|| {
            // The time is read once the write lock is held, so that transitions are ordered by
            // the time they were decided at.
            let now = clock.now();
            let existing = select_record(connection, &self.scope, &self.key)?;
            let (answer, effect) = step(now, existing.as_ref());
            if let Effect::Put(record) = effect {
                upsert_record(connection, &record)?;
            }
            Ok(answer)
        })();
        let result = decided.as_ref().map(drop).map_err(Clone::clone);
        self.decided = Some(decided);
        result
    }

    fn answer(self: Box<Self>, committed: Result<(), StoreError>) {
        let answer = match (self.decided, committed) {
            (Some(Err(error)), _) | (_, Err(error)) => Err(error),
            (Some(Ok(answer)), Ok(())) => Ok(answer),
            (None, Ok(())) => Err(StoreError::new(
                ErrorKind::Backend,
                "a SQLite transition was answered without being applied",
            )),
        };
        let _ = self.reply.send(answer);
    }
}

/// The SQLite store. Clones share its connections and their threads.
///
/// **Writes** run on a dedicated thread that owns the write connection: writes of one process
/// are serialized there without lock contention, and every write transaction is `IMMEDIATE`,
/// so writers in *other* processes (the operations CLI, a second gateway on the same file) wait
/// on the busy timeout instead of failing on a read-to-write upgrade.
///
/// **Group commit.** The thread takes every transition queued when it gets to work (up to
/// [`SqliteOptions::max_batch`]) into one write transaction, each under a savepoint of its own,
/// and commits once: one fsync for the group. A caller is answered only after the commit, so
/// an answer always describes a record on disk; a transition that fails is rolled back to its
/// savepoint and answered with its error, and its neighbours commit. If the commit itself
/// fails, every transition of the group gets the error and nothing of it is written.
/// `max_batch=1` gives each transition its own transaction.
///
/// **Reads** (`get`, `stats`, `list`, and the first look of every `begin`) run on a second
/// connection on a thread of its own, and see what the last commit wrote: a replay, an
/// in-flight answer or a mismatch never waits behind a group's fsync, and never writes. Only a
/// `begin` that must claim or take over goes to the writer, which decides again inside its
/// transaction. A private in-memory database has one connection, for both.
///
/// The threads end when the last clone is dropped.
///
/// ```
/// use idempotency_core::{BeginRequest, Claim, Fingerprint, Held, Key, Scope, Store};
/// use idempotency_sqlite::SqliteStore;
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let dir = tempfile::tempdir()?;
/// let store = SqliteStore::open(&format!("sqlite://{}/idem.db", dir.path().display())).await?;
/// let request = BeginRequest::new(Scope::global(), Key::new("order-1")?, Fingerprint::of_bytes(b"pay"));
/// assert!(matches!(store.begin(&request).await?, Claim::Acquired(Held { attempt: 1, .. })));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    writer: mpsc::Sender<Job>,
    /// The read connection's thread; `None` for a private in-memory database (one connection)
    /// and for a read-only store (its one connection reads).
    reader: Option<mpsc::Sender<Job>>,
    clock: Arc<dyn Clock>,
    location: Location,
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore")
            .field("location", &self.inner.location)
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Opens (creating if needed) the store named by a `sqlite:` URL; see
    /// [`SqliteOptions::from_url`].
    ///
    /// # Errors
    ///
    /// [`ErrorKind::InvalidConfig`] for a malformed URL or a missing directory,
    /// [`ErrorKind::ReadOnly`] for a file the store cannot write, [`ErrorKind::Corrupt`] for a
    /// file that is not a (healthy) SQLite database, [`ErrorKind::Schema`] for a database written
    /// by a newer version or by another application.
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        Self::open_with(SqliteOptions::from_url(url)?).await
    }

    /// A private in-memory store (for tests; nothing survives the process).
    ///
    /// # Errors
    ///
    /// Only if SQLite itself cannot start.
    pub async fn in_memory() -> Result<Self, StoreError> {
        Self::open_with(SqliteOptions::memory()).await
    }

    /// Opens the store described by `options`.
    ///
    /// # Errors
    ///
    /// As [`SqliteStore::open`].
    pub async fn open_with(options: SqliteOptions) -> Result<Self, StoreError> {
        let location = options.location.clone();
        let clock = Arc::clone(&options.clock);
        let writer = spawn_thread(&options, Role::Writer).await?;
        // The writer has created and migrated the file: a reader can open it now.
        let reader = match (&location, options.access) {
            (Location::File(_), Access::Create | Access::Existing) => {
                Some(spawn_thread(&options, Role::Reader).await?)
            }
            _ => None,
        };
        tracing::debug!(?location, "SQLite store opened");
        Ok(Self {
            inner: Arc::new(Inner {
                writer,
                reader,
                clock,
                location,
            }),
        })
    }

    /// Runs `f` on the store's write connection, on the thread that serializes all of this
    /// store's writes, and returns its result.
    ///
    /// For diagnostics, maintenance queries and benchmarks that must share the store's
    /// connection. `f` must not leave a transaction open, and must not modify
    /// `idempotency_records` behind the store's back.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Unavailable`] if the store's thread has stopped.
    pub async fn with_connection<R, F>(&self, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Connection) -> R + Send + 'static,
    {
        alone(&self.inner.writer, f).await
    }

    /// Runs `f` on the write connection, with the store's clock.
    async fn run<R, F>(&self, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Connection, &dyn Clock) -> Result<R, StoreError> + Send + 'static,
    {
        let clock = Arc::clone(&self.inner.clock);
        self.with_connection(move |connection| f(connection, &*clock))
            .await?
    }

    /// Runs `f` on the read connection (the write connection when there is none): it sees what
    /// the last commit wrote, and never waits for a group's commit.
    async fn read<R, F>(&self, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&Connection, &dyn Clock) -> Result<R, StoreError> + Send + 'static,
    {
        let clock = Arc::clone(&self.inner.clock);
        let queue = self.inner.reader.as_ref().unwrap_or(&self.inner.writer);
        alone(queue, move |connection| f(connection, &*clock)).await?
    }

    /// One state-machine transition in the next group's write transaction: read the record,
    /// decide with [`machine`], write the effect; answered after the commit.
    async fn transition<R, F>(&self, scope: &Scope, key: &Key, step: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(Timestamp, Option<&Record>) -> (R, Effect) + Send + 'static,
    {
        self.queue_transition(scope, key, step)?
            .await
            .map_err(|_| stopped())?
    }

    /// Queues a transition for the writer and returns where its answer will come: transitions
    /// queued one after another without waiting join the same group's transaction (as far as
    /// a group holds), in the order they were queued.
    fn queue_transition<R, F>(&self, scope: &Scope, key: &Key, step: F) -> Result<Answer<R>, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(Timestamp, Option<&Record>) -> (R, Effect) + Send + 'static,
    {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let pending = Step {
            scope: scope.clone(),
            key: key.clone(),
            step: Some(step),
            decided: None,
            reply,
        };
        self.inner
            .writer
            .send(Job::Transition(Box::new(pending)))
            .map_err(|_| stopped())?;
        Ok(answer)
    }

    /// Queues every transition of a batch at once (one group commit for all, as far as a group
    /// holds) and waits for their answers, in order.
    async fn transitions<R, F>(&self, steps: Vec<(&Scope, &Key, F)>) -> Vec<Result<R, StoreError>>
    where
        R: Send + 'static,
        F: FnOnce(Timestamp, Option<&Record>) -> (R, Effect) + Send + 'static,
    {
        let queued: Vec<Result<Answer<R>, StoreError>> = steps
            .into_iter()
            .map(|(scope, key, step)| self.queue_transition(scope, key, step))
            .collect();
        let mut answers = Vec::with_capacity(queued.len());
        for answer in queued {
            answers.push(match answer {
                Ok(answer) => answer.await.unwrap_or_else(|_| Err(stopped())),
                Err(error) => Err(error),
            });
        }
        answers
    }
    /// What the read connection decides for each of `requests` in one job: the claim when it
    /// writes nothing (a replay, an in-flight answer, a mismatch), `None` when the writer must
    /// decide (a claim or a takeover), without a write, a lock or a wait for a group's fsync.
    async fn decided_by_reading(
        &self,
        requests: Vec<BeginRequest>,
    ) -> Result<Vec<Option<Claim>>, StoreError> {
        self.read(move |connection, clock| {
            let now = clock.now();
            requests
                .iter()
                .map(|request| {
                    let existing = select_record(connection, &request.scope, &request.key)?;
                    Ok(match machine::begin(now, existing.as_ref(), request) {
                        (claim, Effect::None) => Some(claim),
                        (_, Effect::Put(_)) => None,
                    })
                })
                .collect()
        })
        .await
    }
}

/// Where a queued transition's answer comes.
type Answer<R> = tokio::sync::oneshot::Receiver<Result<R, StoreError>>;

/// Runs `f` alone on the connection of the thread behind `queue`.
async fn alone<R, F>(queue: &mpsc::Sender<Job>, f: F) -> Result<R, StoreError>
where
    R: Send + 'static,
    F: FnOnce(&mut Connection) -> R + Send + 'static,
{
    let (reply, answer) = tokio::sync::oneshot::channel();
    queue
        .send(Job::Alone(Box::new(move |connection| {
            let _ = reply.send(f(connection));
        })))
        .map_err(|_| stopped())?;
    answer.await.map_err(|_| stopped())
}

/// Which connection a thread owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Creates and migrates the database, and makes every write.
    Writer,
    /// Reads only (`PRAGMA query_only`).
    Reader,
}

/// Starts the thread that owns a connection of `role`, once the connection is open.
async fn spawn_thread(options: &SqliteOptions, role: Role) -> Result<mpsc::Sender<Job>, StoreError> {
    let (jobs, queue) = mpsc::channel::<Job>();
    let (opened, opening) = tokio::sync::oneshot::channel();
    let options = options.clone();
    let name = match (role, &options.location) {
        (Role::Reader, _) => "idempotency-sqlite-read",
        (Role::Writer, Location::File(_)) => "idempotency-sqlite",
        (Role::Writer, Location::Memory) => "idempotency-sqlite-mem",
    };
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let opened_connection = match role {
                Role::Writer => open_connection(&options),
                Role::Reader => open_reader(&options),
            };
            let mut connection = match opened_connection {
                Ok(connection) => {
                    let _ = opened.send(Ok(()));
                    connection
                }
                Err(error) => {
                    let _ = opened.send(Err(error));
                    return;
                }
            };
            serve(&mut connection, &queue, &*options.clock, options.max_batch);
        })
        .map_err(|e| StoreError::new(ErrorKind::Backend, "cannot start a SQLite thread").with_source(e))?;
    opening.await.map_err(|_| stopped())??;
    Ok(jobs)
}

/// A connection's thread: jobs one after the other, transitions in groups.
fn serve(connection: &mut Connection, queue: &mpsc::Receiver<Job>, clock: &dyn Clock, max_batch: usize) {
    let mut next = queue.recv().ok();
    while let Some(job) = next.take() {
        match job {
            Job::Alone(job) => {
                // A panicking job (a bug, or a `with_connection` closure) must not take the
                // store down for every later caller: its caller sees its reply channel closed,
                // and the connection is returned to autocommit for the next job.
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(connection)));
                if ran.is_err() {
                    tracing::error!("a SQLite store operation panicked; rolling back and carrying on");
                    if !connection.is_autocommit() {
                        let _ = connection.execute_batch("ROLLBACK");
                    }
                }
            }
            Job::Transition(first) => {
                // Everything queued right now joins the group; a job that must run alone waits
                // for the group's commit.
                let mut group = vec![first];
                while group.len() < max_batch {
                    match queue.try_recv() {
                        Ok(Job::Transition(pending)) => group.push(pending),
                        Ok(other) => {
                            next = Some(other);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                commit_group(connection, group, clock);
            }
        }
        if next.is_none() {
            next = queue.recv().ok();
        }
    }
}

/// Applies `group` in one `IMMEDIATE` transaction, each transition under its own savepoint,
/// commits once, and only then answers the callers.
fn commit_group(connection: &mut Connection, group: Vec<Box<dyn Pending>>, clock: &dyn Clock) {
    #[allow(clippy::cast_precision_loss)] // a group holds at most 1024
    metrics::histogram!("idempotency_sqlite_group_size").record(group.len() as f64);
    if let Err(error) = exec(connection, "BEGIN IMMEDIATE") {
        let error = map_error("begin a write transaction", error);
        for pending in group {
            pending.answer(Err(error.clone()));
        }
        return;
    }
    // A transition alone needs no savepoint: the transaction is its own.
    let isolate = group.len() > 1;
    let mut applied: Vec<Box<dyn Pending>> = Vec::with_capacity(group.len());
    for mut pending in group {
        let opened = if isolate {
            exec(connection, "SAVEPOINT transition").map_err(|e| map_error("open a savepoint", e))
        } else {
            Ok(())
        };
        let result = opened.and_then(|()| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pending.apply(connection, clock)))
                .unwrap_or_else(|_| {
                    tracing::error!("a SQLite transition panicked; rolling it back and carrying on");
                    Err(StoreError::new(
                        ErrorKind::Backend,
                        "the SQLite transition panicked",
                    ))
                })
        });
        match result {
            Ok(()) if !isolate => applied.push(pending),
            Ok(()) => {
                if let Err(error) = exec(connection, "RELEASE transition") {
                    // The savepoint cannot be kept apart from its neighbours: give up the group.
                    let error = map_error("release a savepoint", error);
                    let _ = exec(connection, "ROLLBACK");
                    pending.answer(Err(error.clone()));
                    for done in applied {
                        done.answer(Err(error.clone()));
                    }
                    return;
                }
                applied.push(pending);
            }
            Err(error) => {
                if isolate {
                    let _ = exec(connection, "ROLLBACK TO transition");
                    let _ = exec(connection, "RELEASE transition");
                } else {
                    let _ = exec(connection, "ROLLBACK");
                    pending.answer(Err(error));
                    return;
                }
                pending.answer(Err(error));
            }
        }
    }
    let committed = exec(connection, "COMMIT").map_err(|error| {
        let _ = exec(connection, "ROLLBACK");
        map_error("commit", error)
    });
    for pending in applied {
        pending.answer(committed.clone());
    }
}

/// Runs a statement without parameters or rows (transaction control), prepared once per
/// connection.
fn exec(connection: &Connection, statement: &str) -> rusqlite::Result<()> {
    connection.prepare_cached(statement)?.execute([]).map(drop)
}

#[async_trait]
impl Store for SqliteStore {
    async fn begin(&self, request: &BeginRequest) -> Result<Claim, StoreError> {
        // A replay, an in-flight answer or a mismatch is decided on the read connection, without
        // a write, a lock or a wait for a group's fsync; only a claim or a takeover goes to the
        // writer, which decides again on the record as its transaction sees it.
        if self.inner.reader.is_some()
            && let Some(Some(claim)) = self.decided_by_reading(vec![request.clone()]).await?.pop()
        {
            return Ok(claim);
        }
        let request = request.clone();
        let (scope, key) = (request.scope.clone(), request.key.clone());
        self.transition(&scope, &key, move |now, record| {
            machine::begin(now, record, &request)
        })
        .await
    }

    async fn complete(
        &self,
        held: &Held,
        outcome: Outcome,
        retention: Duration,
    ) -> Result<Fenced<Timestamp>, StoreError> {
        let token = held.token;
        self.transition(&held.scope, &held.key, move |now, record| {
            machine::complete(now, record, token, outcome, retention)
        })
        .await
    }

    async fn release(&self, held: &Held) -> Result<Fenced<()>, StoreError> {
        let token = held.token;
        self.transition(&held.scope, &held.key, move |now, record| {
            machine::release(now, record, token)
        })
        .await
    }

    async fn extend(&self, held: &Held, lease: Duration) -> Result<Fenced<Timestamp>, StoreError> {
        let token = held.token;
        self.transition(&held.scope, &held.key, move |now, record| {
            machine::extend(now, record, token, lease)
        })
        .await
    }

    async fn get(&self, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
        let (scope, key) = (scope.clone(), key.clone());
        self.read(move |connection, clock| {
            let now = clock.now();
            Ok(select_record(connection, &scope, &key)?.filter(|record| !record.is_expired(now)))
        })
        .await
    }

    /// The batch's replays, in-flight answers and mismatches in one job on the read connection
    /// (for keys that stand once in the batch); every claim or takeover queued for the writer
    /// at once, so that they share a group's commit.
    async fn begin_many(&self, requests: &[BeginRequest]) -> Vec<Result<Claim, StoreError>> {
        if requests.len() < 2 {
            return begin_each(self, requests).await;
        }
        let mut answers: Vec<Option<Result<Claim, StoreError>>> = vec![None; requests.len()];
        if self.inner.reader.is_some() {
            // A key that stands twice goes to the writer each time: its second request must
            // see what the first one wrote.
            let mut stands: HashMap<_, usize> = HashMap::with_capacity(requests.len());
            for request in requests {
                *stands.entry(request.record_key()).or_default() += 1;
            }
            let once: Vec<usize> = (0..requests.len())
                .filter(|at| stands[&requests[*at].record_key()] == 1)
                .collect();
            let reads: Vec<BeginRequest> = once.iter().map(|at| requests[*at].clone()).collect();
            let decided = self.decided_by_reading(reads).await;
            // A failed read decides nothing: the writer decides every request instead.
            if let Ok(decided) = decided {
                for (at, claim) in once.into_iter().zip(decided) {
                    answers[at] = claim.map(Ok);
                }
            }
        }
        let undecided: Vec<usize> = (0..requests.len()).filter(|at| answers[*at].is_none()).collect();
        let steps = undecided
            .iter()
            .map(|at| {
                let request = requests[*at].clone();
                let step = move |now, record: Option<&Record>| machine::begin(now, record, &request);
                (&requests[*at].scope, &requests[*at].key, step)
            })
            .collect();
        for (at, claim) in undecided.into_iter().zip(self.transitions(steps).await) {
            answers[at] = Some(claim);
        }
        answers
            .into_iter()
            .map(|answer| answer.unwrap_or_else(|| unreachable!("every request is decided")))
            .collect()
    }

    /// Every completion queued for the writer at once: one group's commit for the batch.
    async fn complete_many(&self, completions: &[Completion]) -> Vec<Result<Fenced<Timestamp>, StoreError>> {
        let steps = completions
            .iter()
            .map(|completion| {
                let (token, outcome, retention) = (
                    completion.held.token,
                    completion.outcome.clone(),
                    completion.retention,
                );
                let step = move |now, record: Option<&Record>| {
                    machine::complete(now, record, token, outcome, retention)
                };
                (&completion.held.scope, &completion.held.key, step)
            })
            .collect();
        self.transitions(steps).await
    }
}

#[async_trait]
impl StoreAdmin for SqliteStore {
    async fn now(&self) -> Result<Timestamp, StoreError> {
        Ok(self.inner.clock.now())
    }

    async fn stats(&self, scope: Option<&Scope>) -> Result<Stats, StoreError> {
        let scope = scope.cloned();
        self.read(move |connection, clock| {
            let now = clock.now();
            let mut statement = connection
                .prepare_cached(sql::STATS)
                .map_err(|e| map_error("prepare stats", e))?;
            statement
                .query_row(
                    params![now.unix_millis(), scope.as_ref().map(Scope::as_str)],
                    |row| {
                        let oldest: Option<i64> = row.get(4)?;
                        Ok(Stats {
                            expired: count(row.get(0)?),
                            in_flight: count(row.get(1)?),
                            stale_leases: count(row.get(2)?),
                            completed: count(row.get(3)?),
                            oldest_in_flight: oldest.map(|t| now.since(Timestamp::from_unix_millis(t))),
                        })
                    },
                )
                .map_err(|e| map_error("read stats", e))
        })
        .await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordSummary>, StoreError> {
        let filter = filter.clone();
        self.read(move |connection, clock| {
            let now = clock.now();
            let state = filter.state.map(|state| match state {
                StateFilter::InFlight => 0,
                StateFilter::Completed => 1,
            });
            let started_by = filter
                .older_than
                .map(|age| now.unix_millis().saturating_sub(duration_millis(age)));
            let (after_scope, after_key) = match &filter.after {
                Some((scope, key)) => (Some(scope.as_str()), Some(key.as_str())),
                None => (None, None),
            };
            let limit = i64::try_from(filter.limit).unwrap_or(i64::MAX);
            let mut statement = connection
                .prepare_cached(sql::LIST)
                .map_err(|e| map_error("prepare list", e))?;
            let rows = statement
                .query_map(
                    params![
                        now.unix_millis(),
                        filter.scope.as_ref().map(Scope::as_str),
                        state,
                        started_by,
                        after_scope,
                        after_key,
                        limit
                    ],
                    |row| Ok(decode_summary(row)),
                )
                .map_err(|e| map_error("list records", e))?;
            let mut found = Vec::new();
            for row in rows {
                found.push(row.map_err(|e| map_error("list records", e))??);
            }
            Ok(found)
        })
        .await
    }

    async fn purge_expired(&self, limit: u64) -> Result<u64, StoreError> {
        self.run(move |connection, clock| {
            let tx = connection
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| map_error("begin a write transaction", e))?;
            let limit = i64::try_from(limit).unwrap_or(i64::MAX);
            let purged = tx
                .prepare_cached(sql::PURGE_EXPIRED)
                .and_then(|mut statement| statement.execute(params![clock.now().unix_millis(), limit]))
                .map_err(|e| map_error("purge expired records", e))?;
            tx.commit().map_err(|e| map_error("commit", e))?;
            Ok(purged as u64)
        })
        .await
    }

    async fn forget(&self, scope: &Scope, key: &Key, token: Token) -> Result<Fenced<()>, StoreError> {
        let (scope, key) = (scope.clone(), key.clone());
        self.run(move |connection, clock| {
            let tx = connection
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| map_error("begin a write transaction", e))?;
            let deleted = tx
                .prepare_cached(sql::FORGET)
                .and_then(|mut statement| {
                    statement.execute(params![
                        scope.as_str(),
                        key.as_str(),
                        &token.to_bytes()[..],
                        clock.now().unix_millis()
                    ])
                })
                .map_err(|e| map_error("forget a record", e))?;
            tx.commit().map_err(|e| map_error("commit", e))?;
            Ok(Fenced::accepted_if(deleted == 1))
        })
        .await
    }
}

fn stopped() -> StoreError {
    StoreError::new(
        ErrorKind::Unavailable,
        "the SQLite store did not answer (its worker thread stopped, or the operation panicked)",
    )
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn open_connection(options: &SqliteOptions) -> Result<Connection, StoreError> {
    let flags = match options.access {
        Access::Create => OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE,
        Access::Existing => OpenFlags::SQLITE_OPEN_READ_WRITE,
        _ => OpenFlags::SQLITE_OPEN_READ_ONLY,
    } | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let connection = match &options.location {
        Location::Memory if options.access != Access::Create => {
            return Err(StoreError::new(
                ErrorKind::InvalidConfig,
                "a private in-memory database exists only in the process that created it: nothing to inspect",
            ));
        }
        Location::Memory => Connection::open_in_memory_with_flags(flags),
        Location::File(path) => {
            check_file(path, options.access)?;
            Connection::open_with_flags(path, flags)
        }
    }
    .map_err(|e| map_error(&format!("open {}", describe(&options.location)), e))?;
    connection
        .busy_timeout(options.busy_timeout)
        .map_err(|e| map_error("set the busy timeout", e))?;
    while_locked(options.busy_timeout, || prepare(&connection, options))?;
    Ok(connection)
}

/// Makes a freshly opened write connection ready: checks the file (unless it may be created),
/// switches it to write-ahead logging, sets `synchronous`, and creates or checks the schema.
/// Every step may be repeated: [`while_locked`] runs it again when another process held a
/// lock.
fn prepare(connection: &Connection, options: &SqliteOptions) -> Result<(), StoreError> {
    if options.access != Access::Create {
        // Before any pragma that writes: the file must be a store of ours, as it is.
        verify(connection, &options.location)?;
        if options.access == Access::ReadOnly {
            return Ok(());
        }
    }
    if let Location::File(_) = options.location {
        let mode: String = connection
            .query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))
            .map_err(|e| {
                map_error(
                    &format!("switch {} to write-ahead logging", describe(&options.location)),
                    e,
                )
            })?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::new(
                ErrorKind::Backend,
                format!(
                    "{} cannot use write-ahead logging (journal mode is {mode})",
                    describe(&options.location)
                ),
            ));
        }
    }
    connection
        .execute_batch(&format!("PRAGMA synchronous = {};", options.synchronous.pragma()))
        .map_err(|e| map_error("set synchronous", e))?;
    if options.access == Access::Create {
        migrate(connection)?;
    }
    Ok(())
}

/// Runs `step` again while it fails because another process holds a lock, for up to
/// `busy_timeout` in all, pausing 1 ms and doubling up to 50 ms between tries.
///
/// SQLite's busy handler waits for most locks, but not all: switching a new file to
/// write-ahead logging while another process does the same fails at once with "database is
/// locked", and processes opening one new file together (replicas started at once) would
/// fail on it. Bounded by the same busy timeout (`busy_timeout_ms`) that bounds every other
/// wait for the lock.
fn while_locked<T>(
    busy_timeout: Duration,
    mut step: impl FnMut() -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(1);
    loop {
        match step() {
            Err(error) if error.kind() == ErrorKind::Timeout => {
                let waited = started.elapsed();
                if waited >= busy_timeout {
                    return Err(StoreError::new(
                        ErrorKind::Timeout,
                        format!(
                            "{error}; still locked after {} ms (the busy timeout, `busy_timeout_ms` in the URL)",
                            waited.as_millis()
                        ),
                    )
                    .with_source(error));
                }
                std::thread::sleep(pause.min(busy_timeout - waited));
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            done => return done,
        }
    }
}

/// The read connection: the file the writer opened, read with `PRAGMA query_only` so that no
/// statement on it can write.
fn open_reader(options: &SqliteOptions) -> Result<Connection, StoreError> {
    let Location::File(path) = &options.location else {
        return Err(StoreError::new(
            ErrorKind::Backend,
            "a private in-memory database has no second connection",
        ));
    };
    let connection = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| map_error(&format!("open {} for reading", describe(&options.location)), e))?;
    connection
        .busy_timeout(options.busy_timeout)
        .map_err(|e| map_error("set the busy timeout", e))?;
    connection
        .execute_batch("PRAGMA query_only = 1;")
        .map_err(|e| map_error("make the read connection read-only", e))?;
    Ok(connection)
}

/// Refuses a database that is not an idempotency store of this schema version, reading only.
fn verify(connection: &Connection, location: &Location) -> Result<(), StoreError> {
    let (version, application) = schema_of(connection)?;
    if application == sql::APPLICATION_ID && version == sql::SCHEMA_VERSION {
        return Ok(());
    }
    Err(StoreError::new(
        ErrorKind::Schema,
        format!(
            "{} is not an idempotency store of this version (application_id {application:#x}, \
             user_version {version}); it was left untouched (`idem migrate` creates a store)",
            describe(location)
        ),
    ))
}

/// Refuses a file marked read-only before SQLite opens it for writing: a process running as
/// root would otherwise write to it anyway, against its owner's intent. Unless the store may be
/// created, a missing file is refused too (SQLite would create an empty one).
fn check_file(path: &std::path::Path, access: Access) -> Result<(), StoreError> {
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => Err(StoreError::new(
            ErrorKind::InvalidConfig,
            format!("{} is a directory, not a database file", path.display()),
        )),
        Ok(meta) if meta.permissions().readonly() && access != Access::ReadOnly => Err(StoreError::new(
            ErrorKind::ReadOnly,
            format!("{} is read-only; the store must write to it", path.display()),
        )),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && access != Access::Create => {
            Err(StoreError::new(
                ErrorKind::InvalidConfig,
                format!(
                    "{} does not exist (`idem migrate --store sqlite://{}` creates a store there)",
                    path.display(),
                    path.display()
                ),
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
            match parent {
                Some(dir) if !dir.is_dir() => Err(StoreError::new(
                    ErrorKind::InvalidConfig,
                    format!(
                        "cannot create {}: directory {} does not exist",
                        path.display(),
                        dir.display()
                    ),
                )),
                _ => Ok(()),
            }
        }
        Err(e) => Err(
            StoreError::new(ErrorKind::Backend, format!("cannot inspect {}", path.display())).with_source(e),
        ),
    }
}

fn describe(location: &Location) -> String {
    match location {
        Location::File(path) => path.display().to_string(),
        Location::Memory => "the in-memory database".into(),
    }
}

/// The schema version and application id in the file's header.
fn schema_of(connection: &Connection) -> Result<(i64, i64), StoreError> {
    let version: i64 = connection
        .query_row("PRAGMA user_version", [], |row| row.get(0))
        .map_err(|e| map_error("read the schema version", e))?;
    let application: i64 = connection
        .query_row("PRAGMA application_id", [], |row| row.get(0))
        .map_err(|e| map_error("read the application id", e))?;
    Ok((version, application))
}

/// Whether a file with this header needs the schema created (`Ok(true)`), has it (`Ok(false)`),
/// or is not ours to touch.
fn needs_schema((version, application): (i64, i64)) -> Result<bool, StoreError> {
    if version != 0 && application != sql::APPLICATION_ID {
        return Err(StoreError::new(
            ErrorKind::Schema,
            format!(
                "the database belongs to another application (application_id {application:#x}, user_version {version})"
            ),
        ));
    }
    match version {
        sql::SCHEMA_VERSION => Ok(false),
        0 => Ok(true),
        newer => Err(StoreError::new(
            ErrorKind::Schema,
            format!(
                "the database has schema version {newer}, newer than this version understands ({})",
                sql::SCHEMA_VERSION
            ),
        )),
    }
}

/// Creates the schema in a new file, or checks the one there.
///
/// Any number of processes may open a new file at once (replicas started together): the
/// header is read again under the write lock (`BEGIN IMMEDIATE`, which waits for it), so the
/// first to get the lock creates the schema and every later one finds it there. Reading it
/// only before taking the lock, each saw an empty file and all but one failed on
/// `table idempotency_records already exists`.
fn migrate(connection: &Connection) -> Result<(), StoreError> {
    if !needs_schema(schema_of(connection)?)? {
        return Ok(());
    }
    connection
        .execute_batch("BEGIN IMMEDIATE")
        .map_err(|e| map_error("lock the database to create the schema", e))?;
    let created = needs_schema(schema_of(connection)?).and_then(|needed| {
        if needed {
            connection
                .execute_batch(&format!(
                    "{}
                     PRAGMA application_id = {};
                     PRAGMA user_version = {};",
                    sql::SCHEMA_V1,
                    sql::APPLICATION_ID,
                    sql::SCHEMA_VERSION
                ))
                .map_err(|e| map_error("create the schema", e))?;
        }
        Ok(needed)
    });
    match created.and_then(|created| {
        connection
            .execute_batch("COMMIT")
            .map_err(|e| map_error("commit the schema", e))
            .map(|()| created)
    }) {
        Ok(created) => {
            if created {
                tracing::info!(version = sql::SCHEMA_VERSION, "created the SQLite schema");
            }
            Ok(())
        }
        Err(error) => {
            let _ = connection.execute_batch("ROLLBACK");
            Err(error)
        }
    }
}

fn select_record(connection: &Connection, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
    let mut statement = connection
        .prepare_cached(sql::SELECT_RECORD)
        .map_err(|e| map_error("prepare select", e))?;
    statement
        .query_row(params![scope.as_str(), key.as_str()], |row| {
            Ok(decode_record(row))
        })
        .optional()
        .map_err(|e| map_error("read a record", e))?
        .transpose()
}

fn upsert_record(connection: &Connection, record: &Record) -> Result<(), StoreError> {
    let columns = RecordColumns::of(record);
    let mut statement = connection
        .prepare_cached(sql::UPSERT_RECORD)
        .map_err(|e| map_error("prepare upsert", e))?;
    statement
        .execute(params![
            record.scope.as_str(),
            record.key.as_str(),
            &record.fingerprint.as_bytes()[..],
            record.attempt,
            record.created_at.unix_millis(),
            record.expires_at.unix_millis(),
            &columns.token.to_bytes()[..],
            columns.completed,
            columns.acquired_at,
            columns.lease_until,
            columns.completed_at,
            columns.outcome,
        ])
        .map_err(|e| map_error("write a record", e))?;
    Ok(())
}

/// The record columns of `SELECT_RECORD` and `LIST`; `at` is the index of `completed` (`LIST`
/// has no token column before it).
fn decode_parts(row: &Row<'_>, at: usize) -> Result<RecordParts, StoreError> {
    let read = |e| map_error("decode a record", e);
    let fingerprint: Vec<u8> = row.get(2).map_err(read)?;
    Ok(RecordParts {
        scope: row.get(0).map_err(read)?,
        key: row.get(1).map_err(read)?,
        fingerprint: Fingerprint::from_slice(&fingerprint)?,
        attempt: row.get(3).map_err(read)?,
        created_at: row.get(4).map_err(read)?,
        expires_at: row.get(5).map_err(read)?,
        completed: row.get(at).map_err(read)?,
        acquired_at: row.get(at + 1).map_err(read)?,
        lease_until: row.get(at + 2).map_err(read)?,
        completed_at: row.get(at + 3).map_err(read)?,
    })
}

fn decode_record(row: &Row<'_>) -> Result<Record, StoreError> {
    let read = |e| map_error("decode a record", e);
    let parts = decode_parts(row, 7)?;
    let token: Vec<u8> = row.get(6).map_err(read)?;
    let outcome: Option<Vec<u8>> = row.get(11).map_err(read)?;
    Ok(parts.into_record(Token::from_slice(&token)?, outcome.map(Outcome::new))?)
}

fn decode_summary(row: &Row<'_>) -> Result<RecordSummary, StoreError> {
    let parts = decode_parts(row, 6)?;
    let outcome_len = row.get(10).map_err(|e| map_error("decode a record", e))?;
    Ok(parts.into_summary(outcome_len)?)
}

/// Classifies a SQLite error; `doing` says what the store was doing.
pub(crate) fn map_error(doing: &str, error: rusqlite::Error) -> StoreError {
    use rusqlite::ErrorCode;
    let kind = match &error {
        rusqlite::Error::SqliteFailure(failure, _) => match failure.code {
            ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt => ErrorKind::Corrupt,
            ErrorCode::ReadOnly | ErrorCode::PermissionDenied => ErrorKind::ReadOnly,
            ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked => ErrorKind::Timeout,
            ErrorCode::CannotOpen => ErrorKind::InvalidConfig,
            _ => ErrorKind::Backend,
        },
        rusqlite::Error::InvalidColumnType(..) | rusqlite::Error::FromSqlConversionFailure(..) => {
            ErrorKind::Corrupt
        }
        _ => ErrorKind::Backend,
    };
    let hint = match kind {
        ErrorKind::Corrupt => " (the file is not a healthy SQLite database)",
        ErrorKind::Timeout => " (another process holds the write lock; retry later)",
        _ => "",
    };
    StoreError::new(kind, format!("{doing}: {error}{hint}")).with_source(error)
}

//! The store: items, conditional writes, scans.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    ReturnValuesOnConditionCheckFailure, ScalarAttributeType,
};
use idempotency_core::{
    BeginRequest, Claim, Clock, ErrorKind, Fenced, Fingerprint, Held, Key, ListFilter, Outcome, Record,
    RecordParts, RecordState, RecordSummary, Scope, Stats, Store, StoreAdmin, StoreError, SummaryState,
    SystemClock, Timestamp, Token, machine,
};

/// Items: the attribute names.
const PK: &str = "pk";
const VERSION: &str = "ver";
const EXPIRES: &str = "expires_ms";
const CHUNKS: &str = "outcome_chunks";
const OUTCOME_LEN: &str = "outcome_len";
const OUTCOME: &str = "outcome";
const STATE: &str = "state";
const TOKEN: &str = "token";
const TTL: &str = "ttl";
/// The `state` attribute's values.
const IN_FLIGHT: &str = "in_flight";
const COMPLETED: &str = "completed";

/// The largest outcome kept in the record's own item; larger ones are split into items of this
/// size, written in the same transaction (DynamoDB's items hold at most 400 KB).
const CHUNK: usize = 300 * 1024;

/// How to reach the table, and the time rules.
#[derive(Clone, derive_more::Debug)]
pub struct DynamoDbOptions {
    table: String,
    #[debug(skip)]
    clock: Arc<dyn Clock>,
    max_clock_skew: Duration,
}

impl DynamoDbOptions {
    /// The table `table`, the system clock, a maximum clock skew of 1 s.
    ///
    /// # Errors
    ///
    /// `InvalidConfig` for a table name DynamoDB would refuse (3 to 255 of `a-z A-Z 0-9 _ - .`).
    pub fn table(table: &str) -> Result<Self, StoreError> {
        let valid = (3..=255).contains(&table.len())
            && table
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
        if !valid {
            return Err(StoreError::new(
                ErrorKind::InvalidConfig,
                format!("invalid DynamoDB table name {table:?} (3 to 255 of a-z, A-Z, 0-9, _, -, .)"),
            ));
        }
        Ok(Self {
            table: table.to_owned(),
            clock: Arc::new(SystemClock),
            max_clock_skew: Duration::from_secs(1),
        })
    }

    /// The clock decisions are made with (tests use a manual one).
    #[must_use]
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// How far apart the clocks of the hosts sharing the table may be: a lease must have been
    /// over for this much longer before another attempt takes it over.
    #[must_use]
    pub fn max_clock_skew(mut self, skew: Duration) -> Self {
        self.max_clock_skew = skew;
        self
    }

    /// The table's name.
    #[must_use]
    pub fn table_name(&self) -> &str {
        &self.table
    }

    /// The maximum clock skew allowed for.
    #[must_use]
    pub fn clock_skew(&self) -> Duration {
        self.max_clock_skew
    }
}

/// Idempotency records in a DynamoDB table; see the [crate docs](crate).
#[derive(Clone, derive_more::Debug)]
pub struct DynamoDbStore {
    #[debug(skip)]
    client: Client,
    options: DynamoDbOptions,
}

/// An item as read: the record (if live or not, as stored) and its version.
struct Stored {
    record: Record,
    version: u64,
}

/// An item as a scan reads it, without its outcome's chunk items (listing, counting and purging
/// need none of the bytes): the record, with a chunked outcome left empty, and what the
/// outcome takes.
struct Scanned {
    stored: Stored,
    /// The outcome's size in bytes (a completed record's).
    outcome_len: usize,
    /// How many chunk items hold the outcome (0 when it is in the item).
    chunks: usize,
}

impl DynamoDbStore {
    /// A store on `client` (configure its region, endpoint and credentials as for any AWS
    /// client); the table must exist ([`migrate`](Self::migrate) creates it).
    #[must_use]
    pub fn new(client: Client, options: DynamoDbOptions) -> Self {
        Self { client, options }
    }

    /// A store on a client configured the usual AWS way (environment, profile, instance role),
    /// with `endpoint` and `region` overriding what the environment says (a local server needs
    /// the endpoint). TLS is rustls with the `ring` provider: no C library is built.
    pub async fn connect(options: DynamoDbOptions, endpoint: Option<&str>, region: Option<&str>) -> Self {
        Self::connect_through(options, endpoint, region, http_client()).await
    }

    /// [`connect`](Self::connect) through `http_client` (for example
    /// [`http_client_trusting`] a private CA).
    pub async fn connect_through(
        options: DynamoDbOptions,
        endpoint: Option<&str>,
        region: Option<&str>,
        http_client: aws_sdk_dynamodb::config::SharedHttpClient,
    ) -> Self {
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest()).http_client(http_client);
        if let Some(endpoint) = endpoint {
            loader = loader.endpoint_url(endpoint);
        }
        if let Some(region) = region {
            loader = loader.region(aws_config::Region::new(region.to_owned()));
        }
        let config = loader.load().await;
        Self::new(Client::new(&config), options)
    }

    /// The client the store talks through (benchmarks issue raw requests on it).
    #[must_use]
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The table's name.
    #[must_use]
    pub fn table(&self) -> &str {
        &self.options.table
    }

    /// Creates the table (key `pk`, on-demand billing) if it does not exist, waits until it is
    /// active, and turns on TTL deletion on the `ttl` attribute.
    ///
    /// # Errors
    ///
    /// The service's error (permissions, an invalid name).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let exists = self
            .client
            .describe_table()
            .table_name(&self.options.table)
            .send()
            .await;
        if exists.is_err() {
            let created = self
                .client
                .create_table()
                .table_name(&self.options.table)
                .billing_mode(BillingMode::PayPerRequest)
                .attribute_definitions(
                    AttributeDefinition::builder()
                        .attribute_name(PK)
                        .attribute_type(ScalarAttributeType::S)
                        .build()
                        .map_err(|e| backend("build the table definition", e))?,
                )
                .key_schema(
                    KeySchemaElement::builder()
                        .attribute_name(PK)
                        .key_type(KeyType::Hash)
                        .build()
                        .map_err(|e| backend("build the key schema", e))?,
                )
                .send()
                .await;
            if let Err(error) = created {
                let in_use = error.as_service_error().is_some_and(
                    aws_sdk_dynamodb::operation::create_table::CreateTableError::is_resource_in_use_exception,
                );
                if !in_use {
                    return Err(sdk("create the table", &error));
                }
            }
        }
        for _ in 0..120 {
            let described = self
                .client
                .describe_table()
                .table_name(&self.options.table)
                .send()
                .await
                .map_err(|e| sdk("describe the table", &e))?;
            let active = described
                .table()
                .and_then(|table| table.table_status())
                .is_some_and(|status| *status == aws_sdk_dynamodb::types::TableStatus::Active);
            if active {
                let ttl = aws_sdk_dynamodb::types::TimeToLiveSpecification::builder()
                    .attribute_name(TTL)
                    .enabled(true)
                    .build()
                    .map_err(|e| backend("build the TTL specification", e))?;
                // Already on is not an error worth failing a migration for.
                let _ = self
                    .client
                    .update_time_to_live()
                    .table_name(&self.options.table)
                    .time_to_live_specification(ttl)
                    .send()
                    .await;
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Err(StoreError::new(
            ErrorKind::Unavailable,
            format!(
                "table {} did not become active within a minute",
                self.options.table
            ),
        ))
    }

    /// Checks that the table exists and has this store's key (`pk`, a string), creating
    /// nothing: what the operations commands do before they read or purge.
    ///
    /// # Errors
    ///
    /// `InvalidConfig` naming the table when it is missing ("create it with `idem migrate`") or
    /// keyed otherwise; the service's error when it cannot be asked.
    pub async fn check(&self) -> Result<(), StoreError> {
        let table = &self.options.table;
        let described = self.client.describe_table().table_name(table).send().await;
        let described = match described {
            Ok(described) => described,
            Err(error)
                if error.as_service_error().is_some_and(
                    aws_sdk_dynamodb::operation::describe_table::DescribeTableError::is_resource_not_found_exception,
                ) =>
            {
                return Err(StoreError::new(
                    ErrorKind::InvalidConfig,
                    format!("DynamoDB table {table} does not exist: create it with `idem migrate`"),
                ));
            }
            Err(error) => return Err(sdk("describe the table", &error)),
        };
        let ours = described.table().is_some_and(|t| {
            let keys = t.key_schema();
            keys.len() == 1 && keys[0].attribute_name() == PK && *keys[0].key_type() == KeyType::Hash
        });
        if !ours {
            return Err(StoreError::new(
                ErrorKind::InvalidConfig,
                format!("DynamoDB table {table} is not an idempotency store (its key is not `{PK}` alone)"),
            ));
        }
        Ok(())
    }

    fn now(&self) -> Timestamp {
        self.options.clock.now()
    }

    fn pk(scope: &Scope, key: &Key) -> AttributeValue {
        AttributeValue::S(Key::qualified(scope, key).as_str().to_owned())
    }

    /// A strongly consistent read of the item.
    async fn read(&self, scope: &Scope, key: &Key) -> Result<Option<Stored>, StoreError> {
        self.read_pk(Key::qualified(scope, key).as_str()).await
    }

    /// A strongly consistent read of the item at `pk`, whatever it holds.
    async fn get_item(
        &self,
        pk: AttributeValue,
        what: &str,
    ) -> Result<Option<HashMap<String, AttributeValue>>, StoreError> {
        let read = self
            .client
            .get_item()
            .table_name(&self.options.table)
            .key(PK, pk)
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| sdk(what, &e))?;
        Ok(read.item)
    }

    /// The chunk item `index` of the outcome of the record at `pk`. A space cannot occur in a
    /// scope or a key, so no record's key is ever a chunk's.
    fn chunk_pk(pk: &str, index: usize) -> AttributeValue {
        AttributeValue::S(format!("{pk} outcome {index}"))
    }

    /// Decodes an item, fetching its outcome's chunks (strongly consistent) if it has any.
    async fn load(&self, item: &HashMap<String, AttributeValue>) -> Result<Stored, StoreError> {
        let chunks = attribute_count(item, CHUNKS);
        if chunks == 0 {
            return decode(item, None);
        }
        let pk = item
            .get(PK)
            .and_then(|value| value.as_s().ok())
            .ok_or_else(|| StoreError::new(ErrorKind::Corrupt, "a DynamoDB item without its key"))?;
        let mut outcome = Vec::new();
        for index in 0..chunks {
            let chunk = self
                .get_item(Self::chunk_pk(pk, index), "read an outcome chunk")
                .await?;
            let data = chunk
                .as_ref()
                .and_then(|item| item.get("data"))
                .and_then(|value| value.as_b().ok())
                .ok_or_else(|| {
                    StoreError::new(
                        ErrorKind::Corrupt,
                        format!("outcome chunk {index} of {pk} is missing"),
                    )
                })?;
            outcome.extend_from_slice(data.as_ref());
        }
        decode(item, Some(outcome))
    }

    /// Writes `record` as version `version`, if the item is still at `expected` (or absent when
    /// `None`); returns the item found instead when the condition fails.
    async fn write(
        &self,
        record: &Record,
        version: u64,
        expected: Option<u64>,
        or_expired_before: Option<Timestamp>,
    ) -> Result<Result<(), Option<Stored>>, StoreError> {
        let (item, chunks) = encode(record, version);
        if !chunks.is_empty() {
            // Only a completion carries an outcome, and it always follows a read.
            let pk = Key::qualified(&record.scope, &record.key);
            let ttl = number_i64(ttl_seconds(record.expires_at));
            let mut put = aws_sdk_dynamodb::types::Put::builder()
                .table_name(&self.options.table)
                .set_item(Some(item));
            put = match expected {
                Some(seen) => put
                    .condition_expression("#v = :v")
                    .expression_attribute_names("#v", VERSION)
                    .expression_attribute_values(":v", number(seen)),
                None => put
                    .condition_expression("attribute_not_exists(#pk)")
                    .expression_attribute_names("#pk", PK),
            };
            let put = put
                .build()
                .map_err(|e| backend("build a transactional write", e))?;
            let main = aws_sdk_dynamodb::types::TransactWriteItem::builder()
                .put(put)
                .build();
            return self.write_chunked(main, pk.as_str(), ttl, chunks).await;
        }
        let mut request = self
            .client
            .put_item()
            .table_name(&self.options.table)
            .set_item(Some(item))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        request = match (expected, or_expired_before) {
            (Some(seen), _) => request
                .condition_expression("#v = :v")
                .expression_attribute_names("#v", VERSION)
                .expression_attribute_values(":v", number(seen)),
            (None, Some(now)) => request
                .condition_expression("attribute_not_exists(#pk) OR #e <= :now")
                .expression_attribute_names("#pk", PK)
                .expression_attribute_names("#e", EXPIRES)
                .expression_attribute_values(":now", number_i64(now.unix_millis())),
            (None, None) => request
                .condition_expression("attribute_not_exists(#pk)")
                .expression_attribute_names("#pk", PK),
        };
        match request.send().await {
            Ok(_) => Ok(Ok(())),
            Err(error) => match error.as_service_error() {
                Some(PutItemError::ConditionalCheckFailedException(failed)) => match failed.item() {
                    Some(item) => Ok(Err(Some(self.load(item).await?))),
                    None => Ok(Err(None)),
                },
                _ => Err(sdk("write a record", &error)),
            },
        }
    }

    /// Writes `main` (the record's put or update, with its condition) and the chunk items of
    /// its outcome in one transaction. A cancelled transaction (a failed condition, or a
    /// conflict with another transaction) reads the record again for the caller to decide on.
    async fn write_chunked(
        &self,
        main: aws_sdk_dynamodb::types::TransactWriteItem,
        pk: &str,
        ttl: AttributeValue,
        chunks: Vec<Vec<u8>>,
    ) -> Result<Result<(), Option<Stored>>, StoreError> {
        use aws_sdk_dynamodb::types::{Put, TransactWriteItem};
        let mut writes = vec![main];
        for (index, data) in chunks.into_iter().enumerate() {
            let chunk = Put::builder()
                .table_name(&self.options.table)
                .item(PK, Self::chunk_pk(pk, index))
                .item("data", AttributeValue::B(Blob::new(data)))
                .item(TTL, ttl.clone())
                .build()
                .map_err(|e| backend("build a transactional write", e))?;
            writes.push(TransactWriteItem::builder().put(chunk).build());
        }
        match self.client.transact_write_items().set_transact_items(Some(writes)).send().await {
            Ok(_) => Ok(Ok(())),
            Err(error)
                if error
                    .as_service_error()
                    .is_some_and(aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError::is_transaction_canceled_exception) =>
            {
                Ok(Err(self.read_pk(pk).await?))
            }
            Err(error) => Err(sdk("write a record with a large outcome", &error)),
        }
    }

    /// `complete`, `release` or `extend` as one `UpdateItem` conditioned on the item being in
    /// flight, held by the caller's token and live: exactly the cases in which the machine
    /// writes, so a write that lands is the machine's answer, `accepted`. A failed condition
    /// returns the item as it was (`ALL_OLD`), and the machine decides on it, without another
    /// read: `LeaseLost`, or a retried `complete` accepted again. Only a decision the update's
    /// condition left out (an `extend` past the record's expiry) writes once more, conditioned
    /// on the version.
    async fn update_held<T>(
        &self,
        held: &Held,
        update: Update,
        chunks: Vec<Vec<u8>>,
        accepted: T,
        decide: impl Fn(Timestamp, Option<&Record>) -> (T, machine::Effect),
    ) -> Result<T, StoreError> {
        // The token of no attempt holds nothing, though a released item carries it.
        if held.token == Token::NONE {
            return Ok(decide(self.now(), None).0);
        }
        let pk = Key::qualified(&held.scope, &held.key);
        let Expressions {
            condition,
            update: expression,
            names,
            values,
        } = update.expressions();
        let found = if chunks.is_empty() {
            let request = self
                .client
                .update_item()
                .table_name(&self.options.table)
                .key(PK, AttributeValue::S(pk.as_str().to_owned()))
                .condition_expression(condition)
                .update_expression(expression)
                .set_expression_attribute_names(Some(names))
                .set_expression_attribute_values(Some(values))
                .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
            match request.send().await {
                Ok(_) => return Ok(accepted),
                Err(error) => match error.as_service_error() {
                    Some(UpdateItemError::ConditionalCheckFailedException(failed)) => match failed.item() {
                        Some(item) => Some(self.load(item).await?),
                        None => None,
                    },
                    _ => return Err(sdk("update a record", &error)),
                },
            }
        } else {
            let ttl = update.value_of(TTL).cloned().unwrap_or_else(|| number(0));
            let main = aws_sdk_dynamodb::types::Update::builder()
                .table_name(&self.options.table)
                .key(PK, AttributeValue::S(pk.as_str().to_owned()))
                .condition_expression(condition)
                .update_expression(expression)
                .set_expression_attribute_names(Some(names))
                .set_expression_attribute_values(Some(values))
                .build()
                .map_err(|e| backend("build a transactional write", e))?;
            let main = aws_sdk_dynamodb::types::TransactWriteItem::builder()
                .update(main)
                .build();
            match self.write_chunked(main, pk.as_str(), ttl, chunks).await? {
                Ok(()) => return Ok(accepted),
                Err(found) => found,
            }
        };
        self.transition(&held.scope, &held.key, Some(found), decide).await
    }

    /// A strongly consistent read of the record at `pk`, its outcome's chunks included.
    async fn read_pk(&self, pk: &str) -> Result<Option<Stored>, StoreError> {
        match self
            .get_item(AttributeValue::S(pk.to_owned()), "read a record")
            .await?
        {
            Some(item) => Ok(Some(self.load(&item).await?)),
            None => Ok(None),
        }
    }

    /// Reads, decides with `decide`, and writes conditioned on what was read, until a write
    /// lands or the decision writes nothing. `first` is an item already in hand (from a failed
    /// write), saving the read.
    async fn transition<T>(
        &self,
        scope: &Scope,
        key: &Key,
        mut first: Option<Option<Stored>>,
        decide: impl Fn(Timestamp, Option<&Record>) -> (T, machine::Effect),
    ) -> Result<T, StoreError> {
        loop {
            let stored = match first.take() {
                Some(stored) => stored,
                None => self.read(scope, key).await?,
            };
            let now = self.now();
            let (answer, effect) = decide(now, stored.as_ref().map(|s| &s.record));
            let machine::Effect::Put(record) = effect else {
                return Ok(answer);
            };
            let (version, expected) = match &stored {
                Some(stored) => (stored.version + 1, Some(stored.version)),
                None => (1, None),
            };
            match self.write(&record, version, expected, None).await? {
                Ok(()) => return Ok(answer),
                // Someone else wrote in between: decide again on what is there now.
                Err(found) => first = Some(found),
            }
        }
    }
}

#[async_trait]
impl Store for DynamoDbStore {
    async fn begin(&self, request: &BeginRequest) -> Result<Claim, StoreError> {
        let now = self.now();
        // The common case, a new key: one write, conditioned on the key being absent or expired.
        let (claim, effect) = machine::begin(now, None, request);
        let machine::Effect::Put(record) = effect else {
            return Ok(claim);
        };
        let found = match self.write(&record, 1, None, Some(now)).await? {
            Ok(()) => return Ok(claim),
            Err(found) => found,
        };
        let skew = self.options.max_clock_skew;
        self.transition(&request.scope, &request.key, Some(found), |now, record| {
            // Another host's lease is only over once the skew bound has passed too.
            if let Some(Record {
                state: RecordState::InFlight {
                    token, lease_until, ..
                },
                fingerprint,
                ..
            }) = machine::live(now, record)
                && *token != request.token
                && *token != Token::NONE
                && *fingerprint == request.fingerprint
                && now < lease_until.after(skew)
                && now >= *lease_until
            {
                let retry_after = Duration::from_millis(
                    u64::try_from(lease_until.after(skew).unix_millis() - now.unix_millis()).unwrap_or(0),
                );
                return (
                    Claim::InFlight {
                        attempt: record.map_or(1, |r| r.attempt),
                        retry_after,
                    },
                    machine::Effect::None,
                );
            }
            machine::begin(now, record, request)
        })
        .await
    }

    async fn complete(
        &self,
        held: &Held,
        outcome: Outcome,
        retention: Duration,
    ) -> Result<Fenced<Timestamp>, StoreError> {
        let now = self.now();
        let expires_at = now.after(retention);
        let mut update = Update::held_by(held.token, now)
            .set(STATE, AttributeValue::S(COMPLETED.into()))
            .set("completed_ms", number_i64(now.unix_millis()))
            .set(EXPIRES, number_i64(expires_at.unix_millis()))
            .set(TTL, number_i64(ttl_seconds(expires_at)))
            .remove("acquired_ms")
            .remove("lease_ms");
        let mut chunks = Vec::new();
        if outcome.len() > CHUNK {
            chunks = split(&outcome);
            update = update
                .set(CHUNKS, number(chunks.len() as u64))
                .set(OUTCOME_LEN, number(outcome.len() as u64))
                .remove(OUTCOME);
        } else {
            update = update
                .set(OUTCOME, AttributeValue::B(Blob::new(outcome.as_bytes().to_vec())))
                .remove(CHUNKS)
                .remove(OUTCOME_LEN);
        }
        let decide = |now, record: Option<&Record>| {
            machine::complete(now, record, held.token, outcome.clone(), retention)
        };
        self.update_held(held, update, chunks, Fenced::Accepted(expires_at), decide)
            .await
    }

    async fn release(&self, held: &Held) -> Result<Fenced<()>, StoreError> {
        let now = self.now();
        let update = Update::held_by(held.token, now)
            .set(TOKEN, token_value(Token::NONE))
            .set("lease_ms", number_i64(now.unix_millis()));
        let decide = |now, record: Option<&Record>| machine::release(now, record, held.token);
        self.update_held(held, update, Vec::new(), Fenced::Accepted(()), decide)
            .await
    }

    async fn extend(&self, held: &Held, lease: Duration) -> Result<Fenced<Timestamp>, StoreError> {
        let now = self.now();
        let lease_until = now.after(lease);
        // The record's expiry moves with the lease only when the lease would outlive it, which
        // an update expression cannot decide (it has no `max`). That rare case fails this
        // condition and goes the read-decide-write way.
        let update = Update::held_by(held.token, now)
            .and(EXPIRES, ">=", number_i64(lease_until.unix_millis()))
            .set("lease_ms", number_i64(lease_until.unix_millis()));
        let decide = |now, record: Option<&Record>| machine::extend(now, record, held.token, lease);
        self.update_held(held, update, Vec::new(), Fenced::Accepted(lease_until), decide)
            .await
    }

    async fn get(&self, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
        let now = self.now();
        Ok(self
            .read(scope, key)
            .await?
            .map(|stored| stored.record)
            .filter(|record| !record.is_expired(now)))
    }
}

impl DynamoDbStore {
    /// Every record of the table, by a paginated, strongly consistent scan; outcomes split into
    /// chunk items are not read.
    async fn scan(&self) -> Result<Vec<Scanned>, StoreError> {
        let mut items = Vec::new();
        let mut start: Option<HashMap<String, AttributeValue>> = None;
        loop {
            let page = self
                .client
                .scan()
                .table_name(&self.options.table)
                .consistent_read(true)
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(|e| sdk("scan the table", &e))?;
            // Chunk items carry no state: they go with their record.
            for item in page.items().iter().filter(|item| item.contains_key(STATE)) {
                items.push(scanned(item)?);
            }
            match page.last_evaluated_key() {
                Some(key) if !key.is_empty() => start = Some(key.clone()),
                _ => return Ok(items),
            }
        }
    }
}

#[async_trait]
impl StoreAdmin for DynamoDbStore {
    async fn now(&self) -> Result<Timestamp, StoreError> {
        Ok(self.options.clock.now())
    }

    async fn stats(&self, scope: Option<&Scope>) -> Result<Stats, StoreError> {
        let now = self.options.clock.now();
        let mut stats = Stats::default();
        for Scanned { stored, .. } in self.scan().await? {
            if scope.is_none_or(|scope| &stored.record.scope == scope) {
                stats.count(&stored.record, now);
            }
        }
        Ok(stats)
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordSummary>, StoreError> {
        let now = self.options.clock.now();
        let found = self
            .scan()
            .await?
            .into_iter()
            .filter(|scanned| filter.matches(&scanned.stored.record, now))
            .map(|scanned| {
                let mut summary = scanned.stored.record.summary();
                if let SummaryState::Completed { outcome_len, .. } = &mut summary.state {
                    *outcome_len = scanned.outcome_len;
                }
                summary
            })
            .collect();
        Ok(filter.page(found))
    }

    async fn purge_expired(&self, limit: u64) -> Result<u64, StoreError> {
        let now = self.options.clock.now();
        let mut purged = 0;
        for Scanned { stored, chunks, .. } in self.scan().await? {
            if purged >= limit {
                break;
            }
            if !stored.record.is_expired(now) {
                continue;
            }
            // Only if it is still the expired item that was scanned.
            if self
                .delete_stored(&stored, chunks, "delete an expired record")
                .await?
            {
                purged += 1;
            }
        }
        Ok(purged)
    }

    async fn forget(&self, scope: &Scope, key: &Key, token: Token) -> Result<Fenced<()>, StoreError> {
        let pk = Key::qualified(scope, key);
        let Some(item) = self
            .get_item(AttributeValue::S(pk.as_str().to_owned()), "read a record")
            .await?
        else {
            return Ok(Fenced::LeaseLost);
        };
        let stored = self.load(&item).await?;
        let now = self.now();
        if stored.record.is_expired(now) || stored.record.token() != token {
            return Ok(Fenced::LeaseLost);
        }
        // Only if it is still the item that was read.
        let deleted = self
            .delete_stored(&stored, attribute_count(&item, CHUNKS), "forget a record")
            .await?;
        Ok(Fenced::accepted_if(deleted))
    }
}

impl DynamoDbStore {
    /// Deletes `stored`'s item if it still has the version that was read, then its outcome's
    /// `chunks`: whether it was deleted (`false`: written since).
    async fn delete_stored(&self, stored: &Stored, chunks: usize, what: &str) -> Result<bool, StoreError> {
        let deleted = self
            .client
            .delete_item()
            .table_name(&self.options.table)
            .key(PK, Self::pk(&stored.record.scope, &stored.record.key))
            .condition_expression("#v = :v")
            .expression_attribute_names("#v", VERSION)
            .expression_attribute_values(":v", number(stored.version))
            .send()
            .await;
        match deleted {
            Ok(_) => {
                let pk = Key::qualified(&stored.record.scope, &stored.record.key);
                for index in 0..chunks {
                    self.client
                        .delete_item()
                        .table_name(&self.options.table)
                        .key(PK, Self::chunk_pk(pk.as_str(), index))
                        .send()
                        .await
                        .map_err(|e| sdk("delete an outcome chunk", &e))?;
                }
                Ok(true)
            }
            Err(error)
                if error
                    .as_service_error()
                    .is_some_and(|e| e.is_conditional_check_failed_exception()) =>
            {
                Ok(false)
            }
            Err(error) => Err(sdk(what, &error)),
        }
    }
}

/// The HTTPS client this crate configures its clients with: rustls on the `ring` provider, so
/// no C library (`aws-lc-sys`) is built. Pass it to a client built by hand
/// (`aws_sdk_dynamodb::Config::builder().http_client(http_client())`).
/// It verifies servers against the system's trust store (which honours `SSL_CERT_FILE` and
/// `SSL_CERT_DIR`).
#[must_use]
pub fn http_client() -> aws_sdk_dynamodb::config::SharedHttpClient {
    idempotency_core::aws::https_client()
}

/// [`http_client`] verifying servers against the CA certificates in the PEM file `ca` instead
/// of the system's trust store: a compatible server or a TLS proxy with a private CA.
///
/// # Errors
///
/// [`ErrorKind::InvalidConfig`] naming the file and why it cannot be used.
pub fn http_client_trusting(
    ca: &std::path::Path,
) -> Result<aws_sdk_dynamodb::config::SharedHttpClient, StoreError> {
    idempotency_core::aws::https_client_trusting(ca)
        .map_err(|why| StoreError::new(ErrorKind::InvalidConfig, why))
}

/// The `ttl` attribute for a record expiring at `expires_at`: DynamoDB's TTL deletion reads
/// whole seconds, rounded up so that it never deletes a live record.
fn ttl_seconds(expires_at: Timestamp) -> i64 {
    expires_at.unix_millis().div_euclid(1000) + 1
}

/// An outcome too large for its record's item, in chunk items' worth.
fn split(outcome: &Outcome) -> Vec<Vec<u8>> {
    outcome.as_bytes().chunks(CHUNK).map(<[u8]>::to_vec).collect()
}

fn token_value(token: Token) -> AttributeValue {
    AttributeValue::B(Blob::new(token.to_bytes().to_vec()))
}

/// An `UpdateItem` of a record held by a token (see `update_held`): its extra conditions and the
/// attributes it sets and removes. Every attribute name goes through a placeholder, since
/// `state`, `token`, `key` and `ttl` are reserved words in DynamoDB's expressions.
#[derive(Debug)]
struct Update {
    token: Token,
    now: Timestamp,
    /// Conditions beyond "held by the token": (attribute, comparison, value).
    conditions: Vec<(&'static str, &'static str, AttributeValue)>,
    sets: Vec<(&'static str, AttributeValue)>,
    removes: Vec<&'static str>,
}

impl Update {
    /// An update that applies only while the item is in flight, held by `token` and live at
    /// `now`, and that moves the item's version on.
    fn held_by(token: Token, now: Timestamp) -> Self {
        Self {
            token,
            now,
            conditions: Vec::new(),
            sets: Vec::new(),
            removes: Vec::new(),
        }
    }

    /// One more condition: `attribute` compared (`op`) with `value`.
    fn and(mut self, attribute: &'static str, op: &'static str, value: AttributeValue) -> Self {
        self.conditions.push((attribute, op, value));
        self
    }

    /// Sets `attribute` to `value`.
    fn set(mut self, attribute: &'static str, value: AttributeValue) -> Self {
        self.sets.push((attribute, value));
        self
    }

    /// Removes `attribute` (nothing if the item has none).
    fn remove(mut self, attribute: &'static str) -> Self {
        self.removes.push(attribute);
        self
    }

    /// The value this update sets `attribute` to, if it sets it.
    fn value_of(&self, attribute: &str) -> Option<&AttributeValue> {
        self.sets
            .iter()
            .find(|(name, _)| *name == attribute)
            .map(|(_, value)| value)
    }

    /// The condition expression, the update expression, and their placeholders' names and
    /// values.
    fn expressions(&self) -> Expressions {
        let mut names = HashMap::from([
            ("#st".to_owned(), STATE.to_owned()),
            ("#tok".to_owned(), TOKEN.to_owned()),
            ("#e".to_owned(), EXPIRES.to_owned()),
            ("#v".to_owned(), VERSION.to_owned()),
        ]);
        let mut values = HashMap::from([
            (":in_flight".to_owned(), AttributeValue::S(IN_FLIGHT.into())),
            (":token".to_owned(), token_value(self.token)),
            (":now".to_owned(), number_i64(self.now.unix_millis())),
            (":one".to_owned(), number(1)),
        ]);
        let mut condition = "#st = :in_flight AND #tok = :token AND #e > :now".to_owned();
        for (index, (attribute, op, value)) in self.conditions.iter().enumerate() {
            names.insert(format!("#c{index}"), (*attribute).to_owned());
            values.insert(format!(":c{index}"), value.clone());
            condition.push_str(&format!(" AND #c{index} {op} :c{index}"));
        }
        let mut update = "SET #v = #v + :one".to_owned();
        for (index, (attribute, value)) in self.sets.iter().enumerate() {
            names.insert(format!("#s{index}"), (*attribute).to_owned());
            values.insert(format!(":s{index}"), value.clone());
            update.push_str(&format!(", #s{index} = :s{index}"));
        }
        for (index, attribute) in self.removes.iter().enumerate() {
            names.insert(format!("#r{index}"), (*attribute).to_owned());
            update.push_str(if index == 0 { " REMOVE " } else { ", " });
            update.push_str(&format!("#r{index}"));
        }
        Expressions {
            condition,
            update,
            names,
            values,
        }
    }
}

/// An [`Update`] as the request takes it.
struct Expressions {
    condition: String,
    update: String,
    names: HashMap<String, String>,
    values: HashMap<String, AttributeValue>,
}

fn number(value: u64) -> AttributeValue {
    AttributeValue::N(value.to_string())
}

fn number_i64(value: i64) -> AttributeValue {
    AttributeValue::N(value.to_string())
}

/// A record as an item (every field its own attribute, so operators can read it in the console),
/// and its outcome's chunks when the outcome is too large for the item.
fn encode(record: &Record, version: u64) -> (HashMap<String, AttributeValue>, Vec<Vec<u8>>) {
    let mut item = HashMap::new();
    let mut chunks = Vec::new();
    let mut put = |name: &str, value: AttributeValue| {
        item.insert(name.to_owned(), value);
    };
    put(PK, DynamoDbStore::pk(&record.scope, &record.key));
    put("scope", AttributeValue::S(record.scope.as_str().to_owned()));
    put("key", AttributeValue::S(record.key.as_str().to_owned()));
    put(
        "fingerprint",
        AttributeValue::B(Blob::new(record.fingerprint.as_bytes().to_vec())),
    );
    put("attempt", number(u64::from(record.attempt)));
    put("created_ms", number_i64(record.created_at.unix_millis()));
    put(EXPIRES, number_i64(record.expires_at.unix_millis()));
    put(TTL, number_i64(ttl_seconds(record.expires_at)));
    put(VERSION, number(version));
    match &record.state {
        RecordState::InFlight {
            token,
            acquired_at,
            lease_until,
        } => {
            put(STATE, AttributeValue::S(IN_FLIGHT.into()));
            put(TOKEN, token_value(*token));
            put("acquired_ms", number_i64(acquired_at.unix_millis()));
            put("lease_ms", number_i64(lease_until.unix_millis()));
        }
        RecordState::Completed {
            token,
            outcome,
            completed_at,
        } => {
            put(STATE, AttributeValue::S(COMPLETED.into()));
            put(TOKEN, token_value(*token));
            if outcome.len() > CHUNK {
                chunks = split(outcome);
                put(CHUNKS, number(chunks.len() as u64));
                put(OUTCOME_LEN, number(outcome.len() as u64));
            } else {
                put(OUTCOME, AttributeValue::B(Blob::new(outcome.as_bytes().to_vec())));
            }
            put("completed_ms", number_i64(completed_at.unix_millis()));
        }
    }
    (item, chunks)
}

/// An item back as a record, checked by the core's decoder; `chunked` is the outcome assembled
/// from its chunk items, if it has any.
fn decode(item: &HashMap<String, AttributeValue>, chunked: Option<Vec<u8>>) -> Result<Stored, StoreError> {
    let corrupt = |what: &str| StoreError::new(ErrorKind::Corrupt, format!("a DynamoDB item with {what}"));
    let text = |name: &str| {
        item.get(name)
            .and_then(|value| value.as_s().ok())
            .cloned()
            .ok_or_else(|| corrupt(&format!("no text attribute {name}")))
    };
    let blob = |name: &str| {
        item.get(name)
            .and_then(|value| value.as_b().ok())
            .map(|b| b.as_ref().to_vec())
    };
    let int = |name: &str| -> Result<Option<i64>, StoreError> {
        item.get(name)
            .map(|value| {
                value
                    .as_n()
                    .ok()
                    .and_then(|n| n.parse::<i64>().ok())
                    .ok_or_else(|| corrupt(&format!("a non-integer {name}")))
            })
            .transpose()
    };
    let required = |name: &str| int(name)?.ok_or_else(|| corrupt(&format!("no number attribute {name}")));
    let fingerprint: [u8; 32] = blob("fingerprint")
        .and_then(|bytes| bytes.try_into().ok())
        .ok_or_else(|| corrupt("a fingerprint that is not 32 bytes"))?;
    let token: [u8; 16] = blob(TOKEN)
        .and_then(|bytes| bytes.try_into().ok())
        .ok_or_else(|| corrupt("a token that is not 16 bytes"))?;
    let completed = text(STATE)? == COMPLETED;
    let parts = RecordParts {
        scope: text("scope")?,
        key: text("key")?,
        fingerprint: Fingerprint::from_digest(fingerprint),
        attempt: required("attempt")?,
        created_at: required("created_ms")?,
        expires_at: required(EXPIRES)?,
        completed,
        acquired_at: int("acquired_ms")?,
        lease_until: int("lease_ms")?,
        completed_at: int("completed_ms")?,
    };
    let outcome = chunked.or_else(|| blob(OUTCOME)).map(Outcome::new);
    let record = parts
        .into_record(Token::from_bytes(token), outcome)
        .map_err(StoreError::from)?;
    let version = u64::try_from(required(VERSION)?).map_err(|_| corrupt("a negative version"))?;
    Ok(Stored { record, version })
}

/// A count an item carries (`outcome_chunks`, `outcome_len`); 0 when it has none.
fn attribute_count(item: &HashMap<String, AttributeValue>, name: &str) -> usize {
    item.get(name)
        .and_then(|value| value.as_n().ok())
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(0)
}

/// An item as a scan keeps it: decoded without its chunk items, with the outcome's size.
fn scanned(item: &HashMap<String, AttributeValue>) -> Result<Scanned, StoreError> {
    let chunks = attribute_count(item, CHUNKS);
    if chunks == 0 {
        let stored = decode(item, None)?;
        let outcome_len = match &stored.record.state {
            RecordState::Completed { outcome, .. } => outcome.len(),
            RecordState::InFlight { .. } => 0,
        };
        return Ok(Scanned {
            stored,
            outcome_len,
            chunks,
        });
    }
    Ok(Scanned {
        stored: decode(item, Some(Vec::new()))?,
        outcome_len: attribute_count(item, OUTCOME_LEN),
        chunks,
    })
}

fn backend(what: &str, error: impl fmt::Display) -> StoreError {
    StoreError::new(ErrorKind::Backend, format!("DynamoDB: {what}: {error}"))
}

/// A service or transport error, with the kind the guard's retry rules need.
fn sdk<E, R>(what: &str, error: &SdkError<E, R>) -> StoreError
where
    E: std::error::Error + aws_sdk_dynamodb::error::ProvideErrorMetadata + 'static,
    R: fmt::Debug,
{
    let kind = match error {
        SdkError::TimeoutError(_) => ErrorKind::Timeout,
        SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => ErrorKind::Unavailable,
        SdkError::ServiceError(service) => match service.err().code() {
            Some(
                "ProvisionedThroughputExceededException" | "ThrottlingException" | "RequestLimitExceeded",
            ) => ErrorKind::Overloaded,
            Some("ResourceNotFoundException") => ErrorKind::Schema,
            Some("InternalServerError" | "ServiceUnavailable") => ErrorKind::Unavailable,
            _ => ErrorKind::Backend,
        },
        _ => ErrorKind::Backend,
    };
    let detail = match error.as_service_error() {
        Some(service) => format!(
            "{}: {}",
            service.code().unwrap_or("error"),
            service.message().unwrap_or_default()
        ),
        None => aws_sdk_dynamodb::error::DisplayErrorContext(error).to_string(),
    };
    StoreError::new(kind, format!("DynamoDB: {what}: {detail}"))
}

//! The dead-letter topic as a [`DeadLetterQueue`]: what `idem dlq` reads, replays and purges.
//!
//! Kafka cannot delete one record. What `idem dlq` has settled is marked by the committed
//! offsets of a consumer group of its own, `<group>.dlq`, on the dead-letter topic: the records
//! before them are done. A listing reads from those offsets to the end without committing
//! anything. A replay produces each selected record to the source topic (its key, payload and
//! original headers, acknowledged by every replica) and a purge drops it; in each partition, a
//! record left before the last one settled is produced again at the end of the dead-letter
//! topic (so it stays listed, after the others), and only then the group's offset moves past
//! them. A crash before the commit leaves duplicates behind (listed twice, or replayed twice:
//! the source's consumer acknowledges the second copy of a completed key without running it);
//! nothing is lost. The topic's own retention removes the records for good.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind};
use idempotency_consumer::dead_letters::{
    Bytes, DeadLetter, DeadLetterQueue, DlqFuture, OpenFuture, Selection, Settle, is_dead_letter_header,
};
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use crate::{BROKER, DEAD_OFFSET_HEADER, DEAD_PARTITION_HEADER, KafkaSource, PRODUCE_TIMEOUT, kafka};

/// How long a metadata or offsets request may take. (They block the calling thread: `idem
/// dlq` is a command, and waits for each answer anyway.)
const ASK: Duration = Duration::from_secs(10);

/// Opens the dead-letter topic of the `kafka://…?topic=…&group=…` source `url`.
pub(crate) fn open(url: String) -> OpenFuture {
    Box::pin(async move {
        let source = KafkaSource::from_url(&url)?;
        let mut consumer_config: ClientConfig = source.client_config(Duration::from_secs(30));
        consumer_config
            .set("group.id", format!("{}.dlq", source.group))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest");
        let consumer: StreamConsumer = consumer_config
            .create()
            .map_err(kafka(AdapterErrorKind::Config, "the dead-letter reader"))?;
        let mut producer_config = ClientConfig::new();
        for (key, value) in consumer_config.config_map() {
            let consumer_only = [
                "group.id",
                "enable.auto.commit",
                "enable.auto.offset.store",
                "auto.offset.reset",
                "max.poll.interval.ms",
            ];
            if !consumer_only.contains(&key) {
                producer_config.set(key, value);
            }
        }
        let producer: FutureProducer = producer_config
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .create()
            .map_err(kafka(AdapterErrorKind::Config, "the replay producer"))?;
        let queue = KafkaDeadLetters {
            consumer,
            producer,
            topic: source.dead_letter.clone(),
            source: source.topic.clone(),
        };
        queue.partitions(&queue.topic).await?;
        queue.partitions(&queue.source).await?;
        let boxed: Box<dyn DeadLetterQueue> = Box::new(queue);
        Ok(boxed)
    })
}

/// The dead-letter topic of one source topic.
struct KafkaDeadLetters {
    consumer: StreamConsumer,
    producer: FutureProducer,
    topic: String,
    source: String,
}

impl KafkaDeadLetters {
    /// The partitions of `topic`; a topic that does not exist is a clear error.
    async fn partitions(&self, topic: &str) -> Result<Vec<i32>, AdapterError> {
        let consumer = &self.consumer;
        let metadata = consumer
            .fetch_metadata(Some(topic), ASK)
            .map_err(kafka(AdapterErrorKind::Unreachable, "the brokers' metadata"))?;
        let found = metadata
            .topics()
            .iter()
            .find(|t| t.name() == topic)
            .filter(|t| t.error().is_none() && !t.partitions().is_empty());
        match found {
            Some(found) => Ok(found.partitions().iter().map(|p| p.id()).collect()),
            None => Err(AdapterError::new(
                AdapterErrorKind::Config,
                BROKER,
                format!("the topic `{topic}` does not exist"),
            )),
        }
    }

    /// Where reading starts and ends in each partition: the group's committed offset (or the
    /// partition's start) and its end.
    async fn bounds(&self) -> Result<BTreeMap<i32, (i64, i64)>, AdapterError> {
        let partitions = self.partitions(&self.topic).await?;
        let consumer = &self.consumer;
        let topic = self.topic.as_str();
        {
            let mut asked = TopicPartitionList::new();
            for partition in &partitions {
                asked.add_partition(topic, *partition);
            }
            let committed = consumer.committed_offsets(asked, ASK).map_err(kafka(
                AdapterErrorKind::Unreachable,
                "the dead letters' committed offsets",
            ))?;
            let mut bounds = BTreeMap::new();
            for partition in partitions {
                let (low, high) = consumer
                    .fetch_watermarks(topic, partition, ASK)
                    .map_err(kafka(AdapterErrorKind::Unreachable, "the dead letters' offsets"))?;
                let start = match committed.find_partition(topic, partition).map(|p| p.offset()) {
                    Some(Offset::Offset(offset)) => offset.max(low),
                    _ => low,
                };
                bounds.insert(partition, (start, high));
            }
            Ok(bounds)
        }
    }

    /// The records from the group's offsets to the end (at most `limit`), oldest first in each
    /// partition, and the bounds they were read within.
    async fn read(
        &self,
        limit: usize,
    ) -> Result<(Vec<(DeadLetter, OwnedMessage)>, BTreeMap<i32, (i64, i64)>), AdapterError> {
        let bounds = self.bounds().await?;
        let wanted: i64 = bounds.values().map(|(start, end)| end - start).sum();
        let wanted = usize::try_from(wanted).unwrap_or(0).min(limit);
        let mut read = Vec::with_capacity(wanted);
        if wanted == 0 {
            return Ok((read, bounds));
        }
        let mut assignment = TopicPartitionList::new();
        for (partition, (start, end)) in &bounds {
            if start < end {
                assignment
                    .add_partition_offset(&self.topic, *partition, Offset::Offset(*start))
                    .map_err(kafka(AdapterErrorKind::Config, "assigning the dead letters"))?;
            }
        }
        self.consumer
            .assign(&assignment)
            .map_err(kafka(AdapterErrorKind::Lost, "assigning the dead letters"))?;
        while read.len() < wanted {
            let message = tokio::time::timeout(ASK, self.consumer.recv())
                .await
                .map_err(|_| {
                    AdapterError::new(
                        AdapterErrorKind::Lost,
                        BROKER,
                        format!(
                            "the dead letters stopped arriving after {} of {wanted}",
                            read.len()
                        ),
                    )
                })?
                .map_err(kafka(AdapterErrorKind::Lost, "reading the dead letters"))?;
            let end = bounds.get(&message.partition()).map_or(0, |(_, end)| *end);
            if message.offset() >= end {
                continue;
            }
            let message = message.detach();
            let headers = message
                .headers()
                .map(|headers| {
                    headers
                        .iter()
                        .map(|h| {
                            (
                                h.key.to_owned(),
                                String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            let letter = DeadLetter::new(
                format!("{}:{}", message.partition(), message.offset()),
                headers,
                Bytes::copy_from_slice(message.payload().unwrap_or_default()),
            );
            read.push((letter, message));
        }
        let _ = self.consumer.unassign();
        read.sort_by_key(|(_, m)| (m.partition(), m.offset()));
        Ok((read, bounds))
    }

    /// Produces `message`'s key, payload and headers (without the dead-letter ones when
    /// `replay`) to `topic`, and waits for every replica.
    async fn produce(&self, topic: &str, message: &OwnedMessage, replay: bool) -> Result<(), AdapterError> {
        let mut headers = OwnedHeaders::new();
        if let Some(kept) = message.headers() {
            for header in kept.iter() {
                let dead = is_dead_letter_header(header.key)
                    || header.key.eq_ignore_ascii_case(DEAD_PARTITION_HEADER)
                    || header.key.eq_ignore_ascii_case(DEAD_OFFSET_HEADER);
                if replay && dead {
                    continue;
                }
                headers = headers.insert(Header {
                    key: header.key,
                    value: header.value,
                });
            }
        }
        let mut record = FutureRecord::to(topic)
            .payload(message.payload().unwrap_or_default())
            .headers(headers);
        if let Some(key) = message.key() {
            record = record.key(key);
        }
        self.producer
            .send(record, PRODUCE_TIMEOUT)
            .await
            .map(drop)
            .map_err(|(source, _)| {
                kafka(
                    AdapterErrorKind::Publish,
                    format!("a record to {topic} was not acknowledged"),
                )(source)
            })
    }
}

impl DeadLetterQueue for KafkaDeadLetters {
    fn name(&self) -> String {
        self.topic.clone()
    }

    fn browse(&mut self, limit: usize) -> DlqFuture<'_, Vec<DeadLetter>> {
        Box::pin(async move {
            let (read, _) = self.read(limit).await?;
            Ok(read.into_iter().map(|(letter, _)| letter).collect())
        })
    }

    fn settle<'a>(&'a mut self, selection: &'a Selection, settle: Settle) -> DlqFuture<'a, usize> {
        Box::pin(async move {
            let now = SystemTime::now();
            let (read, _) = self.read(usize::MAX).await?;
            let mut chosen = Vec::new();
            for (index, (letter, _)) in read.iter().enumerate() {
                if chosen.len() < selection.limit && selection.matches(letter, now) {
                    chosen.push(index);
                }
            }
            // In each partition, the offset moves past its last settled record.
            let mut last: BTreeMap<i32, i64> = BTreeMap::new();
            for index in &chosen {
                let message = &read[*index].1;
                last.insert(message.partition(), message.offset());
            }
            for (index, (_, message)) in read.iter().enumerate() {
                let Some(through) = last.get(&message.partition()) else {
                    continue;
                };
                if message.offset() > *through {
                    continue;
                }
                if chosen.contains(&index) {
                    if settle == Settle::Replay {
                        self.produce(&self.source, message, true).await?;
                    }
                } else {
                    // Kept: after the others, at the end of the topic.
                    self.produce(&self.topic, message, false).await?;
                }
            }
            let mut commit = TopicPartitionList::new();
            for (partition, through) in &last {
                commit
                    .add_partition_offset(&self.topic, *partition, Offset::Offset(through + 1))
                    .map_err(kafka(AdapterErrorKind::Settle, "the settled offsets"))?;
            }
            if commit.count() > 0 {
                let consumer = &self.consumer;
                consumer.commit(&commit, CommitMode::Sync).map_err(kafka(
                    AdapterErrorKind::Settle,
                    "committing the settled dead letters",
                ))?;
            }
            Ok(chosen.len())
        })
    }
}

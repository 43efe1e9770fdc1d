//! The dead-letter subject as a [`DeadLetterQueue`]: what `idem dlq` reads, replays and purges.
//!
//! The dead letters are messages of a stream (the one that stores the dead-letter subject). A
//! listing reads them through a consumer of its own that never acknowledges: the stream, its
//! other consumers and the messages are unchanged (the reading consumer is removed afterwards,
//! or by the server once idle). A replay publishes each selected message to the subject it was
//! consumed from (its `Idempotency-Dead-Source`), with its original headers and a fresh
//! `Nats-Msg-Id`, waits for the stream's acknowledgement, then deletes the dead letter by its
//! sequence; a purge deletes it. The others stay where they are.

use std::time::{Duration, SystemTime};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::PullConsumer};
use futures_util::StreamExt;
use idempotency_consumer::DEAD_LETTER_SOURCE_HEADER;
use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind};
use idempotency_consumer::dead_letters::{
    DeadLetter, DeadLetterQueue, DlqFuture, OpenFuture, Selection, Settle, is_dead_letter_header,
};

use crate::{BROKER, NatsSource, nats};

/// How long opening waits for the server.
const CONNECT: Duration = Duration::from_secs(10);

/// Opens the dead-letter subject of the `nats://…?stream=…&consumer=…` source `url`.
pub(crate) fn open(url: String) -> OpenFuture {
    Box::pin(async move {
        let source = NatsSource::from_url(&url)?;
        let client = source.tls.connect(&source.url, CONNECT).await?;
        let jetstream = jetstream::new(client);
        let missing = |what: String| AdapterError::new(AdapterErrorKind::Config, BROKER, what);
        jetstream
            .get_stream(&source.stream)
            .await
            .map_err(|e| missing(format!("the stream `{}` does not exist ({e})", source.stream)))?;
        let dead_stream = jetstream
            .stream_by_subject(source.dead_letter.as_str())
            .await
            .map_err(|_| {
                missing(format!(
                    "the dead-letter subject `{}` is stored by no stream",
                    source.dead_letter
                ))
            })?;
        let stream = jetstream
            .get_stream(&dead_stream)
            .await
            .map_err(nats(AdapterErrorKind::Refused, &format!("stream {dead_stream}")))?;
        let boxed: Box<dyn DeadLetterQueue> =
            Box::new(NatsDeadLetters::new(jetstream, stream, source.dead_letter));
        Ok(boxed)
    })
}

/// The dead letters of one source: a subject of a stream.
pub(crate) struct NatsDeadLetters {
    jetstream: jetstream::Context,
    stream: jetstream::stream::Stream,
    subject: String,
}

/// A read dead letter, and its sequence in the stream.
type Read = (DeadLetter, u64, HeaderMap, bytes::Bytes);

impl NatsDeadLetters {
    /// The dead letters on `subject`, a subject `stream` stores.
    pub(crate) fn new(
        jetstream: jetstream::Context,
        stream: jetstream::stream::Stream,
        subject: String,
    ) -> Self {
        Self {
            jetstream,
            stream,
            subject,
        }
    }

    /// Replays up to `limit` dead letters, oldest first (see [`crate::replay_dead_letters`]).
    pub(crate) async fn replay(&mut self, limit: usize) -> Result<usize, AdapterError> {
        self.settle(&Selection::all(limit), Settle::Replay).await
    }

    /// Reads up to `limit` dead letters, oldest first, through a consumer that acknowledges
    /// nothing.
    async fn read(&self, limit: usize) -> Result<Vec<Read>, AdapterError> {
        let mut reader: PullConsumer = self
            .stream
            .create_consumer(jetstream::consumer::pull::Config {
                filter_subject: self.subject.clone(),
                inactive_threshold: Duration::from_secs(30),
                ..Default::default()
            })
            .await
            .map_err(nats(AdapterErrorKind::Refused, "reading the dead letters"))?;
        let info = reader
            .info()
            .await
            .map_err(nats(AdapterErrorKind::Lost, "the dead letters' count"))?;
        let (pending, name) = (
            usize::try_from(info.num_pending).unwrap_or(usize::MAX),
            info.name.clone(),
        );
        let wanted = pending.min(limit);
        let mut read = Vec::with_capacity(wanted);
        while read.len() < wanted {
            let mut batch = reader
                .fetch()
                .max_messages((wanted - read.len()).min(1000))
                .expires(Duration::from_secs(1))
                .messages()
                .await
                .map_err(nats(AdapterErrorKind::Lost, "fetching the dead letters"))?;
            let before = read.len();
            while let Some(message) = batch.next().await {
                let message = message.map_err(|e| {
                    AdapterError::new(
                        AdapterErrorKind::Lost,
                        BROKER,
                        format!("fetching a dead letter: {e}"),
                    )
                })?;
                let sequence = message
                    .info()
                    .map_err(|e| {
                        AdapterError::new(
                            AdapterErrorKind::Lost,
                            BROKER,
                            format!("a dead letter's metadata: {e}"),
                        )
                    })?
                    .stream_sequence;
                let original = message.headers.clone().unwrap_or_default();
                let headers = original
                    .iter()
                    .flat_map(|(name, values)| {
                        values.iter().map(move |value| {
                            (AsRef::<str>::as_ref(name).to_owned(), value.as_str().to_owned())
                        })
                    })
                    .collect();
                let letter = DeadLetter::new(sequence.to_string(), headers, message.payload.clone());
                read.push((letter, sequence, original, message.payload.clone()));
            }
            if read.len() == before {
                break;
            }
        }
        let _ = self.stream.delete_consumer(&name).await;
        Ok(read)
    }
}

impl DeadLetterQueue for NatsDeadLetters {
    fn name(&self) -> String {
        self.subject.clone()
    }

    fn browse(&mut self, limit: usize) -> DlqFuture<'_, Vec<DeadLetter>> {
        Box::pin(async move {
            Ok(self
                .read(limit)
                .await?
                .into_iter()
                .map(|(letter, ..)| letter)
                .collect())
        })
    }

    fn settle<'a>(&'a mut self, selection: &'a Selection, settle: Settle) -> DlqFuture<'a, usize> {
        Box::pin(async move {
            let now = SystemTime::now();
            let mut settled = 0;
            for (letter, sequence, original, payload) in self.read(usize::MAX).await? {
                if settled >= selection.limit || !selection.matches(&letter, now) {
                    continue;
                }
                if settle == Settle::Replay {
                    let source = original
                        .get(DEAD_LETTER_SOURCE_HEADER)
                        .map(|v| v.as_str().to_owned())
                        .ok_or_else(|| {
                            AdapterError::new(
                                AdapterErrorKind::Config,
                                BROKER,
                                format!("dead letter {sequence} has no {DEAD_LETTER_SOURCE_HEADER} header"),
                            )
                        })?;
                    if self.jetstream.stream_by_subject(source.as_str()).await.is_err() {
                        return Err(AdapterError::new(
                            AdapterErrorKind::Config,
                            BROKER,
                            format!("the source subject `{source}` is stored by no stream"),
                        ));
                    }
                    let mut headers = HeaderMap::new();
                    for (name, values) in original.iter() {
                        let name: &str = name.as_ref();
                        if is_dead_letter_header(name) || name.eq_ignore_ascii_case("Nats-Msg-Id") {
                            continue;
                        }
                        for value in values {
                            headers.append(name, value.as_str());
                        }
                    }
                    headers.insert("Nats-Msg-Id", format!("replay:{sequence}").as_str());
                    self.jetstream
                        .publish_with_headers(source, headers, payload)
                        .await
                        .map_err(nats(AdapterErrorKind::Publish, "replaying a dead letter"))?
                        .await
                        .map_err(nats(
                            AdapterErrorKind::Publish,
                            "a replayed dead letter's publish ack",
                        ))?;
                }
                self.stream
                    .delete_message(sequence)
                    .await
                    .map_err(nats(AdapterErrorKind::Settle, "deleting a settled dead letter"))?;
                settled += 1;
            }
            Ok(settled)
        })
    }
}

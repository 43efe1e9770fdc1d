//! The dead-letter queue as a [`DeadLetterQueue`]: what `idem dlq` reads, replays and purges.
//!
//! SQS cannot look at a message without receiving it. A listing receives the dead letters
//! (each is then invisible to others for a few seconds) and makes them all visible again at
//! once: the depth is the same afterwards, and each message's receive count has grown by one.
//! A standard queue has no order; the listing shows them as received. A replay sends each
//! selected message to the source queue with its attributes but the `Idempotency-Dead-*` ones
//! (a FIFO queue gets the message's group and a deduplication id of its own), waits for SQS to
//! accept it, then deletes the dead letter; a purge deletes it. The others are made visible
//! again. The queue named by `dead_letter_url` is read, or, with `dead_letter=redrive`, the one
//! the source queue's redrive policy names.

use std::collections::HashMap;
use std::time::SystemTime;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{Message, MessageSystemAttributeName, QueueAttributeName};
use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind};
use idempotency_consumer::dead_letters::{
    Bytes, DeadLetter, DeadLetterQueue, DlqFuture, OpenFuture, Selection, Settle, is_dead_letter_header,
};

use crate::{SqsSource, config, sdk};

/// How long a listed message stays invisible if it could not be made visible again.
const HOLD_SECS: i32 = 30;

/// Opens the dead-letter queue of the `sqs://…?queue_url=…` source `url`.
pub(crate) fn open(url: String) -> OpenFuture {
    Box::pin(async move {
        let source = SqsSource::from_url(&url)?;
        let http_client = match &source.ca {
            Some(ca) => crate::http_client_trusting(ca)?,
            None => crate::http_client(),
        };
        let client =
            crate::client_through(source.endpoint.as_deref(), source.region.as_deref(), http_client).await;
        let attributes = exists(&client, &source.queue_url).await?;
        let dead_url = match &source.dead_letter_url {
            Some(url) => url.clone(),
            None => {
                let policy = attributes
                    .get(&QueueAttributeName::RedrivePolicy)
                    .ok_or_else(|| config(format!("the queue {} has no redrive policy", source.queue_url)))?;
                let policy: serde_json::Value = serde_json::from_str(policy)
                    .map_err(|e| config(format!("the redrive policy cannot be read: {e}")))?;
                let name = policy["deadLetterTargetArn"]
                    .as_str()
                    .and_then(|arn| arn.rsplit(':').next())
                    .ok_or_else(|| config("the redrive policy names no dead-letter queue"))?;
                client
                    .get_queue_url()
                    .queue_name(name)
                    .send()
                    .await
                    .map_err(|e| sdk(AdapterErrorKind::Config, &format!("find the queue `{name}`"), &e))?
                    .queue_url()
                    .unwrap_or_default()
                    .to_owned()
            }
        };
        exists(&client, &dead_url).await?;
        let boxed: Box<dyn DeadLetterQueue> = Box::new(SqsDeadLetters {
            client,
            queue_url: source.queue_url,
            dead_url,
        });
        Ok(boxed)
    })
}

/// A queue's attributes, by name.
type Attributes = HashMap<QueueAttributeName, String>;

/// The attributes of the queue at `url`; a queue that does not exist is a clear error.
async fn exists(client: &Client, url: &str) -> Result<Attributes, AdapterError> {
    let answer = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::All)
        .send()
        .await
        .map_err(|e| {
            let kind = if e.as_service_error().is_some() {
                AdapterErrorKind::Config
            } else {
                AdapterErrorKind::Unreachable
            };
            sdk(kind, &format!("the queue {url} (does it exist?)"), &e)
        })?;
    Ok(answer.attributes().cloned().unwrap_or_default())
}

/// The dead-letter queue of one source queue.
struct SqsDeadLetters {
    client: Client,
    queue_url: String,
    dead_url: String,
}

impl SqsDeadLetters {
    /// Receives up to `limit` dead letters, each invisible for a while: as many as the queue
    /// said it held when asked, or until a receive comes back empty.
    async fn receive(&self, limit: usize) -> Result<Vec<(DeadLetter, Message)>, AdapterError> {
        let attributes = exists(&self.client, &self.dead_url).await?;
        let held: usize = attributes
            .get(&QueueAttributeName::ApproximateNumberOfMessages)
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let wanted = held.min(limit);
        let mut received: Vec<(DeadLetter, Message)> = Vec::new();
        while received.len() < wanted {
            let batch = self
                .client
                .receive_message()
                .queue_url(&self.dead_url)
                .max_number_of_messages(i32::try_from((wanted - received.len()).min(10)).unwrap_or(10))
                .visibility_timeout(HOLD_SECS)
                .wait_time_seconds(1)
                .message_attribute_names("All")
                .message_system_attribute_names(MessageSystemAttributeName::All)
                .send()
                .await
                .map_err(|e| sdk(AdapterErrorKind::Lost, "read the dead letters", &e))?;
            let messages = batch.messages.unwrap_or_default();
            if messages.is_empty() {
                break;
            }
            for message in messages {
                let headers = message
                    .message_attributes()
                    .map(|attributes| {
                        let mut headers: Vec<(String, String)> = attributes
                            .iter()
                            .map(|(name, value)| {
                                (name.clone(), value.string_value().unwrap_or_default().to_owned())
                            })
                            .collect();
                        headers.sort();
                        headers
                    })
                    .unwrap_or_default();
                let letter = DeadLetter::new(
                    message.message_id().unwrap_or_default(),
                    headers,
                    Bytes::copy_from_slice(message.body().unwrap_or_default().as_bytes()),
                );
                received.push((letter, message));
            }
        }
        Ok(received)
    }

    /// Makes `message` visible again at once.
    async fn give_back(&self, message: &Message) -> Result<(), AdapterError> {
        self.client
            .change_message_visibility()
            .queue_url(&self.dead_url)
            .receipt_handle(message.receipt_handle().unwrap_or_default())
            .visibility_timeout(0)
            .send()
            .await
            .map(drop)
            .map_err(|e| sdk(AdapterErrorKind::Settle, "give a dead letter back", &e))
    }

    /// Sends `message` to the source queue, its `Idempotency-Dead-*` attributes left out.
    async fn replay(&self, message: &Message) -> Result<(), AdapterError> {
        let mut send = self
            .client
            .send_message()
            .queue_url(&self.queue_url)
            .message_body(message.body().unwrap_or_default());
        for (name, value) in message.message_attributes().cloned().unwrap_or_default() {
            if !is_dead_letter_header(&name) {
                send = send.message_attributes(name, value);
            }
        }
        if self.queue_url.trim_end_matches('/').ends_with(".fifo") {
            let group = message
                .attributes()
                .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
                .map_or("replayed", String::as_str);
            send = send
                .message_group_id(group)
                .message_deduplication_id(format!("replay-{}", message.message_id().unwrap_or_default()));
        }
        send.send()
            .await
            .map(drop)
            .map_err(|e| sdk(AdapterErrorKind::Publish, "replay a dead letter", &e))
    }
}

impl DeadLetterQueue for SqsDeadLetters {
    fn name(&self) -> String {
        self.dead_url.clone()
    }

    fn browse(&mut self, limit: usize) -> DlqFuture<'_, Vec<DeadLetter>> {
        Box::pin(async move {
            let received = self.receive(limit).await?;
            for (_, message) in &received {
                self.give_back(message).await?;
            }
            Ok(received.into_iter().map(|(letter, _)| letter).collect())
        })
    }

    fn settle<'a>(&'a mut self, selection: &'a Selection, settle: Settle) -> DlqFuture<'a, usize> {
        Box::pin(async move {
            let now = SystemTime::now();
            let mut settled = 0;
            let received = self.receive(usize::MAX).await?;
            let mut failed = None;
            for (letter, message) in &received {
                let chosen = failed.is_none() && settled < selection.limit && selection.matches(letter, now);
                if !chosen {
                    self.give_back(message).await?;
                    continue;
                }
                if settle == Settle::Replay
                    && let Err(error) = self.replay(message).await
                {
                    failed = Some(error);
                    self.give_back(message).await?;
                    continue;
                }
                self.client
                    .delete_message()
                    .queue_url(&self.dead_url)
                    .receipt_handle(message.receipt_handle().unwrap_or_default())
                    .send()
                    .await
                    .map_err(|e| sdk(AdapterErrorKind::Settle, "delete a settled dead letter", &e))?;
                settled += 1;
            }
            match failed {
                Some(error) => Err(error),
                None => Ok(settled),
            }
        })
    }
}

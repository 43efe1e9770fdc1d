//! A broker message made in a test: headers, an optional message id, a payload and a delivery
//! count, for the consumer's own tests and a store's same-transaction consumer tests.

use idempotency_consumer::Delivery;

/// A message as a broker would deliver it. `Idempotency-Key` is a header like any other.
///
/// ```
/// use idempotency_consumer::Delivery;
/// use idempotency_testkit::message::TestMessage;
///
/// let message = TestMessage::keyed("order-1", "1000");
/// assert_eq!(message.header("Idempotency-Key"), Some(&b"order-1"[..]));
/// assert_eq!(message.redelivered().delivery_count(), 2);
/// assert_eq!(message.without_key().header("Idempotency-Key"), None);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TestMessage {
    /// The headers, in order; [`Delivery::header`] answers the first of a name.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The broker's message id, if it has one.
    pub id: Option<String>,
    /// The payload.
    pub payload: Vec<u8>,
    /// How many times it has been delivered (1 the first time).
    pub deliveries: u32,
}

impl TestMessage {
    /// A first delivery of `payload` with `key` as its `Idempotency-Key` header.
    #[must_use]
    pub fn keyed(key: &str, payload: &str) -> Self {
        Self {
            headers: vec![("Idempotency-Key".to_owned(), key.as_bytes().to_vec())],
            ..Self::keyless(payload)
        }
    }

    /// A first delivery of `payload` without headers.
    #[must_use]
    pub fn keyless(payload: &str) -> Self {
        Self {
            payload: payload.as_bytes().to_vec(),
            deliveries: 1,
            ..Self::default()
        }
    }

    /// The same message delivered once more.
    #[must_use]
    pub fn redelivered(&self) -> Self {
        Self {
            deliveries: self.deliveries + 1,
            ..self.clone()
        }
    }

    /// The same message without its `Idempotency-Key` header.
    #[must_use]
    pub fn without_key(&self) -> Self {
        let mut message = self.clone();
        message.headers.retain(|(name, _)| name != "Idempotency-Key");
        message
    }

    /// The payload as text (invalid UTF-8 replaced).
    #[must_use]
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.payload).into_owned()
    }
}

impl Delivery for TestMessage {
    fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(header, _)| header == name)
            .map(|(_, value)| value.as_slice())
    }

    fn message_id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    fn payload(&self) -> &[u8] {
        &self.payload
    }

    fn delivery_count(&self) -> u32 {
        self.deliveries
    }

    fn headers(&self) -> Vec<(String, Vec<u8>)> {
        self.headers.clone()
    }
}

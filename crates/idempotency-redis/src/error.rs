//! Classifying redis-rs errors into [`ErrorKind`]s.

use idempotency_core::{ErrorKind, StoreError};
use redis::ServerErrorKind;

/// Classifies `error`; `doing` says what the store was doing.
pub(crate) fn map_error(doing: &str, error: redis::RedisError) -> StoreError {
    let text = error.to_string();
    let kind = if foreign(&text) {
        ErrorKind::Protocol
    } else if error.is_timeout() {
        ErrorKind::Timeout
    } else if error.is_io_error() || error.is_connection_refusal() || error.is_connection_dropped() {
        ErrorKind::Unavailable
    } else {
        match error.kind() {
            redis::ErrorKind::Server(
                ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::Moved
                | ServerErrorKind::Ask,
            )
            | redis::ErrorKind::Io
            | redis::ErrorKind::ClusterConnectionNotFound => ErrorKind::Unavailable,
            redis::ErrorKind::Server(ServerErrorKind::ReadOnly) => ErrorKind::ReadOnly,
            redis::ErrorKind::AuthenticationFailed
            | redis::ErrorKind::InvalidClientConfig
            | redis::ErrorKind::Server(ServerErrorKind::NoPerm) => ErrorKind::InvalidConfig,
            redis::ErrorKind::Parse | redis::ErrorKind::UnexpectedReturnType => ErrorKind::Protocol,
            _ => ErrorKind::Backend,
        }
    };
    StoreError::new(kind, format!("{doing}: {text}{}", hint(&text))).with_source(error)
}

/// Classifies the error one key of a batch script answered (`{'error', text}`): the same errors
/// the script of one key fails with, a foreign value at the record's key above all.
pub(crate) fn map_script_error(doing: &str, text: &str) -> StoreError {
    let kind = if foreign(text) {
        ErrorKind::Protocol
    } else {
        ErrorKind::Backend
    };
    StoreError::new(kind, format!("{doing}: {text}{}", hint(text)))
}

/// Whether something else lives at the record's key: never overwrite it, never guess.
fn foreign(text: &str) -> bool {
    text.contains("WRONGTYPE") || text.contains("IDEM_FOREIGN")
}

fn hint(text: &str) -> &'static str {
    if text.contains("WRONGTYPE") {
        " (another value lives at the record's key: check the key prefix)"
    } else {
        ""
    }
}

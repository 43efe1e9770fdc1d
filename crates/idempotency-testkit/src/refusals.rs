//! What every store does with bad configuration, asserted once: a malformed URL is
//! [`ErrorKind::InvalidConfig`], not retryable and never echoes its password; an unsafe table
//! (or schema) name is refused before any SQL; a server that cannot be reached is retryable; a
//! table of a newer version is a [`ErrorKind::Schema`] error that names the version it found.
//!
//! Each store's `bad_input` tests call these with its own URLs, names and calls, and keep only
//! what is its own (the server's error codes, a foreign table, a damaged file).
//!
//! ```
//! use idempotency_core::{BeginRequest, ErrorKind, Fingerprint, Key, Scope, Store, StoreError};
//! use idempotency_testkit::refusals;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! // A store whose URL parser refuses everything but `mem://`.
//! let connect = async |url: &str| {
//!     if url.starts_with("mem://") {
//!         Ok(())
//!     } else {
//!         Err(StoreError::new(ErrorKind::InvalidConfig, "not a mem:// URL"))
//!     }
//! };
//! refusals::malformed_urls(&["", "mem//x", "redis://u:s3cret@h"], "s3cret", connect).await;
//! # }
//! ```

use std::fmt::Debug;

use idempotency_core::{BeginRequest, ErrorKind, Fingerprint, Key, Scope, Store, StoreError};

/// Each of `urls` is refused by `connect` as [`ErrorKind::InvalidConfig`], not retryable, and
/// neither the error's message nor its `Debug` form contains `secret` (the password the URLs
/// carry).
///
/// # Panics
///
/// When `connect` accepts a URL, or refuses it otherwise.
pub async fn malformed_urls<T: Debug>(
    urls: &[&str],
    secret: &str,
    connect: impl AsyncFn(&str) -> Result<T, StoreError>,
) {
    for url in urls {
        let error = connect(url).await.expect_err(url);
        assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{url}: {error}");
        assert!(!error.is_retryable(), "{url}");
        assert!(!error.to_string().contains(secret), "password echoed: {error}");
        assert!(
            !format!("{error:?}").contains(secret),
            "password echoed: {error:?}"
        );
    }
}

/// `set` (a table's or a schema's name on the store's options) refuses each unsafe name as
/// [`ErrorKind::InvalidConfig`] saying `unsafe SQL identifier`: SQL after the name, a capital,
/// a leading digit, the empty name, a `qualified` name (`schema.table`) and a name with the
/// engine's `quote` character in it.
///
/// # Panics
///
/// When `set` accepts one, or refuses it otherwise.
pub fn unsafe_identifiers(qualified: &str, quote: char, set: impl Fn(&str) -> Result<(), StoreError>) {
    let quoted = format!("r{quote}ecords");
    for bad in [
        "records; DROP TABLE users",
        "Records",
        "1records",
        "",
        qualified,
        quoted.as_str(),
    ] {
        let error = set(bad).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{bad:?}");
        assert!(
            error.to_string().contains("unsafe SQL identifier"),
            "{bad:?}: {error}"
        );
    }
}

/// `error`, from connecting to a server nothing answers for, is retryable: unavailable or a
/// timeout.
///
/// # Panics
///
/// When it is another error.
pub fn unreachable(error: &StoreError) {
    assert!(error.is_retryable(), "{error}");
    assert!(
        matches!(error.kind(), ErrorKind::Unavailable | ErrorKind::Timeout),
        "{error}"
    );
}

/// `error`, from migrating a table marked as `found` (a version's mark: `v99`), is a
/// [`ErrorKind::Schema`] error that names it.
///
/// # Panics
///
/// When it is another error, or does not name `found`.
pub fn newer_version(error: &StoreError, found: &str) {
    assert_eq!(error.kind(), ErrorKind::Schema, "{error}");
    assert!(error.to_string().contains(found), "{error}");
}

/// The first operation of `store`, whose records table `table` was never created (nor
/// migrated), is a [`ErrorKind::Schema`] error that names the table.
///
/// # Panics
///
/// When `begin` succeeds, or fails otherwise.
pub async fn missing_table(store: &impl Store, table: &str) {
    let request = BeginRequest::new(
        Scope::global(),
        Key::new("k").expect("a valid key"),
        Fingerprint::of_bytes(b""),
    );
    let error = store.begin(&request).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Schema, "{error}");
    assert!(error.to_string().contains(table), "{error}");
}

//! The test CA `scripts/services` makes (`IDEM_TLS_DIR`, by default
//! `~/.local/share/idem/tls`), for the tests of TLS connections to real servers.
//!
//! | file | what |
//! | --- | --- |
//! | `ca.pem` | the CA every TLS test server's certificate is signed by |
//! | `server.pem`, `server.key` | the servers' certificate, for `localhost` only (so that `127.0.0.1` is a name it does not carry) |
//! | `client.pem`, `client.key` | a client certificate the CA signed (`CN=idem-client`) |
//! | `other-ca.pem` | a CA that signed none of them: the wrong CA |

use std::path::PathBuf;

/// The directory of the test CA; panics, naming the command that makes it, when it is missing.
#[must_use]
pub fn dir() -> PathBuf {
    let dir = std::env::var_os("IDEM_TLS_DIR").map_or_else(
        || {
            let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
            PathBuf::from(home).join(".local/share/idem/tls")
        },
        PathBuf::from,
    );
    assert!(
        dir.join("ca.pem").is_file(),
        "the test CA is missing from {} (run scripts/services tls-ca)",
        dir.display()
    );
    dir
}

/// The path of `name` in [`dir`], as text for a URL.
#[must_use]
pub fn file(name: &str) -> String {
    dir().join(name).display().to_string()
}

/// A key begun, completed and replayed through `store`: the record protocol works over its
/// (TLS) connections.
pub async fn runs_and_replays(store: &impl idempotency_core::Store) {
    use idempotency_core::{BeginRequest, Claim, Fingerprint, Key, Scope};
    let request = BeginRequest::new(
        Scope::new("tls").expect("a valid scope"),
        Key::generate(),
        Fingerprint::of_bytes(b"pay"),
    );
    crate::completed(store, &request, "charged").await;
    let replay = store.begin(&request).await.expect("a replay over TLS");
    assert!(matches!(replay, Claim::Replay(_)), "not a replay: {replay:?}");
}

/// The error `result` must be: of `kind`, its message naming `cause`; returned for more checks.
///
/// # Panics
///
/// When `result` succeeded, or failed otherwise.
#[track_caller]
pub fn refused<T>(
    result: Result<T, idempotency_core::StoreError>,
    kind: idempotency_core::ErrorKind,
    cause: &str,
) -> idempotency_core::StoreError {
    let Err(error) = result else {
        panic!("connected, where {cause:?} was expected")
    };
    assert_eq!(error.kind(), kind, "{error}");
    assert!(error.to_string().contains(cause), "{cause:?} is not in: {error}");
    error
}

//! Opening a store by URL: each store crate declares its URL schemes and how to open them (a
//! [`StoreKind`]), and a [`Registry`] of the kinds a program was built with picks one by the
//! URL's scheme — the way sqlx's `any` driver chooses a database driver.
//!
//! Adding a store is one `StoreKind` in its own crate and one line where the registry is built
//! (the `idempotency` facade, behind the store's feature); no other store and no `match` over
//! schemes changes.
//!
//! ```
//! use idempotency_core::{ErrorKind, MemoryStore, Registry};
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let registry = Registry::new()
//!     .with(MemoryStore::KIND)
//!     .unavailable(&["sqlite"], "this build has no `sqlite` store");
//! assert!(registry.open("memory://").await.is_ok());
//! let error = registry.open("sqlite://idem.db").await.unwrap_err();
//! assert_eq!(error.kind(), ErrorKind::InvalidConfig);
//! assert!(error.to_string().contains("this build has no `sqlite` store"));
//! # });
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::{ErrorKind, StoreAdmin, StoreError, redact_url};

/// A store chosen at run time, as a binary or a configuration file needs.
pub type DynStore = Arc<dyn StoreAdmin>;

/// The future [`StoreKind::open`] returns.
pub type OpenFuture = Pin<Box<dyn Future<Output = Result<DynStore, StoreError>> + Send>>;

/// What opening a store may do to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Access {
    /// Create the database, file or table, and create or upgrade the schema, as needed: the
    /// gateway, `idem migrate`, a service embedding a store.
    Create,
    /// Only a store that exists already, whose records may be written (`idem keys purge`):
    /// a missing database, file or table, or one that is not a store of ours, is an error, and
    /// the schema is never touched.
    Existing,
    /// Only a store that exists already, and nothing is ever written to it (`idem keys get`,
    /// `list`, `stats`, `idem inflight`): inspection leaves the database byte for byte as it
    /// was. An in-process store (`memory://`) is refused: there would be nothing to inspect.
    ReadOnly,
}

/// A kind of store that URLs can name: its name, its URL schemes and how to open one.
#[derive(Clone, Copy)]
pub struct StoreKind {
    /// The store's name (also the name of the facade feature that enables it).
    pub name: &'static str,
    /// The URL schemes it answers to, without `:`.
    pub schemes: &'static [&'static str],
    /// What a URL looks like, for error messages (`sqlite://PATH`).
    pub example: &'static str,
    /// Opens (connects to, and with [`Access::Create`] creates) the store a URL of one of
    /// `schemes` names.
    pub open: fn(String, Access) -> OpenFuture,
    /// Checks a URL of one of `schemes` as `open` would, without opening anything: no
    /// connection, no file. Errors never echo a password.
    pub check: fn(&str) -> Result<(), StoreError>,
}

impl fmt::Debug for StoreKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreKind")
            .field("name", &self.name)
            .field("schemes", &self.schemes)
            .finish_non_exhaustive()
    }
}

/// Schemes a registry knows but cannot open, and why.
#[derive(Debug, Clone, Copy)]
struct Unavailable {
    schemes: &'static [&'static str],
    why: &'static str,
}

/// The store kinds a program can open by URL; see the [module docs](self).
#[derive(Debug, Clone, Default)]
pub struct Registry {
    kinds: Vec<StoreKind>,
    unavailable: Vec<Unavailable>,
}

impl Registry {
    /// An empty registry.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a kind of store.
    #[must_use]
    pub fn with(mut self, kind: StoreKind) -> Self {
        self.kinds.push(kind);
        self
    }

    /// Names `schemes` that this program cannot open, with the reason to give (a store whose
    /// feature is not enabled, one that does not exist yet): a clearer answer than "unknown
    /// scheme".
    #[must_use]
    pub fn unavailable(mut self, schemes: &'static [&'static str], why: &'static str) -> Self {
        self.unavailable.push(Unavailable { schemes, why });
        self
    }

    /// The kind of store `url` names, if this registry opens it (by the URL's scheme).
    #[must_use]
    pub fn kind(&self, url: &str) -> Option<&StoreKind> {
        let scheme = scheme(url);
        self.kinds.iter().find(|kind| kind.schemes.contains(&scheme))
    }

    /// Checks `url` as [`Registry::open`] would, without opening anything: its scheme, and
    /// what its store's own parser says of it. For validating settings at start-up.
    ///
    /// ```
    /// use idempotency_core::{MemoryStore, Registry};
    ///
    /// let registry = Registry::new().with(MemoryStore::KIND);
    /// assert!(registry.check("memory://").is_ok());
    /// assert!(registry.check("memory://a/path").is_err());
    /// assert!(registry.check("ftp://x").is_err());
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Registry::open`], for what can be known without opening.
    pub fn check(&self, url: &str) -> Result<(), StoreError> {
        match self.kind(url) {
            Some(kind) => (kind.check)(url),
            None => Err(self.not_openable(url)),
        }
    }

    /// Opens the store `url` names.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::InvalidConfig`] for a URL without a scheme, an unknown scheme or one this
    /// program cannot open (the message says why); otherwise the store's own error.
    pub async fn open(&self, url: &str) -> Result<DynStore, StoreError> {
        self.open_with(url, Access::Create).await
    }

    /// Opens the store `url` names, doing no more to it than `access` allows.
    ///
    /// # Errors
    ///
    /// As [`Registry::open`]; with [`Access::Existing`] or [`Access::ReadOnly`] also a
    /// missing store, or one that is not an idempotency store.
    pub async fn open_with(&self, url: &str, access: Access) -> Result<DynStore, StoreError> {
        if let Some(kind) = self.kind(url) {
            return (kind.open)(url.to_owned(), access).await;
        }
        Err(self.not_openable(url))
    }

    /// Why `url` names no store this registry opens.
    fn not_openable(&self, url: &str) -> StoreError {
        let scheme = scheme(url);
        let expected = self.expected();
        // Anything before the first `:` that is not an RFC 3986 scheme may hold a password or
        // a query.
        let message = if !crate::is_scheme(scheme) {
            // Without a scheme a password may still be in there (`user:pass@host`).
            format!("`{}` is not a store URL (expected {expected})", redact_url(url))
        } else if let Some(unavailable) = self.unavailable.iter().find(|u| u.schemes.contains(&scheme)) {
            format!("{} (available: {expected})", unavailable.why)
        } else {
            format!("unknown store URL scheme `{scheme}` (expected {expected})")
        };
        StoreError::new(ErrorKind::InvalidConfig, message)
    }

    fn expected(&self) -> String {
        let examples: Vec<&str> = self.kinds.iter().map(|kind| kind.example).collect();
        match examples.split_last() {
            Some((last, [])) => (*last).to_owned(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => "nothing: no store is built in".to_owned(),
        }
    }
}

/// The URL's scheme, without `:` (empty when there is none).
fn scheme(url: &str) -> &str {
    url.split_once(':').map(|(scheme, _)| scheme).unwrap_or_default()
}

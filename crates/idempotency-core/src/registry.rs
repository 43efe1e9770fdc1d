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
#[derive(Clone, Copy, derive_more::Debug)]
pub struct StoreKind {
    /// The store's name (also the name of the facade feature that enables it).
    pub name: &'static str,
    /// The URL schemes it answers to, without `:`.
    pub schemes: &'static [&'static str],
    /// What a URL looks like, for error messages (`sqlite://PATH`).
    #[debug(skip)]
    pub example: &'static str,
    /// Opens (connects to, and with [`Access::Create`] creates) the store a URL of one of
    /// `schemes` names.
    #[debug(skip)]
    pub open: fn(String, Access) -> OpenFuture,
    /// Checks a URL of one of `schemes` as `open` would, without opening anything: no
    /// connection, no file. Errors never echo a password.
    #[debug(skip)]
    pub check: fn(&str) -> Result<(), StoreError>,
}

/// The [`StoreKind`] of a store opened from its options: `$options::from_url(url)` reads the
/// URL (and is the kind's `check`), `.access(access)` says what opening may do, and
/// `$open(options)` opens the store; with `group_commit: FIELD`, the options' `FIELD` (an
/// `Option<GroupSettings>`, the URL's `?batch=on`) puts it behind a
/// [`GroupCommit`](crate::GroupCommit). Written once for the stores that open this way
/// (`idempotency-postgres`, `idempotency-mysql`, `idempotency-sqlite`), as `idempotency-mysql`
/// expands it:
///
/// ```text
/// idempotency_core::url_store_kind! {
///     /// `mysql://…` and `mariadb://…` URLs.
///     name: "mysql",
///     schemes: &["mysql", "mariadb"],
///     example: "mysql://USER@HOST/DATABASE",
///     options: MysqlOptions,
///     open: crate::MysqlStore::connect_with,
///     group_commit: group_commit,
/// }
/// ```
#[macro_export]
macro_rules! url_store_kind {
    (
        $(#[$meta:meta])*
        name: $name:literal,
        schemes: $schemes:expr,
        example: $example:literal,
        options: $options:ty,
        open: $open:path
        $(, group_commit: $group:ident)? $(,)?
    ) => {
        $(#[$meta])*
        pub const KIND: $crate::StoreKind = $crate::StoreKind {
            name: $name,
            schemes: $schemes,
            example: $example,
            open: |url, access| {
                ::std::boxed::Box::pin(async move {
                    let options = <$options>::from_url(&url)?.access(access);
                    // With `group_commit: FIELD`, the options' `FIELD` (`?batch=on`) says
                    // whether the store is opened behind a `GroupCommit`.
                    let group: ::std::option::Option<$crate::GroupSettings> = None $(.or(options.$group))?;
                    Ok($crate::registry::dyn_store($open(options).await?, group))
                })
            },
            check: |url| <$options>::from_url(url).map(drop),
        };
    };
}

/// `store` as a [`DynStore`], behind a [`GroupCommit`](crate::GroupCommit) with `group`'s
/// settings when there are some: what [`url_store_kind!`] opens.
pub fn dyn_store<S: StoreAdmin + 'static>(store: S, group: Option<crate::GroupSettings>) -> DynStore {
    match group {
        Some(settings) => Arc::new(crate::GroupCommit::with_settings(store, settings)),
        None => Arc::new(store),
    }
}

/// A kind of thing URLs name by their scheme: a store kind, a consumer's source kind.
pub trait UrlKind {
    /// The URL schemes it answers to, without `:`.
    fn schemes(&self) -> &'static [&'static str];

    /// What a URL of it looks like, for error messages.
    fn example(&self) -> &'static str;
}

impl UrlKind for StoreKind {
    fn schemes(&self) -> &'static [&'static str] {
        self.schemes
    }

    fn example(&self) -> &'static str {
        self.example
    }
}

/// Why no kind of a [`Schemes`] answers a URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoKind<'a> {
    /// What comes before the `:` is not an RFC 3986 scheme (it may hold a password or a
    /// query: never echo it).
    NotAScheme,
    /// A scheme the program knows and cannot serve, with the reason to give.
    Unavailable(&'static str),
    /// A scheme of no kind the program knows.
    Unknown(&'a str),
}

/// The kinds a program was built with, found by a URL's scheme (ASCII case ignored, as
/// RFC 3986 has it), and the schemes it knows but cannot serve: the part a store [`Registry`]
/// and a consumer's registry of sources share.
#[derive(Debug, Clone)]
pub struct Schemes<K> {
    kinds: Vec<K>,
    unavailable: Vec<(&'static [&'static str], &'static str)>,
}

impl<K> Default for Schemes<K> {
    fn default() -> Self {
        Self {
            kinds: Vec::new(),
            unavailable: Vec::new(),
        }
    }
}

impl<K: UrlKind> Schemes<K> {
    /// Adds a kind.
    #[must_use]
    pub fn with(mut self, kind: K) -> Self {
        self.kinds.push(kind);
        self
    }

    /// Names `schemes` this program cannot serve, with the reason to give.
    #[must_use]
    pub fn unavailable(mut self, schemes: &'static [&'static str], why: &'static str) -> Self {
        self.unavailable.push((schemes, why));
        self
    }

    /// The kinds, in the order they were added.
    #[must_use]
    pub fn kinds(&self) -> &[K] {
        &self.kinds
    }

    /// The kind of `scheme` (without `:`), or why there is none.
    ///
    /// ```
    /// use idempotency_core::registry::{NoKind, Schemes};
    /// use idempotency_core::MemoryStore;
    ///
    /// let schemes = Schemes::default().with(MemoryStore::KIND).unavailable(&["redis"], "no redis here");
    /// assert_eq!(schemes.find("MEMORY").unwrap().name, "memory");
    /// assert_eq!(schemes.find("redis").unwrap_err(), NoKind::Unavailable("no redis here"));
    /// assert_eq!(schemes.find("ftp").unwrap_err(), NoKind::Unknown("ftp"));
    /// assert_eq!(schemes.find("user@host").unwrap_err(), NoKind::NotAScheme);
    /// ```
    ///
    /// # Errors
    ///
    /// The [`NoKind`] that says why no kind answers `scheme`.
    pub fn find<'a>(&self, scheme: &'a str) -> Result<&K, NoKind<'a>> {
        let named = |schemes: &[&str]| schemes.iter().any(|known| known.eq_ignore_ascii_case(scheme));
        if let Some(kind) = self.kinds.iter().find(|kind| named(kind.schemes())) {
            return Ok(kind);
        }
        if !crate::is_scheme(scheme) {
            return Err(NoKind::NotAScheme);
        }
        match self.unavailable.iter().find(|(schemes, _)| named(schemes)) {
            Some((_, why)) => Err(NoKind::Unavailable(why)),
            None => Err(NoKind::Unknown(scheme)),
        }
    }

    /// The kinds' example URLs as a list for a message (`a, b or c`), or `none` when there
    /// is no kind.
    #[must_use]
    pub fn expected(&self, none: &str) -> String {
        let examples: Vec<&str> = self.kinds.iter().map(UrlKind::example).collect();
        match examples.split_last() {
            Some((last, [])) => (*last).to_owned(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => none.to_owned(),
        }
    }
}

/// The builder methods of a registry that keeps its kinds in a `schemes: Schemes<KIND>` field
/// (and derives `Default`), written once for the store [`Registry`] and the consumer's registry
/// of sources: `new`, `with` and `unavailable`. Expanded inside the registry's `impl` block:
///
/// ```text
/// impl Registry {
///     idempotency_core::schemes_builders!(StoreKind, "store", "open");
/// }
/// ```
#[macro_export]
macro_rules! schemes_builders {
    ($kind:ty, $what:literal, $verb:literal) => {
        /// An empty registry.
        #[must_use]
        pub fn new() -> Self {
            Self::default()
        }

        #[doc = concat!("Adds a kind of ", $what, ".")]
        #[must_use]
        pub fn with(mut self, kind: $kind) -> Self {
            self.schemes = self.schemes.with(kind);
            self
        }

        #[doc = concat!(
                    "Names `schemes` that this program cannot ", $verb, ", with the reason to give (a ",
                    $what, " whose feature is not enabled, one that does not exist yet): a clearer answer ",
                    "than \"unknown scheme\"."
                )]
        #[must_use]
        pub fn unavailable(mut self, schemes: &'static [&'static str], why: &'static str) -> Self {
            self.schemes = self.schemes.unavailable(schemes, why);
            self
        }
    };
}

/// The store kinds a program can open by URL; see the [module docs](self).
#[derive(Debug, Clone, Default)]
pub struct Registry {
    schemes: Schemes<StoreKind>,
}

impl Registry {
    crate::schemes_builders!(StoreKind, "store", "open");

    /// The kind of store `url` names, if this registry opens it (by the URL's scheme).
    #[must_use]
    pub fn kind(&self, url: &str) -> Option<&StoreKind> {
        self.schemes.find(scheme(url)).ok()
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
        (self.kind_of(url)?.check)(url)
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
        (self.kind_of(url)?.open)(url.to_owned(), access).await
    }

    /// The kind of store `url` names, or why it names none this registry opens.
    fn kind_of(&self, url: &str) -> Result<&StoreKind, StoreError> {
        let expected = || self.schemes.expected("nothing: no store is built in");
        let message = match self.schemes.find(scheme(url)) {
            Ok(kind) => return Ok(kind),
            // Without a scheme a password may still be in there (`user:pass@host`).
            Err(NoKind::NotAScheme) => {
                format!(
                    "`{}` is not a store URL (expected {})",
                    redact_url(url),
                    expected()
                )
            }
            Err(NoKind::Unavailable(why)) => format!("{why} (available: {})", expected()),
            Err(NoKind::Unknown(scheme)) => {
                format!("unknown store URL scheme `{scheme}` (expected {})", expected())
            }
        };
        Err(StoreError::new(ErrorKind::InvalidConfig, message))
    }
}

/// The URL's scheme, without `:` (empty when there is none).
fn scheme(url: &str) -> &str {
    url.split_once(':').map(|(scheme, _)| scheme).unwrap_or_default()
}

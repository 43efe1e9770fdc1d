//! `idem`'s flags and their parsers: every value a flag (or its `IDEM_*` variable) takes is
//! checked here, with the reason in the error, before anything starts.

use std::time::Duration;

use http::header::HeaderName;
use http::{Method, Uri};
use idempotency::ScopeSecret;

pub use crate::error::UpstreamError;
use crate::units;

/// Checks an upstream URL: `http://host[:port][/base]`, no query.
///
/// # Errors
///
/// An [`UpstreamError`] that says what is wrong.
pub fn parse_upstream(text: &str) -> Result<Uri, UpstreamError> {
    let uri: Uri = text
        .parse()
        .map_err(|e: http::uri::InvalidUri| UpstreamError::NotAUrl {
            text: text.into(),
            reason: e.to_string(),
        })?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err(UpstreamError::NotHttp(text.into())),
    }
    if uri.authority().is_none() {
        return Err(UpstreamError::NoHost(text.into()));
    }
    if uri.query().is_some() {
        return Err(UpstreamError::Query(text.into()));
    }
    Ok(uri)
}

/// A flag value that is not an HTTP method or header name the gateway accepts, or a duration or
/// size outside what makes sense for its setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FlagError {
    /// Not a duration or a size at all.
    #[error(transparent)]
    Unit(#[from] units::UnitError),
    /// A duration or size outside its setting's range.
    #[error("`{text}` is out of range for {setting}: {why}")]
    OutOfRange {
        /// What was given.
        text: String,
        /// The setting.
        setting: &'static str,
        /// The range, and what goes wrong outside it.
        why: &'static str,
    },
    /// Not one of the standard methods.
    #[error("`{0}` is not an HTTP method (GET, POST, PUT, PATCH, DELETE, ...)")]
    Method(String),
    /// Not a valid header name.
    #[error("`{0}` is not a header name")]
    HeaderName(String),
    /// Not a status class (`5xx`) or code (`429`).
    #[error("`{0}` is not an HTTP status (100 to 599) or class (1xx to 5xx)")]
    Status(String),
    /// Flags that contradict each other.
    #[error("{0}")]
    Conflict(&'static str),
    /// A scope secret that is too short (the value itself is never echoed).
    #[error("--scope-secret: {0}")]
    ScopeSecret(#[from] idempotency::SecretError),
}

/// `--scope-secret`: 16 bytes or more.
///
/// # Errors
///
/// [`FlagError::ScopeSecret`], which does not repeat the value.
pub fn parse_scope_secret(text: &str) -> Result<ScopeSecret, FlagError> {
    Ok(ScopeSecret::new(text.as_bytes())?)
}

/// The value parser of a flag that carries a secret (`--scope-secret`, `--admin-token`). A plain
/// `value_parser` function's error would make clap print "invalid value '`<the secret>`'": this
/// one's error names the flag and the reason only.
#[derive(Clone, Copy)]
pub struct SecretParser<T> {
    flag: &'static str,
    parse: fn(&str) -> Result<T, SecretError>,
}

/// Why a secret flag's value is refused: the parser's error, whose text never holds the value.
pub type SecretError = Box<dyn std::error::Error + Send + Sync>;

impl<T> std::fmt::Debug for SecretParser<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretParser")
            .field("flag", &self.flag)
            .finish_non_exhaustive()
    }
}

impl<T> SecretParser<T> {
    /// `flag`'s parser: `parse` turns the text into the value, or says why not (without the
    /// value).
    pub const fn new(flag: &'static str, parse: fn(&str) -> Result<T, SecretError>) -> Self {
        Self { flag, parse }
    }
}

impl SecretParser<ScopeSecret> {
    /// `--scope-secret`, with [`parse_scope_secret`].
    pub const SCOPE_SECRET: Self = Self::new("--scope-secret", |text| Ok(parse_scope_secret(text)?));
}

impl<T: Clone + Send + Sync + 'static> clap::builder::TypedValueParser for SecretParser<T> {
    type Value = T;

    fn parse_ref(
        &self,
        _command: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<T, clap::Error> {
        let refuse =
            |why: String| clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{why}\n"));
        let text = value
            .to_str()
            .ok_or_else(|| refuse(format!("{}: not valid UTF-8", self.flag)))?;
        (self.parse)(text).map_err(|e| refuse(e.to_string()))
    }
}

/// A set of HTTP statuses, as `--release-on` takes it: classes (`5xx`) and single codes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StatusSet {
    /// Whole classes, by their first digit.
    classes: Vec<u16>,
    /// Single codes.
    codes: Vec<u16>,
}

impl StatusSet {
    /// The classes (`5xx`) and codes (`429`), as `--release-on` lists them.
    #[must_use]
    pub fn items(&self) -> Vec<String> {
        let classes = self.classes.iter().map(|class| format!("{class}xx"));
        classes.chain(self.codes.iter().map(u16::to_string)).collect()
    }

    /// Whether `status` is in the set.
    #[must_use]
    pub fn contains(&self, status: http::StatusCode) -> bool {
        let code = status.as_u16();
        self.classes.contains(&(code / 100)) || self.codes.contains(&code)
    }
}

/// Parses `--release-on`: `none`, or a comma-separated list of classes (`1xx` to `5xx`) and
/// codes (100 to 599).
///
/// # Errors
///
/// [`FlagError::Status`] naming the item that is neither.
pub fn parse_status_set(text: &str) -> Result<StatusSet, FlagError> {
    let mut set = StatusSet::default();
    if text.trim().eq_ignore_ascii_case("none") {
        return Ok(set);
    }
    for item in text.split(',').map(str::trim) {
        let bad = || FlagError::Status(item.to_owned());
        let lower = item.to_ascii_lowercase();
        if let Some(class) = lower.strip_suffix("xx") {
            match class.parse::<u16>() {
                Ok(class @ 1..=5) if lower.len() == 3 => set.classes.push(class),
                _ => return Err(bad()),
            }
        } else {
            match item.parse::<u16>() {
                Ok(code @ 100..=599) if item.len() == 3 => set.codes.push(code),
                _ => return Err(bad()),
            }
        }
    }
    Ok(set)
}

/// A duration flag within `[min, max]`.
pub(crate) fn bounded_duration(
    text: &str,
    setting: &'static str,
    (min, max): (Duration, Duration),
    why: &'static str,
) -> Result<Duration, FlagError> {
    let duration = units::parse_duration(text)?;
    if duration < min || duration > max {
        return Err(FlagError::OutOfRange {
            text: text.into(),
            setting,
            why,
        });
    }
    Ok(duration)
}

/// `--lease`: 1 s to 24 h. A zero lease lets a concurrent duplicate take a running request over
/// and run it again; a longer one than a day leaves a crashed request's key blocked for as long.
///
/// # Errors
///
/// [`FlagError`] saying why.
pub fn parse_lease(text: &str) -> Result<Duration, FlagError> {
    let range = (Duration::from_secs(1), Duration::from_secs(86_400));
    bounded_duration(
        text,
        "--lease",
        range,
        "from 1s to 24h (a shorter lease lets a duplicate run while the first still runs)",
    )
}

/// `--retention`: 1 s to 3650 days. Zero would replay nothing: every retry would run again.
///
/// # Errors
///
/// [`FlagError`] saying why.
pub fn parse_retention(text: &str) -> Result<Duration, FlagError> {
    let range = (Duration::from_secs(1), Duration::from_secs(3650 * 86_400));
    bounded_duration(
        text,
        "--retention",
        range,
        "from 1s to 3650d (with none, every retry runs again)",
    )
}

/// `--upstream-timeout`: 100 ms to 24 h. Zero would answer 504 while the upstream runs.
///
/// # Errors
///
/// [`FlagError`] saying why.
pub fn parse_upstream_timeout(text: &str) -> Result<Duration, FlagError> {
    let range = (Duration::from_millis(100), Duration::from_secs(86_400));
    bounded_duration(text, "--upstream-timeout", range, "from 100ms to 24h")
}

/// `--header-timeout` and `--body-timeout`: 100 ms to 1 h. Without a bound, a client that
/// never finishes its request holds its connection forever.
///
/// # Errors
///
/// [`FlagError`] saying why.
pub fn parse_client_timeout(text: &str) -> Result<Duration, FlagError> {
    let range = (Duration::from_millis(100), Duration::from_secs(3600));
    bounded_duration(text, "a client timeout", range, "from 100ms to 1h")
}

/// `--drain-timeout`: 0 s to 1 h (zero: exit at once on shutdown, abandoning what runs).
///
/// # Errors
///
/// [`FlagError`] saying why.
pub fn parse_drain_timeout(text: &str) -> Result<Duration, FlagError> {
    let range = (Duration::ZERO, Duration::from_secs(3600));
    bounded_duration(text, "--drain-timeout", range, "from 0s to 1h")
}

/// `--drain-delay`: from 0 s to 10 min.
///
/// # Errors
///
/// A malformed duration, or one out of range.
pub fn parse_drain_delay(text: &str) -> Result<Duration, FlagError> {
    let range = (Duration::ZERO, Duration::from_secs(600));
    bounded_duration(text, "--drain-delay", range, "from 0s to 10m")
}

/// `--purge-every`: an interval, or never.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PurgeEvery(pub Option<Duration>);

/// `--purge-every`: `off`, or 1 s to 24 h.
///
/// # Errors
///
/// [`FlagError`] saying why.
pub fn parse_purge_every(text: &str) -> Result<PurgeEvery, FlagError> {
    if text.trim().eq_ignore_ascii_case("off") {
        return Ok(PurgeEvery(None));
    }
    let range = (Duration::from_secs(1), Duration::from_secs(86_400));
    bounded_duration(text, "--purge-every", range, "from 1s to 24h, or off")
        .map(|every| PurgeEvery(Some(every)))
}

/// `--wait`: 1 ms to 1 h.
///
/// # Errors
///
/// [`FlagError`] saying why.
pub fn parse_wait(text: &str) -> Result<Duration, FlagError> {
    let range = (Duration::from_millis(1), Duration::from_secs(3600));
    bounded_duration(text, "--wait", range, "from 1ms to 1h")
}

/// `--max-body` and `--max-response`: 1 byte to 1 GiB (bodies are held in memory).
///
/// # Errors
///
/// [`FlagError`] saying why.
pub fn parse_limit(text: &str) -> Result<usize, FlagError> {
    let size = units::parse_size(text)?;
    if size == 0 || size > 1 << 30 {
        return Err(FlagError::OutOfRange {
            text: text.into(),
            setting: "a size limit",
            why: "from 1B to 1GiB (bodies are held in memory)",
        });
    }
    Ok(size)
}

/// A standard HTTP method, in any case.
///
/// # Errors
///
/// [`FlagError::Method`] for anything else.
pub fn parse_method(text: &str) -> Result<Method, FlagError> {
    let upper = text.trim().to_ascii_uppercase();
    match upper.as_str() {
        "GET" | "HEAD" | "POST" | "PUT" | "PATCH" | "DELETE" | "OPTIONS" => {
            Method::from_bytes(upper.as_bytes()).map_err(|_| FlagError::Method(text.into()))
        }
        _ => Err(FlagError::Method(text.into())),
    }
}

/// A header name.
///
/// # Errors
///
/// [`FlagError::HeaderName`] when it is not one.
pub fn parse_header_name(text: &str) -> Result<HeaderName, FlagError> {
    HeaderName::from_bytes(text.trim().as_bytes()).map_err(|_| FlagError::HeaderName(text.into()))
}

/// The settings that can carry a secret, by their environment variable. Each can also be given
/// as `<VARIABLE>_FILE`, the path of a file holding the value (the convention of container
/// secrets: a Kubernetes Secret or a Docker secret mounted as a file); and no help text shows
/// their values.
pub const SECRET_SETTINGS: &[&str] = &[
    "IDEM_STORE",
    "IDEM_FROM",
    "IDEM_RELAY_TO",
    "IDEM_SCOPE_SECRET",
    "IDEM_DATABASE",
    "IDEM_ADMIN_TOKEN",
    "IDEM_UI_DATABASE",
];

/// Why a `…_FILE` variable cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SecretFileError {
    /// The value is given twice.
    #[error("{variable} and {variable}_FILE are both set: give the value one way")]
    Both {
        /// The variable.
        variable: String,
    },
    /// The file cannot be read, or holds nothing.
    #[error("{variable}_FILE {path}: {why}")]
    Unreadable {
        /// The variable.
        variable: String,
        /// The file.
        path: String,
        /// Why.
        why: String,
    },
}

/// The secret settings given as `<VARIABLE>_FILE`, by their variable: they rank as variables
/// do, above a configuration file (flag > variable > `*_FILE` > file > default).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SecretFiles(Vec<&'static str>);

impl SecretFiles {
    /// Whether `arg`'s value comes from its variable's `_FILE` (when no flag gives it).
    #[must_use]
    pub fn give(&self, arg: &clap::Arg) -> bool {
        arg.get_env()
            .and_then(|env| env.to_str())
            .is_some_and(|env| self.0.contains(&env))
    }
}

/// `command` with each secret setting of [`SECRET_SETTINGS`] that `environment` gives as
/// `<VARIABLE>_FILE` read from its file (one line; a final newline is dropped) and taken as the
/// flag's value when the flag itself is absent, as the variable would be; and with every secret
/// setting's value hidden from `--help`. The [`SecretFiles`] say which settings the files gave,
/// for the configuration file's merge to leave alone.
///
/// # Errors
///
/// [`SecretFileError`] when a variable is given both ways, or its file cannot be read or is
/// empty. The error names the file, never its content.
pub fn secrets_from_files(
    command: clap::Command,
    environment: &dyn Fn(&str) -> Option<std::ffi::OsString>,
) -> Result<(clap::Command, SecretFiles), SecretFileError> {
    let mut values = Vec::new();
    for variable in SECRET_SETTINGS {
        let Some(path) = environment(&format!("{variable}_FILE")) else {
            continue;
        };
        if environment(variable).is_some() {
            return Err(SecretFileError::Both {
                variable: (*variable).to_owned(),
            });
        }
        let shown = path.to_string_lossy().into_owned();
        let unreadable = |why: String| SecretFileError::Unreadable {
            variable: (*variable).to_owned(),
            path: shown.clone(),
            why,
        };
        let value = read_secret_file(std::path::Path::new(&path)).map_err(unreadable)?;
        values.push((*variable, value));
    }
    let files = SecretFiles(values.iter().map(|(variable, _)| *variable).collect());
    Ok((with_secrets(command, &values), files))
}

/// The value a secret's file holds: its one line, a final newline (`\n` or `\r\n`) dropped.
///
/// # Errors
///
/// Why it cannot be used (unreadable, or empty), never its content.
pub(crate) fn read_secret_file(path: &std::path::Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let value = text.strip_suffix('\n').unwrap_or(&text);
    let value = value.strip_suffix('\r').unwrap_or(value);
    if value.is_empty() {
        return Err("the file is empty".into());
    }
    Ok(value.to_owned())
}

/// `command` and its subcommands, their secret settings hidden from help and given `values`.
fn with_secrets(command: clap::Command, values: &[(&str, String)]) -> clap::Command {
    let secret_args: Vec<clap::Id> = command
        .get_arguments()
        .filter(|arg| {
            arg.get_env()
                .and_then(|env| env.to_str())
                .is_some_and(|env| SECRET_SETTINGS.contains(&env))
        })
        .map(|arg| arg.get_id().clone())
        .collect();
    let mut command = command;
    for id in secret_args {
        command = command.mut_arg(id, |arg| {
            let env = arg
                .get_env()
                .and_then(|env| env.to_str())
                .unwrap_or_default()
                .to_owned();
            let arg = arg.hide_env_values(true);
            match values.iter().find(|(variable, _)| *variable == env) {
                // Given by its file, the setting is no longer missing: as its variable, it
                // satisfies a flag the command requires.
                Some((_, value)) => arg
                    .default_value(value.clone())
                    .hide_default_value(true)
                    .required(false)
                    .required_unless_present(clap::builder::Resettable::Reset),
                None => arg,
            }
        });
    }
    let names: Vec<String> = command
        .get_subcommands()
        .map(|sub| sub.get_name().to_owned())
        .collect();
    for name in names {
        command = command.mut_subcommand(name, |sub| with_secrets(sub, values));
    }
    command
}

#[cfg(test)]
mod secret_tests {
    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Sub,
    }

    #[derive(Debug, clap::Subcommand)]
    enum Sub {
        Run {
            #[arg(long, env = "IDEM_STORE", default_value = "sqlite://idem.db")]
            store: String,
            #[arg(long, env = "IDEM_FROM")]
            from: String,
        },
    }

    fn parse(
        args: &[&str],
        environment: &[(&str, String)],
    ) -> Result<(String, String), Box<dyn std::error::Error>> {
        use clap::{CommandFactory, FromArgMatches};
        let lookup = |name: &str| {
            environment
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| std::ffi::OsString::from(v))
        };
        let (command, _) = secrets_from_files(Cli::command(), &lookup)?;
        let matches = command.try_get_matches_from(args)?;
        let Sub::Run { store, from } = Cli::from_arg_matches(&matches)?.command;
        Ok((store, from))
    }

    #[test]
    fn a_secret_is_read_from_its_file_and_a_flag_still_wins() {
        let dir = std::env::temp_dir().join(format!("idem-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (store, from, empty) = (dir.join("store"), dir.join("from"), dir.join("empty"));
        std::fs::write(&store, "postgres://app:S3CRET@db/orders\n").unwrap();
        std::fs::write(&from, "amqp://u:S3CRET@mq/%2f?queue=q\r\n").unwrap();
        std::fs::write(&empty, "\n").unwrap();
        let files = vec![
            ("IDEM_STORE_FILE", store.display().to_string()),
            ("IDEM_FROM_FILE", from.display().to_string()),
        ];
        assert_eq!(
            parse(&["idem", "run"], &files).unwrap(),
            (
                "postgres://app:S3CRET@db/orders".to_owned(),
                "amqp://u:S3CRET@mq/%2f?queue=q".to_owned()
            )
        );
        assert_eq!(
            parse(&["idem", "run", "--store", "memory://"], &files).unwrap().0,
            "memory://"
        );
        let both = vec![
            ("IDEM_STORE_FILE", store.display().to_string()),
            ("IDEM_STORE", "memory://".to_owned()),
        ];
        assert_eq!(
            parse(&["idem", "run", "--from", "x"], &both)
                .unwrap_err()
                .to_string(),
            "IDEM_STORE and IDEM_STORE_FILE are both set: give the value one way"
        );
        let missing = vec![("IDEM_FROM_FILE", "/nonexistent/from".to_owned())];
        let error = parse(&["idem", "run"], &missing).unwrap_err().to_string();
        assert!(
            error.starts_with("IDEM_FROM_FILE /nonexistent/from: No such file"),
            "{error}"
        );
        let blank = vec![("IDEM_FROM_FILE", empty.display().to_string())];
        assert!(
            parse(&["idem", "run"], &blank)
                .unwrap_err()
                .to_string()
                .ends_with("the file is empty")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! `idem serve --config FILE`: the gateway's settings and its routes in a TOML file.
//!
//! Top-level keys are `idem serve`'s flags by their long names (`upstream`, `store`,
//! `retention`, …), so there is one list of settings: the flags'. Their values go through the
//! flags' own parsers; the command line and the `IDEM_*` variables win over the file. Routes are
//! `[[route]]` tables, tried in file order (see [`crate::gateway::route`]). Errors name the file, the line,
//! the column and the reason; the `toml` crate's spans give the place, `serde` with
//! `deny_unknown_fields` the unknown keys.

use std::ffi::OsString;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use serde::Deserialize;
use toml::Spanned;

use crate::flags::SecretFiles;
use crate::gateway::route::{self, ROUTE_KEYS, RawRoute, RouteSpec};

/// Keys of the file that are not settings of a route's or the gateway's.
const NOT_SETTINGS: [&str; 2] = ["config", "check"];

/// Why a configuration file is refused: where, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileError {
    /// The file.
    pub path: PathBuf,
    /// The line, from 1 (0 when the file could not be read).
    pub line: usize,
    /// The column, from 1.
    pub column: usize,
    /// The reason.
    pub message: String,
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.path.display(), self.message)
        } else {
            write!(
                f,
                "{}:{}:{}: {}",
                self.path.display(),
                self.line,
                self.column,
                self.message
            )
        }
    }
}

impl std::error::Error for FileError {}

/// A gateway setting the file gives: the flag's long name, its values as the command line would
/// pass them, and the line it is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSetting {
    /// The flag's long name (`retention`).
    pub name: String,
    /// The value, as a flag's (`7d`; a list joined with commas); `None` for a switch that is on.
    pub value: Option<String>,
}

/// What a file holds: the gateway's settings and the routes.
#[derive(Debug, Clone, Default)]
pub struct ConfigFile {
    /// The file.
    pub path: PathBuf,
    /// The top-level settings, in file order.
    pub settings: Vec<FileSetting>,
    /// The routes, in file order.
    pub routes: Vec<RouteSpec>,
    /// Routes that are never reached (an earlier one matches every request they would), as
    /// messages naming both lines.
    pub warnings: Vec<String>,
}

/// The routes part of the file; the top-level settings are read key by key.
#[derive(Debug, Deserialize)]
struct RawFile {
    #[serde(default)]
    route: Vec<Spanned<RawRoute>>,
}

/// A `[[relay]]` table, parsed by `idem relay`'s flags, and the line of its header.
#[derive(Debug, Clone)]
pub struct RelayTable {
    /// The line of the `[[relay]]` header.
    pub line: usize,
    /// The table's keys as `idem relay`'s command line would give them.
    pub matches: clap::ArgMatches,
}

/// Reads the `[[relay]]` tables of `path` for `idem relay --config` (`command`, its `IDEM_*`
/// variables left out): each key one of its flags by its long name, parsed by the flag's own
/// parser. The file's other keys and tables are `idem serve`'s, which checks them.
///
/// # Errors
///
/// [`FileError`] with the place: a file that cannot be read or is not TOML, no `[[relay]]`
/// table, an unknown key (`admin-listen` is the process's, given on the command line), a value
/// the flag refuses, a table without `database` or `to`.
pub fn relays(path: &Path, command: &clap::Command) -> Result<Vec<RelayTable>, FileError> {
    use toml::de::DeValue;

    let text = read(path)?;
    let source = Source { path, text: &text };
    let table = toml::de::DeTable::parse(&text).map_err(|e| source.toml(&e))?;
    let tables = match table
        .get_ref()
        .get("relay")
        .map(|value| (value.get_ref(), value.span()))
    {
        Some((DeValue::Array(tables), _)) => tables,
        Some((_, span)) => return Err(source.at(span, "`relay` is an array of tables: [[relay]]".into())),
        None => {
            return Err(source.at(
                0..0,
                "has no [[relay]] table: each names a `database` and a `to` (docs/OUTBOX.md)".into(),
            ));
        }
    };
    // The variables are the process's, not a table's; which settings are secrets is read from
    // them first.
    let flags = command;
    let command = command.clone().mut_args(|arg| arg.env(None));
    let mut relays = Vec::new();
    for relay in tables {
        let DeValue::Table(entries) = relay.get_ref() else {
            return Err(source.at(relay.span(), "a [[relay]] is a table".into()));
        };
        let mut args = vec!["relay".to_owned()];
        let mut spans = Vec::new();
        for (key, value) in entries {
            let name = key.get_ref().as_ref();
            // `database-file = "/run/secrets/…"`: a secret setting's value from a file, so that
            // the configuration file holds no password.
            if let Some(secret) = name
                .strip_suffix("-file")
                .filter(|base| secret_setting(flags, base))
            {
                let DeValue::String(path) = value.get_ref() else {
                    return Err(source.at(
                        value.span(),
                        format!("`{name}` is the path of a file, as a string"),
                    ));
                };
                if entries
                    .iter()
                    .any(|(other, _)| other.get_ref().as_ref() == secret)
                {
                    return Err(source.at(
                        key.span(),
                        format!("[[relay]] gives `{secret}` and `{name}`: give the value one way"),
                    ));
                }
                let text = crate::flags::read_secret_file(Path::new(path.as_ref()))
                    .map_err(|why| source.at(value.span(), format!("`{name}` {path}: {why}")))?;
                spans.push((secret.to_owned(), key.span()));
                args.push(format!("--{secret}"));
                args.push(text);
                continue;
            }
            let Some(flag) = setting_flag(&command, name).filter(|_| name != "admin-listen") else {
                return Err(source.at(
                    key.span(),
                    format!(
                        "unknown key `{name}` in [[relay]]: its keys are `idem relay`'s flags without `--` (not `config` or `admin-listen`, which are the process's)"
                    ),
                ));
            };
            let switch = !flag.get_action().takes_values();
            let value = setting_value(name, value.get_ref(), switch)
                .map_err(|why| source.at(value.span(), why.to_string()))?;
            if switch && value.as_deref() == Some("false") {
                continue;
            }
            spans.push((name.to_owned(), key.span()));
            args.push(format!("--{name}"));
            if !switch {
                args.extend(value);
            }
        }
        for required in ["database", "to"] {
            if !spans.iter().any(|(name, _)| name == required) {
                return Err(source.at(
                    relay.span(),
                    format!("[[relay]] has no `{required}`: each relay names a `database` and a `to`"),
                ));
            }
        }
        let matches = command.clone().try_get_matches_from(args).map_err(|error| {
            let named = spans.iter().map(|(name, span)| (name.as_str(), span));
            let span = flag_span(&error, named).unwrap_or_else(|| relay.span());
            source.at(span, format!("[[relay]]: {}", clap_reason(&error)))
        })?;
        relays.push(RelayTable {
            line: line_column(&text, relay.span().start).0,
            matches,
        });
    }
    Ok(relays)
}

/// Whether `name` is one of `command`'s flags that can carry a secret
/// ([`crate::flags::SECRET_SETTINGS`], by its variable): one a `[[relay]]` table may give as
/// `NAME-file`.
fn secret_setting(command: &clap::Command, name: &str) -> bool {
    command
        .get_arguments()
        .find(|arg| arg.get_long() == Some(name))
        .and_then(clap::Arg::get_env)
        .and_then(|env| env.to_str())
        .is_some_and(|env| crate::flags::SECRET_SETTINGS.contains(&env))
}

/// Reads and checks `path`: the top-level keys against `command`'s flags (the `idem serve`
/// command, whose value parsers check the values), the routes against their own keys.
///
/// # Errors
///
/// [`FileError`] with the place and the reason: a file that cannot be read or is not TOML, an
/// unknown key, a value a flag's parser refuses, a route without `path`, a bad duration, size,
/// JSON pointer, URL or status list.
pub fn load(path: &Path, command: &clap::Command) -> Result<ConfigFile, FileError> {
    parse(path, &read(path)?, command)
}

/// The text of the file at `path`.
fn read(path: &Path) -> Result<String, FileError> {
    std::fs::read_to_string(path).map_err(|error| FileError {
        path: path.to_owned(),
        line: 0,
        column: 0,
        message: format!("cannot be read: {error}"),
    })
}

/// A file's path and text, for errors that name a place in it.
struct Source<'a> {
    path: &'a Path,
    text: &'a str,
}

impl Source<'_> {
    /// An error at the start of `span`.
    fn at(&self, span: Range<usize>, message: String) -> FileError {
        let (line, column) = line_column(self.text, span.start);
        FileError {
            path: self.path.to_owned(),
            line,
            column,
            message,
        }
    }

    /// A `toml` error, at its place.
    fn toml(&self, error: &toml::de::Error) -> FileError {
        self.at(
            error.span().unwrap_or(0..0),
            error.message().trim_end().to_owned(),
        )
    }
}

/// As [`load`], from the file's text.
///
/// # Errors
///
/// As [`load`].
pub fn parse(path: &Path, text: &str, command: &clap::Command) -> Result<ConfigFile, FileError> {
    let source = Source { path, text };
    let at = |span: Range<usize>, message: String| source.at(span, message);
    let table = toml::de::DeTable::parse(text).map_err(|e| source.toml(&e))?;
    let mut settings = Vec::new();
    for (key, value) in table.get_ref() {
        let name = key.get_ref().as_ref();
        // `[[relay]]` tables are `idem relay`'s (`relays`).
        if name == "route" || name == "relay" {
            continue;
        }
        let Some(flag) = setting_flag(command, name) else {
            return Err(at(
                key.span(),
                format!(
                    "unknown key `{name}`: the top-level keys are `idem serve`'s flags without `--`, and [[route]] tables"
                ),
            ));
        };
        let switch = !flag.get_action().takes_values();
        let value =
            setting_value(name, value.get_ref(), switch).map_err(|why| at(value.span(), why.to_string()))?;
        if switch && value.as_deref() == Some("false") {
            continue;
        }
        let setting = FileSetting {
            name: name.to_owned(),
            value: if switch { None } else { value },
        };
        settings.push((setting, key.span()));
    }
    check_with_flags(&settings, command).map_err(|(span, why)| at(span, why))?;
    // The routes from the table already parsed, its spans kept.
    let raw = RawFile::deserialize(toml::de::Deserializer::from(table)).map_err(|e| source.toml(&e))?;
    let mut routes = Vec::new();
    for route in raw.route {
        let line = line_column(text, route.span().start).0;
        routes.push(route::parse(route.into_inner(), line).map_err(|(span, why)| at(span, why))?);
    }
    let mut warnings = Vec::new();
    for (later, route) in routes.iter().enumerate() {
        if let Some(earlier) = routes[..later].iter().find(|earlier| route.shadowed_by(earlier)) {
            warnings.push(format!(
                "{}:{}: the route {} is never reached: the route at line {} ({}) takes every request it would",
                path.display(),
                route.line,
                route.path,
                earlier.line,
                earlier.path
            ));
        }
    }
    Ok(ConfigFile {
        path: path.to_owned(),
        settings: settings.into_iter().map(|(setting, _)| setting).collect(),
        routes,
        warnings,
    })
}

/// Why a top-level value cannot be a flag's text; the message names the setting.
#[derive(Debug, thiserror::Error)]
enum ValueError {
    #[error("`{0}` is a switch: true or false")]
    NotASwitch(String),
    #[error("`{0}`: the number is out of range")]
    OutOfRange(String),
    #[error("`{0}`: a list of strings is expected")]
    NotStrings(String),
    #[error("`{0}`: a string is expected (as the flag takes it)")]
    NotAString(String),
}

/// A top-level value as a flag's text: strings as they are, integers in decimal, a list joined
/// with commas (for flags that take one), `true`/`false` for a switch.
fn setting_value(
    name: &str,
    value: &toml::de::DeValue<'_>,
    switch: bool,
) -> Result<Option<String>, ValueError> {
    use toml::de::DeValue;
    match value {
        DeValue::Boolean(on) if switch => Ok(Some(on.to_string())),
        _ if switch => Err(ValueError::NotASwitch(name.to_owned())),
        DeValue::String(text) => Ok(Some(text.to_string())),
        DeValue::Integer(number) => i64::from_str_radix(&number.as_str().replace('_', ""), number.radix())
            .map(|number| Some(number.to_string()))
            .map_err(|_| ValueError::OutOfRange(name.to_owned())),
        DeValue::Array(items) => {
            let mut texts = Vec::new();
            for item in items {
                match item.get_ref() {
                    DeValue::String(text) => texts.push(text.to_string()),
                    _ => return Err(ValueError::NotStrings(name.to_owned())),
                }
            }
            Ok(Some(texts.join(",")))
        }
        _ => Err(ValueError::NotAString(name.to_owned())),
    }
}

/// Parses the file's settings with the flags' own parsers (the command line's rules, without the
/// environment); a setting that needs another (a certificate's key) may get it from the command
/// line, so only errors about a value are the file's.
fn check_with_flags(
    settings: &[(FileSetting, Range<usize>)],
    command: &clap::Command,
) -> Result<(), (Range<usize>, String)> {
    let mut args = vec!["serve".to_owned()];
    if !settings.iter().any(|(setting, _)| setting.name == "upstream") {
        args.extend(["--upstream".into(), "http://127.0.0.1:1".into()]);
    }
    for (setting, _) in settings {
        args.push(format!("--{}", setting.name));
        args.extend(setting.value.clone());
    }
    let command = command.clone().mut_args(|arg| arg.env(None));
    let Err(error) = command.try_get_matches_from(args) else {
        return Ok(());
    };
    use clap::error::ErrorKind;
    if matches!(
        error.kind(),
        ErrorKind::MissingRequiredArgument | ErrorKind::ArgumentConflict
    ) {
        return Ok(());
    }
    let named = settings
        .iter()
        .map(|(setting, span)| (setting.name.as_str(), span));
    let span = flag_span(&error, named).unwrap_or(0..0);
    Err((span, clap_reason(&error)))
}

/// The span of the setting among `named` (a flag's long name and where the file sets it) whose
/// value clap's `error` is about.
fn flag_span<'s>(
    error: &clap::Error,
    mut named: impl Iterator<Item = (&'s str, &'s Range<usize>)>,
) -> Option<Range<usize>> {
    use clap::error::{ContextKind, ContextValue};
    let flag = match error.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(flag)) => flag.as_str(),
        _ => "",
    };
    named
        .find(|(name, _)| flag.starts_with(&format!("--{name} ")) || flag == format!("--{name}"))
        .map(|(_, span)| span.clone())
}

/// clap's message for `error`, its first line without `error: `.
fn clap_reason(error: &clap::Error) -> String {
    let text = error.to_string();
    let first = text.lines().next().unwrap_or_default();
    first.trim_start_matches("error: ").to_owned()
}

/// The flag of `idem serve` (`command`) that the file's top-level key `name` sets.
fn setting_flag<'c>(command: &'c clap::Command, name: &str) -> Option<&'c clap::Arg> {
    if NOT_SETTINGS.contains(&name) {
        return None;
    }
    command.get_arguments().find(|arg| arg.get_long() == Some(name))
}

/// The command line, merged with the `--config` file it names (or `IDEM_CONFIG`).
#[derive(Debug)]
pub struct Merged {
    /// The command line's matches, with the file's settings where neither a flag nor a variable
    /// gives one.
    pub matches: clap::ArgMatches,
    /// The file, when `idem serve` was given one.
    pub file: Option<ConfigFile>,
    /// The long names of the settings that come from the file.
    pub from_file: Vec<String>,
    /// The long names of the secret settings that come from a `<VARIABLE>_FILE`.
    pub from_secret_files: Vec<String>,
}

/// Parses `args` with `command`; for `idem serve --config FILE`, reads the file and adds its
/// settings as flags where the command line and the environment give none, so that they go
/// through the flags' parsers and checks and lose to both. The precedence, highest first: a
/// flag, its `IDEM_*` variable, the variable's `_FILE` (`secrets`: the settings `command` took
/// from files), the configuration file, the default. Errors of the command line itself are
/// clap's: printed, and the process exits as for any bad flag.
///
/// # Errors
///
/// [`FileError`] when the file cannot be used.
pub fn merge(
    command: &clap::Command,
    args: Vec<OsString>,
    secrets: &SecretFiles,
) -> Result<Merged, FileError> {
    match try_merge(command, args, secrets) {
        Ok(merged) => Ok(merged),
        Err(MergeError::File(error)) => Err(error),
        Err(MergeError::Flags(error)) => error.exit(),
    }
}

/// Why [`try_merge`] failed.
#[derive(Debug)]
pub enum MergeError {
    /// The file cannot be used.
    File(FileError),
    /// The command line with the file's settings is refused by its parsers (clap's message).
    Flags(clap::Error),
}

impl fmt::Display for MergeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File(error) => error.fmt(f),
            Self::Flags(error) => f.write_str(&clap_reason(error)),
        }
    }
}

impl std::error::Error for MergeError {}

/// As [`merge`], returning the command line's errors instead of exiting: what a reload does.
///
/// # Errors
///
/// [`MergeError`] saying what is wrong.
pub fn try_merge(
    command: &clap::Command,
    mut args: Vec<OsString>,
    secrets: &SecretFiles,
) -> Result<Merged, MergeError> {
    let probe = command
        .clone()
        .ignore_errors(true)
        .mut_subcommand("serve", |serve| serve.ignore_errors(true))
        .try_get_matches_from(&args);
    let serve = probe
        .as_ref()
        .ok()
        .and_then(|matches| matches.subcommand_matches("serve"));
    let path = serve.and_then(|serve| serve.get_one::<PathBuf>("config").cloned());
    // The secret settings a `_FILE` gives, unless a flag or the variable gives them first.
    let from_secret_files: Vec<String> = command
        .find_subcommand("serve")
        .into_iter()
        .flat_map(clap::Command::get_arguments)
        .filter(|arg| secrets.give(arg))
        .filter(|arg| {
            let given = serve.and_then(|serve| serve.value_source(arg.get_id().as_str()));
            !matches!(given, Some(ValueSource::CommandLine | ValueSource::EnvVariable))
        })
        .filter_map(|arg| arg.get_long().map(str::to_owned))
        .collect();
    let (Some(serve), Some(path), Some(serve_command)) = (serve, path, command.find_subcommand("serve"))
    else {
        return Ok(Merged {
            matches: command
                .clone()
                .try_get_matches_from(args)
                .map_err(MergeError::Flags)?,
            file: None,
            from_file: Vec::new(),
            from_secret_files,
        });
    };
    let file = load(&path, serve_command).map_err(MergeError::File)?;
    let mut from_file = Vec::new();
    for setting in &file.settings {
        let Some(arg) = setting_flag(serve_command, &setting.name) else {
            continue;
        };
        let given = serve.value_source(arg.get_id().as_str());
        // A `_FILE` ranks as its variable does: above the file.
        if matches!(given, Some(ValueSource::CommandLine | ValueSource::EnvVariable)) || secrets.give(arg) {
            continue;
        }
        args.push(format!("--{}", setting.name).into());
        args.extend(setting.value.clone().map(OsString::from));
        from_file.push(setting.name.clone());
    }
    Ok(Merged {
        matches: command
            .clone()
            .try_get_matches_from(args)
            .map_err(MergeError::Flags)?,
        file: Some(file),
        from_file,
        from_secret_files,
    })
}

/// `idem serve --config FILE --check`: every setting's effective value and where it comes from
/// (`default`, `file`, `env file`, `env`, `flag`), then each route's, its own (`route`) or the
/// gateway's.
#[must_use]
pub fn report(merged: &Merged, serve_command: &clap::Command) -> String {
    use std::fmt::Write as _;
    let Some(serve) = merged.matches.subcommand_matches("serve") else {
        return String::new();
    };
    let mut rows: Vec<(String, String, &'static str)> = Vec::new();
    for arg in serve_command.get_arguments() {
        let (Some(long), id) = (arg.get_long(), arg.get_id().as_str()) else {
            continue;
        };
        if NOT_SETTINGS.contains(&long) || matches!(long, "help" | "version") {
            continue;
        }
        let Some(values) = serve.get_raw(id) else {
            continue;
        };
        let value = values
            .map(|value| value.to_string_lossy())
            .collect::<Vec<_>>()
            .join(",");
        let value = if long.contains("secret") || long.contains("token") {
            "***".to_owned()
        } else if matches!(long, "store" | "ui-database") {
            idempotency::redact_url(&value)
        } else if !arg.get_action().takes_values() {
            if serve.get_flag(id) { "true" } else { "false" }.to_owned()
        } else {
            value
        };
        let source = if merged.from_file.iter().any(|name| name == long) {
            "file"
        } else if merged.from_secret_files.iter().any(|name| name == long) {
            "env file"
        } else {
            match serve.value_source(id) {
                Some(ValueSource::CommandLine) => "flag",
                Some(ValueSource::EnvVariable) => "env",
                _ => "default",
            }
        };
        rows.push((long.to_owned(), value, source));
    }
    let mut out = String::new();
    if let Some(file) = &merged.file {
        let _ = writeln!(out, "{}: valid", file.path.display());
        for warning in &file.warnings {
            let _ = writeln!(out, "warning: {warning}");
        }
    }
    let _ = writeln!(out, "\nsettings (setting, value, from):");
    let width = rows.iter().map(|(name, _, _)| name.len()).max().unwrap_or(0);
    for (name, value, source) in &rows {
        let _ = writeln!(out, "  {name:width$}  {value}  [{source}]");
    }
    let routes = merged.file.as_ref().map_or(&[][..], |file| &file.routes[..]);
    let _ = writeln!(
        out,
        "\nroutes ({}; the first whose path and methods match takes a request, the others get the settings above):",
        routes.len()
    );
    let gateway = |name: &str| {
        rows.iter()
            .find(|(row, _, _)| row == name)
            .map(|(_, value, source)| (value.clone(), format!("gateway, {source}")))
    };
    for (number, route) in routes.iter().enumerate() {
        let _ = writeln!(
            out,
            "  {}. {} (name {}, line {})",
            number + 1,
            route.path,
            route.name,
            route.line
        );
        for key in ROUTE_KEYS {
            let own = route.written.iter().find(|(written, _)| *written == key);
            let (value, source) = match (own, route::own_default(key)) {
                (Some((_, value)), _) => (value.clone(), format!("route, line {}", route.line)),
                (None, Some(default)) => (default.to_owned(), "default".to_owned()),
                (None, None) if key == "methods" => gateway("methods")
                    .map(|(value, source)| (format!("any (guarded: {value})"), source))
                    .unwrap_or_default(),
                (None, None) => gateway(key).unwrap_or_else(|| ("none".to_owned(), "default".to_owned())),
            };
            let _ = writeln!(out, "       {key:16}  {value}  [{source}]");
        }
    }
    out
}

/// The line and column (from 1) of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |last| last.chars().count()) + 1;
    (line, column)
}

//! Human durations (`2s`, `5m`, `24h`, `1h30m`, `250ms`) and sizes (`1MiB`, `512KiB`, `64kB`,
//! `1048576`), as `idem`'s flags, its `IDEM_*` variables and the broker and store URLs take
//! them.
//!
//! Hand-written on purpose, rather than `humantime` and `parse-size`: the flags set leases and
//! retentions, where a misread value is a double execution, and those crates read more than we
//! want to accept. `humantime` takes `1M` as a month and `1m` as a minute, `5 m` and `5min` as five
//! minutes; `parse-size` takes `1 mb` case-insensitively and rounds `1.5MiB`. This grammar is one
//! unit set, whole numbers, no spaces inside a duration, and every refusal names the offending
//! part; the unit tests below pin it.

use std::time::Duration;

/// Why a duration or a size flag is refused; the message is what the user reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UnitError {
    /// Nothing was given.
    #[error("empty duration (examples: 2s, 5m, 24h, 250ms)")]
    EmptyDuration,
    /// Not `<integer><unit>` parts.
    #[error("`{0}` is not a duration (examples: 2s, 5m, 24h, 250ms)")]
    NotADuration(String),
    /// A number without its unit.
    #[error("`{0}`: a unit is missing (ms, s, m, h or d)")]
    MissingUnit(String),
    /// A unit that is not one of the list.
    #[error("`{text}`: unknown unit `{unit}` ({units})")]
    UnknownUnit {
        /// What was given.
        text: String,
        /// The unit that is not known.
        unit: String,
        /// The units that are.
        units: &'static str,
    },
    /// A number with more digits than fit.
    #[error("`{0}`: the number is too large")]
    NumberTooLarge(String),
    /// A duration longer than `Duration` holds.
    #[error("`{0}` is too long")]
    TooLong(String),
    /// Not `<integer>[unit]`.
    #[error("`{0}` is not a size (examples: 1MiB, 512KiB, 64kB, 1048576)")]
    NotASize(String),
    /// A size larger than this machine's address space.
    #[error("`{0}` is too large")]
    TooLarge(String),
}

/// Parses a duration: one or more `<integer><unit>` parts, units `ms`, `s`, `m`, `h`, `d`.
///
/// # Errors
///
/// A [`UnitError`] that says what is wrong.
pub fn parse_duration(text: &str) -> Result<Duration, UnitError> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(UnitError::EmptyDuration);
    }
    let mut total = Duration::ZERO;
    let mut rest = trimmed;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(UnitError::NotADuration(text.into()));
        }
        let number: u64 = rest[..digits]
            .parse()
            .map_err(|_| UnitError::NumberTooLarge(text.into()))?;
        rest = &rest[digits..];
        let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let (unit, tail) = rest.split_at(unit_len);
        let part = match unit {
            "ms" => Duration::from_millis(number),
            "s" => Duration::from_secs(number),
            "m" => Duration::from_secs(number.saturating_mul(60)),
            "h" => Duration::from_secs(number.saturating_mul(3600)),
            "d" => Duration::from_secs(number.saturating_mul(86_400)),
            "" => return Err(UnitError::MissingUnit(text.into())),
            other => {
                return Err(UnitError::UnknownUnit {
                    text: text.into(),
                    unit: other.into(),
                    units: "ms, s, m, h or d",
                });
            }
        };
        total = total
            .checked_add(part)
            .ok_or_else(|| UnitError::TooLong(text.into()))?;
        rest = tail;
    }
    Ok(total)
}

/// Parses a size in bytes: an integer with an optional unit `B`, `kB`/`KB` (1000), `KiB`
/// (1024), `MB`, `MiB`, `GB`, `GiB`.
///
/// # Errors
///
/// A [`UnitError`] that says what is wrong.
pub fn parse_size(text: &str) -> Result<usize, UnitError> {
    let trimmed = text.trim();
    let digits = trimmed.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(UnitError::NotASize(text.into()));
    }
    let number: u64 = trimmed[..digits]
        .parse()
        .map_err(|_| UnitError::NumberTooLarge(text.into()))?;
    let multiplier: u64 = match trimmed[digits..].trim() {
        "" | "B" => 1,
        "kB" | "KB" => 1000,
        "KiB" => 1 << 10,
        "MB" => 1_000_000,
        "MiB" => 1 << 20,
        "GB" => 1_000_000_000,
        "GiB" => 1 << 30,
        other => {
            return Err(UnitError::UnknownUnit {
                text: text.into(),
                unit: other.into(),
                units: "B, kB, KiB, MB, MiB, GB, GiB",
            });
        }
    };
    number
        .checked_mul(multiplier)
        .and_then(|bytes| usize::try_from(bytes).ok())
        .ok_or_else(|| UnitError::TooLarge(text.into()))
}

/// Formats a duration the way [`parse_duration`] reads it, for messages.
#[must_use]
pub fn format_duration(duration: Duration) -> String {
    let millis = duration.as_millis();
    if !millis.is_multiple_of(1000) {
        return format!("{millis}ms");
    }
    let secs = duration.as_secs();
    match secs {
        s if s.is_multiple_of(86_400) && s > 0 => format!("{}d", s / 86_400),
        s if s.is_multiple_of(3600) && s > 0 => format!("{}h", s / 3600),
        s if s.is_multiple_of(60) && s > 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration(" 7d "), Ok(Duration::from_secs(604_800)));
        for (bad, why) in [
            ("", "empty"),
            ("5", "unit is missing"),
            ("5 m", "unit is missing"),
            ("m5", "not a duration"),
            ("-5s", "not a duration"),
            ("1.5s", "unit is missing"),
            ("5min", "unknown unit `min`"),
            ("99999999999999999999s", "too large"),
        ] {
            let error = parse_duration(bad).unwrap_err().to_string();
            assert!(error.contains(why), "{bad:?}: {error}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("512KiB"), Ok(512 << 10));
        assert_eq!(parse_size("64kB"), Ok(64_000));
        assert_eq!(parse_size("1048576"), Ok(1_048_576));
        assert_eq!(parse_size("10 B"), Ok(10));
        for bad in ["", "MiB", "1 mb", "1.5MiB", "-1", "1TiB", "99999999999999999999"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn formatting_round_trips() {
        for text in ["250ms", "2s", "5m", "3h", "7d"] {
            assert_eq!(format_duration(parse_duration(text).unwrap()), text);
        }
    }
}

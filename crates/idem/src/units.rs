//! Human durations (`2s`, `5m`, `24h`, `1h30m`, `250ms`) and sizes (`1MiB`, `512KiB`, `64kB`,
//! `1048576`), as the flags and `IDEM_*` variables take them.

use std::time::Duration;

/// Parses a duration: one or more `<integer><unit>` parts, units `ms`, `s`, `m`, `h`, `d`.
///
/// # Errors
///
/// What is wrong, for the user.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err("empty duration (examples: 2s, 5m, 24h, 250ms)".into());
    }
    let mut total = Duration::ZERO;
    let mut rest = trimmed;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(format!(
                "`{text}` is not a duration (examples: 2s, 5m, 24h, 250ms)"
            ));
        }
        let number: u64 = rest[..digits]
            .parse()
            .map_err(|_| format!("`{text}`: the number is too large"))?;
        rest = &rest[digits..];
        let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let (unit, tail) = rest.split_at(unit_len);
        let part = match unit {
            "ms" => Duration::from_millis(number),
            "s" => Duration::from_secs(number),
            "m" => Duration::from_secs(number.saturating_mul(60)),
            "h" => Duration::from_secs(number.saturating_mul(3600)),
            "d" => Duration::from_secs(number.saturating_mul(86_400)),
            "" => return Err(format!("`{text}`: a unit is missing (ms, s, m, h or d)")),
            other => return Err(format!("`{text}`: unknown unit `{other}` (ms, s, m, h or d)")),
        };
        total = total
            .checked_add(part)
            .ok_or_else(|| format!("`{text}` is too long"))?;
        rest = tail;
    }
    Ok(total)
}

/// Parses a size in bytes: an integer with an optional unit `B`, `kB`/`KB` (1000), `KiB`
/// (1024), `MB`, `MiB`, `GB`, `GiB`.
///
/// # Errors
///
/// What is wrong, for the user.
pub fn parse_size(text: &str) -> Result<usize, String> {
    let trimmed = text.trim();
    let digits = trimmed.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(format!(
            "`{text}` is not a size (examples: 1MiB, 512KiB, 64kB, 1048576)"
        ));
    }
    let number: u64 = trimmed[..digits]
        .parse()
        .map_err(|_| format!("`{text}`: the number is too large"))?;
    let multiplier: u64 = match trimmed[digits..].trim() {
        "" | "B" => 1,
        "kB" | "KB" => 1000,
        "KiB" => 1 << 10,
        "MB" => 1_000_000,
        "MiB" => 1 << 20,
        "GB" => 1_000_000_000,
        "GiB" => 1 << 30,
        other => {
            return Err(format!(
                "`{text}`: unknown unit `{other}` (B, kB, KiB, MB, MiB, GB, GiB)"
            ));
        }
    };
    number
        .checked_mul(multiplier)
        .and_then(|bytes| usize::try_from(bytes).ok())
        .ok_or_else(|| format!("`{text}` is too large"))
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
            let error = parse_duration(bad).unwrap_err();
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

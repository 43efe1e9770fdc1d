//! SQL identifiers that are safe to format into statements.

use std::fmt;

use crate::{ErrorKind, StoreError};

/// A SQL identifier the store may interpolate into its statements: 1 to 63 characters of
/// lowercase ASCII letters, digits and `_`, not starting with a digit.
///
/// The table and schema names are the only text the store puts into SQL by formatting (every
/// value is a bind parameter), so they are held to a grammar that needs no quoting and cannot
/// carry anything but a name.
///
/// ```
/// use idempotency_core::Identifier;
///
/// assert!(Identifier::new("idempotency_records").is_ok());
/// assert!(Identifier::new("records; DROP TABLE users").is_err());
/// assert!(Identifier::new("Records").is_err()); // would need quoting
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Identifier(String);

impl Identifier {
    /// Validates `name`.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::InvalidConfig`] naming the rule that `name` breaks.
    pub fn new(name: &str) -> Result<Self, StoreError> {
        let invalid = |why: &str| {
            StoreError::new(
                ErrorKind::InvalidConfig,
                format!(
                    "unsafe SQL identifier {name:?}: {why} (allowed: a-z, 0-9 and _, not starting with a digit, at most 63 characters)"
                ),
            )
        };
        if name.is_empty() {
            return Err(invalid("it is empty"));
        }
        if name.len() > 63 {
            return Err(invalid("it is longer than 63 bytes"));
        }
        if name.as_bytes()[0].is_ascii_digit() {
            return Err(invalid("it starts with a digit"));
        }
        if let Some(c) = name.chars().find(|c| !matches!(c, 'a'..='z' | '0'..='9' | '_')) {
            return Err(invalid(&format!("it contains {c:?}")));
        }
        Ok(Self(name.to_owned()))
    }

    /// The name.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Identifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for Identifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_follow_the_safe_grammar() {
        for good in ["a", "idempotency_records", "t_123", "_x", &"x".repeat(63)] {
            assert!(Identifier::new(good).is_ok(), "{good}");
        }
        let cases = [
            ("", "it is empty"),
            ("1table", "starts with a digit"),
            ("Records", "contains 'R'"),
            ("records;drop", "contains ';'"),
            ("a b", "contains ' '"),
            ("x\"y", "contains '\"'"),
            ("café", "contains 'é'"),
        ];
        for (bad, why) in cases {
            let error = Identifier::new(bad).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::InvalidConfig);
            assert!(error.to_string().contains(why), "{bad}: {error}");
        }
        assert!(
            Identifier::new(&"x".repeat(64))
                .unwrap_err()
                .to_string()
                .contains("longer than 63")
        );
    }
}

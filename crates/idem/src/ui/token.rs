//! The token `--admin-token` takes, and how it is read.

use subtle::ConstantTimeEq as _;

/// The token `--admin-token` takes: at least 16 characters, never printed (its `Debug` says
/// only that it is set).
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken(String);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(set)")
    }
}

/// The fewest characters an admin token may have.
pub const MIN_TOKEN_LEN: usize = 16;

/// Why an admin token is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// Shorter than [`MIN_TOKEN_LEN`].
    #[error(
        "--admin-token: the token has {0} characters; at least 16 are needed (e.g. `openssl rand -hex 32`)"
    )]
    TooShort(usize),
    /// It holds a space or a control character, which an `Authorization` header cannot carry
    /// whole.
    #[error("--admin-token: the token may not hold spaces or control characters")]
    Unprintable,
}

impl AdminToken {
    /// `text` as a token.
    ///
    /// # Errors
    ///
    /// [`TokenError`] when it is too short or holds a space or control character.
    pub fn new(text: &str) -> Result<Self, TokenError> {
        if text.chars().count() < MIN_TOKEN_LEN {
            return Err(TokenError::TooShort(text.chars().count()));
        }
        if text.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(TokenError::Unprintable);
        }
        Ok(Self(text.to_owned()))
    }

    /// Whether `given` is this token, compared in constant time.
    pub(super) fn matches(&self, given: &str) -> bool {
        self.0.as_bytes().ct_eq(given.as_bytes()).into()
    }
}

impl crate::flags::SecretParser<AdminToken> {
    /// `--admin-token`, with [`AdminToken::new`].
    pub const ADMIN_TOKEN: Self = Self::new("--admin-token", |text| Ok(AdminToken::new(text)?));
}

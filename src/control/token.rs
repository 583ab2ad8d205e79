//! The pre-shared token a cluster may require in every handshake.

use std::fmt;

/// A pre-shared token. Never printed; compared in constant time.
///
/// ```
/// use kvring::control::Token;
/// let token = Token::new("s3cret");
/// assert!(token.matches(b"s3cret"));
/// assert!(!token.matches(b"guess"));
/// assert_eq!(format!("{token:?}"), "Token(<redacted>)");
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Vec<u8>);

impl Token {
    /// A token from bytes or a string.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Self(bytes.into())
    }

    /// The bytes sent in a handshake.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// True when `candidate` is this token. Takes the same time for every
    /// candidate of the same length, so a peer cannot guess it byte by byte.
    pub fn matches(&self, candidate: &[u8]) -> bool {
        if candidate.len() != self.0.len() {
            return false;
        }
        self.0.iter().zip(candidate).fold(0u8, |diff, (a, b)| diff | (a ^ b)) == 0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

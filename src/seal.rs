//! What a tokened session seals once its handshake is done, so that a
//! relay that forwarded both proofs (it never learns the session key) can
//! neither rewrite nor inject anything:
//!
//! - the step-2 descriptor, as the bytes the target sent, with the
//!   initiator's proof (which covers both nonces, both epochs, the
//!   initiator's identity and the addresses it saw): [`descriptor_seal`];
//! - every later control message each way, numbered per direction, so none
//!   can be injected, replayed or reordered: [`ControlSeal`];
//! - a data listener's answer: the listener proves the session too, over
//!   both connection nonces ([`listener_proof`]), before the initiator
//!   proves anything;
//! - every tcp data frame *header*, numbered per direction, with a MAC under
//!   a key of that connection alone: [`FrameSeal`]. Payload bytes are not
//!   covered (that is TLS's or IPsec's job, or an end-to-end checksum's);
//! - the GPU descriptor socket (`transport/gpu_fds`): each end proves the
//!   session over both connection nonces ([`gpu_fds_proof`]), the server
//!   first, before any descriptor is passed.
//!
//! Every tag is HMAC-SHA256 under the session key (or a key derived from it)
//! with a label per purpose, so no tag made for one use passes for another.

use crate::auth::{Nonce, Session, Tag, MAC_BYTES};
use crate::error::{Error, Result};
use hmac::{Hmac, Mac as _};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a frame header's MAC: HMAC-SHA256 truncated to 128 bits
/// (RFC 2104 section 5 allows truncation to at least half the output).
pub const FRAME_MAC_BYTES: usize = 16;

/// What a tag is for.
#[derive(Debug, Clone, Copy)]
enum Label {
    Descriptor,
    Control,
    Listener,
    FrameKey,
    GpuFds,
}

impl Label {
    fn bytes(self) -> &'static [u8] {
        match self {
            Label::Descriptor => b"kvring/3/descriptor",
            Label::Control => b"kvring/3/control",
            Label::Listener => b"kvring/3/data-listener",
            Label::FrameKey => b"kvring/3/frame-key",
            Label::GpuFds => b"kvring/3/gpu-fds",
        }
    }
}

fn keyed(key: &[u8], label: Label) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(label.bytes());
    mac
}

/// HMAC under `key` of the label and each part, length-prefixed (no two
/// lists of parts give the same input).
fn over(key: &[u8], label: Label, parts: &[&[u8]]) -> HmacSha256 {
    let mut mac = keyed(key, label);
    for part in parts {
        mac.update(&(part.len() as u32).to_le_bytes());
        mac.update(part);
    }
    mac
}

fn tag(key: &[u8], label: Label, parts: &[&[u8]]) -> Tag {
    over(key, label, parts).finalize().into_bytes().into()
}

/// The target's seal over its step-2 answer: the initiator's proof (the
/// transcript) and the descriptor bytes exactly as sent.
pub(crate) fn descriptor_seal(session: &Session, client_proof: &[u8], descriptor: &[u8]) -> Tag {
    tag(session.key(), Label::Descriptor, &[client_proof, descriptor])
}

/// Checks a step-2 seal (constant time).
pub(crate) fn check_descriptor_seal(session: &Session, client_proof: &[u8], descriptor: &[u8], seal: &[u8]) -> bool {
    over(session.key(), Label::Descriptor, &[client_proof, descriptor]).verify_slice(seal).is_ok()
}

/// A data listener's proof that it holds the session: over the
/// initiator's nonce for this connection, its own, and its epoch.
pub(crate) fn listener_proof(session: &Session, client_nonce: &Nonce, server_nonce: &Nonce, epoch: u64) -> Tag {
    tag(session.key(), Label::Listener, &[client_nonce, server_nonce, &epoch.to_le_bytes()])
}

/// Checks a data listener's proof (constant time).
pub(crate) fn check_listener_proof(
    session: &Session,
    client_nonce: &Nonce,
    server_nonce: &Nonce,
    epoch: u64,
    proof: &[u8],
) -> bool {
    over(session.key(), Label::Listener, &[client_nonce, server_nonce, &epoch.to_le_bytes()])
        .verify_slice(proof)
        .is_ok()
}

/// One end's proof on the GPU descriptor socket that it holds the session:
/// over its end, both connection nonces and the exporter's epoch (the
/// server's proof is no client's, and neither serves another connection).
pub(crate) fn gpu_fds_proof(
    session: &Session,
    end: End,
    client_nonce: &Nonce,
    server_nonce: &Nonce,
    epoch: u64,
) -> Tag {
    tag(session.key(), Label::GpuFds, &[&[end.byte()], client_nonce, server_nonce, &epoch.to_le_bytes()])
}

/// Checks a [`gpu_fds_proof`] (constant time).
pub(crate) fn check_gpu_fds_proof(
    session: &Session,
    end: End,
    client_nonce: &Nonce,
    server_nonce: &Nonce,
    epoch: u64,
    proof: &[u8],
) -> bool {
    over(session.key(), Label::GpuFds, &[&[end.byte()], client_nonce, server_nonce, &epoch.to_le_bytes()])
        .verify_slice(proof)
        .is_ok()
}

/// Which end of a connection seals: each direction has its own numbering
/// and its own byte in every tag, so a message cannot be reflected back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The side that dialed.
    Initiator,
    /// The side that accepted.
    Target,
}

impl End {
    fn byte(self) -> u8 {
        match self {
            End::Initiator => 0,
            End::Target => 1,
        }
    }

    fn other(self) -> End {
        match self {
            End::Initiator => End::Target,
            End::Target => End::Initiator,
        }
    }
}

/// A tokened control connection after its handshake: every message each
/// way carries a tag over its direction, its number and its bytes.
#[derive(Clone)]
pub(crate) struct ControlSeal {
    key: Tag,
    end: End,
    sent: u64,
    received: u64,
}

impl std::fmt::Debug for ControlSeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlSeal").field("end", &self.end).field("sent", &self.sent).finish_non_exhaustive()
    }
}

impl ControlSeal {
    /// The seal of `session` for this connection's `end`.
    pub(crate) fn new(session: &Session, end: End) -> Self {
        Self { key: *session.key(), end, sent: 0, received: 0 }
    }

    fn tag(&self, end: End, number: u64, body: &[u8]) -> HmacSha256 {
        over(&self.key, Label::Control, &[&[end.byte()], &number.to_le_bytes(), body])
    }

    /// Appends the next message's tag to `body`.
    pub(crate) fn seal(&mut self, body: &mut Vec<u8>) {
        let tag: Tag = self.tag(self.end, self.sent, body).finalize().into_bytes().into();
        self.sent += 1;
        body.extend_from_slice(&tag);
    }

    /// Checks the next message from the other end and returns its body
    /// without the tag; anything else is `Unauthorized`.
    pub(crate) fn open<'a>(&mut self, message: &'a [u8]) -> Result<&'a [u8]> {
        let refused = || Error::Unauthorized {
            reason: "a control message failed its session MAC (injected, replayed, reordered or rewritten on the \
                     path); the connection is closed"
                .into(),
        };
        let split = message.len().checked_sub(MAC_BYTES).ok_or_else(refused)?;
        let (body, tag) = message.split_at(split);
        self.tag(self.end.other(), self.received, body).verify_slice(tag).map_err(|_| refused())?;
        self.received += 1;
        Ok(body)
    }
}

/// One tcp data connection's header seal: a key of that connection alone
/// (derived from the session and both connection nonces), a number per
/// direction, and a truncated HMAC over the header's fixed bytes. The keyed
/// state is computed once; each header clones it (a copy, no allocation)
/// and costs two SHA-256 compressions.
#[derive(Clone)]
pub struct FrameSeal {
    keyed: HmacSha256,
    end: End,
    sent: u64,
    expected: u64,
}

impl std::fmt::Debug for FrameSeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameSeal")
            .field("end", &self.end)
            .field("sent", &self.sent)
            .field("expected", &self.expected)
            .finish_non_exhaustive()
    }
}

impl FrameSeal {
    /// The seal of the data connection opened with `client_nonce` and
    /// `server_nonce` under `session`, for this connection's `end`.
    pub fn new(session: &Session, client_nonce: &Nonce, server_nonce: &Nonce, epoch: u64, end: End) -> Self {
        // The key is this purpose's alone (its derivation carries the
        // label), so a header's MAC input is its direction and covered
        // bytes only: 53 bytes, one SHA-256 block inside the HMAC.
        let key = tag(session.key(), Label::FrameKey, &[client_nonce, server_nonce, &epoch.to_le_bytes()]);
        let keyed = HmacSha256::new_from_slice(&key).expect("HMAC takes keys of any length");
        Self { keyed, end, sent: 0, expected: 0 }
    }

    fn mac(&self, end: End, covered: &[u8]) -> [u8; FRAME_MAC_BYTES] {
        let mut mac = self.keyed.clone();
        mac.update(&[end.byte()]);
        mac.update(covered);
        let full = mac.finalize().into_bytes();
        let mut out = [0u8; FRAME_MAC_BYTES];
        out.copy_from_slice(&full[..FRAME_MAC_BYTES]);
        out
    }

    /// The number the next header sent carries; counts it as sent.
    pub fn next_sent(&mut self) -> u64 {
        let number = self.sent;
        self.sent += 1;
        number
    }

    /// The MAC of a header this end sends, over its `covered` bytes
    /// (everything before the MAC field, the number included).
    pub fn sign(&self, covered: &[u8]) -> [u8; FRAME_MAC_BYTES] {
        self.mac(self.end, covered)
    }

    /// Checks a header from the other end: it must carry the next number
    /// expected and a MAC over `covered`. Compared in constant time; on
    /// success the next number is expected.
    pub fn check(&mut self, number: u64, covered: &[u8], mac: &[u8; FRAME_MAC_BYTES]) -> Result<()> {
        let expected = self.mac(self.end.other(), covered);
        let diff = expected.iter().zip(mac).fold(0u8, |diff, (a, b)| diff | (a ^ b));
        if diff != 0 || number != self.expected {
            return Err(Error::Unauthorized {
                reason: format!(
                    "data frame {number} (expected {}) failed its session MAC: injected, replayed, reordered or \
                     rewritten on the path; the connection is closed",
                    self.expected
                ),
            });
        }
        self.expected += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Token;

    fn session() -> Session {
        Token::new("s3cret").session([1; 16], [2; 16], 42)
    }

    #[test]
    fn control_messages_open_in_order_and_nothing_else_does() {
        let mut initiator = ControlSeal::new(&session(), End::Initiator);
        let mut target = ControlSeal::new(&session(), End::Target);
        let mut first = b"step".to_vec();
        initiator.seal(&mut first);
        let mut second = b"next".to_vec();
        initiator.seal(&mut second);
        // Reordered: the second first.
        assert!(matches!(target.clone().open(&second), Err(Error::Unauthorized { .. })));
        assert_eq!(target.open(&first).unwrap(), b"step");
        // Replayed.
        assert!(target.clone().open(&first).is_err());
        // Rewritten.
        let mut rewritten = second.clone();
        rewritten[0] ^= 1;
        assert!(target.clone().open(&rewritten).is_err());
        // Reflected: the initiator's own message back at it.
        assert!(initiator.clone().open(&first).is_err());
        // Too short to hold a tag; another session's key.
        assert!(target.clone().open(b"x").is_err());
        let mut other = ControlSeal::new(&Token::new("s3cret").session([1; 16], [3; 16], 42), End::Target);
        assert!(other.open(&second).is_err());
        assert_eq!(target.open(&second).unwrap(), b"next");
    }

    #[test]
    fn frame_headers_check_in_order_under_their_connection_key() {
        let mut sender = FrameSeal::new(&session(), &[3; 16], &[4; 16], 42, End::Initiator);
        let mut receiver = FrameSeal::new(&session(), &[3; 16], &[4; 16], 42, End::Target);
        let mut covered = [7u8; 52];
        let number = sender.next_sent();
        covered[44..].copy_from_slice(&number.to_le_bytes());
        let mac = sender.sign(&covered);
        // Another connection's key, or the reflected direction, refuse it.
        let mut other = FrameSeal::new(&session(), &[3; 16], &[5; 16], 42, End::Target);
        assert!(other.check(number, &covered, &mac).is_err());
        assert!(sender.clone().check(number, &covered, &mac).is_err());
        let mut altered = covered;
        altered[0] ^= 1;
        assert!(receiver.clone().check(number, &altered, &mac).is_err());
        receiver.check(number, &covered, &mac).unwrap();
        // Replayed: its number is no longer the one expected.
        assert!(receiver.check(number, &covered, &mac).is_err());
        // Session MACs of each purpose differ.
        assert_ne!(descriptor_seal(&session(), b"p", b"d").to_vec(), listener_proof(&session(), &[0; 16], &[0; 16], 1));
        let seal = descriptor_seal(&session(), b"proof", b"descriptor");
        assert!(check_descriptor_seal(&session(), b"proof", b"descriptor", &seal));
        assert!(!check_descriptor_seal(&session(), b"proof", b"descriptoR", &seal));
        let proof = listener_proof(&session(), &[1; 16], &[2; 16], 42);
        assert!(check_listener_proof(&session(), &[1; 16], &[2; 16], 42, &proof));
        assert!(!check_listener_proof(&session(), &[1; 16], &[2; 16], 43, &proof));
    }
}

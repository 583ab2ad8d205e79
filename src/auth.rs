//! Proof of a pre-shared token, without ever sending it.
//!
//! A cluster may configure a token. Two engines then prove to each other
//! that they hold it, in the control handshake, with HMAC-SHA256 over fresh
//! nonces from both sides (mutual: the initiator checks the target's proof
//! before it sends its own, so an address that cannot prove the token gets
//! no proof to forward). The initiator's proof also covers the connection
//! as it saw it (`Seen`: the address it dialed), so a relay that forwards
//! both proofs to the real engine is refused there. Both sides then derive
//! a *session key* from the token, both nonces and the target's epoch,
//! which seals the descriptor, later control messages and every data frame
//! header (`seal.rs`); every data connection opens with MACs under that key
//! each way. The token itself never crosses the network, and the epoch is
//! never treated as a secret.
//!
//! The target keeps no table of sessions: the nonce it hands out in a
//! challenge carries a MAC under a secret drawn at each start, so a data
//! connection's claim "I hold the session of handshake (cn, sn)" is checked
//! by recomputation, and sessions of an earlier start (another secret, another
//! epoch) are refused.

use hmac::{Hmac, Mac as _};
use sha2::Sha256;
use std::fmt;

/// Bytes of every nonce.
pub const NONCE_BYTES: usize = 16;
/// Bytes of every MAC (HMAC-SHA256).
pub const MAC_BYTES: usize = 32;

/// A fresh random nonce.
pub type Nonce = [u8; NONCE_BYTES];
/// An HMAC-SHA256 tag.
pub type Tag = [u8; MAC_BYTES];

/// What a MAC is for: each proof is bound to its purpose, so a tag made for
/// one step can never be replayed as another.
#[derive(Debug, Clone, Copy)]
enum Purpose {
    /// The target proves the token to the initiator.
    ServerProof,
    /// The initiator proves the token (and its identity) to the target.
    ClientProof,
    /// The session key both sides derive.
    Session,
    /// A data connection proves the session key.
    DataHello,
    /// The target's own tag inside the nonces it issues.
    IssuedNonce,
    /// A tool's socket guarded by the token (`Token::answer`).
    ToolChallenge,
}

impl Purpose {
    fn label(self) -> &'static [u8] {
        match self {
            Purpose::ServerProof => b"kvring/2/server-proof",
            Purpose::ClientProof => b"kvring/2/client-proof",
            Purpose::Session => b"kvring/2/session",
            Purpose::DataHello => b"kvring/2/data-hello",
            Purpose::IssuedNonce => b"kvring/2/issued-nonce",
            Purpose::ToolChallenge => b"kvring/2/tool-challenge",
        }
    }
}

/// HMAC-SHA256 under `key` of the purpose's label and each part, every part
/// length-prefixed so that no two lists of parts give the same input.
fn tag(key: &[u8], purpose: Purpose, parts: &[&[u8]]) -> Tag {
    mac_over(key, purpose, parts).finalize().into_bytes().into()
}

fn mac_over(key: &[u8], purpose: Purpose, parts: &[&[u8]]) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256>>::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(purpose.label());
    for part in parts {
        mac.update(&(part.len() as u32).to_le_bytes());
        mac.update(part);
    }
    mac
}

/// Checks `candidate` against the tag in constant time.
fn verify(key: &[u8], purpose: Purpose, parts: &[&[u8]], candidate: &[u8]) -> bool {
    mac_over(key, purpose, parts).verify_slice(candidate).is_ok()
}

/// `N` random bytes from the kernel.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    let mut filled = 0;
    while filled < N {
        // SAFETY: getrandom writes at most `N - filled` bytes into the tail
        // of `bytes`, which has that much room.
        let got = unsafe { libc::getrandom(bytes[filled..].as_mut_ptr().cast(), N - filled, 0) };
        if got > 0 {
            filled += got as usize;
        } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            // getrandom(2) without flags only fails on a kernel without it
            // (before 3.17).
            panic!("getrandom failed: {}", std::io::Error::last_os_error());
        }
    }
    bytes
}

/// A pre-shared token. Never printed, never sent; only MACs made with it
/// travel.
///
/// ```
/// use kvring::Token;
/// let token = Token::new("s3cret");
/// assert_eq!(format!("{token:?}"), "Token(<redacted>)");
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Vec<u8>);

impl Token {
    /// A token from bytes or a string.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Self(bytes.into())
    }

    /// True when no byte was given (an empty token is refused by the
    /// engine's builder: it would protect nothing).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// A fresh random challenge, for tools that guard a socket of their own
    /// with the cluster's token (`kvring serve`'s raw-TCP baseline sink
    /// does): the peer proves the token with [`Token::answer`] without
    /// sending it, and the challenger checks that with
    /// [`Token::check_answer`].
    ///
    /// ```
    /// use kvring::Token;
    /// let token = Token::new("s3cret");
    /// let challenge = Token::challenge();
    /// assert!(token.check_answer(&challenge, &token.answer(&challenge)));
    /// assert!(!Token::new("guess").check_answer(&challenge, &token.answer(&challenge)));
    /// ```
    pub fn challenge() -> [u8; 16] {
        random_bytes()
    }

    /// The answer to a tool's `challenge`: proof of the token, never the
    /// token itself.
    pub fn answer(&self, challenge: &[u8]) -> [u8; MAC_BYTES] {
        tag(&self.0, Purpose::ToolChallenge, &[challenge])
    }

    /// Checks an answer from [`Token::answer`] in constant time.
    pub fn check_answer(&self, challenge: &[u8], answer: &[u8]) -> bool {
        verify(&self.0, Purpose::ToolChallenge, &[challenge], answer)
    }

    /// The target's proof that it holds the token, for the initiator's
    /// nonce `cn`, its own nonce `sn` and its epoch.
    pub(crate) fn server_proof(&self, cn: &Nonce, sn: &Nonce, epoch: u64) -> Tag {
        tag(&self.0, Purpose::ServerProof, &[cn, sn, &epoch.to_le_bytes()])
    }

    /// Checks a target's proof (constant time).
    pub(crate) fn check_server_proof(&self, cn: &Nonce, sn: &Nonce, epoch: u64, proof: &[u8]) -> bool {
        verify(&self.0, Purpose::ServerProof, &[cn, sn, &epoch.to_le_bytes()], proof)
    }

    /// The initiator's proof: the token, its identity (name, epoch and
    /// control address), both nonces, and the control connection as the
    /// initiator saw it (`seen`: the address it dialed and its own end), so
    /// a proof is good for one handshake of one initiator on one connection,
    /// and a relay cannot rewrite what the initiator dialed.
    pub(crate) fn client_proof(&self, cn: &Nonce, sn: &Nonce, epoch: u64, initiator: &Initiator, seen: &Seen) -> Tag {
        let epochs = (epoch.to_le_bytes(), initiator.epoch.to_le_bytes());
        tag(&self.0, Purpose::ClientProof, &client_parts(cn, sn, &epochs, initiator, seen))
    }

    fn check_client_proof(
        &self,
        cn: &Nonce,
        sn: &Nonce,
        epoch: u64,
        initiator: &Initiator,
        seen: &Seen,
        proof: &[u8],
    ) -> bool {
        let epochs = (epoch.to_le_bytes(), initiator.epoch.to_le_bytes());
        verify(&self.0, Purpose::ClientProof, &client_parts(cn, sn, &epochs, initiator, seen), proof)
    }

    /// The session key of handshake (cn, sn) with the target at `epoch`.
    pub(crate) fn session(&self, cn: Nonce, sn: Nonce, epoch: u64) -> Session {
        let key = tag(&self.0, Purpose::Session, &[&cn, &sn, &epoch.to_le_bytes()]);
        Session { client_nonce: cn, server_nonce: sn, key }
    }
}

/// What a client proof covers, in order.
fn client_parts<'a>(
    cn: &'a Nonce,
    sn: &'a Nonce,
    (epoch, initiator_epoch): &'a ([u8; 8], [u8; 8]),
    initiator: &'a Initiator,
    seen: &'a Seen,
) -> [&'a [u8]; 8] {
    [
        cn,
        sn,
        epoch,
        initiator.name.as_bytes(),
        initiator_epoch,
        initiator.addr.as_bytes(),
        seen.dialed.as_bytes(),
        seen.local.as_bytes(),
    ]
}

/// A tokened control connection as its initiator saw it: the address it
/// connected to (resolved, `ip:port`) and its own end of the connection.
/// Both are covered by its proof; the target checks `dialed` against the
/// address it answered on (or advertises), so a relay is caught.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    /// The target's address as the initiator dialed it.
    pub dialed: String,
    /// The initiator's own end of the connection.
    pub local: String,
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// Who an initiator says it is: its segment name and its epoch (a restart
/// is a new identity), proven by its handshake when the target has a token;
/// and where its control plane listens, so a target can probe it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Initiator {
    /// The initiator engine's name.
    pub name: String,
    /// Its epoch.
    pub epoch: u64,
    /// Its control address (`host:port`); empty when unknown.
    pub addr: String,
}

/// What an initiator holds after a tokened handshake: the two nonces that
/// name the session, and the key derived from them.
#[derive(Clone)]
pub struct Session {
    /// The initiator's nonce of the handshake.
    pub client_nonce: Nonce,
    /// The target's nonce of the handshake.
    pub server_nonce: Nonce,
    key: Tag,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session").field("key", &"<redacted>").finish_non_exhaustive()
    }
}

impl Session {
    /// The session key, for what the session seals (`seal.rs`).
    pub(crate) fn key(&self) -> &Tag {
        &self.key
    }

    /// A data connection's proof: the session key over the nonce the target
    /// sent on that connection.
    pub fn data_proof(&self, data_nonce: &Nonce, epoch: u64) -> Tag {
        tag(&self.key, Purpose::DataHello, &[data_nonce, &epoch.to_le_bytes()])
    }
}

/// The target side: the token, this start's epoch, and a secret drawn at
/// start that tags the nonces it issues.
pub(crate) struct Authenticator {
    token: Token,
    epoch: u64,
    secret: [u8; 32],
    /// The initiator each handshake of this start proved (its engine's
    /// name), by (cn, sn): what a data connection proving that session is
    /// counted as, for arrival grants keyed by sender. Bounded: the oldest
    /// are forgotten past [`MAX_PROVEN_SENDERS`].
    senders: std::sync::Mutex<ProvenSenders>,
}

/// Handshakes whose proven initiator an engine remembers.
pub const MAX_PROVEN_SENDERS: usize = 4096;

#[derive(Default)]
struct ProvenSenders {
    by_session: std::collections::HashMap<(Nonce, Nonce), std::sync::Arc<str>>,
    order: std::collections::VecDeque<(Nonce, Nonce)>,
}

impl fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Authenticator").field("epoch", &format_args!("{:#x}", self.epoch)).finish_non_exhaustive()
    }
}

impl Authenticator {
    /// The target side of `token` for the engine start `epoch`.
    pub(crate) fn new(token: Token, epoch: u64) -> Self {
        Self { token, epoch, secret: random_bytes(), senders: Default::default() }
    }

    /// Records that handshake (cn, sn) proved `initiator` (called once its
    /// proof checked).
    pub(crate) fn remember_sender(&self, cn: &Nonce, sn: &Nonce, initiator: &str) {
        let mut senders = self.senders.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if senders.by_session.insert((*cn, *sn), initiator.into()).is_none() {
            senders.order.push_back((*cn, *sn));
        }
        while senders.order.len() > MAX_PROVEN_SENDERS {
            if let Some(oldest) = senders.order.pop_front() {
                senders.by_session.remove(&oldest);
            }
        }
    }

    /// The initiator handshake (cn, sn) proved, if this start remembers it.
    pub(crate) fn sender_of(&self, cn: &Nonce, sn: &Nonce) -> Option<std::sync::Arc<str>> {
        let senders = self.senders.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        senders.by_session.get(&(*cn, *sn)).cloned()
    }

    /// A challenge for an initiator's nonce: the target's nonce (eight
    /// random bytes and eight of a tag under this start's secret) and its
    /// proof of the token.
    pub(crate) fn challenge(&self, cn: &Nonce) -> (Nonce, Tag) {
        let random: [u8; 8] = random_bytes();
        let sn = self.issued_nonce(cn, random);
        (sn, self.token.server_proof(cn, &sn, self.epoch))
    }

    fn issued_nonce(&self, cn: &Nonce, random: [u8; 8]) -> Nonce {
        let check = tag(&self.secret, Purpose::IssuedNonce, &[cn, &random]);
        let mut sn = [0u8; NONCE_BYTES];
        sn[..8].copy_from_slice(&random);
        sn[8..].copy_from_slice(&check[..8]);
        sn
    }

    /// True when `sn` is a nonce this start issued for `cn`. The tag is
    /// compared in constant time.
    fn issued(&self, cn: &Nonce, sn: &Nonce) -> bool {
        let random: [u8; 8] = sn[..8].try_into().expect("8 bytes");
        let expected = self.issued_nonce(cn, random);
        expected.iter().zip(sn).fold(0u8, |diff, (a, b)| diff | (a ^ b)) == 0
    }

    /// Checks an initiator's proof for a challenge this start issued.
    pub(crate) fn check_client(
        &self,
        cn: &Nonce,
        sn: &Nonce,
        initiator: &Initiator,
        seen: &Seen,
        proof: &[u8],
    ) -> bool {
        self.issued(cn, sn) && self.token.check_client_proof(cn, sn, self.epoch, initiator, seen, proof)
    }

    /// The session of handshake (cn, sn), when this start issued it: what
    /// a data listener proves itself with, and derives its frame keys from.
    pub(crate) fn session_for(&self, cn: &Nonce, sn: &Nonce) -> Option<Session> {
        self.issued(cn, sn).then(|| self.token.session(*cn, *sn, self.epoch))
    }

    /// Checks a data connection's proof: it names a handshake this start
    /// issued, and MACs this connection's nonce with that handshake's key.
    pub(crate) fn check_data(&self, cn: &Nonce, sn: &Nonce, data_nonce: &Nonce, proof: &[u8]) -> bool {
        if !self.issued(cn, sn) {
            return false;
        }
        let session = self.token.session(*cn, *sn, self.epoch);
        verify(&session.key, Purpose::DataHello, &[data_nonce, &self.epoch.to_le_bytes()], proof)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn initiator() -> Initiator {
        Initiator { name: "prefill-0".into(), epoch: 7, addr: String::new() }
    }

    fn seen() -> Seen {
        Seen { dialed: "10.0.0.2:7000".into(), local: "10.0.0.1:40000".into() }
    }

    #[test]
    fn a_full_handshake_and_a_data_hello_check_out() {
        let token = Token::new("s3cret");
        let target = Authenticator::new(token.clone(), 42);
        let cn: Nonce = random_bytes();
        let (sn, server_proof) = target.challenge(&cn);
        assert!(token.check_server_proof(&cn, &sn, 42, &server_proof));
        let proof = token.client_proof(&cn, &sn, 42, &initiator(), &seen());
        assert!(target.check_client(&cn, &sn, &initiator(), &seen(), &proof));
        let session = token.session(cn, sn, 42);
        let data_nonce: Nonce = random_bytes();
        assert!(target.check_data(&cn, &sn, &data_nonce, &session.data_proof(&data_nonce, 42)));
    }

    #[test]
    fn every_forgery_is_refused() {
        let token = Token::new("s3cret");
        let target = Authenticator::new(token.clone(), 42);
        let cn: Nonce = random_bytes();
        let (sn, server_proof) = target.challenge(&cn);
        // Another token cannot prove itself either way.
        let guess = Token::new("guess");
        assert!(!guess.check_server_proof(&cn, &sn, 42, &server_proof));
        let guessed = guess.client_proof(&cn, &sn, 42, &initiator(), &seen());
        assert!(!target.check_client(&cn, &sn, &initiator(), &seen(), &guessed));
        // A proof is bound to the identity it was made for, and to the
        // connection as its initiator saw it.
        let proof = token.client_proof(&cn, &sn, 42, &initiator(), &seen());
        let other = Initiator { name: "prefill-1".into(), ..initiator() };
        assert!(!target.check_client(&cn, &sn, &other, &seen(), &proof));
        let restarted = Initiator { epoch: 8, ..initiator() };
        assert!(!target.check_client(&cn, &sn, &restarted, &seen(), &proof));
        let moved = Initiator { addr: "10.0.0.9:7000".into(), ..initiator() };
        assert!(!target.check_client(&cn, &sn, &moved, &seen(), &proof));
        let relayed = Seen { dialed: "10.6.6.6:7000".into(), ..seen() };
        assert!(!target.check_client(&cn, &sn, &initiator(), &relayed, &proof));
        // A nonce the target never issued (even with a right proof for it).
        let mut made_up = sn;
        made_up[0] ^= 1;
        let forged = token.client_proof(&cn, &made_up, 42, &initiator(), &seen());
        assert!(!target.check_client(&cn, &made_up, &initiator(), &seen(), &forged));
        assert!(target.session_for(&cn, &made_up).is_none());
        // Purposes do not mix: a server proof is no client proof.
        assert!(!target.check_client(&cn, &sn, &initiator(), &seen(), &server_proof));
        // A session of another start (another secret and epoch) is refused.
        let restarted_target = Authenticator::new(token.clone(), 43);
        let session = token.session(cn, sn, 42);
        let data_nonce: Nonce = random_bytes();
        assert!(!restarted_target.check_data(&cn, &sn, &data_nonce, &session.data_proof(&data_nonce, 42)));
        // A data proof for one connection's nonce does not open another.
        let other_nonce: Nonce = random_bytes();
        assert!(!target.check_data(&cn, &sn, &other_nonce, &session.data_proof(&data_nonce, 42)));
        assert!(!target.check_data(&cn, &sn, &data_nonce, &[0u8; 5]));
    }

    #[test]
    fn tokens_and_sessions_are_never_printed() {
        let token = Token::new("s3cret");
        assert_eq!(format!("{token:?}"), "Token(<redacted>)");
        let session = token.session([1; 16], [2; 16], 3);
        assert!(!format!("{session:?}").contains(&format!("{:?}", session.key)));
    }
}

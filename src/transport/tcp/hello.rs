//! How a tcp data connection opens, before any frame is served.
//!
//! 1. The initiator sends a [`ClientHello`]: magic, version, the target's
//!    epoch as it knows it, the session it holds (the nonces of its
//!    tokened handshake; zeros without one), and a fresh nonce of its own.
//! 2. The target answers a [`ServerHello`]: magic, version, a status (0,
//!    `PEER_RESTARTED` for another epoch, `BUSY` when its admission policy
//!    refuses the connection, `UNAUTHORIZED` for a session it never
//!    issued), its epoch, a fresh nonce, and whether it requires proof.
//!    With a token it proves the session first: a MAC under the session key
//!    over both nonces, which a tokened initiator checks, refusing a
//!    listener that asks no proof or proves nothing (a relay's tap).
//! 3. With a token, the initiator sends a [`ClientProof`]: the session key's
//!    MAC over the target's nonce; the target answers a second
//!    [`ServerHello`] whose status says whether the proof holds
//!    (`UNAUTHORIZED` otherwise). Only then is any frame read, and from
//!    then on every frame header each way is numbered and MAC'd under a key
//!    of this connection alone (`FrameSeal`, from the session and both
//!    nonces).
//!
//! All three are fixed zerocopy structs; the target's decoding of them is
//! fuzzed with the rest of its connection loop.

use crate::auth::{Nonce, Tag, MAC_BYTES, NONCE_BYTES};
use crate::error::{Error, Result};
use crate::proto::ErrorCode;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// "KVTH": a data connection's hellos.
pub const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"KVTH");
/// Version of the data protocol (hellos and frames); 3 adds the
/// listener's proof and sealed frame headers; 4 carries 64-bit region ids
/// in frames (a version 3 peer is refused at the hello, not misread); 5
/// checksums READs (frame version 4), and refuses a version 4 peer, which
/// would ignore a READ's checksum flag and a WRITE's, at the hello.
pub const DATA_VERSION: u8 = 5;
/// `ServerHello::flags`: the target requires a [`ClientProof`].
pub const FLAG_PROOF_REQUIRED: u8 = 1;

/// The initiator's opening.
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct ClientHello {
    /// [`HELLO_MAGIC`].
    pub magic: u32,
    /// [`DATA_VERSION`].
    pub version: u8,
    /// Reserved, zero.
    pub reserved: [u8; 3],
    /// The target's epoch as the initiator knows it.
    pub epoch: u64,
    /// The session's client nonce (zeros without a session).
    pub client_nonce: Nonce,
    /// The session's server nonce (zeros without a session).
    pub server_nonce: Nonce,
    /// A fresh nonce of this connection, for the listener's proof and the
    /// connection's frame key.
    pub nonce: Nonce,
}

/// The target's answer (twice with a token: once with the nonce to prove,
/// once with the verdict).
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct ServerHello {
    /// [`HELLO_MAGIC`].
    pub magic: u32,
    /// [`DATA_VERSION`].
    pub version: u8,
    /// [`FLAG_PROOF_REQUIRED`] or 0.
    pub flags: u8,
    /// Reserved, zero.
    pub reserved: [u8; 2],
    /// 0, or the negated wire code of why the connection is refused.
    pub status: i32,
    /// Reserved, zero.
    pub reserved2: u32,
    /// The target's epoch.
    pub epoch: u64,
    /// A fresh nonce to prove the session over.
    pub nonce: Nonce,
    /// With [`FLAG_PROOF_REQUIRED`]: the listener's own proof of the
    /// session, over both connection nonces and its epoch; zero otherwise.
    pub proof: Tag,
}

/// The initiator's proof of its session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct ClientProof {
    /// [`HELLO_MAGIC`].
    pub magic: u32,
    /// Reserved, zero.
    pub reserved: u32,
    /// HMAC-SHA256 under the session key over the nonce and the epoch.
    pub mac: Tag,
}

const _: () = assert!(std::mem::size_of::<ClientHello>() == 64);
const _: () = assert!(std::mem::size_of::<ServerHello>() == 72);
const _: () = assert!(std::mem::size_of::<ClientProof>() == 8 + MAC_BYTES);
const _: () = assert!(NONCE_BYTES == 16);

/// Bytes of a [`ClientHello`].
pub const CLIENT_HELLO_BYTES: usize = std::mem::size_of::<ClientHello>();
/// Bytes of a [`ServerHello`].
pub const SERVER_HELLO_BYTES: usize = std::mem::size_of::<ServerHello>();
/// Bytes of a [`ClientProof`].
pub const CLIENT_PROOF_BYTES: usize = std::mem::size_of::<ClientProof>();

impl ClientHello {
    /// The opening for a target at `epoch`, with the session's nonces and
    /// this connection's own.
    pub fn new(epoch: u64, client_nonce: Nonce, server_nonce: Nonce, nonce: Nonce) -> Self {
        Self { magic: HELLO_MAGIC, version: DATA_VERSION, reserved: [0; 3], epoch, client_nonce, server_nonce, nonce }
    }

    /// What is wrong with a hello from its first bytes, before it is
    /// whole: not the magic, or another version. A stranger, or a peer of
    /// an older version (whose hello is shorter), is told so at once
    /// rather than waited on.
    pub fn early_refusal(bytes: &[u8]) -> Option<Error> {
        if bytes.len() >= 4 && bytes[..4] != HELLO_MAGIC.to_le_bytes() {
            let magic = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"));
            return Some(Error::malformed("data hello", format!("bad magic {magic:#010x}")));
        }
        other_version(bytes)
    }

    /// Decodes and checks an opening from outside (magic, version).
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let hello = Self::read_from_bytes(bytes)
            .map_err(|_| Error::malformed("data hello", format!("needs {CLIENT_HELLO_BYTES} bytes")))?;
        check_magic(hello.magic, hello.version)?;
        Ok(hello)
    }
}

impl ServerHello {
    /// An answer with `status` (0 or a refusal's code).
    pub fn new(status: i32, flags: u8, epoch: u64, nonce: Nonce) -> Self {
        Self {
            magic: HELLO_MAGIC,
            version: DATA_VERSION,
            flags,
            reserved: [0; 2],
            status,
            reserved2: 0,
            epoch,
            nonce,
            proof: [0; MAC_BYTES],
        }
    }

    /// A refusal carrying `error`'s code.
    pub fn refusal(error: &Error, epoch: u64) -> Self {
        Self::new(-(error.code() as i32), 0, epoch, [0; NONCE_BYTES])
    }

    /// Decodes an answer (the initiator's side): what is not a kvring
    /// target's answer is named as such.
    pub fn decode(bytes: &[u8], peer: &str) -> Result<Self> {
        if let Some(error) = other_version(bytes) {
            return Err(error);
        }
        let hello = Self::read_from_bytes(bytes).map_err(|_| Error::not_kvring(peer, bytes))?;
        if hello.magic != HELLO_MAGIC {
            return Err(Error::not_kvring(peer, bytes));
        }
        check_magic(hello.magic, hello.version)?;
        Ok(hello)
    }

    /// The refusal in `status`, as an error for the initiator.
    pub fn refused(&self, peer: &str) -> Option<Error> {
        if self.status == 0 {
            return None;
        }
        let code = crate::error::code_of_status(self.status);
        Some(match code {
            ErrorCode::PeerRestarted => Error::PeerRestarted {
                segment: peer.to_string(),
                detail: format!("its data listener serves epoch {:#x} now", self.epoch),
            },
            ErrorCode::Unauthorized => {
                Error::Unauthorized { reason: format!("{peer}'s data listener refused this engine's session proof") }
            }
            code => Error::Remote { code, message: format!("{peer}'s data listener refused the connection") },
        })
    }
}

impl ClientProof {
    /// A proof carrying `mac`.
    pub fn new(mac: Tag) -> Self {
        Self { magic: HELLO_MAGIC, reserved: 0, mac }
    }

    /// Decodes a proof from outside.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let proof = Self::read_from_bytes(bytes)
            .map_err(|_| Error::malformed("data proof", format!("needs {CLIENT_PROOF_BYTES} bytes")))?;
        if proof.magic != HELLO_MAGIC {
            return Err(Error::malformed("data proof", format!("bad magic {:#010x}", proof.magic)));
        }
        Ok(proof)
    }
}

/// `VersionMismatch` when `bytes` start with the hello magic and another
/// version byte.
fn other_version(bytes: &[u8]) -> Option<Error> {
    let version = *bytes.get(4)?;
    (bytes[..4] == HELLO_MAGIC.to_le_bytes() && version != DATA_VERSION)
        .then(|| Error::VersionMismatch { got: version.into(), supported: DATA_VERSION.into() })
}

fn check_magic(magic: u32, version: u8) -> Result<()> {
    if magic != HELLO_MAGIC {
        return Err(Error::malformed("data hello", format!("bad magic {magic:#010x}")));
    }
    if version != DATA_VERSION {
        return Err(Error::VersionMismatch { got: version.into(), supported: DATA_VERSION.into() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hellos_round_trip_and_strangers_are_named() {
        let hello = ClientHello::new(7, [1; 16], [2; 16], [4; 16]);
        assert_eq!(ClientHello::decode(hello.as_bytes()).unwrap(), hello);
        let mut old = hello;
        old.version = 1;
        assert!(matches!(ClientHello::decode(old.as_bytes()), Err(Error::VersionMismatch { got: 1, .. })));
        // A version-2 peer's shorter hello or answer is named by its version.
        assert!(matches!(
            ClientHello::early_refusal(&old.as_bytes()[..5]),
            Some(Error::VersionMismatch { got: 1, .. })
        ));
        assert!(ClientHello::early_refusal(&hello.as_bytes()[..5]).is_none());
        assert!(matches!(ClientHello::early_refusal(b"GET "), Some(Error::Malformed { .. })));
        assert!(ClientHello::early_refusal(b"KV").is_none());
        let mut old_answer = ServerHello::new(0, 0, 7, [3; 16]);
        old_answer.version = 3;
        let error = ServerHello::decode(&old_answer.as_bytes()[..40], "p").unwrap_err();
        assert!(matches!(error, Error::VersionMismatch { got: 3, supported: 5 }), "a 32-bit id peer: {error}");
        let mut unchecked = ServerHello::new(0, 0, 7, [3; 16]);
        unchecked.version = 4;
        let error = ServerHello::decode(unchecked.as_bytes(), "p").unwrap_err();
        assert!(matches!(error, Error::VersionMismatch { got: 4, supported: 5 }), "a peer without READ sums: {error}");
        unchecked.version = DATA_VERSION;
        assert!(ServerHello::decode(unchecked.as_bytes(), "p").is_ok());
        assert!(ClientHello::decode(&[0; 10]).is_err());

        let answer = ServerHello::new(0, FLAG_PROOF_REQUIRED, 7, [3; 16]);
        assert_eq!(ServerHello::decode(answer.as_bytes(), "p").unwrap(), answer);
        let http = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\nxxxxxxxxxxxxxxx";
        let error = ServerHello::decode(&http[..SERVER_HELLO_BYTES], "10.0.0.2:7001").unwrap_err().to_string();
        assert!(error.contains("10.0.0.2:7001 is not a kvring peer") && error.contains("HTTP/1.1 400"), "{error}");

        let busy = ServerHello::refusal(&Error::Busy { queue: "connection table", capacity: 1 }, 7);
        assert!(matches!(busy.refused("p"), Some(Error::Remote { code: ErrorCode::Busy, .. })));
        let restarted = ServerHello::refusal(&Error::PeerRestarted { segment: "x".into(), detail: "y".into() }, 9);
        assert!(matches!(restarted.refused("p"), Some(Error::PeerRestarted { .. })));
        let denied = ServerHello::refusal(&Error::Unauthorized { reason: "x".into() }, 9);
        assert!(matches!(denied.refused("p"), Some(Error::Unauthorized { .. })));
        assert!(answer.refused("p").is_none());

        let proof = ClientProof::new([5; 32]);
        assert_eq!(ClientProof::decode(proof.as_bytes()).unwrap(), proof);
        assert!(ClientProof::decode(&[0; CLIENT_PROOF_BYTES]).is_err());
    }
}

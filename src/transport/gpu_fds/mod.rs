//! The socket on which an engine passes the descriptors of its GPU regions
//! to a same-host peer (`cuda_ipc`): only the exporting process hands out
//! its device memory, and only to a peer that proved the session.
//!
//! The exporter serves an abstract Unix socket (unix(7); named after its
//! process's instance id and its epoch, advertised in its descriptor, which
//! a tokened session seals). An opener connects and checks the server's
//! `SO_PEERCRED` pid against the descriptor's pid, which the handshake bound
//! to the process that answered it (`transport::cma::owner`). With a token,
//! the server proves the session first, over both connection nonces, and
//! the opener then proves it too (`seal::gpu_fds_proof`); a server that asks
//! no proof is refused by a tokened opener. Then the opener asks, region by
//! region, for a run of its handles' descriptors, and each answer carries at
//! most [`MAX_FDS_PER_MESSAGE`] of them (`SCM_RIGHTS`). The server makes
//! each descriptor when asked ([`Gpu::share`](crate::gpu::Gpu::share)) for a
//! region registered with a remote right, and closes its copy once sent; the
//! opener imports each and closes it at once. Nobody holds thousands of
//! descriptors, and no opener takes a descriptor out of another process.
//!
//! A region of FABRIC-only memory (GPU-REVIEW #16) is answered the same way
//! with its allocations' `CUmemFabricHandle`s instead: at most
//! [`MAX_FABRIC_PER_MESSAGE`] of 64 bytes each after the answer, and no
//! descriptor. They never travel in the segment descriptor: any process on
//! the exporter's IMEX channel that holds them can import the memory, so
//! they are passed, as descriptors are, only after the same proofs and
//! `SO_PEERCRED` check.
//!
//! A Unix socket cannot be spliced into by a third party, so the proofs at
//! its start cover the whole connection. Without a token, any process that
//! reaches the socket (this host's network namespace) may ask for the
//! descriptors, as it may read and write the engine's memory over tcp.

pub(crate) mod client;
pub(crate) mod server;

use crate::auth::{Nonce, Tag, MAC_BYTES, NONCE_BYTES};
pub(crate) use crate::gpu::fd::{socket_name as name, MAX_FDS_PER_MESSAGE};
use crate::gpu::FABRIC_HANDLE_BYTES;

/// Most fabric handles one answer carries (4 KiB of them).
pub(crate) const MAX_FABRIC_PER_MESSAGE: usize = 64;

/// Longest refusal a server sends.
pub(crate) const MAX_REFUSAL_BYTES: usize = 512;

/// The opener's first message: the session it belongs to (both handshake
/// nonces; zeros without a token) and its nonce for this connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub cn: Nonce,
    pub sn: Nonce,
    pub nonce: Nonce,
}

const HELLO_MAGIC: [u8; 4] = *b"KVF1";
/// Bytes of a [`Hello`].
pub(crate) const HELLO_BYTES: usize = 4 + 3 * NONCE_BYTES;

impl Hello {
    pub(crate) fn encode(&self) -> [u8; HELLO_BYTES] {
        let mut out = [0u8; HELLO_BYTES];
        out[..4].copy_from_slice(&HELLO_MAGIC);
        out[4..20].copy_from_slice(&self.cn);
        out[20..36].copy_from_slice(&self.sn);
        out[36..52].copy_from_slice(&self.nonce);
        out
    }

    pub(crate) fn decode(bytes: &[u8; HELLO_BYTES]) -> Result<Self, String> {
        if bytes[..4] != HELLO_MAGIC {
            return Err("not a kvring GPU descriptor hello".into());
        }
        let nonce = |at: usize| -> Nonce { bytes[at..at + NONCE_BYTES].try_into().expect("16 bytes") };
        Ok(Hello { cn: nonce(4), sn: nonce(20), nonce: nonce(36) })
    }
}

/// The server's answer to a [`Hello`]: whether it requires a proof, its
/// nonce for this connection, and its own proof of the session (zeros
/// without a token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Challenge {
    pub proof_required: bool,
    pub nonce: Nonce,
    pub proof: Tag,
}

const CHALLENGE_MAGIC: [u8; 4] = *b"KVF2";
/// Bytes of a [`Challenge`].
pub(crate) const CHALLENGE_BYTES: usize = 8 + NONCE_BYTES + MAC_BYTES;

impl Challenge {
    pub(crate) fn encode(&self) -> [u8; CHALLENGE_BYTES] {
        let mut out = [0u8; CHALLENGE_BYTES];
        out[..4].copy_from_slice(&CHALLENGE_MAGIC);
        out[4..8].copy_from_slice(&u32::from(self.proof_required).to_le_bytes());
        out[8..24].copy_from_slice(&self.nonce);
        out[24..].copy_from_slice(&self.proof);
        out
    }

    pub(crate) fn decode(bytes: &[u8; CHALLENGE_BYTES]) -> Result<Self, String> {
        if bytes[..4] != CHALLENGE_MAGIC {
            return Err("not a kvring GPU descriptor server".into());
        }
        let proof_required = match u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes")) {
            0 => false,
            1 => true,
            other => return Err(format!("unknown challenge flags {other:#x}")),
        };
        Ok(Challenge {
            proof_required,
            nonce: bytes[8..24].try_into().expect("16 bytes"),
            proof: bytes[24..].try_into().expect("32 bytes"),
        })
    }
}

/// A request for the descriptors of handles `first..first + count` of
/// region `region` (its raw id), or (`first` [`FENCE_TABLE`]) for its
/// fence table page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Request {
    pub region: u64,
    pub first: u32,
    pub count: u32,
    /// The opener takes FABRIC answers ("KVF7"); a "KVF6" opener does not,
    /// and is refused a FABRIC region by name (it is served descriptors).
    pub takes_fabric: bool,
}

/// The `first` of a [`Request`] for a region's fence table page (one
/// descriptor, `mem::fence_file`) instead of its handles'; its answer's
/// `handles` says the same.
pub(crate) const FENCE_TABLE: u32 = u32::MAX;

/// "KVF7": the opener takes FABRIC answers ([`Answer::Fabric`]; "KVF6"
/// openers did not). Since "KVF6", a region's fence table page carries the
/// `issued` word (`mem::fence`) that writers check ("KVF5" pages did not;
/// "KVF3" carried a 32-bit region id).
const REQUEST_MAGIC: [u8; 4] = *b"KVF7";
/// The older request served too: the same bytes as "KVF7" from an opener
/// that takes no FABRIC answers, so a fleet upgraded one engine at a time
/// keeps opening descriptor-exported regions both ways.
const FABRICLESS_REQUEST_MAGIC: [u8; 4] = *b"KVF6";
/// Bytes of a [`Request`]: the magic, the region (8), first and count.
pub(crate) const REQUEST_BYTES: usize = 20;
/// Bytes of an [`Answer`].
pub(crate) const ANSWER_BYTES: usize = 16;

/// The reason to give a request whose magic is another version of this
/// one ("KVF" and another letter): it names both versions. `None` for the
/// current magic and for bytes that are no kvring request at all.
pub(crate) fn old_request_version(magic: &[u8]) -> Option<String> {
    let served = magic == REQUEST_MAGIC || magic == FABRICLESS_REQUEST_MAGIC;
    (magic.len() == 4 && magic[..3] == REQUEST_MAGIC[..3] && !served).then(|| {
        format!(
            "a {} GPU descriptor request; this engine serves {} and {} only (update the opener's kvring)",
            String::from_utf8_lossy(magic).escape_debug(),
            String::from_utf8_lossy(&FABRICLESS_REQUEST_MAGIC),
            String::from_utf8_lossy(&REQUEST_MAGIC)
        )
    })
}

impl Request {
    pub(crate) fn encode(&self) -> [u8; REQUEST_BYTES] {
        let mut out = [0u8; REQUEST_BYTES];
        out[..4].copy_from_slice(if self.takes_fabric { &REQUEST_MAGIC } else { &FABRICLESS_REQUEST_MAGIC });
        out[4..12].copy_from_slice(&self.region.to_le_bytes());
        out[12..16].copy_from_slice(&self.first.to_le_bytes());
        out[16..].copy_from_slice(&self.count.to_le_bytes());
        out
    }

    pub(crate) fn decode(bytes: &[u8; REQUEST_BYTES]) -> Result<Self, String> {
        let takes_fabric = match bytes[..4].try_into().expect("4 bytes") {
            REQUEST_MAGIC => true,
            FABRICLESS_REQUEST_MAGIC => false,
            _ => return Err("not a kvring GPU descriptor request".into()),
        };
        let word = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        let region = u64::from_le_bytes(bytes[4..12].try_into().expect("8 bytes"));
        Ok(Request { region, first: word(12), count: word(16), takes_fabric })
    }
}

/// The server's answer to a [`Request`]: `count` descriptors attached, of
/// the region's `handles`; `count` fabric handles of 64 bytes following it
/// (and no descriptor); or a refusal whose `len`-byte reason follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    Descriptors { count: u32, handles: u32 },
    Refused { len: u32 },
    Fabric { count: u32, handles: u32 },
}

const ANSWER_MAGIC: [u8; 4] = *b"KVF4";

impl Answer {
    pub(crate) fn encode(&self) -> [u8; ANSWER_BYTES] {
        match *self {
            Answer::Descriptors { count, handles } => words(ANSWER_MAGIC, [0, count, handles]),
            Answer::Refused { len } => words(ANSWER_MAGIC, [1, len, 0]),
            Answer::Fabric { count, handles } => words(ANSWER_MAGIC, [2, count, handles]),
        }
    }

    pub(crate) fn decode(bytes: &[u8; ANSWER_BYTES]) -> Result<Self, String> {
        match unwords(ANSWER_MAGIC, bytes).ok_or("not a kvring GPU descriptor answer")? {
            [0, count, handles] if count as usize <= MAX_FDS_PER_MESSAGE => Ok(Answer::Descriptors { count, handles }),
            [1, len, 0] if len as usize <= MAX_REFUSAL_BYTES => Ok(Answer::Refused { len }),
            [2, count, handles] if (1..=MAX_FABRIC_PER_MESSAGE).contains(&(count as usize)) => {
                Ok(Answer::Fabric { count, handles })
            }
            [2, count, _] => {
                Err(format!("an answer of {count} FABRIC handles (1 to {MAX_FABRIC_PER_MESSAGE} travel in one)"))
            }
            other => Err(format!("a malformed answer {other:?}")),
        }
    }
}

/// The `count` fabric handles (already bounded by [`Answer::decode`]) that
/// follow an [`Answer::Fabric`], read whole from `from`.
pub(crate) fn read_fabric(
    from: &mut impl std::io::Read,
    count: u32,
) -> std::io::Result<Vec<[u8; FABRIC_HANDLE_BYTES]>> {
    let count = (count as usize).min(MAX_FABRIC_PER_MESSAGE);
    let mut handles = vec![[0u8; FABRIC_HANDLE_BYTES]; count];
    for handle in &mut handles {
        from.read_exact(handle)?;
    }
    Ok(handles)
}

fn words(magic: [u8; 4], values: [u32; 3]) -> [u8; ANSWER_BYTES] {
    let mut out = [0u8; ANSWER_BYTES];
    out[..4].copy_from_slice(&magic);
    for (i, v) in values.iter().enumerate() {
        out[4 + 4 * i..8 + 4 * i].copy_from_slice(&v.to_le_bytes());
    }
    out
}

fn unwords(magic: [u8; 4], bytes: &[u8; ANSWER_BYTES]) -> Option<[u32; 3]> {
    (bytes[..4] == magic)
        .then(|| std::array::from_fn(|i| u32::from_le_bytes(bytes[4 + 4 * i..8 + 4 * i].try_into().expect("4 bytes"))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::fd::check_socket_name as check_name;

    #[test]
    fn every_message_round_trips_and_strangers_bytes_are_refused() {
        let hello = Hello { cn: [1; 16], sn: [2; 16], nonce: [3; 16] };
        assert_eq!(Hello::decode(&hello.encode()), Ok(hello));
        assert!(Hello::decode(&[0; HELLO_BYTES]).is_err());
        let challenge = Challenge { proof_required: true, nonce: [4; 16], proof: [5; 32] };
        assert_eq!(Challenge::decode(&challenge.encode()), Ok(challenge));
        let mut odd = challenge.encode();
        odd[4] = 2;
        assert!(Challenge::decode(&odd).unwrap_err().contains("flags"));
        let request = Request { region: 1 << 40 | 7, first: 64, count: 64, takes_fabric: true };
        assert_eq!(Request::decode(&request.encode()), Ok(request));
        assert_eq!(&request.encode()[..4], b"KVF7");
        // A "KVF6" opener's request: the same bytes, no FABRIC answers.
        let fabricless = Request { takes_fabric: false, ..request };
        assert_eq!(&fabricless.encode()[..4], b"KVF6");
        assert_eq!(Request::decode(&fabricless.encode()), Ok(fabricless));
        assert!(old_request_version(b"KVF3").unwrap().contains("a KVF3 GPU descriptor request"));
        let old = old_request_version(b"KVF5").expect("its pages lack the issued word");
        assert!(old.contains("a KVF5 GPU descriptor request") && old.contains("KVF6 and KVF7 only"), "{old}");
        assert_eq!(old_request_version(b"KVF6"), None);
        assert_eq!(old_request_version(b"KVF7"), None);
        assert_eq!(old_request_version(b"GET "), None);
        let mut answer = [0u8; REQUEST_BYTES];
        answer[..ANSWER_BYTES].copy_from_slice(&Answer::Refused { len: 1 }.encode());
        assert!(Request::decode(&answer).is_err(), "an answer is no request");
        let mut old = request.encode();
        old[..4].copy_from_slice(b"KVF3");
        assert!(Request::decode(&old).is_err(), "a 32-bit id request is refused, not misread");
        let fabric = Answer::Fabric { count: MAX_FABRIC_PER_MESSAGE as u32, handles: 2048 };
        for answer in [Answer::Descriptors { count: 64, handles: 2048 }, Answer::Refused { len: 12 }, fabric] {
            assert_eq!(Answer::decode(&answer.encode()), Ok(answer));
        }
        let too_many = Answer::Descriptors { count: MAX_FDS_PER_MESSAGE as u32 + 1, handles: 1 };
        assert!(Answer::decode(&too_many.encode()).is_err());
        assert!(Answer::decode(&Answer::Refused { len: MAX_REFUSAL_BYTES as u32 + 1 }.encode()).is_err());
    }

    #[test]
    fn a_fabric_answer_claiming_too_many_or_no_handles_is_refused_before_anything_is_read() {
        for count in [0, MAX_FABRIC_PER_MESSAGE as u32 + 1, u32::MAX] {
            let error = Answer::decode(&Answer::Fabric { count, handles: 1 }.encode()).unwrap_err();
            assert!(error.contains(&format!("an answer of {count} FABRIC handles")), "{error}");
        }
        // The handles that follow are read whole: a short payload is an
        // error, and no more than the stated count is taken.
        let payload: Vec<u8> = (0..3 * FABRIC_HANDLE_BYTES).map(|i| i as u8).collect();
        let handles = read_fabric(&mut &payload[..], 2).unwrap();
        assert_eq!(handles.len(), 2);
        assert_eq!(handles[1][..], payload[FABRIC_HANDLE_BYTES..2 * FABRIC_HANDLE_BYTES]);
        let short = &payload[..2 * FABRIC_HANDLE_BYTES - 1];
        assert_eq!(read_fabric(&mut &short[..], 2).unwrap_err().kind(), std::io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn only_names_kvring_makes_are_dialed() {
        let made = name(0xabc, 7);
        assert_eq!(check_name(&made), Ok(made.clone()));
        for bad in ["", "kvring-gpu-fds-", "other", "kvring-gpu-fds-0000000000000abc-xyz", "/tmp/sock"] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }
}

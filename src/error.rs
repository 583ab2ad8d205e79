//! One error type for the whole crate, and its one mapping to wire codes.
//!
//! Every variant names what went wrong with the values a user needs to act on
//! (region ids, offsets, lengths, limits); every `Display` message is tested
//! below. Bad input from a caller or a peer always ends here, never in a panic.

mod code;

use crate::proto::ErrorCode;
use crate::region_id::RegionId;
pub(crate) use code::code_of_status;
use std::fmt;
use std::time::Duration;

/// Which side of a block descriptor an error concerns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The initiator's own region.
    Local,
    /// The peer's region.
    Remote,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// Everything that can go wrong in kvring.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A caller passed a value that can never be valid.
    #[error("invalid {what}: {reason}")]
    InvalidArgument {
        /// The argument.
        what: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// A region that would overlap one already registered.
    #[error("range {addr:#x}+{len} overlaps registered region {existing} ({existing_addr:#x}+{existing_len}); unregister it first or register the same range exactly")]
    RegionOverlap {
        /// Start address of the new range.
        addr: usize,
        /// Length of the new range.
        len: usize,
        /// The registered region it overlaps.
        existing: RegionId,
        /// Start address of that region.
        existing_addr: usize,
        /// Length of that region.
        existing_len: usize,
    },
    /// The same range registered again with different information.
    #[error("range is already registered as region {existing} with different kind, layer, block size or access")]
    RegionInfoMismatch {
        /// The region already registered on that range.
        existing: RegionId,
    },
    /// Unregistering a region while transfers still use it.
    #[error("region {region} has {in_flight} batch(es) in flight; wait for them before unregistering")]
    RegionBusy {
        /// The region.
        region: RegionId,
        /// Batches still holding it.
        in_flight: u32,
    },
    /// A write named a grant older than the latest fence of its
    /// destination (the range was fenced again and handed to another
    /// writer): nothing of it landed there (`Engine::fence`).
    #[error(
        "region {region} was fenced after grant {grant}: the destination belongs to a newer grant, nothing was written"
    )]
    Fenced {
        /// The destination region.
        region: RegionId,
        /// The grant the write named.
        grant: u32,
    },
    /// A region id that names no registered region (never registered,
    /// unregistered, or forged).
    #[error("unknown {side} region {region}: not registered, unregistered, or forged id")]
    UnknownRegion {
        /// Which side's registry was asked.
        side: Side,
        /// The id.
        region: RegionId,
    },
    /// The registry has no free slot.
    #[error("region table is full ({capacity} regions); unregister some first")]
    RegionTableFull {
        /// The registry's capacity.
        capacity: usize,
    },
    /// A descriptor reaches past its region's end.
    #[error("descriptor {desc_index}: {side} range offset {offset} + len {len} exceeds region {region} of {region_len} bytes")]
    OutOfBounds {
        /// Index of the descriptor in its batch.
        desc_index: u32,
        /// Side whose region is exceeded.
        side: Side,
        /// The region.
        region: RegionId,
        /// Descriptor offset.
        offset: u64,
        /// Descriptor length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// `offset + len` does not fit in 64 bits.
    #[error("descriptor {desc_index}: {side} offset {offset} + len {len} overflows 64 bits")]
    LengthOverflow {
        /// Index of the descriptor in its batch.
        desc_index: u32,
        /// Side of the overflowing offset.
        side: Side,
        /// Descriptor offset.
        offset: u64,
        /// Descriptor length.
        len: u64,
    },
    /// A region's access rights forbid the operation.
    #[error("descriptor {desc_index}: {side} region {region} does not allow {needs}")]
    AccessDenied {
        /// Index of the descriptor in its batch.
        desc_index: u32,
        /// Side of the region.
        side: Side,
        /// The region.
        region: RegionId,
        /// The right that is missing.
        needs: &'static str,
    },
    /// A ring or table is full: back-pressure, nothing was queued. Retry
    /// after reaping or waiting.
    #[error("{queue} is full ({capacity} entries): nothing was queued; reap or wait, then resubmit")]
    Busy {
        /// Which queue is full.
        queue: &'static str,
        /// Its capacity.
        capacity: usize,
    },
    /// A batch's own deadline passed: what was posted drained, the blocks
    /// not yet posted were dropped (`Outcome::TimedOut` as an error, for
    /// APIs that report one).
    #[error("the batch's deadline passed after {bytes} bytes; blocks not yet posted were dropped")]
    DeadlinePassed {
        /// Bytes moved before it.
        bytes: u64,
    },
    /// A batch was cancelled (`Outcome::Cancelled` as an error, for APIs
    /// that report one): what was posted drained before it ended, the
    /// blocks not yet posted were dropped, and its memory may be reused.
    #[error("the batch was cancelled after {bytes} bytes; blocks not yet posted were dropped")]
    Cancelled {
        /// Bytes moved before it.
        bytes: u64,
    },
    /// A wait reached its deadline. `what` names the wait (docs/DEADLINES.md
    /// lists each); what it waited for (a batch, a peer's answer) may still
    /// come.
    #[error("deadline reached after {waited:?} waiting for {what}")]
    Timeout {
        /// The wait that ran out, e.g. "the peer's handshake answer".
        what: &'static str,
        /// How long the caller waited.
        waited: Duration,
    },
    /// A batch id that was never issued by this submitter.
    #[error("batch id {id:#x} was not issued by this submitter")]
    UnknownBatch {
        /// The raw id.
        id: u64,
    },
    /// A batch id whose batch already ended and was consumed.
    #[error("batch id {id:#x} already ended and its result was consumed")]
    StaleBatch {
        /// The raw id.
        id: u64,
    },
    /// A segment handle that is closed or unknown to this engine.
    #[error("segment {segment} is not open in this engine")]
    UnknownSegment {
        /// Name or slot of the segment.
        segment: String,
    },
    /// The peer restarted (its epoch changed) or its connection broke.
    #[error("peer {segment} restarted or went away: {detail}")]
    PeerRestarted {
        /// The peer's segment name.
        segment: String,
        /// What was seen.
        detail: String,
    },
    /// A tcp peer took no reply for the engine's `io_timeout` while
    /// replies were awaited (its process stopped or hung, or the path
    /// stalled): the connection is closed and its chunks fail. Nothing says
    /// the peer restarted, and bytes that already left may still be in the
    /// peer's socket buffer: if it resumes, it lands them. A fence on the
    /// destination range (`Engine::fence`) stops them at the target. Its
    /// wire code is `PEER_RESTARTED` (Python: `PeerRestartedError`): the
    /// handle is stale, as after a restart, and the next open reconnects.
    #[error(
        "peer {segment} sent no reply for {waited:?}; the connection was closed, but bytes already sent may \
         still land if the peer resumes: fence the destination range to stop them, and open the segment again"
    )]
    PeerStalled {
        /// The peer's segment name (and address).
        segment: String,
        /// How long no reply came.
        waited: Duration,
    },
    /// A control message of a version this engine does not speak.
    #[error("control message version {got} is not supported (this engine speaks version {supported})")]
    VersionMismatch {
        /// Version received.
        got: u32,
        /// Version spoken here.
        supported: u32,
    },
    /// Bytes from a peer or a caller that do not decode.
    #[error("malformed {what}: {reason}")]
    Malformed {
        /// What was being decoded.
        what: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A message larger than the limit.
    #[error("message of {len} bytes exceeds the {max}-byte limit")]
    MessageTooLarge {
        /// Its length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// An opcode this engine does not know.
    #[error("unknown opcode {opcode}")]
    UnknownOpcode {
        /// The raw opcode.
        opcode: u8,
    },
    /// The peer answered with an error.
    #[error("peer answered {}: {message}", .code.as_str_name())]
    Remote {
        /// The peer's wire code.
        code: ErrorCode,
        /// The peer's message.
        message: String,
    },
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What kvring was doing.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A lane could not start.
    #[error("lane {lane} failed to start: {reason}")]
    LaneStart {
        /// The lane.
        lane: usize,
        /// Why.
        reason: String,
    },
    /// A lane panicked: the batches it held ended with this error, and it
    /// refuses new work until the engine is rebuilt.
    #[error(
        "lane {lane} died: it panicked ({reason}); its batches ended and it takes no new work; rebuild the engine"
    )]
    LaneDied {
        /// The lane.
        lane: usize,
        /// The panic's message.
        reason: String,
    },
    /// The operation is not supported by this build or transport.
    #[error("unsupported: {what}")]
    Unsupported {
        /// What was asked for.
        what: String,
    },
    /// No transport this engine allows reaches a peer (the engine's
    /// allow-list, or a transport asked for outside it): what reaches the
    /// peer, and why each allowed transport does not.
    #[error("no allowed transport reaches {peer}: allowed {}; it is reachable by {}; {}", kind_names(.allowed), kind_names(.offered), kind_reasons(.reasons))]
    TransportRefused {
        /// The peer's segment name.
        peer: String,
        /// The transports this engine allows (`TransportKind` names).
        allowed: Vec<&'static str>,
        /// The transports that do reach the peer (outside the allow-list).
        offered: Vec<&'static str>,
        /// Why each allowed transport cannot reach it.
        reasons: Vec<(&'static str, String)>,
    },
    /// An RDMA device failed, disappeared, or refused an operation.
    #[error("rdma device {device}: {reason}")]
    Device {
        /// The device (or "verbs" when none is known).
        device: String,
        /// What failed.
        reason: String,
    },
    /// A GPU, its driver or a peer's exported GPU memory failed or refused
    /// an operation.
    #[error("gpu {device}: {reason}")]
    Gpu {
        /// The device (or the provider when none is known).
        device: String,
        /// What failed, and what to do about it.
        reason: String,
    },
    /// A peer's descriptor asks this engine for more of something than it
    /// takes from one peer (each costs a mapping or a handle here): the
    /// segment is refused whole and nothing of it is opened.
    #[error("{peer} advertises {count} {what}, past this engine's cap of {limit} per peer ({cap}); nothing of it was opened")]
    PeerLimit {
        /// The peer's segment name.
        peer: String,
        /// What it advertises too many of.
        what: &'static str,
        /// How many it advertises.
        count: usize,
        /// The most this engine takes from one peer.
        limit: usize,
        /// The name of the constant that sets the cap.
        cap: &'static str,
    },
    /// The engine is shutting down or has stopped.
    #[error("the engine is shut down")]
    Shutdown,
    /// What answered at a peer's address does not speak kvring.
    #[error("{peer} is not a kvring peer{}; check the address: kvring serve prints its listen address", sent(.got))]
    NotKvring {
        /// The address (or what it was given as).
        peer: String,
        /// The first bytes it sent, printable.
        got: String,
    },
    /// A peer refused us, or we refused a peer: wrong or missing token.
    #[error("unauthorized: {reason}")]
    Unauthorized {
        /// Why.
        reason: String,
    },
    /// Two KV-cache layouts that cannot exchange blocks.
    #[error("KV layouts differ {}{field}: local {local}, remote {remote}", at_layer(.layer))]
    LayoutMismatch {
        /// The layer that differs, when one does.
        layer: Option<u32>,
        /// The field that differs.
        field: &'static str,
        /// This side's value.
        local: String,
        /// The peer's value.
        remote: String,
    },
    /// A second, different KV-cache layout published by an engine that
    /// already published one. A published layout is fixed for the engine's
    /// life: peers cache it per segment handle and compute every push's
    /// offsets from it, so changing it under them would write blocks to
    /// the wrong places. Publishing the same layout again is no error.
    #[error("this engine's KV layout is fixed once published (peers cache it and compute pushes from it), and the new one differs: {detail}; publish another layout from a new engine")]
    LayoutFixed {
        /// Where the new layout differs from the published one.
        detail: String,
    },
    /// Source and destination block-id lists of different lengths.
    #[error("{src} source block ids but {dst} destination block ids; they pair one to one")]
    BlockCountMismatch {
        /// Source ids.
        src: usize,
        /// Destination ids.
        dst: usize,
    },
    /// A block id past the end of a layout.
    #[error("{side} block id {id} is out of range: the layout has {blocks} blocks")]
    BlockOutOfRange {
        /// Which side's layout.
        side: Side,
        /// The id.
        id: u64,
        /// Blocks that layout has.
        blocks: u64,
    },
    /// The same destination block listed twice.
    #[error("destination block id {id} is listed twice")]
    DuplicateBlock {
        /// The id.
        id: u64,
    },
    /// A layer past the end of a layout.
    #[error("layer {layer} is out of range: the layout has {layers} layers")]
    LayerOutOfRange {
        /// The layer.
        layer: u32,
        /// Layers the layout has.
        layers: u32,
    },
    /// A checksummed block's bytes differ at their destination from what
    /// its sender checksummed (`Batch::checksum`): the batch is not done.
    #[error("block {desc_index} is corrupt: {detail}; its destination must not be used (send it again)")]
    Corrupt {
        /// The block's index in the batch.
        desc_index: u32,
        /// Which checksums differed, and where they were computed.
        detail: String,
    },
}

/// Result alias used throughout kvring.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps an OS error with what kvring was doing when it happened.
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }

    /// Shorthand for [`Error::Timeout`].
    pub(crate) fn timeout(what: &'static str, waited: Duration) -> Self {
        Error::Timeout { what, waited }
    }

    /// Shorthand for [`Error::InvalidArgument`].
    pub(crate) fn invalid(what: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument { what, reason: reason.into() }
    }

    /// Shorthand for [`Error::Malformed`].
    pub(crate) fn malformed(what: &'static str, reason: impl Into<String>) -> Self {
        Error::Malformed { what, reason: reason.into() }
    }

    /// What answered at `peer` does not speak kvring: its first bytes,
    /// shown as text a user can recognise (`HTTP/1.1 400 Bad Request`,
    /// `SSH-2.0-...`).
    pub(crate) fn not_kvring(peer: impl Into<String>, got: &[u8]) -> Self {
        let shown: String =
            got.iter().take(32).map(|&b| if b.is_ascii_graphic() || b == b' ' { b as char } else { '.' }).collect();
        let got = if got.is_empty() { "nothing".into() } else { format!("{shown:?}") };
        Error::NotKvring { peer: peer.into(), got }
    }
}

/// What a stranger at a peer's address sent, for [`Error::NotKvring`].
fn sent(got: &str) -> String {
    if got == "nothing" {
        ": it sent nothing".into()
    } else {
        format!(" (it sent {got})")
    }
}

/// Transports listed for [`Error::TransportRefused`].
fn kind_names(kinds: &[&str]) -> String {
    match kinds {
        [] => "nothing".into(),
        kinds => kinds.join(", "),
    }
}

/// Why each allowed transport failed, for [`Error::TransportRefused`].
fn kind_reasons(reasons: &[(&str, String)]) -> String {
    reasons.iter().map(|(kind, why)| format!("{kind}: {why}")).collect::<Vec<_>>().join("; ")
}

/// Where two layouts differ, for [`Error::LayoutMismatch`].
fn at_layer(layer: &Option<u32>) -> String {
    match layer {
        Some(layer) => format!("at layer {layer}, "),
        None => "in ".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(index: u32) -> RegionId {
        RegionId::new(index, 1)
    }

    /// A peer's status is outside bytes: every i32, `i32::MIN` included
    /// (the fuzzer's find), reads as a code without panicking.
    #[test]
    fn every_wire_status_reads_as_a_code() {
        assert_eq!(code_of_status(-(ErrorCode::OutOfBounds as i32)), ErrorCode::OutOfBounds);
        for status in [i32::MIN, i32::MIN + 1, -1_000_000, 0, 1, i32::MAX] {
            assert_eq!(code_of_status(status), ErrorCode::Internal, "status {status}");
        }
    }

    /// Every variant's message, checked word for word where it matters.
    #[test]
    fn every_message_names_what_a_user_needs() {
        let cases: Vec<(Error, &str, ErrorCode)> = vec![
            (Error::invalid("length", "must be > 0"), "invalid length: must be > 0", ErrorCode::InvalidArgument),
            (
                Error::Device { device: "mlx5_0".into(), reason: "it disappeared".into() },
                "rdma device mlx5_0: it disappeared",
                ErrorCode::Io,
            ),
            (
                Error::Gpu { device: "sim-gpu-1".into(), reason: "the device was lost".into() },
                "gpu sim-gpu-1: the device was lost",
                ErrorCode::Io,
            ),
            (
                Error::RegionOverlap { addr: 0x1000, len: 10, existing: region(2), existing_addr: 0x1004, existing_len: 4 },
                "range 0x1000+10 overlaps registered region 2:1 (0x1004+4)",
                ErrorCode::RegionOverlap,
            ),
            (Error::RegionInfoMismatch { existing: region(3) }, "already registered as region 3:1", ErrorCode::RegionOverlap),
            (Error::RegionBusy { region: region(1), in_flight: 2 }, "region 1:1 has 2 batch(es) in flight", ErrorCode::RegionBusy),
            (Error::Fenced { region: region(1), grant: 3 }, "region 1:1 was fenced after grant 3", ErrorCode::Fenced),
            (Error::UnknownRegion { side: Side::Remote, region: region(9) }, "unknown remote region 9:1", ErrorCode::UnknownRegion),
            (Error::RegionTableFull { capacity: 4 }, "region table is full (4 regions)", ErrorCode::ResourceLimit),
            (
                Error::PeerLimit { peer: "p".into(), what: "GPU regions", count: 9, limit: 8, cap: "MAX_PEER_GPU_REGIONS" },
                "p advertises 9 GPU regions, past this engine's cap of 8 per peer (MAX_PEER_GPU_REGIONS)",
                ErrorCode::ResourceLimit,
            ),
            (
                Error::OutOfBounds { desc_index: 3, side: Side::Local, region: region(1), offset: 4096, len: 8192, region_len: 8192 },
                "descriptor 3: local range offset 4096 + len 8192 exceeds region 1:1 of 8192 bytes",
                ErrorCode::OutOfBounds,
            ),
            (
                Error::LengthOverflow { desc_index: 0, side: Side::Remote, offset: u64::MAX, len: 1 },
                "descriptor 0: remote offset 18446744073709551615 + len 1 overflows 64 bits",
                ErrorCode::LengthOverflow,
            ),
            (
                Error::AccessDenied { desc_index: 1, side: Side::Remote, region: region(4), needs: "remote write" },
                "descriptor 1: remote region 4:1 does not allow remote write",
                ErrorCode::AccessDenied,
            ),
            (Error::Busy { queue: "submission ring", capacity: 8 }, "submission ring is full (8 entries): nothing was queued", ErrorCode::Busy),
            (
                Error::Timeout { what: "the batch to end (it may still complete)", waited: Duration::from_millis(5) },
                "deadline reached after 5ms waiting for the batch to end (it may still complete)",
                ErrorCode::Timeout,
            ),
            (Error::UnknownBatch { id: 0xab }, "batch id 0xab was not issued by this submitter", ErrorCode::UnknownBatch),
            (Error::StaleBatch { id: 0xab }, "batch id 0xab already ended", ErrorCode::StaleBatch),
            (Error::UnknownSegment { segment: "decode-3".into() }, "segment decode-3 is not open", ErrorCode::UnknownSegment),
            (
                Error::PeerRestarted { segment: "decode-3".into(), detail: "epoch 1 -> 2".into() },
                "peer decode-3 restarted or went away: epoch 1 -> 2",
                ErrorCode::PeerRestarted,
            ),
            (
                Error::PeerStalled { segment: "decode-3".into(), waited: Duration::from_millis(500) },
                "peer decode-3 sent no reply for 500ms; the connection was closed, but bytes already sent may still land",
                ErrorCode::PeerRestarted,
            ),
            (
                Error::VersionMismatch { got: 7, supported: 1 },
                "control message version 7 is not supported (this engine speaks version 1)",
                ErrorCode::VersionMismatch,
            ),
            (Error::malformed("frame", "truncated"), "malformed frame: truncated", ErrorCode::MalformedMessage),
            (Error::MessageTooLarge { len: 10, max: 4 }, "message of 10 bytes exceeds the 4-byte limit", ErrorCode::MessageTooLarge),
            (Error::DeadlinePassed { bytes: 8 }, "deadline passed after 8 bytes", ErrorCode::Timeout),
            (Error::Cancelled { bytes: 8 }, "cancelled after 8 bytes", ErrorCode::Cancelled),
            (Error::UnknownOpcode { opcode: 9 }, "unknown opcode 9", ErrorCode::UnknownOpcode),
            (
                Error::Remote { code: ErrorCode::OutOfBounds, message: "x".into() },
                "peer answered OUT_OF_BOUNDS: x",
                ErrorCode::OutOfBounds,
            ),
            (
                Error::io("mapping /dev/shm/x", std::io::Error::from_raw_os_error(libc::ENOENT)),
                "mapping /dev/shm/x: No such file or directory",
                ErrorCode::Io,
            ),
            (Error::LaneStart { lane: 1, reason: "no cpu".into() }, "lane 1 failed to start: no cpu", ErrorCode::Internal),
            (
                Error::LaneDied { lane: 2, reason: "index out of bounds".into() },
                "lane 2 died: it panicked (index out of bounds); its batches ended",
                ErrorCode::Internal,
            ),
            (Error::Unsupported { what: "rdma".into() }, "unsupported: rdma", ErrorCode::Unsupported),
            (
                Error::TransportRefused {
                    peer: "decode-0".into(),
                    allowed: vec!["shm"],
                    offered: vec!["cma", "tcp"],
                    reasons: vec![("shm", "none of its regions is shm-backed".into())],
                },
                "no allowed transport reaches decode-0: allowed shm; it is reachable by cma, tcp; shm: none of its regions is shm-backed",
                ErrorCode::Unsupported,
            ),
            (Error::Shutdown, "the engine is shut down", ErrorCode::Shutdown),
            (
                Error::NotKvring { peer: "127.0.0.1:80".into(), got: "\"HTTP/1.1 400\"".into() },
                "127.0.0.1:80 is not a kvring peer (it sent \"HTTP/1.1 400\")",
                ErrorCode::MalformedMessage,
            ),
            (Error::NotKvring { peer: "h:1".into(), got: "nothing".into() }, "h:1 is not a kvring peer: it sent nothing", ErrorCode::MalformedMessage),
            (
                Error::LayoutMismatch { layer: Some(3), field: "key bytes per block", local: "512".into(), remote: "256".into() },
                "KV layouts differ at layer 3, key bytes per block: local 512, remote 256",
                ErrorCode::LayoutMismatch,
            ),
            (
                Error::LayoutMismatch { layer: None, field: "layer count", local: "61".into(), remote: "32".into() },
                "KV layouts differ in layer count: local 61, remote 32",
                ErrorCode::LayoutMismatch,
            ),
            (
                Error::LayoutFixed { detail: "KV layouts differ in layer count: local 61, remote 32".into() },
                "KV layout is fixed once published (peers cache it and compute pushes from it), and the new one differs: KV layouts differ in layer count",
                ErrorCode::LayoutMismatch,
            ),
            (Error::BlockCountMismatch { src: 3, dst: 2 }, "3 source block ids but 2 destination", ErrorCode::InvalidArgument),
            (
                Error::BlockOutOfRange { side: Side::Remote, id: 9, blocks: 8 },
                "remote block id 9 is out of range: the layout has 8 blocks",
                ErrorCode::InvalidArgument,
            ),
            (Error::DuplicateBlock { id: 4 }, "destination block id 4 is listed twice", ErrorCode::InvalidArgument),
            (Error::LayerOutOfRange { layer: 70, layers: 61 }, "layer 70 is out of range", ErrorCode::InvalidArgument),
            (
                Error::Unauthorized { reason: "wrong or missing token".into() },
                "unauthorized: wrong or missing token",
                ErrorCode::Unauthorized,
            ),
            (
                Error::Corrupt { desc_index: 3, detail: "crc32c 0x1 sent, 0x2 landed".into() },
                "block 3 is corrupt: crc32c 0x1 sent, 0x2 landed; its destination must not be used",
                ErrorCode::Corrupt,
            ),
        ];
        for (error, expected, code) in cases {
            let message = error.to_string();
            assert!(message.contains(expected), "{message:?} should contain {expected:?}");
            assert_eq!(error.code(), code, "code of {message:?}");
        }
    }

    #[test]
    fn io_errors_keep_their_source() {
        use std::error::Error as _;
        let error = Error::io("x", std::io::Error::other("boom"));
        assert_eq!(error.source().unwrap().to_string(), "boom");
    }
}

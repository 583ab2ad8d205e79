//! Submission and completion queue entries: the fixed structs the rings carry.
//!
//! Both are `#[repr(C)]`, plain old data, and have their sizes asserted at
//! compile time, like tokio-rs/io-uring's `squeue::Entry`. An SQE carries an
//! index into the submitter's descriptor arena, never a copy of the
//! descriptors; `user_data` ties the CQE back to its SQE.

use bytemuck::{Pod, Zeroable};

/// Which way a batch moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// Push: local region → remote region.
    Write = 1,
    /// Pull: remote region → local region.
    Read = 2,
}

impl Opcode {
    /// Decodes a wire opcode; unknown values are `None`.
    pub fn from_u8(value: u8) -> Option<Self> {
        match value {
            1 => Some(Self::Write),
            2 => Some(Self::Read),
            _ => None,
        }
    }

    /// Lower-case name, as the bench and errors print it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Write => "write",
            Self::Read => "read",
        }
    }
}

/// One submission queue entry: a batch, or the part of a batch that one lane
/// executes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Sqe {
    /// Caller's tag, copied into the CQE.
    pub user_data: u64,
    /// Raw [`BatchId`](crate::BatchId) of the batch this part belongs to.
    pub batch_id: u64,
    /// Deadline as nanoseconds on the engine's monotonic clock; 0 = none.
    pub deadline_ns: u64,
    /// Position of the first descriptor in the submitter's arena for this lane.
    pub desc_position: u64,
    /// Number of descriptors of this part.
    pub desc_count: u32,
    /// Slot of the target segment in the engine's segment table.
    pub segment: u32,
    /// Index in the whole batch of this part's first descriptor, so errors
    /// name the caller's descriptor index.
    pub desc_base: u32,
    /// [`Opcode`] as a byte.
    pub opcode: u8,
    /// [`SQE_FLAG_CHECKSUM`] or 0.
    pub flags: u8,
    /// Reserved, zero.
    pub _reserved: [u8; 2],
    /// Arrival tag the target counts this part's bytes under (0: none).
    pub arrival_tag: u32,
    /// The grant the batch names for its destination (0: none).
    pub grant: u32,
}

const _: () = assert!(std::mem::size_of::<Sqe>() == 56);

/// [`Sqe::flags`]: the part's blocks are checksummed end to end.
pub const SQE_FLAG_CHECKSUM: u8 = 1;

/// Kinds of completion a CQE can report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum CqeKind {
    /// A batch reached a terminal state.
    Batch = 1,
    /// Peers' notifications are waiting (one CQE for any number of them:
    /// [`Submitter::reap_event`](crate::Submitter::reap_event) drains them).
    Notification = 2,
}

/// One completion queue entry: a batch reached a terminal state, or (kind
/// [`CqeKind::Notification`]) notifications arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Cqe {
    /// The `user_data` of the batch's submission.
    pub user_data: u64,
    /// Raw [`BatchId`](crate::BatchId) of the batch.
    pub batch_id: u64,
    /// Bytes moved by the whole batch.
    pub bytes: u64,
    /// 0 for done; otherwise the negated wire error code
    /// ([`ErrorCode`](crate::ErrorCode)) of the batch's outcome.
    pub result: i32,
    /// [`CqeKind`] as a number.
    pub kind: u32,
}

const _: () = assert!(std::mem::size_of::<Cqe>() == 32);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opcode_round_trips_and_rejects_unknown_values() {
        for op in [Opcode::Write, Opcode::Read] {
            assert_eq!(Opcode::from_u8(op as u8), Some(op));
        }
        assert_eq!(Opcode::from_u8(0), None);
        assert_eq!(Opcode::from_u8(3), None);
    }
}

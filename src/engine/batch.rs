//! What a caller submits and what it gets back.

use super::segment::Segment;
use crate::desc::BlockDesc;
use crate::error::Error;
use crate::ring::Opcode;
use crate::runtime::BatchId;
use std::borrow::Cow;
use std::time::Duration;

/// One submission: a direction, a target segment, block descriptors, a tag
/// and an optional deadline. Borrow the descriptors with
/// [`descs`](Batch::descs) on hot paths; [`block`](Batch::block) collects
/// them one by one for convenience.
///
/// ```
/// # fn demo(segment: &kvring::Segment, local: kvring::RegionId) {
/// use kvring::{Batch, BlockDesc};
/// use std::time::Duration;
/// let remote = segment.regions()[0].id;
/// let descs = [BlockDesc::new(local, 0, remote, 0, 4096)];
/// let batch = Batch::write(segment).descs(&descs).user_data(42).deadline(Duration::from_millis(50));
/// assert_eq!(batch.len(), 1);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Batch<'a> {
    pub(crate) opcode: Opcode,
    pub(crate) segment: &'a Segment,
    pub(crate) descs: Cow<'a, [BlockDesc]>,
    pub(crate) user_data: u64,
    pub(crate) deadline: Option<Duration>,
    pub(crate) arrival_tag: u32,
    /// End-to-end checksums: `None` takes the engine's setting.
    pub(crate) checksum: Option<bool>,
    pub(crate) grant: u32,
}

impl<'a> Batch<'a> {
    /// A push: local regions → the segment's regions.
    pub fn write(segment: &'a Segment) -> Self {
        Self::new(Opcode::Write, segment)
    }

    /// A pull: the segment's regions → local regions.
    pub fn read(segment: &'a Segment) -> Self {
        Self::new(Opcode::Read, segment)
    }

    /// A batch with an explicit opcode.
    pub fn new(opcode: Opcode, segment: &'a Segment) -> Self {
        Self {
            opcode,
            segment,
            descs: Cow::Borrowed(&[]),
            user_data: 0,
            deadline: None,
            arrival_tag: 0,
            checksum: None,
            grant: 0,
        }
    }

    /// Uses these descriptors (borrowed, no copy).
    pub fn descs(mut self, descs: &'a [BlockDesc]) -> Self {
        self.descs = Cow::Borrowed(descs);
        self
    }

    /// Adds one descriptor.
    pub fn block(mut self, desc: BlockDesc) -> Self {
        self.descs.to_mut().push(desc);
        self
    }

    /// Tags the batch; the tag comes back in its completion.
    pub fn user_data(mut self, user_data: u64) -> Self {
        self.user_data = user_data;
        self
    }

    /// Descriptors not yet posted when this much time has passed since
    /// submission are dropped and the batch ends `TimedOut`.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Counts this push's bytes on the target under `tag` as they land, so
    /// the target can wait for them ([`Engine::wait_landed`](crate::Engine::wait_landed))
    /// without a notification; 0 (the default) counts nothing. Carried on
    /// the data path itself: a field of each tcp frame, the immediate data
    /// of each RDMA WRITE. A WRITE only, over tcp or rdma: another transport
    /// fails the batch saying so. [`kv::arrival_tag`](crate::kv::arrival_tag)
    /// makes one tag per request and layer.
    pub fn arrival_tag(mut self, tag: u32) -> Self {
        self.arrival_tag = tag;
        self
    }

    /// Checksums this batch's blocks end to end (or not), whatever the
    /// engine's [`checksum`](crate::EngineBuilder::checksum) setting: the
    /// sender computes each block's CRC32C, the receiver verifies it before
    /// the batch is reported done, and a block whose bytes differ fails the
    /// batch with [`Error::Corrupt`] naming it. Host memory over shm, cma,
    /// tcp and rdma (each chunk verified once it completed, by asking the
    /// target for the CRC32C of what landed: one control round trip per
    /// chunk, into regions peers may read); what cannot be verified (GPU
    /// memory, a write-only rdma destination, a tagged checksummed rdma
    /// push) fails the batch with `Unsupported` saying why, never unchecked. See
    /// docs/CHECKSUMS.md for what each transport's check catches.
    pub fn checksum(mut self, on: bool) -> Self {
        self.checksum = Some(on);
        self
    }

    /// Names the grant the target handed out for this push's destination
    /// ([`Engine::fence`](crate::Engine::fence)); a write lands only where
    /// no newer fence covers it, else the batch fails `Fenced` and none of
    /// the refused bytes land. 0 (the default) names none: such a write
    /// lands only where nothing was ever fenced.
    pub fn grant(mut self, grant: u32) -> Self {
        self.grant = grant;
        self
    }

    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.descs.len()
    }

    /// True with no descriptors (such a batch is refused at submit).
    pub fn is_empty(&self) -> bool {
        self.descs.is_empty()
    }

    /// The opcode.
    pub fn opcode(&self) -> Opcode {
        self.opcode
    }
}

/// How a batch ended. Timed out, cancelled and failed are distinct.
#[derive(Debug)]
pub enum Outcome {
    /// Every descriptor moved.
    Done {
        /// Bytes moved.
        bytes: u64,
    },
    /// A descriptor failed; the ones after it were dropped.
    Failed(Error),
    /// The batch deadline passed; descriptors not yet posted were dropped.
    TimedOut {
        /// Bytes moved before the deadline.
        bytes: u64,
    },
    /// Cancelled; every posted descriptor had drained.
    Cancelled {
        /// Bytes moved before the cancel.
        bytes: u64,
    },
}

impl Outcome {
    /// True for `Done`.
    pub fn is_done(&self) -> bool {
        matches!(self, Outcome::Done { .. })
    }

    /// The error of a failed batch, the batch-deadline error of a timed-out
    /// one, `Ok(bytes)` for a done one.
    pub fn into_result(self) -> Result<u64, Error> {
        match self {
            Outcome::Done { bytes } => Ok(bytes),
            Outcome::Failed(error) => Err(error),
            Outcome::TimedOut { .. } => {
                Err(Error::Timeout { what: "the batch's own deadline", waited: Duration::ZERO })
            }
            Outcome::Cancelled { .. } => Err(Error::invalid("batch", "cancelled")),
        }
    }
}

/// A reaped completion: which batch, its tag, how it ended.
#[derive(Debug)]
pub struct Completion {
    /// The batch.
    pub id: BatchId,
    /// Its `user_data`.
    pub user_data: u64,
    /// The transport that carried it (its segment's link).
    pub transport: crate::transport::TransportKind,
    /// How it ended.
    pub outcome: Outcome,
}

/// What [`Submitter::reap_event`](crate::Submitter::reap_event) yields.
#[derive(Debug)]
pub enum Event {
    /// A batch ended.
    Batch(Completion),
    /// A peer's notification arrived.
    Notification(crate::notify::Notification),
}

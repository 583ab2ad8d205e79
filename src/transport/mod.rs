//! Transports: how a lane moves validated blocks to or from a peer.
//!
//! Every transport implements [`Link`], and every link is driven by the same
//! lane loop, so the ring, status, backoff and validation logic is exercised
//! whatever moves the bytes. A lane validates every block before it hands it
//! to a link (local range against the registry, remote range against the
//! peer's descriptor), in chunks of at most [`Link::max_chunk`] blocks, and
//! checks cancel and deadlines between chunks.

pub mod notify;
pub mod null;
pub mod rdma;
pub mod select;
pub mod shm;
pub mod tcp;

use crate::desc::BlockDesc;
use crate::error::Error;
use crate::ring::Opcode;
use crate::segment::TransportKind;

/// One validated block: where its local bytes are, and its descriptor.
#[derive(Debug, Clone, Copy)]
pub struct Block {
    /// First byte of the local range (inside a leased, registered region).
    pub local: *mut u8,
    /// The descriptor (its remote range was checked against the peer's).
    pub desc: BlockDesc,
    /// Its index in the caller's batch, for errors.
    pub desc_index: u32,
}

/// A chunk's failure: the error, and the bytes moved before it.
pub type TransferError = (Error, u64);

/// How a chunk ended, or that it will end later.
#[derive(Debug)]
pub enum Posted {
    /// Moved now (synchronous links): the bytes moved.
    Done(u64),
    /// Failed now: the error and the bytes moved before it.
    Failed(TransferError),
    /// Handed to the link; its end comes from [`Link::poll`] under the
    /// chunk's ticket. The chunk's memory must stay leased until then.
    InFlight,
}

/// A chunk that ended after [`Posted::InFlight`]: its ticket and result.
pub type Finished = (u64, Result<u64, TransferError>);

/// A connection from this engine to one peer segment over one transport.
///
/// Shared by every lane (`Sync`), but a lane's calls name the lane, and a
/// link keeps per-lane state that only that lane touches.
pub trait Link: Send + Sync + std::fmt::Debug {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;

    /// Most blocks the lane hands over at once.
    fn max_chunk(&self) -> usize;

    /// Moves `blocks` in order for lane `lane`, now ([`Posted::Done`],
    /// [`Posted::Failed`]) or later ([`Posted::InFlight`]: the end is
    /// reported by [`Link::poll`] under `ticket`).
    ///
    /// # Safety
    ///
    /// Each block's `local..local + desc.len` must lie within one registered
    /// local region that stays registered, valid for reads (WRITE) or writes
    /// (READ), and not otherwise accessed until the chunk has ended: on
    /// return for `Done` and `Failed`, when `poll` or `abort` reports its
    /// ticket for `InFlight`.
    unsafe fn transfer(&self, lane: usize, op: Opcode, batch_id: u64, ticket: u64, blocks: &[Block]) -> Posted;

    /// Makes progress on lane `lane`'s chunks in flight and appends those
    /// that ended to `finished`. Returns true if anything moved.
    fn poll(&self, _lane: usize, _finished: &mut Vec<Finished>) -> bool {
        false
    }

    /// Ends every chunk lane `lane` has in flight at once (a batch passed
    /// its deadline, the lane stops): closes what carries them, so no byte
    /// of theirs is read or written afterwards, and reports each as failed
    /// with `reason`.
    fn abort(&self, _lane: usize, _reason: &str, _finished: &mut Vec<Finished>) {}

    /// True once the link can carry nothing more (an RDMA QP in the error
    /// state): the lane marks its segment stale at the first failure, of
    /// whatever kind, so the next open reconnects.
    fn is_broken(&self) -> bool {
        false
    }

    /// The engine retired this link's handle (closed, evicted, or found
    /// stale). A link whose connections failed hands back what it can
    /// reuse now rather than when the last lane lets go of it, so the
    /// reconnect that usually follows at once can take it. A healthy link
    /// keeps everything until dropped: its chunks in flight still end.
    fn retire(&self) {}

    /// True when the transport carries notifications on its own path
    /// ([`Link::post_notification`]); otherwise the engine sends them on
    /// the control plane.
    fn carries_notifications(&self) -> bool {
        false
    }

    /// Queues an encoded notification on lane `lane`'s path, after
    /// everything that lane has queued; it ends, like a chunk, through
    /// `poll` under `ticket`.
    fn post_notification(&self, _lane: usize, _ticket: u64, _payload: Vec<u8>) -> Result<(), Error> {
        Err(Error::Unsupported { what: "notifications on this transport's data path".into() })
    }
}

pub use null::NullLink;
pub use shm::ShmLink;
pub use tcp::{TcpDataServer, TcpLink};

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

/// A connection from this engine to one peer segment over one transport.
pub trait Link: Send + Sync + std::fmt::Debug {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;

    /// Most blocks the lane hands over at once.
    fn max_chunk(&self) -> usize;

    /// Moves `blocks` in order for lane `lane`; returns the bytes moved, or
    /// the first failure and the bytes moved before it.
    ///
    /// # Safety
    ///
    /// Each block's `local..local + desc.len` must lie within one registered
    /// local region that stays registered for the call (the lane holds a
    /// lease on it), valid for reads (WRITE) or writes (READ), and not
    /// otherwise accessed during the call.
    unsafe fn transfer(&self, lane: usize, op: Opcode, batch_id: u64, blocks: &[Block]) -> Result<u64, TransferError>;

    /// Sends a notification on this link's own path, after what lane `lane`
    /// has sent; `None` when the transport has no path of its own for it
    /// (the engine then uses the control plane).
    fn notify(&self, _lane: usize, _from: &str, _message: &[u8]) -> Option<crate::error::Result<()>> {
        None
    }
}

pub use null::NullLink;
pub use shm::ShmLink;
pub use tcp::{TcpDataServer, TcpLink};

//! Transports: how a lane moves one validated block to or from a peer.
//!
//! Every transport implements [`Link`], and every link is driven by the same
//! lane loop, so the ring, status, backoff and validation logic is exercised
//! whatever moves the bytes. A lane validates both ranges before it calls a
//! link (local range against the registry, remote range against the peer's
//! descriptor); a link maps the already-checked remote range to its medium.

pub mod null;
pub mod shm;

use crate::desc::BlockDesc;
use crate::error::Result;
use crate::ring::Opcode;
use crate::segment::TransportKind;

/// A connection from this engine to one peer segment over one transport.
pub trait Link: Send + Sync + std::fmt::Debug {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;

    /// Moves one block between `local` and the remote range of `desc`
    /// (checked against the peer's descriptor by the lane).
    ///
    /// # Safety
    ///
    /// `local..local + desc.len` must lie within one registered local region
    /// that stays registered for the call (the lane holds a lease on it),
    /// valid for reads (WRITE) or writes (READ).
    unsafe fn transfer(&self, op: Opcode, local: *mut u8, desc: &BlockDesc, desc_index: u32) -> Result<()>;
}

pub use null::NullLink;
pub use shm::ShmLink;

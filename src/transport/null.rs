//! The null transport: validates like any other, moves nothing. It measures
//! what kvring itself costs per descriptor (rings, lane loop, status).

use super::Link;
use crate::desc::BlockDesc;
use crate::error::Result;
use crate::ring::Opcode;
use crate::segment::TransportKind;

/// A link that moves nothing.
#[derive(Debug, Default)]
pub struct NullLink;

impl Link for NullLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Null
    }

    #[inline]
    unsafe fn transfer(&self, _op: Opcode, _local: *mut u8, _desc: &BlockDesc, _desc_index: u32) -> Result<()> {
        Ok(())
    }
}

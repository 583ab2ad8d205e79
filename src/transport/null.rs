//! The null transport: validates like any other, moves nothing. It measures
//! what kvring itself costs per descriptor (rings, lane loop, status).

use super::{Block, Link, TransferError};
use crate::ring::Opcode;
use crate::segment::TransportKind;

/// A link that moves nothing.
#[derive(Debug, Default)]
pub struct NullLink;

impl Link for NullLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Null
    }

    fn max_chunk(&self) -> usize {
        64
    }

    #[inline]
    unsafe fn transfer(
        &self,
        _lane: usize,
        _op: Opcode,
        _batch_id: u64,
        blocks: &[Block],
    ) -> Result<u64, TransferError> {
        Ok(blocks.iter().map(|b| b.desc.len).sum())
    }
}

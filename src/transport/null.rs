//! The null transport: validates like any other, moves nothing. It measures
//! what kvring itself costs per descriptor (rings, lane loop, status).

use super::{Block, Link, Posted};
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
    unsafe fn transfer(&self, _lane: usize, _op: Opcode, _batch_id: u64, _ticket: u64, blocks: &[Block]) -> Posted {
        Posted::Done(blocks.iter().map(|b| b.desc.len).sum())
    }
}

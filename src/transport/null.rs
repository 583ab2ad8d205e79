//! The null transport: validates like any other, moves nothing. It measures
//! what kvring itself costs per descriptor (rings, lane loop, status).

use super::{Block, LaneLink, Link, LinkState, Posted, TransportKind};
use crate::ring::Opcode;

/// A lane link that moves nothing.
#[derive(Debug, Default)]
pub(crate) struct NullLink;

impl NullLink {
    /// One null lane link per lane.
    pub fn open(lanes: usize) -> Link {
        let lanes = (0..lanes).map(|_| Box::new(NullLink) as Box<dyn LaneLink>).collect();
        Link { state: LinkState::new(TransportKind::Null, false), lanes }
    }
}

impl LaneLink for NullLink {
    fn max_chunk(&self) -> usize {
        64
    }

    #[inline]
    unsafe fn transfer(&mut self, _op: Opcode, _batch_id: u64, _ticket: u64, blocks: &[Block]) -> Posted {
        Posted::Done(blocks.iter().map(|b| b.desc.len).sum())
    }
}

//! The shared-memory transport: the peer's shm-backed regions are mapped
//! into this process, and the lane copies straight into (WRITE) or out of
//! (READ) them. One copy, no syscall, no peer thread involved.

use super::{Block, LaneLink, Link, LinkState, Posted, TransportKind};
use crate::desc::BlockDesc;
use crate::error::{Error, Result, Side};
use crate::mem::shm::PeerRegion;
use crate::mem::ShmMapping;
use crate::ring::Opcode;
use crate::segment::SegmentDescriptor;
use std::sync::Arc;

/// A lane's view of one peer's shm-backed regions, indexed by region slot.
/// The mappings are made once and shared by the lanes (they only copy
/// through them), so each lane's link is a pointer to them.
#[derive(Debug)]
pub(crate) struct ShmLink {
    mappings: Arc<[Option<ShmMapping>]>,
}

impl ShmLink {
    /// Maps every shm-backed region of the peer, each only if its file
    /// proves to be that region of that peer (`ShmMapping::open_peer`).
    /// Fails when the peer is on another host or exposes no shm-backed
    /// region. Every lane gets a link over the same mappings.
    pub fn open(descriptor: &SegmentDescriptor, lanes: usize) -> Result<Link> {
        if descriptor.host_id != crate::segment::local_host_id() {
            return Err(Error::Unsupported {
                what: format!("shm to {}: the peer is on another host", descriptor.name),
            });
        }
        let max_index = descriptor.regions.iter().map(|r| r.id.index() as usize + 1).max().unwrap_or(0);
        let mut mappings: Vec<Option<ShmMapping>> = (0..max_index).map(|_| None).collect();
        let mut mapped = 0;
        for region in &descriptor.regions {
            if let Some(path) = &region.shm_path {
                let len = usize::try_from(region.len)
                    .map_err(|_| Error::malformed("segment descriptor", format!("region {} too large", region.id)))?;
                let claim = PeerRegion { pid: descriptor.pid, epoch: descriptor.epoch, region: region.id, len };
                mappings[region.id.index() as usize] = Some(ShmMapping::open_peer(path, claim)?);
                mapped += 1;
            }
        }
        if mapped == 0 && !descriptor.regions.is_empty() {
            return Err(Error::Unsupported {
                what: format!(
                    "shm to {}: none of its regions is shm-backed (allocate them with alloc_region)",
                    descriptor.name
                ),
            });
        }
        let mappings: Arc<[Option<ShmMapping>]> = mappings.into();
        let lanes = (0..lanes).map(|_| Box::new(ShmLink { mappings: mappings.clone() }) as Box<dyn LaneLink>).collect();
        Ok(Link { state: LinkState::new(TransportKind::Shm, false), lanes })
    }
}

/// Blocks per chunk: the lane checks cancel and deadlines between chunks.
pub const SHM_CHUNK_BLOCKS: usize = 16;

impl LaneLink for ShmLink {
    fn max_chunk(&self) -> usize {
        SHM_CHUNK_BLOCKS
    }

    #[inline]
    unsafe fn transfer(&mut self, op: Opcode, _batch_id: u64, _ticket: u64, blocks: &[Block]) -> Posted {
        let mut moved = 0;
        for block in blocks {
            // SAFETY: forwarded from our caller, block by block.
            match unsafe { self.copy(op, block.local, &block.desc, block.desc_index) } {
                Ok(()) => moved += block.desc.len,
                Err(error) => return Posted::Failed((error, moved)),
            }
        }
        Posted::Done(moved)
    }
}

impl ShmLink {
    /// Copies one block.
    ///
    /// # Safety
    ///
    /// As [`LaneLink::transfer`], for this one block.
    #[inline]
    unsafe fn copy(&self, op: Opcode, local: *mut u8, desc: &BlockDesc, desc_index: u32) -> Result<()> {
        let mapping = self
            .mappings
            .get(desc.remote_region.index() as usize)
            .and_then(Option::as_ref)
            .ok_or(Error::UnknownRegion { side: Side::Remote, region: desc.remote_region })?;
        // The lane checked the range against the descriptor; the mapping was
        // made with the descriptor's length, so re-checking here is a cheap
        // second fence against ever touching memory outside it.
        let end = desc.remote_offset.checked_add(desc.len).ok_or(Error::LengthOverflow {
            desc_index,
            side: Side::Remote,
            offset: desc.remote_offset,
            len: desc.len,
        })?;
        if end > mapping.len() as u64 {
            return Err(Error::OutOfBounds {
                desc_index,
                side: Side::Remote,
                region: desc.remote_region,
                offset: desc.remote_offset,
                len: desc.len,
                region_len: mapping.len() as u64,
            });
        }
        // SAFETY: `remote_offset + len <= mapping.len()` (checked above), and
        // the mapping lives as long as `self`.
        let remote = unsafe { mapping.as_ptr().add(desc.remote_offset as usize) };
        let len = desc.len as usize;
        // The ranges overlap only when an engine maps its own region
        // (loopback), which `copy` (memmove) handles.
        // SAFETY: `local` is valid per our contract; `remote` is in the mapping.
        unsafe {
            match op {
                Opcode::Write => std::ptr::copy(local, remote, len),
                Opcode::Read => std::ptr::copy(remote, local, len),
            }
        }
        Ok(())
    }
}

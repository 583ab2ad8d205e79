//! Regions that kvring allocated in shared memory.

use crate::desc::RegionId;
use crate::error::{Error, Result, Side};
use crate::mem::registry::check_range;
use crate::mem::ShmMapping;
use std::sync::Arc;

/// A shared-memory region allocated by [`Engine::alloc_region`]: page
/// aligned, pre-faulted, mappable by same-host peers. The memory lives as
/// long as this handle or its registration, whichever is longer.
///
/// [`Engine::alloc_region`]: crate::Engine::alloc_region
#[derive(Debug, Clone)]
pub struct Region {
    pub(crate) id: RegionId,
    pub(crate) mapping: Arc<ShmMapping>,
}

impl Region {
    /// The region's id, for block descriptors.
    pub fn id(&self) -> RegionId {
        self.id
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mapping.len()
    }

    /// Never true: empty regions are refused.
    pub fn is_empty(&self) -> bool {
        self.mapping.is_empty()
    }

    /// First byte. Writing through it races with transfers into the region;
    /// keep them apart as with any DMA buffer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.mapping.as_ptr()
    }

    /// The backing file under /dev/shm.
    pub fn shm_path(&self) -> &std::path::Path {
        self.mapping.path()
    }

    fn range(&self, offset: u64, len: usize) -> Result<*mut u8> {
        check_range(self.id, Side::Local, 0, offset, len as u64, self.len() as u64)?;
        // SAFETY: offset + len <= self.len() was just checked.
        Ok(unsafe { self.as_ptr().add(offset as usize) })
    }

    /// Copies `bytes` into the region at `offset` (bounds checked).
    pub fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        let dst = self.range(offset, bytes.len())?;
        // SAFETY: `dst..dst+len` is inside the mapping (checked above), which
        // cannot overlap a Rust slice the caller owns.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) };
        Ok(())
    }

    /// Copies from the region at `offset` into `out` (bounds checked).
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let src = self.range(offset, out.len())?;
        // SAFETY: as in `write_at`.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Checksum of `len` bytes at `offset`: equal to what the owning engine
    /// computes for a peer (`Segment::remote_checksum`).
    pub fn checksum(&self, offset: u64, len: usize) -> Result<u64> {
        let src = self.range(offset, len)?;
        // SAFETY: in bounds (checked); the bytes are plain integers, and a
        // concurrent transfer only makes the sum meaningless, as documented.
        let bytes = unsafe { std::slice::from_raw_parts(src, len) };
        Ok(crate::mem::checksum(bytes))
    }

    /// Fills the whole region with a deterministic pattern from `seed`
    /// (tests and the bench use it to make every block's bytes distinct).
    pub fn fill_pattern(&self, seed: u64) {
        // SAFETY: the whole mapping is ours to write; see `as_ptr`.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len()) };
        fill_pattern(bytes, seed);
    }
}

/// Fills `bytes` with a pattern derived from `seed` and each word's position.
pub fn fill_pattern(bytes: &mut [u8], seed: u64) {
    let mut chunks = bytes.chunks_exact_mut(8);
    for (i, chunk) in (&mut chunks).enumerate() {
        let v = (seed ^ i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17);
        chunk.copy_from_slice(&v.to_le_bytes());
    }
    for (j, b) in chunks.into_remainder().iter_mut().enumerate() {
        *b = (seed as u8).wrapping_add(j as u8);
    }
}

impl From<&Region> for RegionId {
    fn from(region: &Region) -> RegionId {
        region.id
    }
}

impl Region {
    pub(crate) fn new(id: RegionId, mapping: Arc<ShmMapping>) -> Result<Self> {
        if mapping.is_empty() {
            return Err(Error::invalid("region", "empty mapping"));
        }
        Ok(Self { id, mapping })
    }
}

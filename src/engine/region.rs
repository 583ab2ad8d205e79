//! Regions that kvring allocated: in shared memory, or in a GPU's memory.

use crate::desc::RegionId;
use crate::error::{Error, Result, Side};
use crate::mem::registry::check_range;
use crate::mem::{DeviceBacking, MemoryKind, ShmMapping};
use std::sync::Arc;

/// A region allocated by [`Engine::alloc_region`]: host shared memory (page
/// aligned, pre-faulted, mappable by same-host peers) or a GPU's memory
/// (exported for same-host peers). The memory lives as long as this handle
/// or its registration, whichever is longer.
///
/// [`Engine::alloc_region`]: crate::Engine::alloc_region
#[derive(Debug, Clone)]
pub struct Region {
    pub(crate) id: RegionId,
    memory: RegionMemory,
}

/// Where a [`Region`]'s bytes are.
#[derive(Debug, Clone)]
enum RegionMemory {
    Shm(Arc<ShmMapping>),
    /// Device memory at `ptr`: reached only through the provider's copies.
    Device {
        backing: Arc<DeviceBacking>,
        ptr: u64,
        len: usize,
    },
}

impl Region {
    /// The region's id, for block descriptors.
    pub fn id(&self) -> RegionId {
        self.id
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match &self.memory {
            RegionMemory::Shm(mapping) => mapping.len(),
            RegionMemory::Device { len, .. } => *len,
        }
    }

    /// Never true: empty regions are refused.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where its bytes live.
    pub fn memory(&self) -> MemoryKind {
        match &self.memory {
            RegionMemory::Shm(_) => MemoryKind::Host,
            RegionMemory::Device { backing, .. } => MemoryKind::Gpu(backing.ordinal),
        }
    }

    /// First byte. For host memory, writing through it races with transfers
    /// into the region (keep them apart as with any DMA buffer); for GPU
    /// memory it is a device address, for the GPU's own kernels and copies,
    /// never to be dereferenced on the host.
    pub fn as_ptr(&self) -> *mut u8 {
        match &self.memory {
            RegionMemory::Shm(mapping) => mapping.as_ptr(),
            RegionMemory::Device { ptr, .. } => *ptr as *mut u8,
        }
    }

    /// The backing file under /dev/shm (none for GPU memory).
    pub fn shm_path(&self) -> Option<&std::path::Path> {
        match &self.memory {
            RegionMemory::Shm(mapping) => Some(mapping.path()),
            RegionMemory::Device { .. } => None,
        }
    }

    fn range(&self, offset: u64, len: usize) -> Result<*mut u8> {
        check_range(self.id, Side::Local, 0, offset, len as u64, self.len() as u64)?;
        // SAFETY: offset + len <= self.len() was just checked (for device
        // memory the address is only computed, never dereferenced).
        Ok(unsafe { self.as_ptr().add(offset as usize) })
    }

    /// Copies `bytes` into the region at `offset` (bounds checked; GPU
    /// memory through the provider's copy engine, waiting for it).
    ///
    /// A region is memory that this engine's lanes, its peers (over shm,
    /// cma, tcp, a NIC) and other handles write while it is registered,
    /// with no lock that this call could take: the caller keeps the copy
    /// apart from them, as with any DMA buffer.
    ///
    /// # Safety
    ///
    /// For the whole call nothing else reads or writes
    /// `offset..offset + bytes.len()` of this region: no batch naming those
    /// bytes is in flight on this engine (submitted and not yet ended), no
    /// peer's batch moves them (a target does not see those coming), and no
    /// other thread copies into or out of them. A race is undefined
    /// behaviour under Rust's memory model, not merely torn bytes.
    pub unsafe fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        let dst = self.range(offset, bytes.len())?;
        match &self.memory {
            RegionMemory::Device { backing, .. } => backing.write(dst as u64, bytes),
            RegionMemory::Shm(_) => {
                // SAFETY: `dst..dst+len` is inside the mapping (checked
                // above), which cannot overlap a Rust slice the caller owns;
                // nothing else touches it during the copy (the contract).
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) };
                Ok(())
            }
        }
    }

    /// Copies from the region at `offset` into `out` (bounds checked; GPU
    /// memory through the provider's copy engine, waiting for it).
    ///
    /// # Safety
    ///
    /// For the whole call nothing writes `offset..offset + out.len()` of
    /// this region: no batch that writes those bytes is in flight on this
    /// engine or a peer, and no other thread copies into them (see
    /// [`write_at`](Self::write_at)). Concurrent readers are fine.
    pub unsafe fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let src = self.range(offset, out.len())?;
        match &self.memory {
            RegionMemory::Device { backing, .. } => backing.read(src as u64, out),
            RegionMemory::Shm(_) => {
                // SAFETY: as in `write_at`; nothing writes the source during
                // the copy (the contract).
                unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
                Ok(())
            }
        }
    }

    /// Checksum of `len` bytes at `offset`: equal to what the owning engine
    /// computes for a peer (`Segment::remote_checksum`).
    ///
    /// # Safety
    ///
    /// As [`read_at`](Self::read_at): nothing writes those bytes during the
    /// call.
    pub unsafe fn checksum(&self, offset: u64, len: usize) -> Result<u64> {
        let src = self.range(offset, len)?;
        match &self.memory {
            RegionMemory::Device { backing, .. } => crate::mem::checksum::checksum_device(backing, src as u64, len),
            // SAFETY: in bounds (checked) of a mapping this handle keeps
            // alive; nothing writes it during the call (the contract).
            RegionMemory::Shm(_) => Ok(unsafe { crate::mem::checksum_shared(src, len) }),
        }
    }

    /// Fills the whole region with a deterministic pattern from `seed`
    /// (tests and the bench use it to make every block's bytes distinct).
    ///
    /// # Safety
    ///
    /// As [`write_at`](Self::write_at), for the whole region.
    pub unsafe fn fill_pattern(&self, seed: u64) {
        // Written through a bounce buffer, so no `&mut` to the mapping is
        // ever made.
        const BOUNCE: usize = 1 << 20;
        let mut bounce = vec![0u8; BOUNCE.min(self.len())];
        let whole = self.len() - self.len() % 8;
        let mut offset = 0;
        while offset < whole {
            let n = (whole - offset).min(BOUNCE);
            fill_words(&mut bounce[..n], seed, (offset / 8) as u64);
            // SAFETY: the caller's contract covers the whole region.
            let _ = unsafe { self.write_at(offset as u64, &bounce[..n]) };
            offset += n;
        }
        let tail: Vec<u8> = (0..self.len() - whole).map(|j| (seed as u8).wrapping_add(j as u8)).collect();
        // SAFETY: as above.
        let _ = unsafe { self.write_at(whole as u64, &tail) };
    }
}

/// Fills `bytes` with a pattern derived from `seed` and each word's position
/// (what [`Region::fill_pattern`] writes, for tests to compare against).
#[cfg(any(test, feature = "testing"))]
pub fn fill_pattern(bytes: &mut [u8], seed: u64) {
    let whole = bytes.len() - bytes.len() % 8;
    fill_words(&mut bytes[..whole], seed, 0);
    for (j, b) in bytes[whole..].iter_mut().enumerate() {
        *b = (seed as u8).wrapping_add(j as u8);
    }
}

/// The pattern's whole words, the first being word `first` of the region.
fn fill_words(bytes: &mut [u8], seed: u64, first: u64) {
    for (i, chunk) in bytes.chunks_exact_mut(8).enumerate() {
        let v = (seed ^ (first + i as u64)).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17);
        chunk.copy_from_slice(&v.to_le_bytes());
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
        Ok(Self { id, memory: RegionMemory::Shm(mapping) })
    }

    /// A region in GPU memory at `ptr`, `len` bytes, backed by `backing`.
    pub(crate) fn on_device(id: RegionId, backing: Arc<DeviceBacking>, ptr: u64, len: usize) -> Self {
        Self { id, memory: RegionMemory::Device { backing, ptr, len } }
    }
}

//! Bounce memory for device blocks crossing hosts over tcp: a fixed pool of
//! pinned host pages, allocated and registered with the GPU provider once
//! (at the first staged chunk) and reused for good, so staging never
//! allocates or pins on the data path. A chunk takes whole pages; its
//! blocks are packed into them back to back, and a block larger than what
//! is left of a page is split across pages (each piece becomes its own
//! frame). A pool that has no pages free makes the chunk wait, never fail.

use crate::error::{Error, Result};
use crate::gpu::Gpu;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

/// Bytes of one page: one frame's largest payload.
pub(crate) const STAGE_PAGE_BYTES: usize = super::tcp::frame::MAX_FRAME_PAYLOAD_BYTES as usize;

/// A lane's staging counters: pools made (each allocated and pinned once,
/// never per transfer) and released, and pages handed out and not yet given
/// back.
#[derive(Debug, Default)]
pub(crate) struct StageCounters {
    /// Pools that allocated and pinned their memory.
    pub pools_pinned: AtomicU64,
    /// Pools dropped (their memory unpinned and unmapped).
    pub pools_released: AtomicU64,
    /// Pages handed out and not yet given back.
    pub pages_out: AtomicI64,
}

/// A pool of pinned pages, owned by one lane's link or one lane's served
/// connections.
pub(crate) struct StagePool {
    gpu: Arc<dyn Gpu>,
    counters: Arc<StageCounters>,
    pages: usize,
    /// The pages, once allocated and pinned.
    memory: Option<memmap2::MmapMut>,
    free: Vec<u32>,
    /// Pages went back since [`StagePool::take_returned`] last looked.
    returned: bool,
}

impl std::fmt::Debug for StagePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagePool").field("pages", &self.pages).field("free", &self.free.len()).finish()
    }
}

impl StagePool {
    /// A pool of `pages` pages through `gpu`, counted in `counters`;
    /// nothing is allocated yet.
    pub fn new(gpu: Arc<dyn Gpu>, pages: usize, counters: Arc<StageCounters>) -> Self {
        Self { gpu, counters, pages: pages.max(1), memory: None, free: Vec::new(), returned: false }
    }

    /// The GPU provider the pool pins with (and its copies use).
    pub fn gpu(&self) -> &Arc<dyn Gpu> {
        &self.gpu
    }

    /// Allocates and pins the pages, the first time.
    fn ensure(&mut self) -> Result<()> {
        if self.memory.is_some() {
            return Ok(());
        }
        let len = self.pages * STAGE_PAGE_BYTES;
        let mut memory = memmap2::MmapMut::map_anon(len).map_err(|e| Error::io("allocating tcp staging memory", e))?;
        // Touch every page now, so no fault lands on the data path.
        memory.iter_mut().step_by(4096).for_each(|b| *b = 0);
        // SAFETY: the mapping stays mapped until `drop`, which unregisters
        // it first.
        unsafe { self.gpu.host_register(memory.as_mut_ptr() as u64, len as u64)? };
        self.counters.pools_pinned.fetch_add(1, Ordering::Relaxed);
        self.memory = Some(memory);
        self.free = (0..self.pages as u32).rev().collect();
        Ok(())
    }

    /// Takes `count` pages into `into`; false (nothing taken) when fewer
    /// are free. An error only if the pool could not be made.
    pub fn take(&mut self, count: usize, into: &mut Vec<u32>) -> Result<bool> {
        self.ensure()?;
        if count > self.free.len() {
            return Ok(false);
        }
        into.extend(self.free.drain(self.free.len() - count..));
        self.counters.pages_out.fetch_add(count as i64, Ordering::Relaxed);
        Ok(true)
    }

    /// Gives pages back.
    pub fn give(&mut self, pages: &mut Vec<u32>) {
        self.counters.pages_out.fetch_sub(pages.len() as i64, Ordering::Relaxed);
        self.returned |= !pages.is_empty();
        self.free.append(pages);
    }

    /// True (once) when pages went back since the last call.
    pub fn take_returned(&mut self) -> bool {
        std::mem::take(&mut self.returned)
    }

    /// True when a page is free (or the pool is not made yet).
    pub fn has_free(&self) -> bool {
        self.memory.is_none() || !self.free.is_empty()
    }

    /// Pages free now.
    #[cfg(test)]
    pub fn free_pages(&self) -> usize {
        if self.memory.is_some() {
            self.free.len()
        } else {
            self.pages
        }
    }

    /// The first byte of `page`.
    pub fn page(&self, page: u32) -> *mut u8 {
        let memory = self.memory.as_ref().expect("pages are handed out only after the pool is made");
        debug_assert!((page as usize) < self.pages);
        memory.as_ptr().wrapping_add(page as usize * STAGE_PAGE_BYTES).cast_mut()
    }
}

impl Drop for StagePool {
    fn drop(&mut self) {
        if let Some(memory) = self.memory.take() {
            // Pages still out go with the pool (whoever held them is being
            // dropped with it, its copies ended: see the owners' drops).
            let out = self.pages - self.free.len();
            self.counters.pages_out.fetch_sub(out as i64, Ordering::Relaxed);
            let _ = self.gpu.host_unregister(memory.as_ptr() as u64);
            self.counters.pools_released.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Pages a chunk of `lens` needs, packed back to back with no block crossing
/// a page unless it is larger than what is left (then it is split).
pub(crate) fn pages_for(lens: impl Iterator<Item = u64>) -> usize {
    let total: u64 = lens.sum();
    total.div_ceil(STAGE_PAGE_BYTES as u64) as usize
}

/// Lays a chunk's staged bytes over its pages, in order: each call gives
/// where the next `len` bytes go, as pieces of at most one page.
#[derive(Debug)]
pub(crate) struct Packer<'a> {
    pool: &'a StagePool,
    pages: &'a [u32],
    page: usize,
    used: usize,
}

impl<'a> Packer<'a> {
    /// Packs into `pages` of `pool`.
    pub fn new(pool: &'a StagePool, pages: &'a [u32]) -> Self {
        Self { pool, pages, page: 0, used: 0 }
    }

    /// Places `len` bytes: calls `piece(at, offset, n)` for each piece
    /// (`offset` into the `len` bytes). The pages must hold them
    /// ([`pages_for`]): a chunk's bytes are packed densely, pages in order.
    pub fn place(&mut self, len: u64, mut piece: impl FnMut(*mut u8, u64, u64)) {
        let mut done = 0u64;
        while done < len {
            if self.used == STAGE_PAGE_BYTES {
                self.page += 1;
                self.used = 0;
            }
            let room = (STAGE_PAGE_BYTES - self.used) as u64;
            let n = room.min(len - done);
            let at = self.pool.page(self.pages[self.page]).wrapping_add(self.used);
            piece(at, done, n);
            self.used += n as usize;
            done += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::SimGpu;

    #[test]
    fn a_pool_is_made_and_pinned_once_and_pages_go_round() {
        let sim = Arc::new(SimGpu::new(1, std::time::Duration::ZERO));
        let gpu: Arc<dyn Gpu> = sim.clone();
        let mut pool = StagePool::new(gpu, 3, Arc::default());
        assert_eq!(pool.free_pages(), 3);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        assert!(pool.take(2, &mut a).unwrap());
        assert!(!pool.take(2, &mut b).unwrap(), "one page is left");
        assert!(b.is_empty());
        assert!(pool.take(1, &mut b).unwrap());
        assert_eq!(pool.free_pages(), 0);
        pool.give(&mut a);
        assert_eq!((pool.free_pages(), a.len()), (2, 0));
        // The pages are pinned with the provider, and unpinned when dropped.
        let first = pool.page(b[0]) as u64;
        let start = pool.page(0) as u64;
        assert!(sim.is_host_registered(start), "the staging pages are pinned");
        assert!(first >= start);
        drop(pool);
        assert!(!sim.is_host_registered(start));
    }

    #[test]
    fn blocks_pack_back_to_back_and_a_large_one_splits_at_page_ends() {
        let gpu: Arc<dyn Gpu> = Arc::new(SimGpu::new(1, std::time::Duration::ZERO));
        let mut pool = StagePool::new(gpu, 4, Arc::default());
        let page = STAGE_PAGE_BYTES as u64;
        let lens = [4096, page - 4096 + 10, 2 * page];
        assert_eq!(pages_for(lens.iter().copied()), 4);
        let mut pages = Vec::new();
        assert!(pool.take(4, &mut pages).unwrap());
        let mut packer = Packer::new(&pool, &pages);
        let mut pieces = Vec::new();
        for len in lens {
            packer.place(len, |at, offset, n| pieces.push((at as usize, offset, n)));
        }
        let base = |i: usize| pool.page(pages[i]) as usize;
        assert_eq!(pieces[0], (base(0), 0, 4096));
        assert_eq!(pieces[1], (base(0) + 4096, 0, page - 4096));
        assert_eq!(pieces[2], (base(1), page - 4096, 10));
        assert_eq!(pieces[3], (base(1) + 10, 0, page - 10));
        assert_eq!(pieces[4], (base(2), page - 10, page));
        assert_eq!(pieces[5], (base(3), 2 * page - 10, 10));
    }
}

//! Fenced destinations, the target's side: [`Engine::fence`] takes a range
//! of a region back from whoever was granted it and hands out a new grant
//! (`mem::fence`, docs/ARCHITECTURE.md "Fenced destinations").

use super::Engine;
use crate::desc::RegionId;
use crate::error::{Error, Result, Side};
use crate::mem::fence::{next_grant, pauser, FenceFailed, Span};
use std::time::{Duration, Instant};

/// Longest [`Engine::fence`] waits for writes under older grants that are
/// in progress in the region (each is one chunk of copies, microseconds;
/// only a writer stopped inside its copy makes it wait this long).
pub const FENCE_WAIT: Duration = Duration::from_secs(2);

/// Fences of this process, one at a time: each table takes one fencer at
/// a time, and one fence enters its grant in two tables.
static FENCING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds off this process's fences (an rdma connect lists its initiator as
/// a writer and takes the snapshot of the tables under it).
pub(super) fn fencing() -> std::sync::MutexGuard<'static, ()> {
    FENCING.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// As [`fencing`], waiting at most until `deadline` (`Timeout`): an rdma
/// connect's handler does not wait on fences, one after another, past
/// the time its initiator waits for the answer.
pub(super) fn fencing_until(deadline: Instant) -> Result<std::sync::MutexGuard<'static, ()>> {
    let started = Instant::now();
    let mut pause = pauser(deadline);
    loop {
        match FENCING.try_lock() {
            Ok(guard) => return Ok(guard),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => return Ok(poisoned.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => {}
        }
        if !pause() {
            let waited = started.elapsed();
            return Err(Error::Timeout { what: "the fence in progress at the rdma target", waited });
        }
    }
}

impl Engine {
    /// Fences `[offset, offset + len)` of `region` and returns the new
    /// grant for it: from the moment this returns, no write under an older
    /// grant (or under none) is in the range and none starts; a batch that
    /// names an older grant for it fails `Fenced`, and none of the refused
    /// bytes land. Hand the grant to the one sender that may write there
    /// ([`Batch::grant`](crate::Batch::grant)).
    ///
    /// The grant is checked by whoever writes (this target's lanes for
    /// tcp; a same-host peer's own lane for shm, cma and cuda_ipc, against
    /// tables in memory both map; an rdma peer's lanes against mirrors of
    /// the tables in its own memory). Fencing a range no write is in sends
    /// no message, except one request to each rdma peer holding QPs here,
    /// all at once, answered once its writes before the fence completed (a
    /// peer that does not answer in time has its QPs here moved to the
    /// error state, so nothing of it lands after). Grants rise across the
    /// process, so a grant of another range never passes for an older one.
    ///
    /// `RegionBusy` when a write under an older grant did not end within
    /// `FENCE_WAIT` (2 s; the range then stays fenced under a grant nobody
    /// holds: fence it again).
    pub fn fence(&self, region: RegionId, offset: u64, len: u64) -> Result<u32> {
        self.fence_ranges(&[(region, offset, len)])
    }

    /// As [`fence`](Self::fence), for `(region, offset, len)` ranges under
    /// one grant (a request's blocks in every layer): equal ranges equally
    /// spaced in a region take one entry of its table (a layer-major KV
    /// pool's request is one entry, however many layers).
    pub fn fence_ranges(&self, ranges: &[(RegionId, u64, u64)]) -> Result<u32> {
        if ranges.is_empty() {
            return Err(Error::invalid("fence", "no range to fence"));
        }
        let mut by_region: Vec<(RegionId, Vec<(u64, u64)>)> = Vec::new();
        for &(region, offset, len) in ranges {
            let entry = self.inner.registry.get(region)?;
            crate::mem::registry::check_range(region, Side::Local, 0, offset, len, entry.len as u64)?;
            if len == 0 {
                return Err(Error::invalid("fence length", "must be greater than zero"));
            }
            match by_region.iter_mut().find(|(r, _)| *r == region) {
                Some((_, list)) => list.push((offset, len)),
                None => by_region.push((region, vec![(offset, len)])),
            }
        }
        let _serial = fencing();
        let grant = next_grant()
            .ok_or_else(|| Error::invalid("fence", "every grant of this process was issued; start a new one"))?;
        let deadline = Instant::now() + FENCE_WAIT;
        let mut pushed = Vec::with_capacity(by_region.len());
        let mut failed = None;
        for (region, list) in &mut by_region {
            let region = *region;
            let entry = self.inner.registry.get(region)?;
            let spans = spans_of(list);
            let busy = |FenceFailed::Busy(n): FenceFailed| Error::RegionBusy {
                region,
                in_flight: u32::try_from(n).unwrap_or(u32::MAX),
            };
            // The region's own table, by offset: tcp and staged copies at
            // this end, shm peers (a region file's table) and cuda_ipc peers
            // (a GPU region's page).
            let own = entry.fence_view().fence(&spans, grant, pauser(deadline));
            // Same-host cma peers check the page's table, by address here.
            // Entered even when the wait above failed: a failed fence
            // leaves its range fenced for every writer, cma's included.
            let page = match (self.inner.context.cma.as_ref(), entry.info.memory) {
                (Ok(cma), crate::mem::MemoryKind::Host) => {
                    let at = entry.addr as u64;
                    let spans: Vec<Span> = spans.iter().map(|s| Span { start: at + s.start, ..*s }).collect();
                    cma.fences().fence(&spans, grant, pauser(deadline))
                }
                _ => Ok(()),
            };
            if let Err(error) = own.and(page) {
                failed.get_or_insert(busy(error));
            }
            pushed.push((region.raw(), spans));
        }
        // rdma writers' mirrors, also when a wait above failed.
        super::fence_rdma::push(self, grant, &pushed, deadline);
        match failed {
            Some(error) => Err(error),
            None => Ok(grant),
        }
    }

    /// Fences blocks `ids` of this engine's KV layout
    /// ([`set_kv_layout`](Self::set_kv_layout)) in every layer and kind, under
    /// one grant: what a decode engine does when it gives a request its
    /// blocks, before it hands the grant to the request's sender with the
    /// block table ([`Submitter::push_blocks_granted`](crate::Submitter::push_blocks_granted)).
    pub fn fence_blocks(&self, ids: &[u64]) -> Result<u32> {
        let layout = self
            .kv_layout()
            .ok_or_else(|| Error::invalid("fence_blocks", "this engine has no KV layout (set_kv_layout)"))?;
        let descs = crate::kv::plan_blocks(&layout, &layout, crate::ring::Opcode::Write, ids, ids)?;
        let ranges: Vec<_> = descs.iter().map(|d| (d.remote_region, d.remote_offset, d.len)).collect();
        self.fence_ranges(&ranges)
    }
}

/// One region's ranges as few spans as their pattern allows: runs of equal
/// lengths equally spaced (in offset order) become one span each.
fn spans_of(ranges: &mut [(u64, u64)]) -> Vec<Span> {
    ranges.sort_unstable();
    let mut spans: Vec<Span> = Vec::new();
    for &(start, len) in ranges.iter() {
        if let Some(last) = spans.last_mut() {
            let gap = start - last.start;
            let extends = len == last.len
                && if last.count == 1 { gap >= len } else { last.stride.checked_mul(last.count) == Some(gap) };
            if extends {
                if last.count == 1 {
                    last.stride = gap;
                }
                last.count += 1;
                continue;
            }
        }
        spans.push(Span::range(start, len));
    }
    spans
}

impl crate::Submitter {
    /// As [`push_blocks`](Self::push_blocks), the push naming `grant` (from
    /// the target's [`Engine::fence_blocks`] of `dst_ids`, carried with the
    /// block table): it lands only where no newer fence covers it, else it
    /// fails `Fenced` and none of the refused bytes land.
    pub fn push_blocks_granted(
        &mut self,
        segment: &crate::Segment,
        local: &crate::kv::KvLayout,
        remote: &crate::kv::KvLayout,
        src_ids: &[u64],
        dst_ids: &[u64],
        grant: u32,
    ) -> Result<crate::BatchId> {
        let descs = crate::kv::plan_blocks(local, remote, crate::ring::Opcode::Write, src_ids, dst_ids)?;
        self.submit(&crate::Batch::write(segment).descs(&descs).grant(grant))
    }

    /// As [`push_layer`](Self::push_layer), the push naming `grant` (see
    /// [`push_blocks_granted`](Self::push_blocks_granted)).
    #[allow(clippy::too_many_arguments)]
    pub fn push_layer_granted(
        &mut self,
        segment: &crate::Segment,
        local: &crate::kv::KvLayout,
        remote: &crate::kv::KvLayout,
        layer: u32,
        src_ids: &[u64],
        dst_ids: &[u64],
        grant: u32,
    ) -> Result<crate::BatchId> {
        let descs = crate::kv::plan_layer(local, remote, crate::ring::Opcode::Write, layer, src_ids, dst_ids)?;
        self.submit(&crate::Batch::write(segment).descs(&descs).grant(grant))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equally_spaced_equal_ranges_make_one_span_and_others_their_own() {
        let mut layer_major = vec![(1000, 100), (200, 100), (600, 100), (1400, 100)];
        assert_eq!(spans_of(&mut layer_major), vec![Span { start: 200, len: 100, stride: 400, count: 4 }]);
        let mut mixed = vec![(0, 10), (100, 10), (150, 10), (200, 20)];
        assert_eq!(
            spans_of(&mut mixed),
            vec![Span { start: 0, len: 10, stride: 100, count: 2 }, Span::range(150, 10), Span::range(200, 20)]
        );
    }
}

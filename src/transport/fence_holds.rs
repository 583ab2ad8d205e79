//! A cuda_ipc chunk's counts in the fence tables of the peer regions it
//! writes (`mem::fence`): kept until its copies completed, released then,
//! or kept for good (poisoned) when that end is unknown. Split from
//! `cuda_ipc.rs` (docs/ARCHITECTURE.md, "Fenced destinations").

use crate::gpu::{Event, Gpu};
use crate::mem::fence::{FenceView, Held};
use crate::mem::fence_file::SharedFences;
use std::sync::Arc;

/// Where a peer region's fence table is mapped here, kept mapped by the
/// `Arc` while a chunk holds a count in it.
#[derive(Debug, Clone)]
pub(crate) enum FenceTables {
    /// A peer GPU region's page (`mem::fence_file`).
    Page(Arc<SharedFences>),
    /// A peer's host region files (a same-host link's mappings, by region
    /// slot), each with its table in its header page.
    Mappings(Arc<[Option<crate::mem::ShmMapping>]>),
}

impl FenceTables {
    /// The table of region slot `slot` (a page has one table).
    pub(super) fn view(&self, slot: usize) -> Option<FenceView<'_>> {
        match self {
            Self::Page(page) => Some(page.view()),
            Self::Mappings(all) => all.get(slot)?.as_ref().map(crate::mem::ShmMapping::fences),
        }
    }
}

/// A chunk's count in one peer region's fence table (`mem::fence`), kept
/// until the chunk's copies ended, so that a fence meanwhile waits for
/// them: the pass is taken before the chunk's first check and released
/// when this is dropped.
#[derive(Debug)]
pub(super) struct FenceHold {
    /// Keeps the table mapped until the count is released (never read).
    pub(super) _tables: FenceTables,
    /// The table's first word, as an address (which run of blocks it is).
    pub(super) words: usize,
    pub(super) held: Option<Held>,
}

impl FenceHold {
    /// Keeps the count for good: for a chunk whose copies may still run
    /// though nobody will see them end (its event's query failed, or the
    /// lane stops with it in flight). Releasing would let a fence return
    /// while a stale copy can still land; kept, the table's next fences
    /// of that phase parity fail `RegionBusy` instead (fail safe: the
    /// owner learns its range is not known clean).
    pub(super) fn poison(mut self) {
        if let Some(held) = self.held.take() {
            // SAFETY: entered in a table of `_tables`, mapped until this
            // returns (the count stays in the table's shared words).
            unsafe { held.poison() };
        }
    }
}

impl Drop for FenceHold {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            // SAFETY: entered in a table of `_tables`, which keeps it mapped.
            unsafe { held.release() };
        }
    }
}

/// How long a stopping lane waits, in all, for its chunks in flight that
/// hold fence counts to complete before it poisons their counts.
pub(super) const STOP_FENCE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// A chunk dropped in flight (the lane stops): its fence counts are
/// released once its event says its copies completed (looked at until
/// `deadline`); otherwise a copy may still land, and they stay counted
/// (`FenceHold::poison`).
pub(super) fn release_if_done(gpu: &dyn Gpu, event: Event, holds: &mut Vec<FenceHold>, deadline: std::time::Instant) {
    if holds.is_empty() {
        return;
    }
    loop {
        match gpu.query(event) {
            Ok(true) => return holds.clear(),
            Ok(false) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            _ => return holds.drain(..).for_each(FenceHold::poison),
        }
    }
}

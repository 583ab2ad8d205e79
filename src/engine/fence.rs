//! Fenced destinations, the target's side: [`Engine::fence`] takes a range
//! of a region back from whoever was granted it and hands out a new grant
//! (`mem::fence`, docs/ARCHITECTURE.md "Fenced destinations").

use super::Engine;
use crate::desc::RegionId;
use crate::error::{Error, Result, Side};
use crate::mem::fence::{next_grant, FenceFailed};
use std::time::{Duration, Instant};

/// Longest [`Engine::fence`] waits for writes under older grants that are
/// in progress in the region (each is one chunk of copies, microseconds;
/// only a writer stopped inside its copy makes it wait this long).
pub const FENCE_WAIT: Duration = Duration::from_secs(2);

/// Fences of this process, one at a time: each table takes one fencer at
/// a time, and one fence enters its grant in two tables.
static FENCING: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Engine {
    /// Fences `[offset, offset + len)` of `region` and returns the new
    /// grant for it: from the moment this returns, no write under an older
    /// grant (or under none) is in the range and none starts; a batch that
    /// names an older grant for it fails `Fenced`, and none of the refused
    /// bytes land. Hand the grant to the one sender that may write there
    /// ([`Batch::grant`](crate::Batch::grant)).
    ///
    /// Fencing a range no write is in sends no message: the grant is
    /// checked by whoever writes (this target's lanes for tcp and staged
    /// GPU copies; a same-host peer's own lane for shm and cma, against
    /// tables in memory both map). Grants rise across the process, so a
    /// grant of another range never passes for an older one.
    ///
    /// `RegionBusy` when a write under an older grant did not end within
    /// [`FENCE_WAIT`] (the range then stays fenced under a grant nobody
    /// holds: fence it again).
    pub fn fence(&self, region: RegionId, offset: u64, len: u64) -> Result<u32> {
        let entry = self.inner.registry.get(region)?;
        crate::mem::registry::check_range(region, Side::Local, 0, offset, len, entry.len as u64)?;
        if len == 0 {
            return Err(Error::invalid("fence length", "must be greater than zero"));
        }
        // In bounds (checked above), so no sum overflows.
        let end = offset + len;
        let _serial = FENCING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let grant = next_grant()
            .ok_or_else(|| Error::invalid("fence", "every grant of this process was issued; start a new one"))?;
        let deadline = Instant::now() + FENCE_WAIT;
        let busy = |writing: u64| Error::RegionBusy { region, in_flight: u32::try_from(writing).unwrap_or(u32::MAX) };
        // The region's own table, by offset: tcp and staged copies at this
        // end, and shm peers (a region file's table).
        entry.fence_view().fence(offset, end, grant, pauser(deadline)).map_err(|FenceFailed::Busy(n)| busy(n))?;
        // Same-host cma peers check the page's table, by address here.
        if let (Ok(cma), crate::mem::MemoryKind::Host) = (self.inner.context.cma.as_ref(), entry.info.memory) {
            let at = entry.addr as u64;
            cma.fences()
                .fence(at + offset, at + end, grant, pauser(deadline))
                .map_err(|FenceFailed::Busy(n)| busy(n))?;
        }
        Ok(grant)
    }
}

/// Sleeps between looks at writers in progress (doubling to 1 ms); false
/// once `deadline` passed.
fn pauser(deadline: Instant) -> impl FnMut() -> bool {
    let mut pause = Duration::from_micros(1);
    move || {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(1));
        true
    }
}

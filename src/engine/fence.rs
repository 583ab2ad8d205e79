//! Fenced destinations, the target's side: [`Engine::fence`] takes a range
//! of a region back from whoever was granted it and hands out a new grant
//! (`mem::fence`, docs/ARCHITECTURE.md "Fenced destinations").

use super::Engine;
use crate::desc::RegionId;
use crate::error::{Error, Result, Side};
use crate::mem::fence::FenceFailed;
use std::time::{Duration, Instant};

/// Longest [`Engine::fence`] waits for writes under older grants that are
/// in progress in the region (each is one chunk of copies, microseconds;
/// only a writer stopped inside its copy makes it wait this long).
pub const FENCE_WAIT: Duration = Duration::from_secs(2);

impl Engine {
    /// Fences `[offset, offset + len)` of `region` and returns the new
    /// grant for it: from the moment this returns, no write under an older
    /// grant (or under none) is in the range and none starts; a batch that
    /// names an older grant for it fails `Fenced`, and none of the refused
    /// bytes land. Hand the grant to the one sender that may write there
    /// ([`Batch::grant`](crate::Batch::grant)).
    ///
    /// Fencing a range no write is in costs no message to any peer: the
    /// grant is checked by whoever writes (at this target for tcp, by the
    /// peer's own lane for shm, against the region file's table).
    ///
    /// Regions from [`alloc_region`](Self::alloc_region) only, for now: a
    /// region of caller memory is refused with `Unsupported`. `RegionBusy`
    /// when a write under an older grant did not end within
    /// [`FENCE_WAIT`] (the range then stays fenced under a grant nobody
    /// holds: fence it again).
    pub fn fence(&self, region: RegionId, offset: u64, len: u64) -> Result<u32> {
        let entry = self.inner.registry.get(region)?;
        crate::mem::registry::check_range(region, Side::Local, 0, offset, len, entry.len as u64)?;
        // In bounds (checked above), so no overflow.
        let end = offset + len;
        if len == 0 {
            return Err(Error::invalid("fence length", "must be greater than zero"));
        }
        let Some(shm) = entry.shm.as_deref() else {
            return Err(Error::Unsupported {
                what: format!("fencing region {region}: only regions from alloc_region can be fenced so far"),
            });
        };
        // One fence (or unregister) of a region at a time.
        let _serial = shm.unregistering.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let deadline = Instant::now() + FENCE_WAIT;
        let mut pause = Duration::from_micros(1);
        let fenced = shm.fences().fence(offset, end, || {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
            true
        });
        match fenced {
            Ok(grant) => Ok(grant),
            Err(FenceFailed::Busy(writing)) => {
                Err(Error::RegionBusy { region, in_flight: u32::try_from(writing).unwrap_or(u32::MAX) })
            }
            Err(FenceFailed::Exhausted) => {
                Err(Error::invalid("fence", format!("every grant of region {region} was issued; register it again")))
            }
        }
    }
}

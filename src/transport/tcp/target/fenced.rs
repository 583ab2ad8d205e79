//! A target connection's grants (`mem::fence`): the grant a GRANT frame
//! names for the WRITE frames after it, and the check, under a pass of the
//! destination's fence table, before every piece of a payload lands in a
//! region (so that once `Engine::fence` returned, no stale piece lands,
//! even of a frame whose header came before the fence).

use super::super::frame::FrameHeader;
use super::{Receiving, TargetConn, TargetContext};
use crate::desc::RegionId;
use crate::error::{Error, Result};
use crate::mem::fence::{FenceView, Pass, FENCE_WORDS};
use crate::mem::registry::RegionEntry;
use crate::sync::AtomicU64;

/// The fence table of the region a WRITE frame's payload lands in, kept
/// with the frame's lease.
#[derive(Debug, Clone, Copy)]
pub(super) struct FrameFence {
    words: *const AtomicU64,
    region: RegionId,
    grant: u32,
}

// SAFETY: it points at a fence table's atomic words (shared between
// threads by design), which the frame's kept lease keeps alive wherever the
// frame's state travels (its connection, or its lane's orphaned groups).
unsafe impl Send for FrameFence {}

impl FrameFence {
    /// The table of `entry` (leased for the frame), for a write under `grant`.
    pub fn of(entry: &RegionEntry, region: RegionId, grant: u32) -> Self {
        let view = entry.fence_view();
        Self { words: view.words().as_ptr(), region, grant }
    }

    /// Enters the table; `Err(Fenced)` when `[offset, offset + len)` is
    /// fenced under a newer grant than the frame's.
    ///
    /// # Safety
    ///
    /// The frame's lease on the region is still kept (it keeps the entry,
    /// and so its table, alive).
    pub unsafe fn admit(&self, offset: u64, len: u64) -> Result<Pass<'_>> {
        // SAFETY: a table of FENCE_WORDS words that the kept lease keeps
        // alive (our contract) for as long as `self` is borrowed.
        let words = unsafe { std::slice::from_raw_parts(self.words, FENCE_WORDS) };
        let fenced = Error::Fenced { region: self.region, grant: self.grant };
        let pass = FenceView::new(words).enter().ok_or(Error::RegionBusy { region: self.region, in_flight: 0 })?;
        if pass.admits(offset, offset.saturating_add(len), self.grant) {
            Ok(pass)
        } else {
            Err(fenced)
        }
    }
}

impl TargetConn {
    /// A GRANT frame: the WRITE frames after it name `offset` as their grant.
    pub(super) fn on_grant(&mut self, header: &FrameHeader) -> Result<()> {
        let grant = u32::try_from(header.offset)
            .map_err(|_| Error::malformed("frame", format!("grant {} is past 32 bits", header.offset)))?;
        // Grants are this process's counter: one above the last it issued
        // was given to nobody, and would pass every fence. The writes under
        // it are refused `Fenced`, as a one-sided writer's are by the
        // table's `issued` word; the connection stays framed.
        self.made_up = !crate::mem::fence::issued(grant);
        self.grant = grant;
        Ok(())
    }

    /// Stamps this connection's grant on a checked WRITE's fence and checks
    /// its whole range once at its header (a payload into host memory is
    /// checked again before each piece lands; a staged one again just
    /// before its device copy is issued, `staging::issue`, under a pass
    /// then kept until that copy completed); a refusal gives the kept lease
    /// back.
    pub(super) fn check_grant(
        &mut self,
        ctx: &TargetContext,
        (addr, device, fence): (usize, Option<super::frames::Device>, FrameFence),
    ) -> Result<(usize, Option<super::frames::Device>, FrameFence)> {
        let fence = FrameFence { grant: self.grant, ..fence };
        let header = &self.current;
        let admitted = match self.made_up {
            true => Err(Error::Fenced { region: fence.region, grant: fence.grant }),
            // SAFETY: `check_block` kept the lease this frame holds.
            false => unsafe { fence.admit(header.offset, header.len.into()) },
        };
        match admitted {
            Ok(_pass) => Ok((addr, device, fence)),
            Err(error) => {
                // SAFETY: kept by `check_block` for this frame, which it now
                // refuses: given back once, here.
                unsafe { ctx.registry.release_kept(fence.region) };
                Err(error)
            }
        }
    }

    /// The fence the next piece of the current payload (`left` bytes of
    /// it not yet in) is checked under, with the piece's offset: none for
    /// a staged payload (its pages are not the region; checked at its
    /// header).
    pub(super) fn piece(&self, left: usize) -> Option<(FrameFence, u64)> {
        let header = self.current;
        self.fence.map(|fence| (fence, header.offset + (u64::from(header.len) - left as u64)))
    }

    /// The rest of the payload (`left` bytes) is refused with `error`: its
    /// lease goes back and its bytes are read and dropped.
    pub(super) fn refuse_rest(&mut self, ctx: &TargetContext, left: usize, error: Error) {
        if let (Receiving::Payload { region, .. }, Some(_)) = (self.receiving, self.fence.take()) {
            // SAFETY: `check_block` kept this lease for this frame; its
            // payload ends here, so it is given back once, here.
            unsafe { ctx.registry.release_kept(region) };
        }
        self.chunk_failure.get_or_insert((self.current, error));
        self.receiving = Receiving::Discard { left };
    }
}

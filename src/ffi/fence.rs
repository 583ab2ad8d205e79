//! The C ABI's fenced destinations (split from `ffi.rs`; the same
//! conventions: negative error codes, the message in `kvring_last_error`):
//! a decode process fences a request's blocks and hands the grant to its
//! sender with the block table (`kvring_fence`); the prefill process names
//! it on its push (`kvring_submit_granted`); a push under a stale grant
//! ends `-FENCED` and nothing of it lands.

use super::submit::{submit_and_report, submit_inputs};
use super::{guarded, null, KvringBlock, KvringEngine, KvringSegment, KvringSubmitter};
use crate::{Batch, RegionId};
use std::ffi::c_int;

/// Fences `len` bytes at `offset` of this engine's `region` and writes the
/// new grant to `grant_out`: from the moment this returns, no write under
/// an older grant is in the range and none starts (`-REGION_BUSY` when one
/// did not end in time).
///
/// # Safety
///
/// `engine` is live; `grant_out` is valid.
#[no_mangle]
pub unsafe extern "C" fn kvring_fence(
    engine: *mut KvringEngine,
    region: u64,
    offset: u64,
    len: u64,
    grant_out: *mut u32,
) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let engine = unsafe { engine.as_ref() }.ok_or_else(|| null("engine"))?;
        if grant_out.is_null() {
            return Err(null("grant_out"));
        }
        let grant = engine.0.fence(RegionId::from_raw(region), offset, len)?;
        // SAFETY: checked non-null; valid per our contract.
        unsafe { *grant_out = grant };
        Ok(0)
    })
}

/// As `kvring_submit` with `KVRING_WRITE`, the push naming `grant` (from
/// the target's `kvring_fence`) for its destination: it lands only where no
/// newer fence covers it, else the batch ends `-FENCED`.
///
/// # Safety
///
/// As `kvring_submit`.
#[no_mangle]
#[allow(clippy::too_many_arguments)] // the C signature
pub unsafe extern "C" fn kvring_submit_granted(
    submitter: *mut KvringSubmitter,
    segment: *const KvringSegment,
    blocks: *const KvringBlock,
    count: usize,
    user_data: u64,
    deadline_ms: u32,
    grant: u32,
    batch_out: *mut u64,
) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let (submitter, segment, descs) = unsafe { submit_inputs(submitter, segment, blocks, count, batch_out)? };
        let batch = Batch::write(&segment.0).descs(&descs).user_data(user_data).grant(grant);
        // SAFETY: `batch_out` was checked non-null; valid per our contract.
        unsafe { submit_and_report(submitter, batch, deadline_ms, batch_out) }
    })
}

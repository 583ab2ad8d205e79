//! The C ABI's batch ends: waiting, cancelling and reaping (split from
//! `ffi.rs`; the same conventions: negative error codes, the message in
//! `kvring_last_error`).

use super::{fail, guarded, null, KvringCompletion, KvringSubmitter};
use crate::{Error, Outcome};
use std::os::raw::c_int;
use std::time::Duration;

fn outcome_code(outcome: Outcome, bytes_out: *mut u64) -> Result<c_int, Error> {
    let (bytes, result) = match outcome {
        Outcome::Done { bytes } => (bytes, Ok(0)),
        Outcome::Failed(error) => (0, Err(error)),
        Outcome::TimedOut { bytes } => (bytes, Err(Error::DeadlinePassed { bytes })),
        Outcome::Cancelled { bytes } => (bytes, Err(Error::Cancelled { bytes })),
    };
    if !bytes_out.is_null() {
        // SAFETY: non-null; the caller passes a valid pointer or null.
        unsafe { *bytes_out = bytes };
    }
    result
}

/// Waits up to `timeout_ms` for a batch; 0 when it moved everything (bytes
/// in `bytes_out`, which may be null), else a negative code: the batch's
/// failure, or `-TIMEOUT` if it is still running.
///
/// # Safety
///
/// `submitter` is live; `bytes_out` is null or valid.
#[no_mangle]
pub unsafe extern "C" fn kvring_wait(
    submitter: *mut KvringSubmitter,
    batch: u64,
    timeout_ms: u32,
    bytes_out: *mut u64,
) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let submitter = unsafe { submitter.as_mut() }.ok_or_else(|| null("submitter"))?;
        let outcome =
            submitter.0.wait(crate::BatchId::from_raw(batch), Duration::from_millis(u64::from(timeout_ms)))?;
        outcome_code(outcome, bytes_out)
    })
}

/// Cancels a batch: blocks not yet posted are dropped; the batch ends
/// (`kvring_wait` returns `-CANCELLED`) only once every posted block has
/// drained, so its memory may be reused when that is seen. 0, or a negative
/// code (an unknown or already consumed batch).
///
/// # Safety
///
/// `submitter` is live.
#[no_mangle]
pub unsafe extern "C" fn kvring_cancel(submitter: *mut KvringSubmitter, batch: u64) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let submitter = unsafe { submitter.as_mut() }.ok_or_else(|| null("submitter"))?;
        submitter.0.cancel(crate::BatchId::from_raw(batch))?;
        Ok(0)
    })
}

/// Reaps one completion into `out`: 1 if there was one, 0 if none.
///
/// # Safety
///
/// `submitter` is live; `out` is valid.
#[no_mangle]
pub unsafe extern "C" fn kvring_reap(submitter: *mut KvringSubmitter, out: *mut KvringCompletion) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let submitter = unsafe { submitter.as_mut() }.ok_or_else(|| null("submitter"))?;
        if out.is_null() {
            return Err(null("out"));
        }
        let Some(done) = submitter.0.reap() else { return Ok(0) };
        let mut bytes = 0u64;
        let result = match outcome_code(done.outcome, &mut bytes) {
            Ok(_) => 0,
            Err(error) => fail(error),
        };
        let transport = super::transports::code(done.transport);
        // SAFETY: checked non-null; valid per our contract.
        unsafe {
            *out = KvringCompletion { batch: done.id.raw(), user_data: done.user_data, bytes, result, transport }
        };
        Ok(1)
    })
}

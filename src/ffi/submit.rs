//! The C ABI's submissions (`kvring_submit`, and `kvring_submit_with` for
//! per-batch flags: end-to-end checksums) and `kvring_open_many` (a TP
//! group's peers opened in one call, handshakes concurrent). Split from
//! `ffi.rs`; the same conventions.

use super::{
    give, guarded, null, open_transport, text, KvringBlock, KvringEngine, KvringSegment, KvringSubmitter, KVRING_READ,
    KVRING_WRITE,
};
use crate::error::Error;
use crate::{Batch, BlockDesc, Opcode, RegionId};
use std::ffi::{c_char, c_int};
use std::time::Duration;

/// `kvring_submit_with` flag: checksum this batch's blocks end to end
/// (CRC32C at the source, verified at the destination before the batch is
/// done; a mismatch fails it with `-CORRUPT`, `kvring_last_error` naming
/// the block), whatever the engine's `checksum` setting.
pub const KVRING_SUBMIT_CHECKSUM: u32 = 1;
/// `kvring_submit_with` flag: no checksum for this batch, whatever the
/// engine's setting.
pub const KVRING_SUBMIT_NO_CHECKSUM: u32 = 2;

/// Submits `count` blocks to `segment` as one batch (`KVRING_WRITE` or
/// `KVRING_READ`), with a deadline (`deadline_ms`, 0: none); writes the
/// batch id to `batch_out`.
///
/// # Safety
///
/// `submitter` and `segment` are live; `blocks` points to `count` blocks;
/// `batch_out` is valid. The memory the blocks name stays untouched by the
/// caller until the batch ends.
#[no_mangle]
pub unsafe extern "C" fn kvring_submit(
    submitter: *mut KvringSubmitter,
    segment: *const KvringSegment,
    opcode: c_int,
    blocks: *const KvringBlock,
    count: usize,
    user_data: u64,
    deadline_ms: u32,
    batch_out: *mut u64,
) -> c_int {
    // SAFETY: forwarded from our own contract.
    unsafe { kvring_submit_with(submitter, segment, opcode, blocks, count, user_data, deadline_ms, 0, batch_out) }
}

/// As `kvring_submit`, with `flags`: 0, `KVRING_SUBMIT_CHECKSUM` or
/// `KVRING_SUBMIT_NO_CHECKSUM` (0: as the engine's `checksum` setting).
/// A checksummed batch that its transport cannot verify (rdma, GPU memory)
/// fails with `-UNSUPPORTED` and the reason, never unchecked.
///
/// # Safety
///
// Repeats `kvring_submit`'s parameters on purpose: callers built against it keep it (docs/DUPLICATES.md).
/// As `kvring_submit`.
#[no_mangle]
#[allow(clippy::too_many_arguments)] // a C signature
pub unsafe extern "C" fn kvring_submit_with(
    submitter: *mut KvringSubmitter,
    segment: *const KvringSegment,
    opcode: c_int,
    blocks: *const KvringBlock,
    count: usize,
    user_data: u64,
    deadline_ms: u32,
    flags: u32,
    batch_out: *mut u64,
) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let (submitter, segment, descs) = unsafe { submit_inputs(submitter, segment, blocks, count, batch_out)? };
        let op = match opcode {
            KVRING_WRITE => Opcode::Write,
            KVRING_READ => Opcode::Read,
            other => return Err(Error::UnknownOpcode { opcode: other as u8 }),
        };
        let checksum = match flags {
            0 => None,
            KVRING_SUBMIT_CHECKSUM => Some(true),
            KVRING_SUBMIT_NO_CHECKSUM => Some(false),
            other => {
                return Err(Error::invalid(
                    "flags",
                    format!("{other:#x} is not 0, KVRING_SUBMIT_CHECKSUM (1) or KVRING_SUBMIT_NO_CHECKSUM (2)"),
                ))
            }
        };
        let mut batch = Batch::new(op, &segment.0).descs(&descs).user_data(user_data);
        if let Some(on) = checksum {
            batch = batch.checksum(on);
        }
        // SAFETY: `batch_out` was checked non-null; valid per our contract.
        unsafe { submit_and_report(submitter, batch, deadline_ms, batch_out) }
    })
}

/// Opens `count` peers' segments by name in one call, their handshakes
/// concurrent (a TP group's ranks), each before `timeout_ms`: `out[i]` gets
/// the handle of `names[i]` (free each with `kvring_segment_free`) or NULL,
/// and `codes[i]` 0 or that peer's negative error code. Returns 0 when
/// every peer opened, else the first failure's code, `kvring_last_error`
/// naming the peer (one that failed does not hide the others: look at
/// `codes`). A name listed twice gets two handles of one link.
///
/// # Safety
///
/// `engine` is live; `names` points to `count` NUL-terminated strings;
/// `out` and `codes` point to room for `count` entries each.
#[no_mangle]
pub unsafe extern "C" fn kvring_open_many(
    engine: *mut KvringEngine,
    names: *const *const c_char,
    count: usize,
    transport: c_int,
    timeout_ms: u32,
    out: *mut *mut KvringSegment,
    codes: *mut c_int,
) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let engine = unsafe { engine.as_ref() }.ok_or_else(|| null("engine"))?;
        if count > 0 && (names.is_null() || out.is_null() || codes.is_null()) {
            return Err(null(if names.is_null() {
                "names"
            } else if out.is_null() {
                "out"
            } else {
                "codes"
            }));
        }
        let transport = open_transport(transport)?;
        let names: Vec<&str> = (0..count)
            // SAFETY: `names` points to `count` strings (our contract).
            .map(|i| unsafe { text(*names.add(i), "names[i]") })
            .collect::<Result<_, _>>()?;
        let opened = engine.0.open_many(&names, transport, Duration::from_millis(u64::from(timeout_ms)));
        let mut first_failure = None;
        for (i, result) in opened.into_iter().enumerate() {
            // SAFETY: `out` and `codes` have room for `count` entries (our contract).
            let (slot, code) = unsafe { (out.add(i), &mut *codes.add(i)) };
            match result {
                Ok(segment) => {
                    // SAFETY: inside `out` (above).
                    unsafe { give(slot, KvringSegment(segment))? };
                    *code = 0;
                }
                Err(error) => {
                    // SAFETY: inside `out` (above).
                    unsafe { *slot = std::ptr::null_mut() };
                    *code = -(error.code() as c_int);
                    first_failure.get_or_insert_with(|| (names[i], error));
                }
            }
        }
        match first_failure {
            None => Ok(0),
            Some((name, error)) => {
                Err(Error::Remote { code: error.code(), message: format!("opening {name}: {error}") })
            }
        }
    })
}

/// A submission's handles checked and its blocks read as descriptors,
/// shared by every `kvring_submit*` and `kvring_push_*` function.
///
/// # Safety
///
/// `submitter` and `segment` are null or live; `blocks` is null or points
/// to `count` blocks; `batch_out` is null or valid (each null is refused).
pub(super) unsafe fn submit_inputs<'a>(
    submitter: *mut KvringSubmitter,
    segment: *const KvringSegment,
    blocks: *const KvringBlock,
    count: usize,
    batch_out: *mut u64,
) -> Result<(&'a mut KvringSubmitter, &'a KvringSegment, Vec<BlockDesc>), Error> {
    // SAFETY: per our contract.
    let submitter = unsafe { submitter.as_mut() }.ok_or_else(|| null("submitter"))?;
    // SAFETY: per our contract.
    let segment = unsafe { segment.as_ref() }.ok_or_else(|| null("segment"))?;
    if blocks.is_null() || batch_out.is_null() {
        return Err(null(if blocks.is_null() { "blocks" } else { "batch_out" }));
    }
    // SAFETY: `blocks` points to `count` blocks (our contract), not null.
    let blocks = unsafe { std::slice::from_raw_parts(blocks, count) };
    let descs = blocks
        .iter()
        .map(|b| {
            let (local, remote) = (RegionId::from_raw(b.local_region), RegionId::from_raw(b.remote_region));
            BlockDesc::new(local, b.local_offset, remote, b.remote_offset, b.len)
        })
        .collect();
    Ok((submitter, segment, descs))
}

/// Submits `batch` with its deadline (`deadline_ms`, 0: none) and writes
/// the batch id to `batch_out`.
///
/// # Safety
///
/// `batch_out` is valid for a write (checked non-null by [`submit_inputs`]).
pub(super) unsafe fn submit_and_report(
    submitter: &mut KvringSubmitter,
    mut batch: Batch<'_>,
    deadline_ms: u32,
    batch_out: *mut u64,
) -> Result<c_int, Error> {
    if deadline_ms > 0 {
        batch = batch.deadline(Duration::from_millis(u64::from(deadline_ms)));
    }
    let id = submitter.0.submit(&batch)?;
    // SAFETY: valid for a write, per our contract.
    unsafe { *batch_out = id.raw() };
    Ok(0)
}

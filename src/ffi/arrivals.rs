//! The C ABI's arrival tags (split from `ffi.rs`; the same conventions:
//! negative error codes, the message in `kvring_last_error`): a prefill
//! process pushes a layer's blocks tagged for a request
//! (`kvring_push_layer_tagged`); the decode process grants the tag the
//! ranges the request was given (`kvring_grant_arrival`, optionally for one
//! proven sender) and waits until its bytes landed (`kvring_wait_landed`,
//! with a deadline), instead of a notification per layer.

use super::submit::{submit_and_report, submit_inputs};
use super::{guarded, null, text, KvringBlock, KvringEngine, KvringSegment, KvringSubmitter};
use crate::{Batch, Error, RegionId};
use std::ffi::{c_char, c_int};
use std::time::Duration;

/// One range of this engine's memory a tag may count: `len` bytes at
/// `offset` of `region` (24 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KvringRange {
    /// The region, as this engine numbers it.
    pub region: u64,
    /// Offset in the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// The sender a call names: null for any sender.
///
/// # Safety
///
/// `sender` is null or a NUL-terminated string.
unsafe fn sender<'a>(sender: *const c_char) -> Result<Option<&'a str>, Error> {
    if sender.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null and NUL-terminated per our contract.
    unsafe { text(sender, "sender") }.map(Some)
}

/// Writes the tag of request slot `slot`'s `layer` (`slot << 12 | layer`)
/// into `tag_out`; `-INVALID_ARGUMENT` for a slot outside 1 ..= 2^20 - 1
/// or a layer past 4095.
///
/// # Safety
///
/// `tag_out` is valid.
#[no_mangle]
pub unsafe extern "C" fn kvring_arrival_tag(slot: u32, layer: u32, tag_out: *mut u32) -> c_int {
    guarded(|| {
        if tag_out.is_null() {
            return Err(null("tag_out"));
        }
        let tag = crate::kv::arrival_tag(slot, layer)?;
        // SAFETY: checked non-null; valid per our contract.
        unsafe { *tag_out = tag };
        Ok(0)
    })
}

/// Binds `tag` to `count` ranges of this engine's regions (the blocks its
/// request was given): only bytes landing wholly inside them count under
/// it, each once. With `sender` (non-null: the pushing engine's name, as
/// it proved it with the shared token) only that sender's bytes count, and
/// other senders may be granted the same tag, each counted apart (without
/// a token: `-UNSUPPORTED`). A tag already granted: `-INVALID_ARGUMENT`.
///
/// # Safety
///
/// `engine` is live; `sender` is null or a NUL-terminated string; `ranges`
/// points to `count` ranges.
#[no_mangle]
pub unsafe extern "C" fn kvring_grant_arrival(
    engine: *mut KvringEngine,
    sender: *const c_char,
    tag: u32,
    ranges: *const KvringRange,
    count: usize,
) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let engine = unsafe { engine.as_ref() }.ok_or_else(|| null("engine"))?;
        // SAFETY: per our contract.
        let sender = unsafe { self::sender(sender) }?;
        if ranges.is_null() {
            return Err(null("ranges"));
        }
        // SAFETY: `ranges` points to `count` ranges (our contract).
        let ranges = unsafe { std::slice::from_raw_parts(ranges, count) };
        let ranges: Vec<_> = ranges.iter().map(|r| (RegionId::from_raw(r.region), r.offset, r.len)).collect();
        match sender {
            Some(sender) => engine.0.grant_arrival_from(sender, tag, &ranges)?,
            None => engine.0.grant_arrival(tag, &ranges)?,
        }
        Ok(0)
    })
}

/// Writes the bytes landed under `tag` (under `sender`'s grant of it, with
/// a non-null `sender`) into `bytes_out`.
///
/// # Safety
///
/// `engine` is live; `sender` is null or a NUL-terminated string;
/// `bytes_out` is valid.
#[no_mangle]
pub unsafe extern "C" fn kvring_landed(
    engine: *mut KvringEngine,
    sender: *const c_char,
    tag: u32,
    bytes_out: *mut u64,
) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let engine = unsafe { engine.as_ref() }.ok_or_else(|| null("engine"))?;
        // SAFETY: per our contract.
        let sender = unsafe { self::sender(sender) }?;
        if bytes_out.is_null() {
            return Err(null("bytes_out"));
        }
        let landed = match sender {
            Some(sender) => engine.0.landed_from(sender, tag),
            None => engine.0.landed(tag),
        };
        // SAFETY: checked non-null; valid per our contract.
        unsafe { *bytes_out = landed };
        Ok(0)
    })
}

/// Waits until `bytes` have landed under `tag` (under `sender`'s grant of
/// it, with a non-null `sender`), for at most `timeout_ms`: 0, or
/// `-TIMEOUT` past it.
///
/// # Safety
///
/// `engine` is live; `sender` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn kvring_wait_landed(
    engine: *mut KvringEngine,
    sender: *const c_char,
    tag: u32,
    bytes: u64,
    timeout_ms: u32,
) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let engine = unsafe { engine.as_ref() }.ok_or_else(|| null("engine"))?;
        // SAFETY: per our contract.
        let sender = unsafe { self::sender(sender) }?;
        let timeout = Duration::from_millis(u64::from(timeout_ms));
        match sender {
            Some(sender) => engine.0.wait_landed_from(sender, tag, bytes, timeout)?,
            None => engine.0.wait_landed(tag, bytes, timeout)?,
        }
        Ok(0)
    })
}

/// Forgets `tag` (only `sender`'s grant of it, with a non-null `sender`),
/// freeing its slot; the bytes it had counted go to `bytes_out` (may be
/// null).
///
/// # Safety
///
// The same parameters and null checks as `kvring_landed`, on purpose: a C function each (docs/DUPLICATES.md).
/// `engine` is live; `sender` is null or a NUL-terminated string;
/// `bytes_out` is null or valid.
#[no_mangle]
pub unsafe extern "C" fn kvring_forget_arrival(
    engine: *mut KvringEngine,
    sender: *const c_char,
    tag: u32,
    bytes_out: *mut u64,
) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let engine = unsafe { engine.as_ref() }.ok_or_else(|| null("engine"))?;
        // SAFETY: per our contract.
        let sender = unsafe { self::sender(sender) }?;
        let forgotten = match sender {
            Some(sender) => engine.0.forget_arrival_from(sender, tag),
            None => engine.0.forget_arrival(tag),
        };
        if !bytes_out.is_null() {
            // SAFETY: non-null; valid per our contract.
            unsafe { *bytes_out = forgotten };
        }
        Ok(0)
    })
}

/// Pushes one layer's `count` blocks (WRITEs, planned by the caller) tagged
/// for request slot `slot` (`kvring_arrival_tag(slot, layer)`), so the
/// target can wait for them with `kvring_wait_landed`; its batch id goes to
/// `batch_out` (end it with `kvring_wait`). Tags are counted by the target
/// over tcp and rdma; a link that cannot carry them (shm, cma) fails the
/// batch with `-UNSUPPORTED`.
///
/// # Safety
///
/// `submitter` and `segment` are live; `blocks` points to `count` blocks;
/// `batch_out` is valid. The memory the blocks name stays untouched by the
/// caller until the batch ends.
#[no_mangle]
pub unsafe extern "C" fn kvring_push_layer_tagged(
    submitter: *mut KvringSubmitter,
    segment: *const KvringSegment,
    layer: u32,
    slot: u32,
    blocks: *const KvringBlock,
    count: usize,
    deadline_ms: u32,
    batch_out: *mut u64,
) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let (submitter, segment, descs) = unsafe { submit_inputs(submitter, segment, blocks, count, batch_out)? };
        let tag = crate::kv::arrival_tag(slot, layer)?;
        let batch = Batch::write(&segment.0).descs(&descs).arrival_tag(tag);
        // SAFETY: `batch_out` was checked non-null; valid per our contract.
        unsafe { submit_and_report(submitter, batch, deadline_ms, batch_out) }
    })
}

//! Issuing a chunk's copies: one `cuMemcpyBatchAsync` (the 12.8 ABI,
//! looked up by version), or one `cuMemcpyAsync` per copy.

use super::{check, tier};
use crate::error::Result;
use crate::gpu::Copy;
use cudarc::driver::sys;
use std::ffi::c_void;

/// `cuMemcpyBatchAsync` as the 12.8 ABI has it (with `failIdx`).
pub(super) type BatchCopy = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;

/// `copies` as one `cuMemcpyBatchAsync` on `stream`.
///
/// # Safety
///
/// As [`Gpu::copy_batch`].
pub(super) unsafe fn batched(batch: BatchCopy, stream: sys::CUstream, copies: &[Copy], pageable: bool) -> Result<()> {
    let mut dsts: Vec<u64> = copies.iter().map(|c| c.dst).collect();
    let mut srcs: Vec<u64> = copies.iter().map(|c| c.src).collect();
    let mut sizes: Vec<usize> = copies.iter().map(|c| c.len as usize).collect();
    let nowhere = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID, id: 0 };
    let mut attributes = [sys::CUmemcpyAttributes {
        // A pageable source in stream order makes the driver wait for the
        // stream inside the call (the lane would block); ANY lets it stage
        // the source at once, as vLLM's offload does. Sources are never
        // written by earlier work on a lane's stream.
        srcAccessOrder: match pageable {
            true => sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_ANY,
            false => sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        },
        srcLocHint: nowhere,
        dstLocHint: nowhere,
        flags: 0,
    }];
    let mut first = [0usize];
    let mut failed = usize::MAX;
    // SAFETY: the arrays hold `copies.len()` entries each and one attribute
    // set covering them all; the ranges are our caller's.
    let result = unsafe {
        batch(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            copies.len(),
            attributes.as_mut_ptr(),
            first.as_mut_ptr(),
            1,
            &mut failed,
            stream,
        )
    };
    // failIdx stays SIZE_MAX "if the error does not pertain to a specific
    // copy" [ref: cuMemcpyBatchAsync].
    let what = match failed {
        usize::MAX => "a batched copy (the whole call refused)".to_owned(),
        copy => format!("a batched copy (copy {copy} refused)"),
    };
    check(result, &what)
}

/// `copies` as one `cuMemcpyAsync` each on `stream`.
///
/// # Safety
///
/// As [`Gpu::copy_batch`].
pub(super) unsafe fn per_copy(stream: sys::CUstream, copies: &[Copy]) -> Result<()> {
    for copy in copies {
        // SAFETY: the ranges are our caller's; UVA resolves directions.
        check(unsafe { sys::cuMemcpyAsync(copy.dst, copy.src, copy.len as usize, stream) }, "a copy")?;
    }
    Ok(())
}

/// The 12.8-ABI `cuMemcpyBatchAsync`, when the driver has it (asked for
/// by ABI version: a 13.x driver also exports a `_v2` without `failIdx`).
/// Looked up only on drivers that have the batch API, through
/// `cuGetProcAddress_v2`, which older drivers lack.
pub(super) fn batch_copy_12080(driver_version: u32) -> Option<BatchCopy> {
    const _: () = assert!(tier::BATCH_API_DRIVER >= tier::PROC_ADDRESS_DRIVER);
    if driver_version < tier::BATCH_API_DRIVER {
        return None;
    }
    let mut pointer: *mut c_void = std::ptr::null_mut();
    let mut status = sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    // SAFETY: a NUL-terminated name and two out-pointers.
    let result =
        unsafe { sys::cuGetProcAddress_v2(c"cuMemcpyBatchAsync".as_ptr(), &mut pointer, 12080, 0, &mut status) };
    if result != sys::CUresult::CUDA_SUCCESS
        || pointer.is_null()
        || status != sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS
    {
        return None;
    }
    // SAFETY: the driver returned this entry point for the 12.8 ABI, whose
    // signature `BatchCopy` is.
    Some(unsafe { std::mem::transmute::<*mut c_void, BatchCopy>(pointer) })
}

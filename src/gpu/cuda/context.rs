//! Contexts: each device's primary context, retained at its first use
//! (never at load: every context costs device memory in every process),
//! made current for one call and the caller's put back after it.

use super::{check, cuda_error, CudaGpu, Raw};
use crate::error::Result;
use cudarc::driver::sys;
use std::ffi::c_uint;

impl CudaGpu {
    /// `device`'s primary context, retained at its first use.
    pub(super) fn context(&self, device: u32) -> Result<sys::CUcontext> {
        let slot = self
            .contexts
            .get(device as usize)
            .ok_or_else(|| cuda_error(format!("no GPU {device} (this host has {})", self.contexts.len())))?;
        if let Some(context) = slot.context.get() {
            return Ok(context.0);
        }
        let _one = self.retaining.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(context) = slot.context.get() {
            return Ok(context.0);
        }
        let mut context: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle for a valid device.
        check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, slot.device) }, "retaining a GPU's context")?;
        let _ = slot.context.set(Raw(context));
        Ok(context)
    }

    /// Makes `device`'s primary context current on this thread until the
    /// guard drops, which puts back the context the thread had.
    pub(super) fn bind(&self, device: u32) -> Result<Bound> {
        let context = self.context(device)?;
        let mut previous: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle (null when none is current).
        check(unsafe { sys::cuCtxGetCurrent(&mut previous) }, "reading the thread's current context")?;
        if previous == context {
            return Ok(Bound { previous: None });
        }
        // SAFETY: a context this provider retained.
        check(unsafe { sys::cuCtxSetCurrent(context) }, "making a GPU's context current")?;
        Ok(Bound { previous: Some(previous) })
    }

    /// The devices whose primary context this provider retained.
    pub(super) fn retained(&self) -> impl Iterator<Item = (u32, Raw<sys::CUcontext>)> + '_ {
        self.contexts.iter().enumerate().filter_map(|(i, slot)| slot.context.get().map(|c| (i as u32, *c)))
    }

    /// The device a call that names none runs under: the one whose context
    /// is current on this thread (the caller's device), else the first one
    /// this provider already uses, else the first.
    pub(super) fn home(&self) -> u32 {
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle.
        if unsafe { sys::cuCtxGetCurrent(&mut current) } == sys::CUresult::CUDA_SUCCESS && !current.is_null() {
            if let Some((device, _)) = self.retained().find(|(_, c)| c.0 == current) {
                return device;
            }
        }
        self.retained().next().map_or(0, |(device, _)| device)
    }
}

/// A context made current by [`CudaGpu::bind`]; dropping it puts back
/// the one the thread had (none included), so the caller's CUDA runtime
/// state (PyTorch's current device) is what it was.
#[must_use]
pub(super) struct Bound {
    previous: Option<sys::CUcontext>,
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            // SAFETY: the context the thread had a moment ago, or null
            // (which unbinds); a failure leaves nothing to clean up.
            unsafe { sys::cuCtxSetCurrent(previous) };
        }
    }
}

impl CudaGpu {
    /// An event recorded on the caller's `stream` (0: `device`'s legacy
    /// stream), made in the stream's own context as the driver requires.
    pub(super) fn mark_caller_stream(&self, device: u32, stream: u64) -> Result<Raw<sys::CUevent>> {
        let raw = stream as sys::CUstream;
        let _bound = self.bind(device)?;
        let mut context: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: the driver checks the handle (a stale one is an error
        // code) and writes one context.
        check(unsafe { sys::cuStreamGetCtx(raw, &mut context) }, "finding the caller stream's context")?;
        // SAFETY: a context the driver just named.
        check(unsafe { sys::cuCtxPushCurrent_v2(context) }, "making the caller stream's context current")?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
        // SAFETY: writes one event handle.
        let mut result = unsafe { sys::cuEventCreate(&mut event, flags) };
        if result == sys::CUresult::CUDA_SUCCESS {
            // SAFETY: both handles live, of one context.
            result = unsafe { sys::cuEventRecord(event, raw) };
            if result != sys::CUresult::CUDA_SUCCESS {
                // SAFETY: made just above, never recorded.
                unsafe { sys::cuEventDestroy_v2(event) };
            }
        }
        // SAFETY: pops what was pushed above.
        unsafe { sys::cuCtxPopCurrent_v2(std::ptr::null_mut()) };
        check(result, "marking the caller's stream")?;
        Ok(Raw(event))
    }
}

//! What the copy kernel may dereference: host memory this provider pinned
//! (and mapped for the device at the same address), and other GPUs' memory
//! once peer access to them is enabled (`cuCtxEnablePeerAccess`, asked once
//! per pair of GPUs and remembered).

use super::CudaGpu;
use crate::gpu::{Copy, CopySides, Place};
use cudarc::driver::sys;
use std::ffi::c_int;

/// True when `device` reads pinned host memory at its host address (UVA
/// hosts; otherwise the kernel would need translated pointers).
pub(super) fn host_pointers_usable(device: sys::CUdevice) -> bool {
    let mut usable: c_int = 0;
    let attribute = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM;
    // SAFETY: writes one int for a valid device.
    let asked = unsafe { sys::cuDeviceGetAttribute(&mut usable, attribute, device) };
    asked == sys::CUresult::CUDA_SUCCESS && usable == 1
}

impl CudaGpu {
    /// True when every host end of `copies` (as `sides` tells them) lies
    /// in memory this provider pinned, and `device` reads it at that
    /// address; false when `sides` does not describe every copy.
    pub(super) fn host_pinned(&self, device: u32, copies: &[Copy], sides: &[CopySides]) -> bool {
        if sides.len() != copies.len() || !self.host_pointers.get(device as usize).copied().unwrap_or(false) {
            return false;
        }
        let state = self.lock();
        let pinned = |addr: u64, len: u64| {
            let below = state.pinned.range(..=addr).next_back();
            below.is_some_and(|(&start, &n)| addr.checked_add(len).is_some_and(|end| end <= start + n))
        };
        copies.iter().zip(sides).all(|(copy, sides)| {
            (sides.src != Place::Host || pinned(copy.src, copy.len))
                && (sides.dst != Place::Host || pinned(copy.dst, copy.len))
        })
    }

    /// True when some source of `copies` is host memory this provider did
    /// not pin (`sides` tells which ends are host memory).
    pub(super) fn pageable_source(&self, copies: &[Copy], sides: &[CopySides]) -> bool {
        if sides.len() != copies.len() {
            return false;
        }
        let state = self.lock();
        copies.iter().zip(sides).any(|(copy, sides)| {
            sides.src == Place::Host && {
                let below = state.pinned.range(..=copy.src).next_back();
                below.is_none_or(|(&start, &n)| copy.src.checked_add(copy.len).is_none_or(|end| end > start + n))
            }
        })
    }

    /// True when a kernel on `device` may touch every GPU's memory that
    /// `sides` names: its own, or a peer's it has (or now gets) access to.
    pub(super) fn peers_reachable(&self, device: u32, sides: &[CopySides]) -> bool {
        sides.iter().flat_map(|s| [s.src, s.dst]).all(|place| match place {
            Place::Host => true,
            Place::Device(other) => other == device || self.peer(device, other),
        })
    }

    /// Whether `from`'s kernels may touch `to`'s memory: asked once per
    /// pair (can it, then enable it) and remembered.
    fn peer(&self, from: u32, to: u32) -> bool {
        if let Some(&known) = self.lock().peers.get(&(from, to)) {
            return known;
        }
        let enabled = self.enable_peer(from, to);
        if !enabled {
            tracing::debug!(from, to, "no peer access between these GPUs: their chunks take one copy call each");
        }
        self.lock().peers.insert((from, to), enabled);
        enabled
    }

    fn enable_peer(&self, from: u32, to: u32) -> bool {
        let (Some(from_slot), Some(to_slot)) = (self.contexts.get(from as usize), self.contexts.get(to as usize))
        else {
            return false;
        };
        let mut can: c_int = 0;
        // SAFETY: writes one int for two valid devices.
        let asked = unsafe { sys::cuDeviceCanAccessPeer(&mut can, from_slot.device, to_slot.device) };
        if asked != sys::CUresult::CUDA_SUCCESS || can != 1 {
            return false;
        }
        let Ok(to_context) = self.context(to) else { return false };
        let Ok(_bound) = self.bind(from) else { return false };
        // SAFETY: `from`'s context is current; `to_context` is retained.
        let enabled = unsafe { sys::cuCtxEnablePeerAccess(to_context, 0) };
        matches!(enabled, sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
    }
}

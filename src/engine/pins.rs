//! Caller-registered host memory pinned with the GPU provider, so that the
//! GPU's copy engines reach it at full rate and its chunks may take the
//! copy kernel: only when the engine is asked to (`pin_host_memory`, off
//! by default: GPU-REVIEW #14, pinning behind an application's back breaks
//! its own later `cudaHostRegister`), and never memory its owner pinned
//! already. Best effort: memory that cannot be pinned (past the
//! locked-memory limit) is still registered and moved, through the
//! driver's staged copies; every case is counted.

use crate::gpu::Gpu;
use crate::region_id::RegionId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What pinning caller-registered host memory achieved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostPinStats {
    /// Registered regions pinned now.
    pub regions: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Attempts that failed since the engine started (those regions work,
    /// unpinned).
    pub failed: u64,
    /// Registrations of memory its owner had pinned already (used as it is).
    pub owner_pinned: u64,
    /// Registrations left pageable because pinning is off.
    pub left_pageable: u64,
}

/// One pinned range, unpinned when dropped.
struct Pin {
    gpu: Arc<dyn Gpu>,
    addr: u64,
    len: u64,
}

impl Drop for Pin {
    fn drop(&mut self) {
        if let Err(error) = self.gpu.host_unregister(self.addr) {
            tracing::debug!(%error, addr = self.addr, "unpinning a registered region");
        }
    }
}

/// The engine's pinned regions and its count of failures.
#[derive(Default)]
pub(crate) struct HostPins {
    pinned: Mutex<HashMap<RegionId, Pin>>,
    failed: AtomicU64,
    owner_pinned: AtomicU64,
    left_pageable: AtomicU64,
}

impl std::fmt::Debug for HostPins {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPins").field("stats", &self.stats()).finish()
    }
}

impl HostPins {
    /// Pins region `id` at `addr..addr + len` with `gpu` when `opted_in`,
    /// unless this engine pinned it already (a registration repeated
    /// returns the same id) or its owner did.
    ///
    /// # Safety
    ///
    /// The range stays mapped until [`HostPins::unpin`] for `id` (or this
    /// value's drop).
    pub unsafe fn pin(&self, gpu: &Arc<dyn Gpu>, id: RegionId, addr: u64, len: u64, opted_in: bool) {
        let mut pinned = self.pinned.lock().unwrap_or_else(|p| p.into_inner());
        if pinned.contains_key(&id) {
            return;
        }
        if gpu.host_is_pinned(addr) {
            self.owner_pinned.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if !opted_in {
            self.left_pageable.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // SAFETY: forwarded from our caller; unpinned by `Pin`'s drop.
        match unsafe { gpu.host_register(addr, len) } {
            Ok(()) => drop(pinned.insert(id, Pin { gpu: gpu.clone(), addr, len })),
            Err(error) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%error, region = %id, "registered host memory not pinned: its GPU copies are staged");
            }
        }
    }

    /// Unpins region `id`, if it was pinned.
    pub fn unpin(&self, id: RegionId) {
        let pin = self.pinned.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        drop(pin);
    }

    /// True when region `id` is pinned.
    pub fn is_pinned(&self, id: RegionId) -> bool {
        self.pinned.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&id)
    }

    /// The counts now.
    pub fn stats(&self) -> HostPinStats {
        let pinned = self.pinned.lock().unwrap_or_else(|p| p.into_inner());
        HostPinStats {
            regions: pinned.len() as u64,
            bytes: pinned.values().map(|p| p.len).sum(),
            failed: self.failed.load(Ordering::Relaxed),
            owner_pinned: self.owner_pinned.load(Ordering::Relaxed),
            left_pageable: self.left_pageable.load(Ordering::Relaxed),
        }
    }
}

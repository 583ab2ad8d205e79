//! Registering memory: regions the caller owns, regions the engine
//! allocates in shared memory, and their registration with every NIC.

use super::pins::HostPinStats;
use super::{Engine, Region};
use crate::error::{Error, Result};
use crate::gpu::{CudaGpu, Gpu, Memory};
use crate::mem::{Access, Backing, DeviceBacking, MemoryKind, RegionInfo, ShmMapping};
use crate::region_id::RegionId;
use std::sync::Arc;

impl Engine {
    /// Registers `len` bytes at `ptr`. The same range again (same info)
    /// returns the same id; overlapping another region is refused.
    ///
    /// # Safety
    ///
    /// `ptr..ptr+len` must stay valid for reads and writes until the region
    /// is unregistered (or the engine dropped), and the caller must not
    /// access it while a batch that uses it is in flight.
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// let mut kv = vec![0u8; 1 << 20];
    /// // SAFETY: `kv` outlives the registration (unregistered below).
    /// let id = unsafe { engine.register(kv.as_mut_ptr(), kv.len(), kvring::RegionInfo::raw())? };
    /// engine.unregister(id)?;
    /// # Ok::<(), kvring::Error>(())
    /// ```
    ///
    /// Host memory is pinned with the GPU provider where there is one and
    /// [`EngineBuilder::pin_host_memory`](crate::EngineBuilder::pin_host_memory)
    /// asks for it (best effort: [`host_pins`](Self::host_pins) counts what
    /// was and was not, [`region_pinned`](Self::region_pinned) says it per
    /// region), so copies between it and a GPU run at full rate; it is
    /// unpinned when unregistered. Memory its owner pinned is used as it is. GPU memory (`RegionInfo::on_gpu(n)`) is exported for
    /// same-host peers when it is registered. CUDA cannot revoke a peer's mapping: keep the
    /// memory allocated until the peers that opened this engine's segment
    /// have closed it (or this engine has stopped), not only until
    /// [`unregister`](Self::unregister).
    pub unsafe fn register(&self, ptr: *mut u8, len: usize, info: RegionInfo) -> Result<RegionId> {
        let device = self.check_memory(ptr as u64, len as u64, &info)?;
        let backing = Backing { shm: None, device: device.clone() };
        let id = self.inner.registry.register(ptr as usize, len, info, backing)?;
        if let Some(device) = &device {
            // SAFETY: as below: the caller keeps the memory allocated until
            // it unregisters, which deregisters it from the NICs too.
            unsafe { self.register_device_with_nics(id, ptr as u64, len as u64, info.access, device) };
        }
        if info.memory == MemoryKind::Host {
            // SAFETY: the caller keeps the range valid until it unregisters
            // (our contract), which deregisters it from the NICs too.
            unsafe { self.register_with_nics(id, ptr as u64, len as u64, info.access)? };
            if let Some(gpu) = self.gpu() {
                // SAFETY: as above; `unregister` (or the engine's drop)
                // unpins it.
                unsafe { self.inner.pins.pin(gpu, id, ptr as u64, len as u64, self.inner.config.pin_host_memory) };
            }
            self.expose_to_cma(id, ptr as usize, len, info.access);
        }
        Ok(id)
    }

    /// What pinning caller-registered host memory with the GPU provider
    /// achieved: regions and bytes pinned now, failures so far.
    pub fn host_pins(&self) -> HostPinStats {
        self.inner.pins.stats()
    }

    /// True when registered region `id` is host memory this engine pinned
    /// with its GPU provider (`alloc_region`'s shared memory is pinned at
    /// allocation and not counted here).
    pub fn region_pinned(&self, id: RegionId) -> bool {
        self.inner.pins.is_pinned(id)
    }

    /// Checks where `addr..addr + len` lives against where `info` says it
    /// does, with the GPU provider: a device pointer registered as host
    /// memory (what a CUDA tensor's address handed to a host API is) would
    /// have a lane copy from it, so it is refused, as is the reverse. GPU
    /// memory comes back with its backing (exported for peers).
    fn check_memory(&self, addr: u64, len: u64, info: &RegionInfo) -> Result<Option<Arc<DeviceBacking>>> {
        let gpu = self.gpu();
        let found = match gpu {
            Some(gpu) => gpu.classify(addr, len)?,
            None => Memory::Host,
        };
        let wrong = |reason: String| Err(Error::invalid("memory", format!("{addr:#x}+{len} {reason}")));
        match (info.memory, found) {
            // Managed memory migrates to the host on touch: host threads may
            // use it (at the cost of page migration), and CUDA cannot share it.
            (MemoryKind::Host, Memory::Host | Memory::Managed { .. }) => Ok(None),
            (MemoryKind::Gpu(want), Memory::Device { ordinal, .. }) if want == ordinal => {
                let gpu = gpu.expect("device memory was classified by a provider").clone();
                Ok(Some(Arc::new(DeviceBacking::caller(gpu, ordinal, addr, len))))
            }
            (MemoryKind::Gpu(_), Memory::Managed { ordinal }) => wrong(format!(
                "is managed memory (of GPU {ordinal}), which CUDA cannot share between processes: register it as \
                 host memory (RegionInfo::raw())"
            )),
            (MemoryKind::Host, Memory::Device { ordinal, .. }) => wrong(format!(
                "is memory of GPU {ordinal}, registered as host memory: register it with RegionInfo::on_gpu({ordinal})"
            )),
            (MemoryKind::Gpu(want), Memory::Device { ordinal, .. }) => {
                wrong(format!("is memory of GPU {ordinal}, registered as GPU {want}'s"))
            }
            (MemoryKind::Gpu(want), Memory::Host) if gpu.is_none() => wrong(format!(
                "is registered as GPU {want}'s, but this engine has no GPU provider ({})",
                crate::gpu::cuda::unavailable()
            )),
            (MemoryKind::Gpu(want), Memory::Host) => wrong(format!("is host memory, registered as GPU {want}'s")),
        }
    }

    /// Where `addr..addr + len` lives, as this engine's GPU provider tells
    /// it: `Gpu(n)` for memory of GPU n, `Host` for host memory (managed
    /// memory too, which host threads may touch). Without a provider, host
    /// memory. For callers that name memory by address alone, as Mooncake's
    /// `register_memory(addr, len)` does: register what this says.
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// let kv = vec![0u8; 4096];
    /// assert_eq!(engine.memory_of(kv.as_ptr() as u64, 4096)?, kvring::MemoryKind::Host);
    /// # Ok::<(), kvring::Error>(())
    /// ```
    pub fn memory_of(&self, addr: u64, len: u64) -> Result<MemoryKind> {
        let Some(gpu) = self.gpu() else { return Ok(MemoryKind::Host) };
        Ok(match gpu.classify(addr, len)? {
            Memory::Host | Memory::Managed { .. } => MemoryKind::Host,
            Memory::Device { ordinal, .. } => MemoryKind::Gpu(ordinal),
        })
    }

    /// The GPU provider: the builder's, or the CUDA driver's when one is
    /// installed (loaded at the first registration, not at start, so an
    /// engine that never registers memory never initialises CUDA).
    pub(crate) fn gpu(&self) -> Option<&Arc<dyn Gpu>> {
        self.inner
            .gpu
            .get_or_init(|| {
                self.inner.config.gpu.clone().or_else(|| {
                    crate::gpu::cuda::driver_present()
                        .then(CudaGpu::load)
                        .and_then(|loaded| loaded.ok())
                        .map(|gpu| Arc::new(gpu) as Arc<dyn Gpu>)
                })
            })
            .as_ref()
    }

    /// Registers a region with every NIC (when the engine serves RDMA);
    /// on failure the region is unregistered again.
    ///
    /// # Safety
    ///
    /// The range stays valid until the region is unregistered.
    unsafe fn register_with_nics(&self, id: RegionId, addr: u64, len: u64, access: Access) -> Result<()> {
        let Some(node) = &self.inner.context.rdma else { return Ok(()) };
        // SAFETY: forwarded from our caller.
        if let Err(error) = unsafe { node.register_region(id, addr, len, access) } {
            node.unregister_region(id);
            let _ = self.inner.registry.unregister(id);
            return Err(error);
        }
        Ok(())
    }

    /// Registers a region of GPU memory with every NIC, when the engine
    /// serves RDMA (GPUDirect: through a dma-buf the GPU provider exports,
    /// else by device pointer through a peer-memory module). It never fails
    /// the registration: a region no NIC takes still moves over cuda_ipc and
    /// tcp, and rdma refuses it with the reason, said here once.
    ///
    /// # Safety
    ///
    /// The memory stays allocated until the region is unregistered.
    unsafe fn register_device_with_nics(
        &self,
        id: RegionId,
        addr: u64,
        len: u64,
        access: Access,
        device: &DeviceBacking,
    ) {
        let Some(node) = &self.inner.context.rdma else { return };
        // SAFETY: forwarded from our caller.
        let registered =
            unsafe { node.register_device_region(id, addr, len, access, device.gpu.as_ref(), device.ordinal) };
        match registered {
            Ok(()) => {
                let mut gpus = self.inner.context.gpudirect.lock().unwrap_or_else(|p| p.into_inner());
                gpus.add(device.ordinal, &device.gpu, id);
            }
            Err(reason) => {
                tracing::warn!(region = %id, %reason, "GPU memory not registered with the NICs: rdma cannot move it")
            }
        }
    }

    /// The registered local region holding `addr..addr + len`, and the
    /// offset of `addr` in it: for callers that name memory by address.
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// let region = engine.alloc_region(1 << 20, kvring::RegionInfo::raw())?;
    /// let (id, offset) = engine.locate(region.as_ptr() as u64 + 4096, 4096)?;
    /// assert_eq!((id, offset), (region.id(), 4096));
    /// # Ok::<(), kvring::Error>(())
    /// ```
    pub fn locate(&self, addr: u64, len: u64) -> Result<(RegionId, u64)> {
        let found = usize::try_from(addr).ok().zip(usize::try_from(len).ok());
        found
            .and_then(|(addr, len)| self.inner.registry.find(addr, len))
            .ok_or_else(|| Error::invalid("local address", format!("{addr:#x}+{len} lies in no registered region")))
    }

    /// Unregisters a region; refused with `RegionBusy` while batches use it
    /// (this engine's, or a same-host peer's copy into it over cma).
    pub fn unregister(&self, id: RegionId) -> Result<()> {
        // Peers cache the published layout and compute pushes from it, and it
        // is fixed for the engine's life: a region it names stays, rather
        // than leave a layout every peer's push would find dead.
        if self.inner.context.kv_layout.get().is_some_and(|layout| layout.names_region(id)) {
            return Err(Error::invalid(
                "region",
                format!("{id} holds this engine's published KV layout, fixed for the engine's life; close the engine to free it"),
            ));
        }
        let cma = self.inner.context.cma.as_ref().ok();
        // Two unregisters of one region (two threads, or a caller's retry)
        // run one after the other: the second finds it gone below, before
        // it touches the page.
        let _serial = cma.map(|cma| cma.serialize());
        let entry = self.inner.registry.get(id)?;
        let shm = entry.shm.as_deref();
        let _shm_serial = shm.map(|shm| shm.unregistering.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        if let Some(shm) = shm {
            // Same-host peers map this region's file: mark it dead in its
            // header and wait out any peer's copy inside it, so that none
            // lands once this returns (`mem::shm`, revocation).
            let deadline = std::time::Instant::now() + crate::mem::shm::SHM_REVOKE_WAIT;
            shm.revoke(deadline).map_err(|busy| Error::RegionBusy { region: id, in_flight: busy })?;
        }
        if let Some(cma) = cma {
            // Off the page first, then wait out any peer's call inside it:
            // once this returns, the caller may free the memory.
            if let Err(busy) = cma.revoke(id) {
                shm.inspect(|shm| shm.republish());
                return Err(Error::RegionBusy { region: id, in_flight: busy });
            }
        }
        match self.inner.registry.unregister(id) {
            Ok(_) => {}
            // Still registered (this engine's batches hold it): list it
            // again. Any other failure means it is not registered under
            // `id` any more, and nothing of it is listed again.
            Err(error @ Error::RegionBusy { .. }) => {
                if let Some(cma) = cma.filter(|_| entry.info.memory == MemoryKind::Host) {
                    cma.publish(id, entry.addr, entry.len, entry.info.access);
                }
                shm.inspect(|shm| shm.republish());
                return Err(error);
            }
            Err(error) => return Err(error),
        }
        self.inner.pins.unpin(id);
        if let Some(node) = &self.inner.context.rdma {
            node.unregister_region(id);
        }
        self.inner.context.gpudirect.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
        Ok(())
    }

    /// Lists a host region on the cma page, for same-host peers.
    fn expose_to_cma(&self, id: RegionId, addr: usize, len: usize, access: Access) {
        if let Ok(cma) = &self.inner.context.cma {
            cma.publish(id, addr, len, access);
        }
    }

    /// Allocates `len` bytes and registers them: host shared memory (page
    /// aligned, pre-faulted, mappable by same-host peers, and pinned for the
    /// GPU where there is one), or with `RegionInfo::on_gpu(n)` memory of
    /// GPU `n` (exported for same-host peers).
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// let region = engine.alloc_region(1 << 20, kvring::RegionInfo::raw())?;
    /// // SAFETY: no batch names the new region yet.
    /// unsafe { region.write_at(0, b"hello")? };
    /// # Ok::<(), kvring::Error>(())
    /// ```
    pub fn alloc_region(&self, len: usize, info: RegionInfo) -> Result<Region> {
        if let MemoryKind::Gpu(ordinal) = info.memory {
            return self.alloc_device_region(ordinal, len, info);
        }
        let mapping = Arc::new(ShmMapping::create(len, self.inner.epoch)?);
        if let Some(gpu) = self.gpu() {
            // Copies between this region and a GPU then run at full rate.
            mapping.pin(gpu)?;
        }
        let backing = Backing { shm: Some(mapping.clone()), device: None };
        let id = self.inner.registry.register(mapping.as_ptr() as usize, len, info, backing)?;
        // SAFETY: the registry keeps the mapping alive while it is registered.
        unsafe { self.register_with_nics(id, mapping.as_ptr() as u64, len as u64, info.access)? };
        self.expose_to_cma(id, mapping.as_ptr() as usize, len, info.access);
        Region::new(id, mapping)
    }

    /// Allocates `len` bytes of GPU `ordinal`'s memory and registers them.
    fn alloc_device_region(&self, ordinal: u32, len: usize, info: RegionInfo) -> Result<Region> {
        let gpu = self.gpu().ok_or_else(|| {
            Error::invalid(
                "memory",
                format!("GPU {ordinal}: this engine has no GPU provider ({})", crate::gpu::cuda::unavailable()),
            )
        })?;
        let (backing, ptr) = DeviceBacking::allocate(gpu.clone(), ordinal, len as u64)?;
        let backing = Arc::new(backing);
        let entry = Backing { shm: None, device: Some(backing.clone()) };
        let id = self.inner.registry.register(ptr.0 as usize, len, info, entry)?;
        // SAFETY: the registry entry keeps the allocation alive while the
        // region is registered, and unregistering deregisters it from the NICs.
        unsafe { self.register_device_with_nics(id, ptr.0, len as u64, info.access, &backing) };
        Ok(Region::on_device(id, backing, ptr.0, len))
    }

    /// A registered region's description.
    pub fn region_info(&self, id: RegionId) -> Result<(usize, usize, RegionInfo)> {
        let entry = self.inner.registry.get(id)?;
        Ok((entry.addr, entry.len, entry.info))
    }
}

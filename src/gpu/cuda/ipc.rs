//! Device memory across processes on the CUDA driver: where a pointer lives
//! (including runs of physical allocations that the virtual memory API maps
//! back to back, as PyTorch's expandable segments do), exporting a range,
//! and opening a peer's export.
//!
//! `cuMemAlloc` memory travels by legacy IPC handle (`cuIpcGetMemHandle`,
//! opened with `cuIpcOpenMemHandle`). Virtual-memory-API memory cannot: each
//! physical allocation is exported as a shareable POSIX descriptor
//! (`cuMemExportToShareableHandle`) when a peer asks for it, and passed by
//! the exporter over its socket (`gpu/fd.rs`); the opener imports each and
//! closes it at once, reserves one address range and maps the pieces back
//! to back, granting its devices access, which is how PyTorch shares
//! expandable segments.

use super::fabric;
use super::{check, cuda_error, CudaGpu, State};
use crate::error::Result;
use crate::gpu::{fd, DevicePtr, Export, FdSource, HandleKind, IpcHandle, Memory, Shareable};
use cudarc::driver::sys;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Marks a handle naming a physical allocation of the virtual memory API
/// by its address in the exporter.
const PIECE_MAGIC: [u8; 4] = *b"KVCP";
/// Where a piece's handle carries the UUID of the GPU holding it: the
/// exporter's ordinal means nothing to a peer whose `CUDA_VISIBLE_DEVICES`
/// differs (GPU-REVIEW #17). All zero: not known.
const PIECE_UUID: std::ops::Range<usize> = 16..32;

/// A peer's export opened here.
#[derive(Debug)]
pub(super) enum Opened {
    /// By `cuIpcOpenMemHandle` (once per handle, counted in `State::legacy`:
    /// regions of one peer often share an allocation, and the driver maps a
    /// handle once per context).
    Legacy { handle: [u8; 64], device: u32 },
    /// Pieces imported and mapped into an address range reserved here.
    Mapped { range: u64, total: u64, pieces: Vec<(u64, u64)> },
}

impl Opened {
    /// The device whose context opened it (mapped ranges need none: 0).
    pub(super) fn device(&self) -> u32 {
        self.context_device().unwrap_or(0)
    }

    /// The device whose context alone maps it: a legacy handle's opener
    /// (`cuIpcOpenMemHandle` maps "into the current device address
    /// space"); `None` for mapped pieces, which every device was granted.
    pub(super) fn context_device(&self) -> Option<u32> {
        match self {
            Opened::Legacy { device, .. } => Some(*device),
            Opened::Mapped { .. } => None,
        }
    }
}

/// One pointer's attributes.
struct Attributes {
    kind: u32,
    ordinal: i32,
    start: u64,
    size: usize,
    managed: bool,
    legacy_ipc: bool,
}

impl CudaGpu {
    /// The attributes of the allocation holding `addr`.
    fn attributes(&self, addr: u64) -> Result<Attributes> {
        use sys::CUpointer_attribute::*;
        let (mut kind, mut ordinal, mut start, mut size) = (0u32, -1i32, 0u64, 0usize);
        let (mut managed, mut legacy_ipc) = (0u32, 0u32);
        let mut attributes = [
            CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            CU_POINTER_ATTRIBUTE_IS_MANAGED,
            CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
        ];
        let mut data: [*mut c_void; 6] = [
            (&mut kind as *mut u32).cast(),
            (&mut ordinal as *mut i32).cast(),
            (&mut start as *mut u64).cast(),
            (&mut size as *mut usize).cast(),
            (&mut managed as *mut u32).cast(),
            (&mut legacy_ipc as *mut u32).cast(),
        ];
        // SAFETY: each data pointer points at a value of the type its
        // attribute writes; the call does not fail on unknown pointers.
        let result = unsafe {
            sys::cuPointerGetAttributes(attributes.len() as c_uint, attributes.as_mut_ptr(), data.as_mut_ptr(), addr)
        };
        check(result, "classifying a pointer")?;
        if kind == 2 && managed == 0 {
            // RANGE_START_ADDR/RANGE_SIZE are "not necessarily the mapped
            // region, but the mappable address range" (for the virtual
            // memory API, the whole reservation: about 90 GB for one of
            // PyTorch's expandable segments). A piece is the mapping, which
            // cuMemGetAddressRange gives.
            let (mut base, mut mapped) = (0u64, 0usize);
            // Unlike the pointer attributes, cuMemGetAddressRange needs a
            // current context (a real H100 answered INVALID_CONTEXT from a
            // thread with none): the pointer's own GPU's, whose memory is
            // being named, so no other GPU gains a context; the caller's
            // is restored when the guard drops.
            let _bound = self.bind(ordinal.max(0) as u32)?;
            // SAFETY: writes one address and one size.
            let result = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut mapped, addr) };
            check(result, "finding the mapping holding a pointer")?;
            (start, size) = (base, mapped);
        }
        Ok(Attributes { kind, ordinal, start, size, managed: managed != 0, legacy_ipc: legacy_ipc != 0 })
    }

    /// The device allocation (for the virtual memory API, the mapping)
    /// holding `addr`; `None` for host and managed memory.
    pub(super) fn span_of(&self, addr: u64) -> Result<Option<(u64, u64)>> {
        let found = self.attributes(addr)?;
        Ok((found.kind == 2 && !found.managed).then_some((found.start, found.size as u64)))
    }

    /// Where `addr..addr + len` lives; device memory may span a run of
    /// physical allocations of the virtual memory API mapped back to back
    /// on one device (an expandable segment), never two allocations of
    /// another kind that merely sit side by side (exported one by one, a
    /// peer would not reach the second).
    pub(super) fn classify_range(&self, addr: u64, len: u64) -> Result<Memory> {
        // Pointer attributes need no context: classifying binds none, so
        // host memory never makes this process retain a GPU's context.
        let first = self.attributes(addr)?;
        if first.managed {
            return Ok(Memory::Managed { ordinal: first.ordinal.max(0) as u32 });
        }
        // 2 is CU_MEMORYTYPE_DEVICE; 0 (unknown to CUDA) and 1 (host) are host memory.
        if first.kind != 2 {
            return Ok(Memory::Host);
        }
        let end = addr.saturating_add(len);
        let described = |at: u64| -> Result<Piece> {
            let found = self.attributes(at)?;
            Ok(Piece::of(&found, || is_vmm(at)))
        };
        let run = run_end(Piece::of(&first, || is_vmm(addr)), end, described)?;
        match run {
            Some(run_end) => Ok(Memory::Device {
                ordinal: first.ordinal.max(0) as u32,
                base: DevicePtr(first.start),
                len: run_end - first.start,
            }),
            None => Err(cuda_error(format!(
                "{addr:#x}+{len} runs past its device allocation ({:#x}+{}); only pieces of the virtual \
                 memory API mapped back to back form one range",
                first.start, first.size
            ))),
        }
    }

    /// Exports `addr..addr + len`: a legacy handle for `cuMemAlloc` memory,
    /// else one shareable descriptor per physical allocation.
    pub(super) fn export_range(&self, addr: u64, len: u64) -> Result<Export> {
        let Memory::Device { ordinal, .. } = self.classify_range(addr, len)? else {
            return Err(cuda_error(format!("{addr:#x} is not device memory")));
        };
        let _bound = self.bind(ordinal)?;
        let first = self.attributes(addr)?;
        if first.legacy_ipc && addr + len <= first.start + first.size as u64 {
            let mut handle = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
            // SAFETY: writes one handle for the allocation's base.
            check(unsafe { sys::cuIpcGetMemHandle(handle.as_mut_ptr(), first.start) }, "exporting device memory")?;
            // SAFETY: initialised by the successful call above.
            let bytes = unsafe { handle.assume_init() }.reserved.map(|b| b as u8);
            let handle =
                IpcHandle { kind: HandleKind::Legacy, bytes, offset: addr - first.start, len: first.size as u64 };
            return Ok(Export::new(vec![handle]));
        }
        // Each allocation of the run, and the handle types it allows: one
        // kind shares the whole run (FABRIC where POSIX descriptors are not
        // allowed everywhere, GPU-REVIEW #16).
        let mut pieces = Vec::new();
        let mut at = first.start;
        while at < addr + len {
            let piece = self.attributes(at)?;
            pieces.push((at, piece.size as u64, allowed_handle_types(at)));
            at += piece.size as u64;
        }
        let masks: Vec<_> = pieces.iter().map(|(at, _, mask)| (*at, mask.clone())).collect();
        let kind = fabric::run_kind(&masks).map_err(cuda_error)?;
        let mut handles = Vec::with_capacity(pieces.len());
        for (at, size, _) in pieces {
            // Exportable now, or refused now: what a peer opens it by is
            // made when the peer asks.
            match kind {
                HandleKind::Fabric => drop(fabric::export_fabric(at)?),
                _ => drop(export_piece(at)?),
            }
            let mut bytes = fd::encode(PIECE_MAGIC, at, ordinal);
            if let Some(uuid) = self.contexts.get(ordinal as usize).and_then(|slot| slot.uuid) {
                bytes[PIECE_UUID].copy_from_slice(&uuid);
            }
            let offset = addr.saturating_sub(at);
            handles.push(IpcHandle { kind, bytes, offset, len: size });
        }
        Ok(Export::new(handles))
    }

    /// A new descriptor, or the fabric handle, of the allocation one of
    /// this process's own handles names; `None` for a legacy handle (the
    /// driver's own).
    pub(super) fn share_handle(&self, handle: &IpcHandle) -> Result<Option<Shareable>> {
        if handle.kind == HandleKind::Legacy {
            return Ok(None);
        }
        let (at, ordinal) =
            fd::decode(PIECE_MAGIC, &handle.bytes).ok_or_else(|| cuda_error("not a handle this provider made"))?;
        let _bound = self.bind(ordinal)?;
        let piece = self.attributes(at)?;
        // Still the allocation exported: mapped there, as long, of the
        // virtual memory API (the owner may have unmapped it since).
        if piece.kind != 2 || piece.start != at || piece.size as u64 != handle.len || !is_vmm(at) {
            return Err(cuda_error(format!("{at:#x} is no longer the device memory this process exported")));
        }
        match handle.kind {
            HandleKind::Fabric => fabric::export_fabric(at).map(|bytes| Some(Shareable::Fabric(bytes))),
            _ => export_piece(at).map(|fd| Some(Shareable::Fd(fd))),
        }
    }

    /// Opens a peer's export; a handle already open here is opened once
    /// more by reference (the driver would refuse a second open).
    pub(super) fn open_export(&self, handles: &[IpcHandle], fds: FdSource<'_>) -> Result<DevicePtr> {
        crate::gpu::check_handles(handles, 1).map_err(|reason| cuda_error(format!("a peer's export: {reason}")))?;
        let device = self.home();
        let _bound = self.bind(device)?;
        let first = handles[0];
        let (opened, base) = match first.kind {
            HandleKind::Legacy => {
                (Opened::Legacy { handle: first.bytes, device }, self.open_legacy(&first.bytes, device)?)
            }
            HandleKind::FileDescriptor | HandleKind::Fabric => {
                let mapped = self.map_pieces(handles, fds)?;
                let Opened::Mapped { range, .. } = mapped else { unreachable!("map_pieces maps") };
                (mapped, range)
            }
        };
        let ptr = base + first.offset;
        self.lock().opened.entry(ptr).or_default().push(opened);
        Ok(DevicePtr(ptr))
    }

    /// The base of a legacy handle's allocation here: opened now, or
    /// counted once more.
    fn open_legacy(&self, handle: &[u8; 64], device: u32) -> Result<u64> {
        if let Some((base, opens)) = self.lock().legacy.get_mut(&(*handle, device)) {
            *opens += 1;
            return Ok(*base);
        }
        let raw = sys::CUipcMemHandle { reserved: handle.map(|b| b as c_char) };
        let mut base: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint;
        // SAFETY: writes one device pointer; the handle is passed by value.
        let result = unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, raw, flags) };
        check(result, "opening a peer's device memory (has it exited or freed it?)")?;
        self.lock().legacy.insert((*handle, device), (base, 1));
        Ok(base)
    }

    /// Imports every piece (its descriptor from `fds`, closed once
    /// imported, or its fabric handle) and maps them back to back in a new range, with read and
    /// write access for every device of this process; on any failure,
    /// undoes what was done.
    fn map_pieces(&self, handles: &[IpcHandle], fds: FdSource<'_>) -> Result<Opened> {
        handles.iter().try_for_each(|handle| self.check_visible(handle))?;
        let total: u64 = handles.iter().map(|h| h.len).sum();
        let mut range: sys::CUdeviceptr = 0;
        // SAFETY: writes one address; alignment 0 is the default granularity.
        check(unsafe { sys::cuMemAddressReserve(&mut range, total as usize, 0, 0, 0) }, "reserving addresses")?;
        let mut pieces = Vec::with_capacity(handles.len());
        let mapped = handles.iter().enumerate().try_for_each(|(i, handle)| {
            let at = range + pieces.iter().map(|&(_, len)| len).sum::<u64>();
            map_piece(handle, at, fds(i)?)?;
            pieces.push((at, handle.len));
            Ok(())
        });
        let access = mapped.and_then(|()| self.grant_access(range, total));
        if let Err(error) = access {
            unmap(range, total, &pieces);
            return Err(error);
        }
        Ok(Opened::Mapped { range, total, pieces })
    }

    /// Refuses a piece held by a GPU this process does not see (its
    /// exporter's `CUDA_VISIBLE_DEVICES` showed it, ours hides it), which
    /// the driver cannot import, saying so; the GPU is named by UUID.
    fn check_visible(&self, handle: &IpcHandle) -> Result<()> {
        let uuid: [u8; 16] = handle.bytes[PIECE_UUID].try_into().expect("16 bytes");
        if uuid == [0; 16] || self.contexts.iter().any(|slot| slot.uuid == Some(uuid)) {
            return Ok(());
        }
        let named: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
        Err(cuda_error(format!(
            "the peer's memory is on GPU {named} (UUID), which this process does not see: CUDA_VISIBLE_DEVICES \
             hides it here; make it visible to both processes (the order may differ) to open this memory"
        )))
    }

    /// Allocates a run of `pieces` physical allocations with shareable
    /// descriptor handles, mapped back to back (what PyTorch's expandable
    /// segments do), readable and writable by every device that can.
    pub(super) fn alloc_run(&self, device: u32, piece_len: u64, pieces: u32) -> Result<DevicePtr> {
        let _bound = self.bind(device)?;
        // SAFETY: every field of the properties is plain data; zero is a
        // valid value for each (the ones that matter are set below).
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes = sys::CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location =
            sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device as c_int };
        // A NIC registers this memory only when it was made for GPUDirect
        // RDMA, which the flag asks for where the device supports it
        // (review #15; PyTorch's expandable segments do the same).
        prop.allocFlags.gpuDirectRDMACapable = u8::from(self.gdr_with_vmm(device));
        let mut granularity = 0usize;
        let option = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: writes one size for valid properties.
        let result = unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, &prop, option) };
        check(result, "allocation granularity")?;
        if piece_len == 0 || granularity == 0 || !piece_len.is_multiple_of(granularity as u64) || pieces == 0 {
            return Err(cuda_error(format!(
                "pieces of {piece_len} bytes: not a multiple of the granularity {granularity}"
            )));
        }
        let total = piece_len * pieces as u64;
        let mut range: sys::CUdeviceptr = 0;
        // SAFETY: writes one address.
        check(unsafe { sys::cuMemAddressReserve(&mut range, total as usize, 0, 0, 0) }, "reserving addresses")?;
        let mut mapped = Vec::new();
        let made = (0..pieces).try_for_each(|i| {
            let at = range + i as u64 * piece_len;
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: writes one handle for valid properties.
            check(unsafe { sys::cuMemCreate(&mut handle, piece_len as usize, &prop, 0) }, "allocating a piece")?;
            // SAFETY: maps the whole new allocation at reserved addresses.
            let result = unsafe { sys::cuMemMap(at, piece_len as usize, 0, handle, 0) };
            // SAFETY: the mapping holds its own reference.
            unsafe { sys::cuMemRelease(handle) };
            check(result, "mapping a piece")?;
            mapped.push((at, piece_len));
            Ok(())
        });
        if let Err(error) = made.and_then(|()| self.grant_access(range, total)) {
            unmap(range, total, &mapped);
            return Err(error);
        }
        self.lock().runs.insert(range, Opened::Mapped { range, total, pieces: mapped });
        Ok(DevicePtr(range))
    }

    /// Whether `device` takes `gpuDirectRDMACapable` in `cuMemCreate`
    /// (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`).
    fn gdr_with_vmm(&self, device: u32) -> bool {
        let Some(slot) = self.contexts.get(device as usize) else { return false };
        let mut supported: c_int = 0;
        let attribute = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED;
        // SAFETY: writes one int for a valid device.
        let asked = unsafe { sys::cuDeviceGetAttribute(&mut supported, attribute, slot.device) };
        asked == sys::CUresult::CUDA_SUCCESS && supported == 1
    }

    /// Read and write access to `range` for every device of this process
    /// that can have it (at least one).
    fn grant_access(&self, range: u64, total: u64) -> Result<()> {
        let mut granted = 0;
        for ordinal in 0..self.contexts.len() {
            let desc = sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: ordinal as c_int,
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: one access descriptor for a range this provider mapped.
            if unsafe { sys::cuMemSetAccess(range, total as usize, &desc, 1) } == sys::CUresult::CUDA_SUCCESS {
                granted += 1;
            }
        }
        if granted == 0 {
            return Err(cuda_error("no GPU of this process can access the peer's memory"));
        }
        Ok(())
    }

    /// Closes what `open_export` opened at `ptr`.
    ///
    /// # Safety
    ///
    /// No copy in flight uses it.
    pub(super) unsafe fn close_export(&self, ptr: DevicePtr) -> Result<()> {
        let mut state = self.lock();
        let opened = state.opened.get_mut(&ptr.0).and_then(Vec::pop);
        let opened = opened.ok_or_else(|| cuda_error(format!("{:#x} was not opened from a peer", ptr.0)))?;
        state.opened.retain(|_, opens| !opens.is_empty());
        let device = opened.device();
        let closing = match opened {
            Opened::Legacy { handle, device } => {
                let Some((base, opens)) = state.legacy.get_mut(&(handle, device)) else { return Ok(()) };
                *opens -= 1;
                let base = *base;
                (*opens == 0)
                    .then(|| state.legacy.remove(&(handle, device)))
                    .map(|_| Opened::Legacy { handle, device })
                    .map(|o| (o, base))
            }
            mapped => Some((mapped, 0)),
        };
        drop(state);
        // A legacy handle is closed from the context that opened it.
        let _bound = self.bind(device)?;
        match closing {
            Some((opened, base)) => close(opened, base),
            None => Ok(()),
        }
    }
}

/// One allocation as the driver describes an address in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Piece {
    /// Device memory (not host, not managed).
    pub device: bool,
    pub ordinal: i32,
    pub start: u64,
    pub size: u64,
    /// Mapped through the virtual memory API (`cuMemMap`).
    pub vmm: bool,
}

impl Piece {
    /// `found` as a piece; `vmm` is asked only of device memory.
    fn of(found: &Attributes, vmm: impl FnOnce() -> bool) -> Self {
        let device = found.kind == 2 && !found.managed;
        let vmm = device && vmm();
        Piece { device, ordinal: found.ordinal, start: found.start, size: found.size as u64, vmm }
    }
}

/// The end of the run of device memory that holds `first.start..end`:
/// `first` alone when it reaches `end`, else `first` and the pieces after
/// it (`at` describes the allocation at an address), each mapped right at
/// the end of the one before, on the same device, all of the virtual
/// memory API. `None` when no such run reaches `end`.
pub(super) fn run_end(first: Piece, end: u64, mut at: impl FnMut(u64) -> Result<Piece>) -> Result<Option<u64>> {
    let mut run_end = first.start.saturating_add(first.size);
    while run_end < end {
        if !first.vmm {
            return Ok(None);
        }
        let next = at(run_end)?;
        let joins = next.device && next.vmm && next.ordinal == first.ordinal && next.start == run_end && next.size > 0;
        if !joins {
            return Ok(None);
        }
        run_end = run_end.saturating_add(next.size);
    }
    Ok(Some(run_end))
}

/// True when `addr` is in memory mapped through the virtual memory API
/// (`cuMemRetainAllocationHandle` knows only that memory).
fn is_vmm(addr: u64) -> bool {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: writes one handle, or fails for memory not from cuMemMap.
    let retained = unsafe { sys::cuMemRetainAllocationHandle(&mut handle, addr as *mut c_void) };
    if retained != sys::CUresult::CUDA_SUCCESS {
        return false;
    }
    // SAFETY: one release per successful retain.
    unsafe { sys::cuMemRelease(handle) };
    true
}

impl State {
    /// Everything opened, for the provider's drop: each mapped range, and
    /// each legacy allocation once.
    pub(super) fn take_opened(&mut self) -> Vec<(Opened, u64)> {
        let mapped = self.opened.drain().flat_map(|(_, opens)| opens).filter(|o| matches!(o, Opened::Mapped { .. }));
        let mut all: Vec<(Opened, u64)> = mapped.map(|o| (o, 0)).collect();
        all.extend(self.legacy.drain().map(|((handle, device), (base, _))| (Opened::Legacy { handle, device }, base)));
        all
    }
}

/// Closes an opened export (`base`: a legacy handle's allocation here).
pub(super) fn close(opened: Opened, base: u64) -> Result<()> {
    match opened {
        Opened::Legacy { .. } => {
            // SAFETY: the last open of this handle here; nothing uses it
            // (our callers' contract).
            check(unsafe { sys::cuIpcCloseMemHandle(base) }, "closing a peer's device memory")
        }
        Opened::Mapped { range, total, pieces } => {
            unmap(range, total, &pieces);
            Ok(())
        }
    }
}

/// The handle types an allocation was made with
/// (`CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES`, a mask of
/// `CUmemAllocationHandleType`), by name.
fn allowed_handle_types(at: u64) -> Option<(u64, String)> {
    let mut mask = 0u64;
    let mut attribute = [sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES];
    let mut data: [*mut c_void; 1] = [(&mut mask as *mut u64).cast()];
    // SAFETY: writes one 64-bit mask, the attribute's type, for any address.
    let asked = unsafe { sys::cuPointerGetAttributes(1, attribute.as_mut_ptr(), data.as_mut_ptr(), at) };
    if asked != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    let names = [(0x1, "POSIX_FILE_DESCRIPTOR"), (0x2, "WIN32"), (0x4, "WIN32_KMT"), (0x8, "FABRIC")];
    let named: Vec<&str> = names.iter().filter(|(bit, _)| mask & bit != 0).map(|&(_, name)| name).collect();
    Some((mask, if named.is_empty() { "none".to_owned() } else { named.join("|") }))
}

/// The shareable descriptor of the physical allocation mapped at `at`
/// (one whose handle types allow it: `fabric::run_kind` chose it).
fn export_piece(at: u64) -> Result<OwnedFd> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: writes one handle; `at` is the start of a mapped allocation.
    let retained = unsafe { sys::cuMemRetainAllocationHandle(&mut handle, at as *mut c_void) };
    check(
        retained,
        "exporting device memory: neither cuMemAlloc memory nor from the virtual memory API (cudaMallocAsync pools \
         are not exportable)",
    )?;
    let mut raw: c_int = -1;
    let kind = sys::CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: writes one descriptor number for a retained handle.
    let exported = unsafe { sys::cuMemExportToShareableHandle((&mut raw as *mut c_int).cast(), handle, kind, 0) };
    // SAFETY: one release per retain above.
    unsafe { sys::cuMemRelease(handle) };
    check(exported, "exporting device memory as a POSIX descriptor")?;
    // SAFETY: a fresh descriptor the driver handed to this process.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Imports what a peer passed for `handle` (a descriptor, closed here, or
/// a fabric handle) and maps the allocation at `at`.
fn map_piece(handle: &IpcHandle, at: u64, taken: Shareable) -> Result<()> {
    let imported = match (handle.kind, taken) {
        (HandleKind::FileDescriptor, Shareable::Fd(taken)) => {
            let mut imported: sys::CUmemGenericAllocationHandle = 0;
            let kind = sys::CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            // SAFETY: the driver reads the descriptor number passed as the
            // pointer value (its convention for POSIX handles) and writes
            // one handle.
            let result = unsafe {
                sys::cuMemImportFromShareableHandle(&mut imported, taken.as_raw_fd() as usize as *mut c_void, kind)
            };
            drop(taken);
            check(result, "importing a peer's device memory")?;
            imported
        }
        (HandleKind::Fabric, Shareable::Fabric(bytes)) => fabric::import_fabric(&bytes)?,
        (kind, taken) => {
            return Err(cuda_error(format!("the peer passed a {:?} handle for a {kind:?} one", taken.kind())));
        }
    };
    // SAFETY: maps the whole imported allocation at reserved addresses.
    let mapped = unsafe { sys::cuMemMap(at, handle.len as usize, 0, imported, 0) };
    // SAFETY: the mapping holds its own reference; ours is released.
    unsafe { sys::cuMemRelease(imported) };
    check(mapped, "mapping a peer's device memory")
}

/// Unmaps `pieces` and frees the reserved range.
fn unmap(range: u64, total: u64, pieces: &[(u64, u64)]) {
    for &(at, len) in pieces {
        // SAFETY: a piece this provider mapped, used by no copy any more.
        unsafe { sys::cuMemUnmap(at, len as usize) };
    }
    // SAFETY: the range this provider reserved, now empty.
    unsafe { sys::cuMemAddressFree(range, total as usize) };
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn piece(start: u64, size: u64, vmm: bool) -> Piece {
        Piece { device: true, ordinal: 0, start, size, vmm }
    }

    /// Runs `run_end` over a synthetic address map.
    fn end_of(map: &[Piece], addr: u64, len: u64) -> Option<u64> {
        let at = |a: u64| map.iter().copied().find(|p| p.start <= a && a < p.start + p.size);
        let host = Piece { device: false, ordinal: -1, start: 0, size: 0, vmm: false };
        run_end(at(addr).unwrap(), addr + len, |a| Ok(at(a).unwrap_or(host))).unwrap()
    }

    #[test]
    fn only_pieces_of_the_virtual_memory_api_join_into_one_range() {
        // Two cuMemAlloc allocations side by side: never one range.
        let legacy = [piece(0, 2 * MIB, false), piece(2 * MIB, 2 * MIB, false)];
        assert_eq!(end_of(&legacy, MIB, MIB), Some(2 * MIB), "inside the first");
        assert_eq!(end_of(&legacy, MIB, 2 * MIB), None);
        // An expandable segment's pieces: one range.
        let pieces = [piece(0, 2 * MIB, true), piece(2 * MIB, 2 * MIB, true), piece(4 * MIB, 2 * MIB, true)];
        assert_eq!(end_of(&pieces, MIB, 4 * MIB), Some(6 * MIB));
        // A piece next to a cuMemAlloc allocation, either way round.
        assert_eq!(end_of(&[piece(0, 2 * MIB, true), piece(2 * MIB, 2 * MIB, false)], MIB, 2 * MIB), None);
        assert_eq!(end_of(&[piece(0, 2 * MIB, false), piece(2 * MIB, 2 * MIB, true)], MIB, 2 * MIB), None);
        // Another GPU's piece, a gap, or host memory after it.
        let other = Piece { ordinal: 1, ..piece(2 * MIB, 2 * MIB, true) };
        assert_eq!(end_of(&[piece(0, 2 * MIB, true), other], MIB, 2 * MIB), None);
        assert_eq!(end_of(&[piece(0, 2 * MIB, true), piece(3 * MIB, MIB, true)], MIB, 2 * MIB), None);
        assert_eq!(end_of(&[piece(0, 2 * MIB, true)], MIB, 2 * MIB), None);
    }
}

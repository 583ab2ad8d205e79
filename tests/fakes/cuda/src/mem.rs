//! Device memory, the virtual memory API, legacy IPC, pinned host memory
//! and pointer attributes.
//!
//! Every physical allocation is a memfd. Where it is mapped at a device
//! address the mapping is `PROT_NONE` (the host cannot touch device
//! memory); the copy engines use a private read-write alias.

use super::{code, err, put, with, CUdeviceptr, CUresult, Driver, COUNTERS};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// The allocation granularity the fake reports (as NVIDIA GPUs do).
pub const GRANULARITY: u64 = 2 << 20;

/// The allocation granularity the devices report: 2 MiB (today's GPUs'),
/// or `FAKECUDA_GRANULARITY` (a power of two from 4 KiB up to 2 MiB) so a
/// test can make thousands of pieces on a small machine. The rules that
/// use it are the driver's: sizes and mapped addresses are multiples of
/// what `cuMemGetAllocationGranularity` reports [ref: 6.14,
/// cuMemGetAllocationGranularity, cuMemCreate, cuMemMap]; the address
/// layout keeps 2 MiB steps (a coarser alignment breaks no rule).
pub fn granularity() -> u64 {
    static ONE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *ONE.get_or_init(|| match std::env::var("FAKECUDA_GRANULARITY").ok().and_then(|v| v.parse::<u64>().ok()) {
        Some(g) if g.is_power_of_two() && (4096..=GRANULARITY).contains(&g) => g,
        _ => GRANULARITY,
    })
}
/// The host page size for dma-buf alignment.
const PAGE: u64 = 4096;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
const POSIX_FD: u32 = 1;
/// `CU_MEM_HANDLE_TYPE_FABRIC`: a `CUmemFabricHandle` of 64 bytes.
const FABRIC: u32 = 8;
/// The first bytes of the fake's FABRIC handles.
const FABRIC_MAGIC: &[u8; 4] = b"FKFB";
/// The address space the fake hands device addresses out of.
const ARENA: u64 = 1 << 40;

/// One physical allocation.
#[derive(Debug)]
pub struct Phys {
    pub id: u64,
    /// The GPU holding it.
    pub device: i32,
    pub size: u64,
    /// The driver's own descriptor of the memory.
    fd: c_int,
    /// The copy engines' read-write view.
    pub alias: *mut u8,
    handle_types: u32,
    gdr: bool,
}

// SAFETY: the alias is only written by copy workers, on ranges the caller
// queued; the struct itself is immutable after creation.
unsafe impl Send for Phys {}
// SAFETY: as above.
unsafe impl Sync for Phys {}

impl Drop for Phys {
    fn drop(&mut self) {
        // SAFETY: the alias mapping and descriptor this struct made.
        unsafe {
            libc::munmap(self.alias.cast(), self.size as usize);
            libc::close(self.fd);
        }
    }
}

/// What made a mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `cuMemAlloc` in the context of this device.
    Alloc,
    /// `cuMemMap` inside the reservation starting here.
    Vmm { reservation: u64 },
    /// `cuIpcOpenMemHandle` in this device's context.
    Ipc { context: i32 },
}

/// A device address range backed by (part of) one physical allocation.
#[derive(Debug)]
pub struct Map {
    pub size: u64,
    pub phys: Arc<Phys>,
    pub kind: Kind,
    /// Devices granted access (`cuMemSetAccess`; VMM only).
    pub access: HashSet<i32>,
    /// Opens of a legacy IPC mapping not yet closed.
    opens: u32,
    /// A legacy IPC mapping's exporter: its pid and allocation id.
    exporter: Option<(u32, u64)>,
}

/// Host memory the driver pinned.
#[derive(Debug)]
struct Host {
    len: u64,
    devicemap: bool,
    /// From `cuMemHostAlloc` (freed with `cuMemFreeHost`), not registered.
    allocated: bool,
}

pub struct Memory {
    arena: u64,
    next: u64,
    next_id: u64,
    /// Random per load: tells this process's IPC handles from others'.
    instance: u64,
    pub maps: BTreeMap<u64, Map>,
    reservations: BTreeMap<u64, u64>,
    /// Generic allocation handles and the references held on each.
    handles: HashMap<u64, (Arc<Phys>, u32)>,
    host: BTreeMap<u64, Host>,
    /// Managed memory: start, length and the device it was allocated for.
    managed: BTreeMap<u64, (u64, i32)>,
}

/// Where one end of a copy lies.
#[derive(Debug, Clone)]
pub enum End {
    /// Device memory: the alias of each mapping the range crosses, in
    /// order (more than one only for back-to-back mappings of one
    /// reservation of the virtual memory API).
    Device {
        parts: Vec<(*mut u8, u64, Arc<Phys>)>,
        kind: Kind,
        access: HashSet<i32>,
    },
    Host {
        at: *mut u8,
        pinned: bool,
        devicemap: bool,
    },
}

// SAFETY: raw pointers into mappings the fake owns (kept alive by `phys`)
// or host memory the caller vouched for.
unsafe impl Send for End {}

impl End {
    /// The (pointer, length) runs of this end, in order.
    pub fn runs(&self, len: u64) -> Vec<(*mut u8, u64)> {
        match self {
            End::Device { parts, .. } => parts.iter().map(|(at, n, _)| (*at, *n)).collect(),
            End::Host { at, .. } => vec![(*at, len)],
        }
    }

    /// The GPU holding the memory (device ends).
    pub fn device(&self) -> Option<i32> {
        match self {
            End::Device { parts, .. } => parts.first().map(|p| p.2.device),
            End::Host { .. } => None,
        }
    }
}

impl Memory {
    pub fn new() -> Self {
        // SAFETY: a fresh reservation, no access, no backing.
        let arena = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                (ARENA + GRANULARITY) as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        } as u64;
        let arena = arena.div_ceil(GRANULARITY) * GRANULARITY;
        let mut instance = [0u8; 8];
        // SAFETY: writes 8 bytes into the buffer.
        unsafe { libc::getrandom(instance.as_mut_ptr().cast(), 8, 0) };
        Memory {
            arena,
            next: arena,
            next_id: 1,
            instance: u64::from_le_bytes(instance),
            maps: BTreeMap::new(),
            reservations: BTreeMap::new(),
            handles: HashMap::new(),
            host: BTreeMap::new(),
            managed: BTreeMap::new(),
        }
    }

    /// Fresh device addresses, granule aligned: allocations made one after
    /// another lie back to back, as `cudaMalloc`'s often do.
    fn take_addresses(&mut self, size: u64, align: u64) -> Result<u64, CUresult> {
        let align = align.max(GRANULARITY);
        let start = self.next.div_ceil(align) * align;
        let end = start.checked_add(size.div_ceil(GRANULARITY) * GRANULARITY).ok_or(err::OUT_OF_MEMORY)?;
        if end > self.arena + ARENA {
            return Err(err::OUT_OF_MEMORY);
        }
        self.next = end;
        Ok(start)
    }

    /// A new allocation on this process's GPU `device`, which is physical
    /// GPU `physical` (what its descriptor's name records, for other
    /// processes, whose ordinals may differ).
    fn new_phys(
        &mut self,
        device: i32,
        physical: i32,
        size: u64,
        handle_types: u32,
        gdr: bool,
    ) -> Result<Arc<Phys>, CUresult> {
        let id = self.next_id;
        self.next_id += 1;
        let name = format!("fakecuda-{}-{id}-{physical}-{handle_types}-{}\0", std::process::id(), u8::from(gdr));
        // SAFETY: a NUL-terminated name.
        let fd = unsafe { libc::memfd_create(name.as_ptr().cast(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(err::OPERATING_SYSTEM);
        }
        // SAFETY: sizes a descriptor we own.
        if unsafe { libc::ftruncate(fd, size as libc::off_t) } != 0 {
            // SAFETY: ours.
            unsafe { libc::close(fd) };
            return Err(err::OUT_OF_MEMORY);
        }
        Phys::from_fd(id, device, size, fd, handle_types, gdr)
    }

    /// Maps `phys` with no access at `at` (inside the arena).
    fn place(&mut self, at: u64, phys: Arc<Phys>, kind: Kind) -> Result<(), CUresult> {
        // SAFETY: `at..at + size` lies in the fake's own reservation.
        let placed = unsafe {
            libc::mmap(
                at as *mut c_void,
                phys.size as usize,
                libc::PROT_NONE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                phys.fd,
                0,
            )
        };
        if placed == libc::MAP_FAILED {
            return Err(err::OUT_OF_MEMORY);
        }
        let size = phys.size;
        self.maps.insert(at, Map { size, phys, kind, access: HashSet::new(), opens: 1, exporter: None });
        Ok(())
    }

    /// Puts `at..at + size` back to reserved, unbacked addresses.
    fn unplace(&mut self, at: u64, size: u64) -> Option<Map> {
        // SAFETY: addresses of the fake's own reservation.
        unsafe {
            libc::mmap(
                at as *mut c_void,
                size as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            );
        }
        self.maps.remove(&at)
    }

    /// The mapping holding `addr`.
    pub fn map_at(&self, addr: u64) -> Option<(u64, &Map)> {
        let (&start, map) = self.maps.range(..=addr).next_back()?;
        (addr < start + map.size).then_some((start, map))
    }

    fn reservation_at(&self, addr: u64) -> Option<(u64, u64)> {
        let (&start, &size) = self.reservations.range(..=addr).next_back()?;
        (addr < start + size).then_some((start, size))
    }

    /// The pinned host range holding `addr`.
    /// The managed allocation holding `addr`: start, length, device.
    fn managed_at(&self, addr: u64) -> Option<(u64, u64, i32)> {
        let (&start, &(len, device)) = self.managed.range(..=addr).next_back()?;
        (addr < start + len).then_some((start, len, device))
    }

    fn host_at(&self, addr: u64) -> Option<(u64, &Host)> {
        let (&start, host) = self.host.range(..=addr).next_back()?;
        (addr < start + host.len).then_some((start, host))
    }

    /// Where `addr..addr + len` lies, for a copy: wholly inside one device
    /// mapping, or host memory wholly pinned or wholly pageable. `None`
    /// for a range that crosses a mapping's end, lies in reserved but
    /// unmapped addresses, or mixes pinned and pageable host memory.
    pub fn resolve(&self, addr: u64, len: u64) -> Option<End> {
        let end = addr.checked_add(len)?;
        if let Some((start, map)) = self.map_at(addr) {
            // [ref: 6.14 Virtual Memory Management: mappings made back to
            // back in one reservation form one range of addresses, as
            // PyTorch's expandable segments use them; two cuMemAlloc
            // allocations side by side do not.]
            let (kind, mut access) = (map.kind, map.access.clone());
            let mut parts = Vec::new();
            let (mut at, mut here, mut current) = (addr, start, map);
            loop {
                let take = end.min(here + current.size) - at;
                // SAFETY: inside the alias of this mapping's allocation.
                parts.push((unsafe { current.phys.alias.add((at - here) as usize) }, take, current.phys.clone()));
                at += take;
                if at == end {
                    break;
                }
                let next = self.maps.get(&at)?;
                let same_run =
                    matches!((kind, next.kind), (Kind::Vmm { reservation: a }, Kind::Vmm { reservation: b }) if a == b);
                if !same_run || next.phys.device != current.phys.device {
                    return None;
                }
                access.retain(|d| next.access.contains(d));
                (here, current) = (at, next);
            }
            return Some(End::Device { parts, kind, access });
        }
        if self.reservation_at(addr).is_some() || (addr >= self.arena && addr < self.arena + ARENA) {
            return None;
        }
        // Device memory anywhere inside the range makes it no host range.
        if self.maps.range(addr..end).next().is_some() {
            return None;
        }
        let pinned = self.host_at(addr);
        let touched = self.host.range(addr..end).next().is_some();
        match pinned {
            Some((start, host)) if end <= start + host.len => {
                Some(End::Host { at: addr as *mut u8, pinned: true, devicemap: host.devicemap })
            }
            Some(_) => None,
            None if touched => None,
            None => Some(End::Host { at: addr as *mut u8, pinned: false, devicemap: false }),
        }
    }

    pub fn ipc_opened_in(&self, device: i32) -> i64 {
        self.maps.values().filter(|m| m.kind == Kind::Ipc { context: device }).count() as i64
    }

    pub fn allocations(&self) -> i64 {
        let mut ids: HashSet<u64> = self.maps.values().map(|m| m.phys.id).collect();
        ids.extend(self.handles.values().map(|(p, _)| p.id));
        ids.len() as i64
    }

    pub fn pinned_ranges(&self) -> i64 {
        self.host.values().filter(|h| !h.allocated).count() as i64
    }
}

impl Phys {
    fn from_fd(
        id: u64,
        device: i32,
        size: u64,
        fd: c_int,
        handle_types: u32,
        gdr: bool,
    ) -> Result<Arc<Phys>, CUresult> {
        // SAFETY: a private shared view of a descriptor we own.
        let alias = unsafe {
            libc::mmap(std::ptr::null_mut(), size as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        if alias == libc::MAP_FAILED {
            // SAFETY: ours.
            unsafe { libc::close(fd) };
            return Err(err::OUT_OF_MEMORY);
        }
        Ok(Arc::new(Phys { id, device, size, fd, alias: alias.cast(), handle_types, gdr }))
    }
}

/// Descriptors of fake device memory open in this process beyond the ones
/// the driver holds (one per physical allocation object alive).
pub fn foreign_fds(d: &Driver) -> i64 {
    let mut held: HashSet<c_int> = d.mem.maps.values().map(|m| m.phys.fd).collect();
    held.extend(d.mem.handles.values().map(|(p, _)| p.fd));
    held.extend(d.exec.held_fds());
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else { return -1 };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            let fd: c_int = e.file_name().to_string_lossy().parse().unwrap_or(-1);
            !held.contains(&fd)
                && std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:fakecuda-"))
        })
        .count() as i64
}

// ---------------------------------------------------------------------------
// cuMemAlloc and friends [ref: 6.13 Memory Management].
// ---------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    // [ref: 6.13, cuMemAlloc: allocates on the current context's device;
    // INVALID_VALUE for 0 bytes; INVALID_CONTEXT without a context.]
    code(with(|d| {
        let device = d.current()?;
        if size == 0 {
            return Err(err::INVALID_VALUE);
        }
        let physical = d.physical(device);
        let phys = d.mem.new_phys(device, physical, size as u64, 0, false)?;
        let at = d.mem.take_addresses(size as u64, GRANULARITY)?;
        d.mem.place(at, phys, Kind::Alloc)?;
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(dptr, at) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) -> CUresult {
    // [ref: 6.13, cuMemAllocManaged: memory "automatically managed by the
    // Unified Memory system", accessible from the host and every device;
    // allocated for the current context's device; INVALID_VALUE for 0
    // bytes or flags other than CU_MEM_ATTACH_GLOBAL (1) or
    // CU_MEM_ATTACH_HOST (2); freed with cuMemFree.] The fake gives host
    // memory the host may touch, known to the pointer attributes (6.16:
    // MEMORY_TYPE DEVICE, IS_MANAGED) and to nothing else: copies to or
    // from it are not modelled, and refused (INVALID_VALUE).
    code(with(|d| {
        let device = d.current()?;
        if size == 0 || !(flags == 1 || flags == 2) {
            return Err(err::INVALID_VALUE);
        }
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: a fresh anonymous mapping, the host's to touch.
        let at = unsafe { libc::mmap(std::ptr::null_mut(), size, rw, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
        if at == libc::MAP_FAILED {
            return Err(err::OUT_OF_MEMORY);
        }
        d.mem.managed.insert(at as u64, (size as u64, device));
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(dptr, at as u64) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    // [ref: 6.13, cuMemFree: needs a current context (INVALID_CONTEXT);
    // dptr must be what cuMemAlloc or cuMemAllocManaged returned.]
    code(with(|d| {
        d.current()?;
        if let Some((len, _)) = d.mem.managed.remove(&dptr) {
            // SAFETY: the mapping cuMemAllocManaged made, now out of the table.
            unsafe { libc::munmap(dptr as *mut c_void, len as usize) };
            return Ok(());
        }
        match d.mem.maps.get(&dptr) {
            Some(map) if map.kind == Kind::Alloc => {
                let size = map.size;
                d.mem.unplace(dptr, size);
                Ok(())
            }
            _ => Err(err::INVALID_VALUE),
        }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    base: *mut CUdeviceptr,
    size: *mut usize,
    dptr: CUdeviceptr,
) -> CUresult {
    // [ref: 6.13, cuMemGetAddressRange: the base and size of the
    // allocation holding dptr; for the virtual memory API that is the
    // mapping made by one cuMemMap, not the reservation. NOT_FOUND
    // otherwise. Like the other memory-management calls it runs in the
    // current context and returns CUDA_ERROR_INVALID_CONTEXT without one
    // (6.8): seen on a real H100 with driver 580 (2026-11-26), where a call
    // from a thread with no current context returned 201.]
    code(with(|d| {
        d.current()?;
        let (start, map) = d.mem.map_at(dptr).ok_or(err::NOT_FOUND)?;
        let len = map.size as usize;
        if !base.is_null() {
            // SAFETY: an out-pointer the caller passes under the Driver API's contract
            // (valid for this write or null); `put` refuses null.
            unsafe { put(base, start)? };
        }
        if !size.is_null() {
            // SAFETY: an out-pointer the caller passes under the Driver API's contract
            // (valid for this write or null); `put` refuses null.
            unsafe { put(size, len)? };
        }
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(pp: *mut *mut c_void, size: usize, flags: c_uint) -> CUresult {
    // [ref: 6.13, cuMemHostAlloc: page-locked host memory, device-mapped
    // with CU_MEMHOSTALLOC_DEVICEMAP (0x02); needs a context.]
    code(with(|d| {
        d.current()?;
        if size == 0 {
            return Err(err::INVALID_VALUE);
        }
        // SAFETY: fresh anonymous memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(err::OUT_OF_MEMORY);
        }
        d.mem.host.insert(p as u64, Host { len: size as u64, devicemap: flags & 0x02 != 0, allocated: true });
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(pp, p) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    code(with(|d| {
        d.current()?;
        match d.mem.host.get(&(p as u64)) {
            Some(h) if h.allocated => {
                let len = h.len;
                d.mem.host.remove(&(p as u64));
                // SAFETY: the mapping cuMemHostAlloc made.
                unsafe { libc::munmap(p, len as usize) };
                Ok(())
            }
            _ => Err(err::INVALID_VALUE),
        }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    dptr: *mut CUdeviceptr,
    p: *mut c_void,
    flags: c_uint,
) -> CUresult {
    // [ref: 6.13, cuMemHostGetDevicePointer: only for memory allocated or
    // registered with DEVICEMAP; flags must be 0; with unified addressing
    // the device pointer equals the host pointer.]
    code(with(|d| {
        d.current()?;
        if flags != 0 {
            return Err(err::INVALID_VALUE);
        }
        match d.mem.host_at(p as u64) {
            // SAFETY: an out-pointer the caller passes under the Driver API's contract
            // (valid for this write or null); `put` refuses null.
            Some((_, h)) if h.devicemap => unsafe { put(dptr, p as u64) },
            _ => Err(err::INVALID_VALUE),
        }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostRegister_v2(p: *mut c_void, size: usize, flags: c_uint) -> CUresult {
    // [ref: 6.13, cuMemHostRegister: needs a context; a range overlapping
    // one registered before fails HOST_MEMORY_ALREADY_REGISTERED; memory
    // the process has not mapped fails INVALID_VALUE; a read-only mapping
    // needs CU_MEMHOSTREGISTER_READ_ONLY (0x08).]
    code(with(|d| {
        d.current()?;
        let (start, len) = (p as u64, size as u64);
        if size == 0 || p.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let end = start.checked_add(len).ok_or(err::INVALID_VALUE)?;
        let overlaps = d.mem.host_at(start).is_some() || d.mem.host.range(start..end).next().is_some();
        if overlaps {
            return Err(err::HOST_MEMORY_ALREADY_REGISTERED);
        }
        if d.mem.map_at(start).is_some() || !host_mapped(start, len, flags & 0x08 != 0) {
            return Err(err::INVALID_VALUE);
        }
        d.mem.host.insert(start, Host { len, devicemap: flags & 0x02 != 0, allocated: false });
        Ok(())
    }))
}

/// True when every page of `start..start + len` is mapped in this process,
/// and writable unless `read_only` (from /proc/self/maps).
fn host_mapped(start: u64, len: u64, read_only: bool) -> bool {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return false };
    let mut covered = start;
    let end = start + len;
    let mut spans: Vec<(u64, u64, bool)> = maps
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let range = fields.next()?;
            let perms = fields.next()?;
            let (a, b) = range.split_once('-')?;
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
                perms.as_bytes().get(1) == Some(&b'w'),
            ))
        })
        .collect();
    spans.sort();
    for (a, b, writable) in spans {
        if b <= covered || a > covered {
            continue;
        }
        if !writable && !read_only {
            return false;
        }
        covered = b;
        if covered >= end {
            return true;
        }
    }
    covered >= end
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    // [ref: 6.13, cuMemHostUnregister: p must be the base registered;
    // HOST_MEMORY_NOT_REGISTERED otherwise.]
    code(with(|d| {
        d.current()?;
        match d.mem.host.get(&(p as u64)) {
            Some(h) if !h.allocated => {
                d.mem.host.remove(&(p as u64));
                Ok(())
            }
            _ => Err(err::HOST_MEMORY_NOT_REGISTERED),
        }
    }))
}

// ---------------------------------------------------------------------------
// Pointer attributes [ref: 6.16 Unified Addressing].
// ---------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttributes(
    count: c_uint,
    attributes: *mut c_int,
    data: *mut *mut c_void,
    ptr: CUdeviceptr,
) -> CUresult {
    // [ref: 6.16, cuPointerGetAttributes: "Unlike cuPointerGetAttribute,
    // this function will not return an error when the ptr encountered is
    // not a valid CUDA pointer. Instead, the attributes are assigned
    // default NULL values and CUDA_SUCCESS is returned." RANGE_START_ADDR
    // and RANGE_SIZE: "not necessarily the mapped region, but the mappable
    // address range (e.g. from cuMemAddressReserve)"; MAPPING_BASE_ADDR
    // and MAPPING_SIZE give the mapping.]
    code(with(|d| {
        if attributes.is_null() || data.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let found = d.mem.map_at(ptr);
        let host = d.mem.host_at(ptr);
        let managed = d.mem.managed_at(ptr);
        for i in 0..count as usize {
            // SAFETY: `count` entries at each array, checked non-null above (cuPointerGetAttributes' contract).
            let (attribute, out) = unsafe { (*attributes.add(i), *data.add(i)) };
            if out.is_null() {
                return Err(err::INVALID_VALUE);
            }
            let (u32_of, u64_of, bool_of) = (
                // SAFETY: `out` is this attribute's non-null out-pointer, sized as it documents.
                |v: u32| unsafe { out.cast::<u32>().write_unaligned(v) },
                // SAFETY: as above.
                |v: u64| unsafe { out.cast::<u64>().write_unaligned(v) },
                // SAFETY: as above.
                |v: bool| unsafe { out.cast::<u8>().write(u8::from(v)) },
            );
            // Managed memory: a device pointer (MEMORY_TYPE DEVICE) that
            // IS_MANAGED; never legacy-IPC capable (cuIpcGetMemHandle takes
            // cuMemAlloc memory only [ref: 6.13]).
            if let Some((start, len, device)) = managed {
                match attribute {
                    2 => u32_of(2),
                    9 => u32_of(device as u32),
                    8 | 13 => bool_of(true),
                    10 | 15 => bool_of(false),
                    11 => u64_of(start),
                    12 => u64_of(len),
                    1 | 3 | 4 | 14 | 18 | 19 => u64_of(0),
                    _ => return Err(err::INVALID_VALUE),
                }
                continue;
            }
            match (attribute, found, host) {
                (2, Some(_), _) => u32_of(2),    // MEMORY_TYPE: DEVICE
                (2, None, Some(_)) => u32_of(1), // HOST
                (2, None, None) => u32_of(0),
                (9, Some((_, m)), _) => u32_of(m.phys.device as u32), // DEVICE_ORDINAL
                (9, None, _) => u32_of(u32::MAX),
                (8, ..) => bool_of(false),                               // IS_MANAGED
                (10, Some((_, m)), _) => bool_of(m.kind == Kind::Alloc), // IS_LEGACY_CUDA_IPC_CAPABLE
                (10, ..) => bool_of(false),
                (11 | 12, Some((start, m)), _) => {
                    let (base, size) = match m.kind {
                        Kind::Vmm { reservation } => (reservation, d.mem.reservations[&reservation]),
                        _ => (start, m.size),
                    };
                    if attribute == 11 {
                        u64_of(base)
                    } else {
                        u64_of(size)
                    }
                }
                (11 | 12, None, Some((start, h))) => u64_of(if attribute == 11 { start } else { h.len }),
                (11 | 12, None, None) => u64_of(0),
                (13, m, h) => bool_of(m.is_some() || h.is_some()), // MAPPED
                (14, Some((_, m)), _) => u64_of(m.phys.handle_types as u64), // ALLOWED_HANDLE_TYPES
                (15, Some((_, m)), _) => bool_of(m.phys.gdr || m.kind == Kind::Alloc),
                (18, Some((_, m)), _) => u64_of(m.size),    // MAPPING_SIZE
                (19, Some((start, _)), _) => u64_of(start), // MAPPING_BASE_ADDR
                (14 | 18 | 19, ..) => u64_of(0),
                (15, ..) => bool_of(false),
                (1, ..) | (3, ..) | (4, ..) => u64_of(0),
                _ => return Err(err::INVALID_VALUE),
            }
        }
        Ok(())
    }))
}

// ---------------------------------------------------------------------------
// The virtual memory API [ref: 6.14 Virtual Memory Management].
// ---------------------------------------------------------------------------

/// `CUmemAllocationProp` [ref: 7 Data Structures, CUmemAllocationProp].
#[repr(C)]
pub struct AllocationProp {
    kind: u32,
    handle_types: u32,
    location_type: u32,
    location_id: c_int,
    win32: *mut c_void,
    compression: u8,
    gdr: u8,
    usage: u16,
    reserved: [u8; 4],
}

unsafe fn device_of_prop(d: &Driver, prop: *const AllocationProp) -> Result<(i32, u32, bool), CUresult> {
    // SAFETY: null or an allocation property, under our caller's contract.
    let prop = unsafe { prop.as_ref() }.ok_or(err::INVALID_VALUE)?;
    // type must be CU_MEM_ALLOCATION_TYPE_PINNED (1), location a device (1).
    if prop.kind != 1 || prop.location_type != 1 {
        return Err(err::INVALID_VALUE);
    }
    Ok((d.check_device(prop.location_id)?, prop.handle_types, prop.gdr != 0))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    g: *mut usize,
    prop: *const AllocationProp,
    _option: c_int,
) -> CUresult {
    code(with(|d| {
        // SAFETY: `prop` as the Driver API's contract for this call gives it.
        unsafe { device_of_prop(d, prop)? };
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(g, granularity() as usize) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    align: usize,
    addr: CUdeviceptr,
    flags: u64,
) -> CUresult {
    // [ref: 6.14, cuMemAddressReserve: size a multiple of the granularity;
    // flags must be 0; `addr` is only a hint.]
    code(with(|d| {
        let _ = addr;
        if size == 0 || !(size as u64).is_multiple_of(granularity()) || flags != 0 {
            return Err(err::INVALID_VALUE);
        }
        let at = d.mem.take_addresses(size as u64, align as u64)?;
        d.mem.reservations.insert(at, size as u64);
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(ptr, at) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    // [ref: 6.14, cuMemAddressFree: the whole reservation; "All physical
    // memory mapped to this virtual address range must be unmapped prior
    // to calling this function".]
    code(with(|d| {
        if d.mem.reservations.get(&ptr) != Some(&(size as u64)) {
            return Err(err::INVALID_VALUE);
        }
        if d.mem.maps.range(ptr..ptr + size as u64).next().is_some() {
            return Err(err::INVALID_VALUE);
        }
        d.mem.reservations.remove(&ptr);
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const AllocationProp,
    flags: u64,
) -> CUresult {
    // [ref: 6.14, cuMemCreate: size a multiple of the granularity; flags 0.]
    code(with(|d| {
        // SAFETY: `prop` as the Driver API's contract for this call gives it.
        let (device, types, gdr) = unsafe { device_of_prop(d, prop)? };
        if size == 0 || !(size as u64).is_multiple_of(granularity()) || flags != 0 {
            return Err(err::INVALID_VALUE);
        }
        // [ref: 5 Enumerations, CUdevice_attribute:
        // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED "Device
        // supports specifying the GPUDirect RDMA flag with cuMemCreate"; and
        // 7 Data Structures, CUmemAllocationProp::allocFlags::
        // gpuDirectRDMACapable.] A device without it takes no such flag.
        if gdr && !d.config.gdr_vmm {
            return Err(err::NOT_SUPPORTED);
        }
        let physical = d.physical(device);
        let phys = d.mem.new_phys(device, physical, size as u64, types, gdr)?;
        let id = phys.id;
        d.mem.handles.insert(id, (phys, 1));
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(handle, id) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemRelease(handle: u64) -> CUresult {
    // [ref: 6.14, cuMemRelease: the memory is freed once every mapping of
    // it is unmapped too.]
    code(with(|d| {
        let entry = d.mem.handles.get_mut(&handle).ok_or(err::INVALID_VALUE)?;
        entry.1 -= 1;
        if entry.1 == 0 {
            d.mem.handles.remove(&handle);
        }
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: u64, flags: u64) -> CUresult {
    // [ref: 6.14, cuMemMap: "offset ... must be zero"; flags must be 0;
    // the range lies inside one reservation, granule aligned, not mapped
    // already; size is the allocation's.]
    code(with(|d| {
        let phys = d.mem.handles.get(&handle).ok_or(err::INVALID_HANDLE)?.0.clone();
        let (size, end) = (size as u64, ptr.checked_add(size as u64).ok_or(err::INVALID_VALUE)?);
        if offset != 0 || flags != 0 || size == 0 || !ptr.is_multiple_of(granularity()) || size != phys.size {
            return Err(err::INVALID_VALUE);
        }
        let (start, len) = d.mem.reservation_at(ptr).ok_or(err::INVALID_VALUE)?;
        if end > start + len || d.mem.map_at(ptr).is_some() || d.mem.maps.range(ptr..end).next().is_some() {
            return Err(err::INVALID_VALUE);
        }
        d.mem.place(ptr, phys, Kind::Vmm { reservation: start })
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    // [ref: 6.14, cuMemUnmap: "the range must be the entire contiguous
    // address range that was mapped to" (whole mappings).]
    code(with(|d| {
        let end = ptr + size as u64;
        let covered: Vec<(u64, u64)> = d.mem.maps.range(ptr..end).map(|(&a, m)| (a, m.size)).collect();
        let whole = !covered.is_empty()
            && covered[0].0 == ptr
            && covered.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0)
            && covered.last().is_some_and(|&(a, s)| a + s == end)
            && covered.iter().all(|(a, _)| matches!(d.mem.maps[a].kind, Kind::Vmm { .. }));
        if !whole {
            return Err(err::INVALID_VALUE);
        }
        for (a, s) in covered {
            d.mem.unplace(a, s);
        }
        Ok(())
    }))
}

/// `CUmemAccessDesc`.
#[repr(C)]
pub struct AccessDesc {
    location_type: u32,
    location_id: c_int,
    flags: u32,
}

#[no_mangle]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const AccessDesc,
    count: usize,
) -> CUresult {
    // [ref: 6.14, cuMemSetAccess: the range must be fully mapped by
    // cuMemMap; each descriptor names a device.]
    code(with(|d| {
        let end = ptr + size as u64;
        let covered: Vec<u64> = d.mem.maps.range(ptr..end).map(|(&a, _)| a).collect();
        let mut at = ptr;
        for a in &covered {
            if *a != at || !matches!(d.mem.maps[a].kind, Kind::Vmm { .. }) {
                return Err(err::INVALID_VALUE);
            }
            at += d.mem.maps[a].size;
        }
        if covered.is_empty() || at != end || desc.is_null() || count == 0 {
            return Err(err::INVALID_VALUE);
        }
        // SAFETY: `count` descriptors at `desc`, checked non-null above (cuMemSetAccess's contract).
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        for one in descs {
            if one.location_type != 1 {
                return Err(err::INVALID_VALUE);
            }
            d.check_device(one.location_id)?;
        }
        for a in covered {
            let map = d.mem.maps.get_mut(&a).expect("listed above");
            for one in descs {
                // CU_MEM_ACCESS_FLAGS_PROT_NONE (0) revokes.
                if one.flags == 0 {
                    map.access.remove(&one.location_id);
                } else {
                    map.access.insert(one.location_id);
                }
            }
        }
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(handle: *mut u64, addr: *mut c_void) -> CUresult {
    // [ref: 6.14, cuMemRetainAllocationHandle: any address in a range
    // mapped by cuMemMap; the handle must be released with cuMemRelease.]
    code(with(|d| {
        let (_, map) = d.mem.map_at(addr as u64).ok_or(err::INVALID_VALUE)?;
        if !matches!(map.kind, Kind::Vmm { .. }) {
            return Err(err::INVALID_VALUE);
        }
        let phys = map.phys.clone();
        let id = phys.id;
        d.mem.handles.entry(id).or_insert((phys, 0)).1 += 1;
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(handle, id) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    out: *mut c_void,
    handle: u64,
    kind: c_int,
    flags: u64,
) -> CUresult {
    // [ref: 6.14, cuMemExportToShareableHandle: only a handle type the
    // allocation was created with (requestedHandleTypes); flags 0; for
    // POSIX_FILE_DESCRIPTOR `out` receives an int.]
    code(with(|d| {
        let phys = d.mem.handles.get(&handle).ok_or(err::INVALID_HANDLE)?.0.clone();
        if kind as u32 == FABRIC && phys.handle_types & FABRIC != 0 && flags == 0 {
            return export_fabric(d, &phys, out);
        }
        if kind as u32 != POSIX_FD || phys.handle_types & POSIX_FD == 0 || flags != 0 {
            return Err(err::INVALID_VALUE);
        }
        let fd = reopen(phys.fd).map_err(|_| err::OPERATING_SYSTEM)?;
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(out.cast::<c_int>(), fd) }
    }))
}

/// Writes the 64-byte `CUmemFabricHandle` of `phys` to `out` [ref: 6.14,
/// cuMemExportToShareableHandle: for CU_MEM_HANDLE_TYPE_FABRIC the
/// shareable handle is a CUmemFabricHandle; 7 Data Structures,
/// CUmemFabricHandle: `unsigned char data[64]`]. A process granted no IMEX
/// channel cannot export one (`NOT_PERMITTED`, as the import documents;
/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED` is 0 there). The
/// fake's handle names the exporter's process, its descriptor of the
/// memory, the allocation, its size, physical GPU and handle types, and
/// the channel: bytes, with no descriptor, valid only while the exporter
/// holds the memory.
fn export_fabric(d: &Driver, phys: &Phys, out: *mut c_void) -> Result<(), CUresult> {
    let channel = d.config.imex_channel.ok_or(err::NOT_PERMITTED)?;
    if out.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let mut bytes = [0u8; 64];
    bytes[..4].copy_from_slice(FABRIC_MAGIC);
    bytes[4..8].copy_from_slice(&std::process::id().to_le_bytes());
    bytes[8..12].copy_from_slice(&phys.fd.to_le_bytes());
    bytes[12..20].copy_from_slice(&phys.id.to_le_bytes());
    bytes[20..28].copy_from_slice(&phys.size.to_le_bytes());
    bytes[28..32].copy_from_slice(&d.physical(phys.device).to_le_bytes());
    bytes[32..36].copy_from_slice(&phys.handle_types.to_le_bytes());
    bytes[36..40].copy_from_slice(&channel.to_le_bytes());
    bytes[40] = u8::from(phys.gdr);
    // SAFETY: a non-null out-pointer to a CUmemFabricHandle (64 bytes),
    // the call's contract for this handle type.
    unsafe { out.cast::<[u8; 64]>().write_unaligned(bytes) };
    Ok(())
}

/// Imports a `CUmemFabricHandle` [ref: 6.14, cuMemImportFromShareableHandle:
/// "If shHandleType is CU_MEM_HANDLE_TYPE_FABRIC and the importer process
/// has not been granted access to the same IMEX channel as the exporter
/// process, this API will error as CUDA_ERROR_NOT_PERMITTED"]; `os` points
/// at the 64 bytes. Bytes that are no live handle of the fake's are
/// `INVALID_VALUE` (not a handle) or `INVALID_HANDLE` (its memory gone).
fn import_fabric(d: &mut Driver, os: *const c_void) -> Result<u64, CUresult> {
    if os.is_null() {
        return Err(err::INVALID_VALUE);
    }
    // SAFETY: a non-null pointer to a CUmemFabricHandle (64 bytes), the
    // call's contract for this handle type.
    let bytes = unsafe { os.cast::<[u8; 64]>().read_unaligned() };
    let word = |a: usize| u32::from_le_bytes(bytes[a..a + 4].try_into().expect("4"));
    let long = |a: usize| u64::from_le_bytes(bytes[a..a + 8].try_into().expect("8"));
    if bytes[..4] != *FABRIC_MAGIC || bytes[41..].iter().any(|&b| b != 0) || bytes[40] > 1 {
        return Err(err::INVALID_VALUE);
    }
    let (pid, fd, id, size, physical, types, channel) =
        (word(4), word(8) as c_int, long(12), long(20), word(28) as i32, word(32), word(36));
    if d.config.imex_channel != Some(channel) {
        return Err(err::NOT_PERMITTED);
    }
    if types & FABRIC == 0 {
        return Err(err::INVALID_VALUE);
    }
    let path = format!("/proc/{pid}/fd/{fd}\0");
    // SAFETY: a NUL-terminated path.
    let own = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDWR | libc::O_CLOEXEC) };
    if own < 0 {
        return Err(err::INVALID_HANDLE); // the exporter is gone
    }
    let matches = describe_fd(own).is_some_and(|(dev, t, _, len)| dev == physical && t == types && len == size)
        && std::fs::read_link(format!("/proc/self/fd/{own}"))
            .is_ok_and(|l| l.to_string_lossy().starts_with(&format!("/memfd:fakecuda-{pid}-{id}-")));
    if !matches {
        // SAFETY: ours.
        unsafe { libc::close(own) };
        return Err(err::INVALID_HANDLE); // freed, its descriptor reused
    }
    let Some(device) = d.ordinal_of_physical(physical) else {
        // SAFETY: ours.
        unsafe { libc::close(own) };
        return Err(err::NOT_SUPPORTED); // as for POSIX descriptors, below
    };
    let local = d.mem.next_id;
    d.mem.next_id += 1;
    let phys = Phys::from_fd(local, device, size, own, types, bytes[40] == 1)?;
    d.mem.handles.insert(local, (phys, 1));
    Ok(local)
}

/// A new descriptor (a new open file) of the memfd behind `fd`.
fn reopen(fd: c_int) -> std::io::Result<c_int> {
    let path = format!("/proc/self/fd/{fd}\0");
    // SAFETY: a NUL-terminated path.
    let new = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDWR | libc::O_CLOEXEC) };
    if new < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(new)
}

/// The (device, handle types, gdr) a fake memfd's name records.
fn describe_fd(fd: c_int) -> Option<(i32, u32, bool, u64)> {
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
    let link = link.to_string_lossy();
    let name = link.strip_prefix("/memfd:fakecuda-")?.split(' ').next()?.to_owned();
    let fields: Vec<&str> = name.split('-').collect();
    let [_pid, _id, device, types, gdr] = fields[..] else { return None };
    // SAFETY: fstat writes one stat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return None;
    }
    Some((device.parse().ok()?, types.parse().ok()?, gdr == "1", st.st_size as u64))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(handle: *mut u64, os: *mut c_void, kind: c_int) -> CUresult {
    // [ref: 6.14, cuMemImportFromShareableHandle: for POSIX_FILE_DESCRIPTOR
    // the descriptor is passed as the pointer's value; the caller keeps
    // its descriptor (the driver holds its own reference).]
    code(with(|d| {
        let fd = os as usize as c_int;
        if kind as u32 == FABRIC {
            if super::open_fails() {
                return Err(err::INVALID_HANDLE);
            }
            let id = import_fabric(d, os)?;
            // SAFETY: an out-pointer the caller passes under the Driver API's contract
            // (valid for this write or null); `put` refuses null.
            return unsafe { put(handle, id) };
        }
        if kind as u32 != POSIX_FD {
            return Err(err::INVALID_VALUE);
        }
        if super::open_fails() {
            return Err(err::INVALID_HANDLE);
        }
        let (physical, types, gdr, size) = describe_fd(fd).ok_or(err::INVALID_VALUE)?;
        // Memory of a GPU this process does not see (another
        // CUDA_VISIBLE_DEVICES): CUDA 13.2 names such a location
        // CU_MEM_LOCATION_TYPE_INVISIBLE; older drivers' behaviour is not
        // documented, so the fake refuses it rather than guess.
        let device = d.ordinal_of_physical(physical).ok_or(err::NOT_SUPPORTED)?;
        let own = reopen(fd).map_err(|_| err::OPERATING_SYSTEM)?;
        let id = d.mem.next_id;
        d.mem.next_id += 1;
        let phys = Phys::from_fd(id, device, size, own, types, gdr)?;
        d.mem.handles.insert(id, (phys, 1));
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(handle, id) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetHandleForAddressRange(
    out: *mut c_void,
    dptr: CUdeviceptr,
    size: usize,
    kind: c_int,
    flags: u64,
) -> CUresult {
    // [ref: 6.13, cuMemGetHandleForAddressRange: type
    // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD (1); dptr and size aligned to the
    // host page size; the range inside one allocation.]
    code(with(|d| {
        if kind != 1 || flags != 0 || !dptr.is_multiple_of(PAGE) || !(size as u64).is_multiple_of(PAGE) || size == 0 {
            return Err(err::INVALID_VALUE);
        }
        let (start, map) = d.mem.map_at(dptr).ok_or(err::INVALID_VALUE)?;
        // [ref: 6.13, cuMemGetHandleForAddressRange: dma-buf export needs
        // CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED on the memory's device.]
        if !d.config.dmabuf {
            return Err(err::NOT_SUPPORTED);
        }
        if dptr + size as u64 > start + map.size {
            return Err(err::INVALID_VALUE);
        }
        let fd = reopen(map.phys.fd).map_err(|_| err::OPERATING_SYSTEM)?;
        // The dma-buf's byte 0 is `dptr` (a real dma-buf covers exactly the
        // range). The fake's dma-buf is an open file description of the
        // allocation's memory whose position is that first byte: what a
        // NIC's importer (the fake libibverbs) maps from, and all the two
        // fakes share, as a GPU and a NIC share only the dma-buf's pages.
        // Every mapping of an allocation starts at its offset 0 (cuMemMap's
        // offset must be zero).
        // SAFETY: a descriptor we just opened; lseek has no memory effects.
        if unsafe { libc::lseek(fd, (dptr - start) as libc::off_t, libc::SEEK_SET) } < 0 {
            // SAFETY: ours, not handed out.
            unsafe { libc::close(fd) };
            return Err(err::OPERATING_SYSTEM);
        }
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(out.cast::<c_int>(), fd) }
    }))
}

// ---------------------------------------------------------------------------
// Legacy IPC [ref: 6.13 Memory Management, cuIpc*].
// ---------------------------------------------------------------------------

const IPC_MAGIC: &[u8; 4] = b"FKIP";

/// `CUipcMemHandle`, passed by value (64 bytes).
#[repr(C)]
pub struct IpcMemHandle {
    reserved: [u8; 64],
}

#[no_mangle]
pub unsafe extern "C" fn cuIpcGetMemHandle(handle: *mut [u8; 64], dptr: CUdeviceptr) -> CUresult {
    // [ref: 6.13, cuIpcGetMemHandle: "Takes a pointer to the base of an
    // existing device memory allocation created with cuMemAlloc".]
    code(with(|d| {
        let map = d.mem.maps.get(&dptr).ok_or(err::INVALID_VALUE)?;
        if map.kind != Kind::Alloc {
            return Err(err::INVALID_VALUE);
        }
        let mut bytes = [0u8; 64];
        bytes[..4].copy_from_slice(IPC_MAGIC);
        bytes[4..8].copy_from_slice(&std::process::id().to_le_bytes());
        bytes[8..12].copy_from_slice(&map.phys.fd.to_le_bytes());
        bytes[12..20].copy_from_slice(&map.phys.id.to_le_bytes());
        bytes[20..28].copy_from_slice(&map.size.to_le_bytes());
        bytes[28..32].copy_from_slice(&d.physical(map.phys.device).to_le_bytes());
        bytes[32..40].copy_from_slice(&d.mem.instance.to_le_bytes());
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(handle, bytes) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    dptr: *mut CUdeviceptr,
    handle: IpcMemHandle,
    flags: c_uint,
) -> CUresult {
    let handle = handle.reserved;
    // [ref: 6.13, cuIpcOpenMemHandle: opened in the current context; the
    // handle is another process's ("cannot be opened in the process that
    // created it"); "memory handles may be opened by at most one CUcontext
    // per CUdevice per other process" (a second open in the same context
    // returns the same address); flags must be
    // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS (1); the allocation's base is
    // returned.]
    code(with(|d| {
        let device = d.current()?;
        if flags != 1 || handle[..4] != *IPC_MAGIC {
            return Err(err::INVALID_VALUE);
        }
        if super::open_fails() {
            return Err(err::INVALID_HANDLE);
        }
        let word = |a: usize| u32::from_le_bytes(handle[a..a + 4].try_into().expect("4"));
        let long = |a: usize| u64::from_le_bytes(handle[a..a + 8].try_into().expect("8"));
        let (pid, fd, id, size, owner, instance) =
            (word(4), word(8) as c_int, long(12), long(20), word(28) as i32, long(32));
        if instance == d.mem.instance {
            return Err(err::INVALID_CONTEXT);
        }
        let key = (pid, id);
        for (&at, map) in d.mem.maps.iter_mut() {
            if let (Kind::Ipc { context }, Some(k)) = (map.kind, map.exporter) {
                if k == key && context == device {
                    map.opens += 1;
                    COUNTERS.ipc_opens.fetch_add(1, Relaxed);
                    // SAFETY: an out-pointer the caller passes under the Driver API's contract
                    // (valid for this write or null); `put` refuses null.
                    return unsafe { put(dptr, at) };
                }
            }
        }
        let path = format!("/proc/{pid}/fd/{fd}\0");
        // SAFETY: a NUL-terminated path.
        let own = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDWR | libc::O_CLOEXEC) };
        if own < 0 {
            return Err(err::INVALID_HANDLE); // the exporter is gone
        }
        let matches = describe_fd(own).is_some_and(|(dev, _, _, len)| dev == owner && len == size)
            && std::fs::read_link(format!("/proc/self/fd/{own}"))
                .is_ok_and(|l| l.to_string_lossy().starts_with(&format!("/memfd:fakecuda-{pid}-{id}-")));
        if !matches {
            // SAFETY: ours.
            unsafe { libc::close(own) };
            return Err(err::INVALID_HANDLE); // freed, its descriptor reused
        }
        // The memory's GPU as this process numbers it; one it does not see
        // is reached through the opening context's GPU (legacy IPC needs
        // no ordinal of the owner's device here).
        let local = d.ordinal_of_physical(owner).unwrap_or(device);
        let phys = Phys::from_fd(id, local, size, own, 0, false)?;
        let at = d.mem.take_addresses(size, GRANULARITY)?;
        d.mem.place(at, phys, Kind::Ipc { context: device })?;
        d.mem.maps.get_mut(&at).expect("placed").exporter = Some(key);
        COUNTERS.ipc_opens.fetch_add(1, Relaxed);
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(dptr, at) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuIpcCloseMemHandle(dptr: CUdeviceptr) -> CUresult {
    // [ref: 6.13, cuIpcCloseMemHandle: the base cuIpcOpenMemHandle
    // returned, closed from the context that opened it.]
    code(with(|d| {
        let device = d.current()?;
        let map = d.mem.maps.get_mut(&dptr).ok_or(err::INVALID_VALUE)?;
        let Kind::Ipc { context } = map.kind else { return Err(err::INVALID_VALUE) };
        if context != device {
            return Err(err::INVALID_CONTEXT);
        }
        map.opens -= 1;
        COUNTERS.ipc_closes.fetch_add(1, Relaxed);
        if map.opens == 0 {
            let size = map.size;
            d.mem.unplace(dptr, size);
        }
        Ok(())
    }))
}

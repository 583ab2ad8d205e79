//! A simulated GPU provider: every GPU code path of kvring runs on it, in
//! CI, on machines with no GPU.
//!
//! Device memory is a `memfd` mapped twice: at the "device address" with no
//! access at all, so any host dereference of a device pointer faults (the
//! rule that no lane ever touches device memory is enforced, not hoped
//! for), and once more, readable and writable, where only the stand-in copy
//! engine reaches it. Another process opens an export through
//! `/proc/<pid>/fd/<fd>` (same user, as CUDA IPC needs the same machine),
//! and gets the same two views of the same pages. Copies run when their
//! stream is polled after a configurable delay, so "the copy finished" is
//! only ever learnt from an event, as with a real GPU. Faults can be
//! injected: an open that fails, a copy that errors (sticky afterwards, as
//! CUDA's are), a device that is lost.

use super::{Copy, CopyMethod, DevicePtr, Event, Gpu, GpuDevice, IpcHandle, Memory, Stream};
use crate::error::{Error, Result};
use memmap2::MmapRaw;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Marks a simulated IPC handle.
const HANDLE_MAGIC: [u8; 4] = *b"KVSG";
/// Memory each simulated device reports.
const SIM_MEMORY_BYTES: u64 = 16 << 30;

/// The simulated provider.
#[derive(Debug)]
pub struct SimGpu {
    devices: u32,
    copy_delay: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// By device address.
    allocs: BTreeMap<u64, Alloc>,
    streams: HashMap<u64, StreamState>,
    events: HashMap<u64, EventState>,
    /// Host ranges registered: start → length.
    registered: BTreeMap<u64, u64>,
    next_id: u64,
    fail_next_open: bool,
    fail_next_copy: bool,
    lost: HashSet<u32>,
    /// The first copy error: every later query reports it.
    sticky: Option<String>,
}

/// One allocation (or one opened export): two views of one memfd.
#[derive(Debug)]
struct Alloc {
    device: u32,
    len: u64,
    file: File,
    /// The inaccessible view at the device address (held for its mapping).
    _view: NoAccess,
    /// The view the copy engine uses.
    alias: MmapRaw,
    /// Opened from another process's export (closed, not freed).
    opened: bool,
}

/// A mapping with no access rights: touching it faults.
#[derive(Debug)]
struct NoAccess {
    addr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is only an address range no one may touch; moving the
// handle between threads moves no access.
unsafe impl Send for NoAccess {}

impl Drop for NoAccess {
    fn drop(&mut self) {
        // SAFETY: the range was mapped by `map_no_access` and is unmapped once.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

#[derive(Debug)]
struct StreamState {
    device: u32,
    pending: VecDeque<Work>,
}

#[derive(Debug)]
enum Work {
    /// Copies, resolved to host-reachable addresses, due at `ready`.
    Copies { ready: Instant, copies: Vec<(u64, u64, u64)>, fail: bool },
    /// An event: complete once everything before it is.
    Event(u64),
}

#[derive(Debug)]
struct EventState {
    stream: u64,
    done: bool,
}

impl SimGpu {
    /// `devices` simulated GPUs whose copies complete `copy_delay` after
    /// they were queued.
    pub fn new(devices: u32, copy_delay: Duration) -> Self {
        Self { devices, copy_delay, state: Mutex::new(State { next_id: 1, ..State::default() }) }
    }

    /// The next [`Gpu::open`] fails, as for a peer whose memory is gone.
    pub fn fail_next_open(&self) {
        self.lock().fail_next_open = true;
    }

    /// The next [`Gpu::copy_batch`] fails when it runs (reported by the
    /// event after it, and by every query from then on).
    pub fn fail_next_copy(&self) {
        self.lock().fail_next_copy = true;
    }

    /// `device` is lost: every operation on it fails from now on.
    pub fn lose_device(&self, device: u32) {
        self.lock().lost.insert(device);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_device(&self, state: &State, device: u32) -> Result<()> {
        if device >= self.devices {
            return Err(gpu_error(device, format!("no such device (this provider has {})", self.devices)));
        }
        if state.lost.contains(&device) {
            return Err(gpu_error(device, "the device was lost"));
        }
        Ok(())
    }

    /// Maps `file` twice (the device view, the copy engine's alias) and
    /// records it at its device address.
    fn install(&self, state: &mut State, device: u32, file: File, len: u64, opened: bool) -> Result<u64> {
        let view = map_no_access(&file, len)?;
        let alias = MmapRaw::map_raw(&file).map_err(|e| Error::io("mapping simulated device memory", e))?;
        let base = view.addr as u64;
        state.allocs.insert(base, Alloc { device, len, file, _view: view, alias, opened });
        Ok(base)
    }
}

impl State {
    /// The allocation holding `addr`, if any.
    fn alloc_at(&self, addr: u64) -> Option<(u64, &Alloc)> {
        let (&base, alloc) = self.allocs.range(..=addr).next_back()?;
        (addr < base + alloc.len).then_some((base, alloc))
    }

    /// `addr..addr + len` resolved to where the copy engine reaches it:
    /// the alias of a device range, or the host address as it is.
    fn resolve(&self, addr: u64, len: u64) -> Result<u64> {
        match self.alloc_at(addr) {
            None => Ok(addr),
            Some((base, alloc)) => {
                if self.lost.contains(&alloc.device) {
                    return Err(gpu_error(alloc.device, "the device was lost"));
                }
                let end = addr.checked_add(len).ok_or_else(|| gpu_error(alloc.device, "a copy's range overflows"))?;
                if end > base + alloc.len {
                    return Err(past_allocation(alloc.device, addr, len, base, alloc.len));
                }
                Ok(alloc.alias.as_ptr() as u64 + (addr - base))
            }
        }
    }

    fn take_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Runs a stream's due work in order, up to the first that is not due.
    fn progress(&mut self, stream: u64) {
        let now = Instant::now();
        loop {
            let Some(work) = self.streams.get_mut(&stream).and_then(|s| s.pending.pop_front()) else { return };
            match work {
                Work::Copies { ready, copies, fail } => {
                    if ready > now {
                        if let Some(s) = self.streams.get_mut(&stream) {
                            s.pending.push_front(Work::Copies { ready, copies, fail });
                        }
                        return;
                    }
                    if fail {
                        self.sticky.get_or_insert_with(|| "a copy failed on the device (injected)".into());
                        continue;
                    }
                    for (src, dst, len) in copies {
                        // Device ranges were resolved inside live allocations'
                        // aliases; host ranges stay valid until this work's
                        // event completes (`copy_batch`'s contract).
                        // SAFETY: both ranges are valid for `len` bytes, as above.
                        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) };
                    }
                }
                Work::Event(id) => {
                    if let Some(event) = self.events.get_mut(&id) {
                        event.done = true;
                    }
                }
            }
        }
    }
}

impl Gpu for SimGpu {
    fn provider(&self) -> &'static str {
        "sim"
    }

    fn devices(&self) -> Result<Vec<GpuDevice>> {
        let state = self.lock();
        Ok((0..self.devices)
            .filter(|d| !state.lost.contains(d))
            .map(|ordinal| GpuDevice {
                ordinal,
                name: format!("sim-gpu-{ordinal}"),
                memory_bytes: SIM_MEMORY_BYTES,
                pci_bus: None,
                numa_node: None,
            })
            .collect())
    }

    fn classify(&self, addr: u64, len: u64) -> Result<Memory> {
        let state = self.lock();
        match state.alloc_at(addr) {
            None => Ok(Memory::Host),
            Some((base, alloc)) => {
                let end = addr.saturating_add(len);
                if end > base + alloc.len {
                    return Err(past_allocation(alloc.device, addr, len, base, alloc.len));
                }
                Ok(Memory::Device { ordinal: alloc.device, base: DevicePtr(base), len: alloc.len })
            }
        }
    }

    fn alloc(&self, device: u32, len: u64) -> Result<DevicePtr> {
        let mut state = self.lock();
        self.check_device(&state, device)?;
        if len == 0 {
            return Err(gpu_error(device, "an allocation of 0 bytes"));
        }
        // SAFETY: memfd_create with a NUL-terminated name; the descriptor
        // is owned by the File made from it below.
        let fd = unsafe { libc::memfd_create(c"kvring-sim-gpu".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::io("creating simulated device memory", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len).map_err(|e| Error::io("sizing simulated device memory", e))?;
        Ok(DevicePtr(self.install(&mut state, device, file, len, false)?))
    }

    unsafe fn free(&self, ptr: DevicePtr) -> Result<()> {
        let mut state = self.lock();
        match state.allocs.get(&ptr.0) {
            Some(alloc) if !alloc.opened => {
                state.allocs.remove(&ptr.0);
                Ok(())
            }
            _ => Err(gpu_error(0, format!("{:#x} is not an allocation of this process", ptr.0))),
        }
    }

    fn export(&self, ptr: DevicePtr) -> Result<IpcHandle> {
        let state = self.lock();
        let (base, alloc) = state
            .alloc_at(ptr.0)
            .filter(|(_, a)| !a.opened)
            .ok_or_else(|| gpu_error(0, format!("{:#x} is not device memory this process allocated", ptr.0)))?;
        self.check_device(&state, alloc.device)?;
        let mut bytes = [0u8; 64];
        bytes[..4].copy_from_slice(&HANDLE_MAGIC);
        bytes[4..8].copy_from_slice(&std::process::id().to_le_bytes());
        bytes[8..12].copy_from_slice(&alloc.file.as_raw_fd().to_le_bytes());
        bytes[12..16].copy_from_slice(&alloc.device.to_le_bytes());
        Ok(IpcHandle { bytes, offset: ptr.0 - base, len: alloc.len })
    }

    fn open(&self, handle: &IpcHandle) -> Result<DevicePtr> {
        let mut state = self.lock();
        let field = |at: usize| u32::from_le_bytes(handle.bytes[at..at + 4].try_into().expect("4 bytes"));
        if handle.bytes[..4] != HANDLE_MAGIC {
            return Err(gpu_error(0, "not a simulated GPU's IPC handle"));
        }
        let (pid, fd, device) = (field(4), field(8) as i32, field(12));
        self.check_device(&state, device)?;
        if pid == std::process::id() {
            return Err(gpu_error(device, "a process cannot open its own IPC handle"));
        }
        if std::mem::take(&mut state.fail_next_open) {
            return Err(gpu_error(device, "opening the peer's memory failed (injected)"));
        }
        if handle.offset >= handle.len {
            return Err(gpu_error(device, "the handle's offset lies past its allocation"));
        }
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).map_err(|e| {
            gpu_error(device, format!("the exporting process {pid} is gone or its memory is freed ({e})"))
        })?;
        let size = file.metadata().map_err(|e| Error::io(format!("reading {path}"), e))?.len();
        if size != handle.len {
            return Err(gpu_error(
                device,
                format!("the exported memory is {size} bytes, the handle says {}", handle.len),
            ));
        }
        let base = self.install(&mut state, device, file, handle.len, true)?;
        Ok(DevicePtr(base + handle.offset))
    }

    unsafe fn close(&self, ptr: DevicePtr) -> Result<()> {
        let mut state = self.lock();
        let base = state.alloc_at(ptr.0).filter(|(_, a)| a.opened).map(|(base, _)| base);
        let base = base.ok_or_else(|| gpu_error(0, format!("{:#x} was not opened from a peer", ptr.0)))?;
        state.allocs.remove(&base);
        Ok(())
    }

    fn create_stream(&self, device: u32) -> Result<Stream> {
        let mut state = self.lock();
        self.check_device(&state, device)?;
        let id = state.take_id();
        state.streams.insert(id, StreamState { device, pending: VecDeque::new() });
        Ok(Stream(id))
    }

    fn destroy_stream(&self, stream: Stream) -> Result<()> {
        self.lock().streams.remove(&stream.0).map(drop).ok_or_else(|| gpu_error(0, "no such stream"))
    }

    unsafe fn copy_batch(&self, stream: Stream, copies: &[Copy]) -> Result<CopyMethod> {
        let mut state = self.lock();
        let device = state.streams.get(&stream.0).ok_or_else(|| gpu_error(0, "no such stream"))?.device;
        self.check_device(&state, device)?;
        let resolved = copies
            .iter()
            .map(|c| Ok((state.resolve(c.src, c.len)?, state.resolve(c.dst, c.len)?, c.len)))
            .collect::<Result<Vec<_>>>()?;
        let fail = std::mem::take(&mut state.fail_next_copy);
        let ready = Instant::now() + self.copy_delay;
        let work = Work::Copies { ready, copies: resolved, fail };
        state.streams.get_mut(&stream.0).expect("checked above").pending.push_back(work);
        Ok(CopyMethod::Batched)
    }

    fn record(&self, stream: Stream) -> Result<Event> {
        let mut state = self.lock();
        let id = state.take_id();
        let queue = state.streams.get_mut(&stream.0).ok_or_else(|| gpu_error(0, "no such stream"))?;
        queue.pending.push_back(Work::Event(id));
        state.events.insert(id, EventState { stream: stream.0, done: false });
        Ok(Event(id))
    }

    fn query(&self, event: Event) -> Result<bool> {
        let mut state = self.lock();
        let stream = state.events.get(&event.0).ok_or_else(|| gpu_error(0, "no such event"))?.stream;
        if let Some(device) = state.streams.get(&stream).map(|s| s.device) {
            self.check_device(&state, device)?;
        }
        state.progress(stream);
        if let Some(error) = &state.sticky {
            return Err(gpu_error(0, error.clone()));
        }
        Ok(state.events.get(&event.0).is_some_and(|e| e.done))
    }

    fn destroy_event(&self, event: Event) -> Result<()> {
        self.lock().events.remove(&event.0).map(drop).ok_or_else(|| gpu_error(0, "no such event"))
    }

    unsafe fn host_register(&self, addr: u64, len: u64) -> Result<()> {
        let mut state = self.lock();
        let overlaps =
            state.registered.range(..addr.saturating_add(len)).next_back().is_some_and(|(&a, &l)| a + l > addr);
        if overlaps {
            return Err(gpu_error(0, format!("{addr:#x}+{len} is already registered")));
        }
        state.registered.insert(addr, len);
        Ok(())
    }

    fn host_unregister(&self, addr: u64) -> Result<()> {
        self.lock()
            .registered
            .remove(&addr)
            .map(drop)
            .ok_or_else(|| gpu_error(0, format!("{addr:#x} is not registered")))
    }
}

fn gpu_error(device: u32, reason: impl Into<String>) -> Error {
    Error::Gpu { device: format!("sim-gpu-{device}"), reason: reason.into() }
}

fn past_allocation(device: u32, addr: u64, len: u64, base: u64, alloc_len: u64) -> Error {
    gpu_error(device, format!("{addr:#x}+{len} runs past its allocation ({base:#x}+{alloc_len})"))
}

/// Maps `file` with no access rights: the device address range.
fn map_no_access(file: &File, len: u64) -> Result<NoAccess> {
    let len = usize::try_from(len).map_err(|_| Error::invalid("allocation", "larger than the address space"))?;
    // SAFETY: a fresh shared mapping of a file we hold, with no access; the
    // kernel picks the address.
    let addr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, libc::MAP_SHARED, file.as_raw_fd(), 0) };
    if addr == libc::MAP_FAILED {
        return Err(Error::io("reserving simulated device addresses", std::io::Error::last_os_error()));
    }
    Ok(NoAccess { addr, len })
}

#[cfg(test)]
mod tests;

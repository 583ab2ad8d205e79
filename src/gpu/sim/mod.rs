//! A simulated GPU provider: every GPU code path of kvring runs on it, in
//! CI, on machines with no GPU.
//!
//! Device memory is host memory no host thread can touch: each piece is
//! mapped with no access at its device address, so any dereference of a
//! device pointer faults (the rule that no lane ever touches device memory
//! is enforced, not hoped for), and once more where only the stand-in copy
//! engine reaches it (`memory.rs`). Another process opens an export as it
//! would a real one of the virtual memory API: from descriptors the
//! exporter shares (`Gpu::share`, passed over its socket), one per piece
//! (a legacy allocation is one piece). Copies run when their stream is polled,
//! after a configurable delay, so "the copy finished" is only ever learnt
//! from an event, as with a real GPU. Faults can be injected: an open that
//! fails, a copy that errors when it runs (sticky on its GPU afterwards, as
//! CUDA's are), a copy call refused at once, a peer's opened memory that
//! vanishes, a device that is lost; and the driver can be set older, so
//! that chunks go through the copy kernel or one call per copy
//! ([`super::tier`]). The kernel tier faults as a real one would when it is
//! handed host memory nobody pinned, or another GPU's memory without peer
//! access: a regression in the tier choice fails a test instead of a GPU.

mod memory;

use super::tier::{choose_method, TierInputs, BATCH_API_DRIVER};
use super::{
    check_handles, Copy, CopyMethod, CopySides, DevicePtr, DmaBuf, Event, Export, Gpu, GpuDevice, IpcHandle, Memory,
    Place, Stream,
};
use crate::error::{Error, Result};
use memory::{past_allocation, Piece};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Memory each simulated device reports.
const SIM_MEMORY_BYTES: u64 = 16 << 30;
/// Copy-kernel launches in flight per stream before a chunk must take one
/// call per copy (the CUDA provider's descriptor slots).
const KERNEL_SLOTS: usize = 16;
/// Copies one kernel launch takes (a slot's size).
const KERNEL_SLOT_COPIES: usize = 256;

/// `delay` in whole nanoseconds (saturating: about 584 years).
fn nanos(delay: Duration) -> u64 {
    u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX)
}

/// The simulated provider.
#[derive(Debug)]
pub struct SimGpu {
    devices: u32,
    /// The copy engine's delay, in nanoseconds (a test may change it
    /// while copies are in flight: [`SimGpu::set_copy_delay`]).
    copy_delay_ns: AtomicU64,
    /// The CUDA version the simulated driver reports.
    driver_version: u32,
    /// Whether its copy kernel loads (on drivers without the batch API).
    kernel_loads: bool,
    /// Whether its GPUs have peer access to each other.
    peer_access: bool,
    /// Whether its driver exports device memory as dma-buf.
    dmabuf: bool,
    numa_node: Option<u32>,
    state: Mutex<State>,
    copy_calls: AtomicU64,
    copies: AtomicU64,
    opens: AtomicU64,
    closes: AtomicU64,
}

#[derive(Debug, Default)]
pub(super) struct State {
    /// By device address.
    pieces: BTreeMap<u64, Piece>,
    streams: HashMap<u64, StreamState>,
    events: HashMap<u64, EventState>,
    /// Host ranges registered: start → length.
    registered: BTreeMap<u64, u64>,
    next_id: u64,
    fail_next_open: bool,
    fail_next_copy: bool,
    /// Copy calls still accepted before one is refused at once.
    refuse_after: Option<u32>,
    lost: HashSet<u32>,
    /// Per GPU, its first copy error: every later query and copy call on
    /// that GPU reports it (CUDA's errors are sticky per context).
    sticky: HashMap<u32, String>,
}

#[derive(Debug)]
struct StreamState {
    device: u32,
    pending: VecDeque<Work>,
    /// Copy-kernel launches of this stream not yet completed.
    kernels: usize,
}

#[derive(Debug)]
enum Work {
    /// Copies, resolved to host-reachable addresses, due at `ready`; with
    /// `fail`, they fault instead (the reason); `kernel` when launched as
    /// the copy kernel (which holds a descriptor slot until it ends).
    Copies { ready: Instant, copies: Vec<(u64, u64, u64)>, fail: Option<String>, kernel: bool },
    /// An event's recording: completes it, unless it was recorded again
    /// since (`generation`).
    Event { id: u64, generation: u64 },
}

#[derive(Debug)]
struct EventState {
    device: u32,
    /// The stream of its latest recording, if any.
    stream: Option<u64>,
    generation: u64,
    done: bool,
}

impl SimGpu {
    /// `devices` simulated GPUs whose copies complete `copy_delay` after
    /// they were queued, on a driver with the batch API (CUDA 12.8) and
    /// peer access between its GPUs.
    pub fn new(devices: u32, copy_delay: Duration) -> Self {
        Self {
            devices,
            copy_delay_ns: AtomicU64::new(nanos(copy_delay)),
            driver_version: BATCH_API_DRIVER,
            kernel_loads: true,
            peer_access: true,
            dmabuf: true,
            numa_node: None,
            state: Mutex::new(State { next_id: 1, ..State::default() }),
            copy_calls: AtomicU64::new(0),
            copies: AtomicU64::new(0),
            opens: AtomicU64::new(0),
            closes: AtomicU64::new(0),
        }
    }

    /// Simulates a driver whose best method is `method`: CUDA 12.8
    /// (`Batched`), 12.0 with the copy kernel (`Kernel`), or 11.8 whose
    /// kernel does not load (`PerCopy`). The bytes move the same; each
    /// chunk's method is chosen as the CUDA provider chooses it.
    pub fn with_copy_method(self, method: CopyMethod) -> Self {
        match method {
            CopyMethod::Batched => self.with_driver(BATCH_API_DRIVER, true),
            CopyMethod::Kernel => self.with_driver(12000, true),
            CopyMethod::PerCopy => self.with_driver(11080, false),
        }
    }

    /// Simulates a driver of CUDA `version` (12080 for 12.8) whose copy
    /// kernel loads or not.
    pub fn with_driver(mut self, version: u32, kernel_loads: bool) -> Self {
        self.driver_version = version;
        self.kernel_loads = kernel_loads;
        self
    }

    /// Its GPUs cannot reach each other's memory (no peer access), as on
    /// hosts whose GPUs share no NVLink or PCIe switch.
    pub fn without_peer_access(mut self) -> Self {
        self.peer_access = false;
        self
    }

    /// Its driver exports no dma-buf (older than CUDA 11.7, or a GPU or
    /// kernel without support): a NIC registers its memory through a
    /// peer-memory module, or not at all.
    pub fn without_dmabuf(mut self) -> Self {
        self.dmabuf = false;
        self
    }

    /// Says every device sits on NUMA node `node` (for lane placement).
    pub fn with_numa_node(mut self, node: u32) -> Self {
        self.numa_node = Some(node);
        self
    }

    /// The copy engine's delay.
    pub fn copy_delay(&self) -> Duration {
        Duration::from_nanos(self.copy_delay_ns.load(Ordering::Relaxed))
    }

    /// Copies queued from now on complete `delay` after they were queued;
    /// those queued before keep their time (a test makes a stale copy slow
    /// and the next owner's fast, so the order they land in tells whether a
    /// fence waited for the stale one).
    pub fn set_copy_delay(&self, delay: Duration) {
        self.copy_delay_ns.store(nanos(delay), Ordering::Relaxed);
    }

    /// Calls to [`Gpu::copy_batch`] so far, and the copies they carried.
    pub fn copy_counts(&self) -> (u64, u64) {
        (self.copy_calls.load(Ordering::Relaxed), self.copies.load(Ordering::Relaxed))
    }

    /// Host ranges pinned with [`Gpu::host_register`] now.
    pub fn host_registered_ranges(&self) -> usize {
        self.lock().registered.len()
    }

    /// True when `addr` starts a host range pinned with
    /// [`Gpu::host_register`].
    pub fn is_host_registered(&self, addr: u64) -> bool {
        self.lock().registered.contains_key(&addr)
    }

    /// The next [`Gpu::open`] fails, as for a peer whose memory is gone.
    pub fn fail_next_open(&self) {
        self.lock().fail_next_open = true;
    }

    /// The next [`Gpu::copy_batch`] fails when it runs (reported by the
    /// event after it, and by every query and copy on its GPU from then on).
    pub fn fail_next_copy(&self) {
        self.lock().fail_next_copy = true;
    }

    /// After `accepted` more calls, one [`Gpu::copy_batch`] call is refused
    /// at once with an error (as the driver refuses bad arguments); nothing
    /// is queued by it, and the GPU stays usable.
    pub fn refuse_copy_call(&self, accepted: u32) {
        self.lock().refuse_after = Some(accepted);
    }

    /// Every peer's memory this provider opened so far vanishes, as if its
    /// owner had freed it: a copy touching it faults on the GPU.
    pub fn vanish_opened(&self) {
        self.lock().pieces.values_mut().filter(|p| p.opened).for_each(|p| p.vanished = true);
    }

    /// Successful [`Gpu::open`]s and [`Gpu::close`]s so far.
    pub fn open_counts(&self) -> (u64, u64) {
        (self.opens.load(Ordering::Relaxed), self.closes.load(Ordering::Relaxed))
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
}

impl State {
    fn take_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Runs a stream's due work in order, up to the first that is not due.
    /// A GPU with a sticky error runs nothing more (as a CUDA context).
    fn progress(&mut self, stream: u64) {
        let now = Instant::now();
        let Some(device) = self.streams.get(&stream).map(|s| s.device) else { return };
        loop {
            let Some(work) = self.streams.get_mut(&stream).and_then(|s| s.pending.pop_front()) else { return };
            match work {
                Work::Copies { ready, copies, fail, kernel } => {
                    if ready > now {
                        if let Some(s) = self.streams.get_mut(&stream) {
                            s.pending.push_front(Work::Copies { ready, copies, fail, kernel });
                        }
                        return;
                    }
                    if kernel {
                        if let Some(s) = self.streams.get_mut(&stream) {
                            s.kernels -= 1;
                        }
                    }
                    if let Some(reason) = fail {
                        self.sticky.entry(device).or_insert(reason);
                    }
                    if self.sticky.contains_key(&device) {
                        continue;
                    }
                    for (src, dst, len) in copies {
                        // Device ranges were resolved inside live pieces'
                        // aliases; host ranges stay valid until this work's
                        // event completes (`copy_batch`'s contract).
                        // SAFETY: both ranges are valid for `len` bytes, as above.
                        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) };
                    }
                }
                Work::Event { id, generation } => {
                    if let Some(event) = self.events.get_mut(&id).filter(|e| e.generation == generation) {
                        event.done = true;
                    }
                }
            }
        }
    }

    /// True when `addr..addr + len` lies in one host range pinned here.
    fn pinned(&self, addr: u64, len: u64) -> bool {
        self.registered.range(..=addr).next_back().is_some_and(|(&start, &n)| addr.saturating_add(len) <= start + n)
    }

    /// Why the copy kernel would fault on `copies` launched on `device`'s
    /// stream: a host end nobody pinned, or another GPU's memory with no
    /// peer access (judged from the memory itself, not from what the caller
    /// said about it).
    fn kernel_fault(&self, copies: &[Copy], device: u32, peer_access: bool) -> Option<String> {
        for copy in copies {
            for addr in [copy.src, copy.dst] {
                match self.piece_at(addr) {
                    None if !self.pinned(addr, copy.len) => {
                        return Some(format!(
                            "the copy kernel dereferenced host memory at {addr:#x} that is not pinned for the GPU \
                             (an illegal address on a real one)"
                        ))
                    }
                    Some((_, piece)) if piece.device != device && !peer_access => {
                        return Some(format!(
                            "the copy kernel on GPU {device} dereferenced GPU {}'s memory at {addr:#x} without peer \
                             access (an illegal address on a real one)",
                            piece.device
                        ))
                    }
                    _ => {}
                }
            }
        }
        None
    }
}

impl SimGpu {
    /// The GPU of `stream`, which must be usable: not lost, no sticky error.
    fn usable_stream(&self, state: &State, stream: Stream) -> Result<u32> {
        let device = state.streams.get(&stream.0).ok_or_else(|| gpu_error(0, "no such stream"))?.device;
        self.check_device(state, device)?;
        match state.sticky.get(&device) {
            Some(error) => Err(gpu_error(device, error.clone())),
            None => Ok(device),
        }
    }

    /// Resolves `copies` and queues them on `stream`, due after the copy
    /// engine's delay, faulting when they run if a fault is injected, if
    /// they touch memory that vanished, or if the copy kernel (`kernel`)
    /// would dereference what it cannot.
    ///
    /// # Safety
    ///
    /// As [`Gpu::copy_batch`].
    unsafe fn queue(&self, state: &mut State, stream: Stream, copies: &[Copy], kernel: bool) -> Result<()> {
        let device = state.streams.get(&stream.0).ok_or_else(|| gpu_error(0, "no such stream"))?.device;
        let mut resolved = Vec::with_capacity(copies.len());
        for copy in copies {
            state.split_at_pieces(copy.src, copy.dst, copy.len, &mut resolved)?;
        }
        let injected = std::mem::take(&mut state.fail_next_copy);
        let mut fail = injected.then(|| "a copy failed on the device (injected)".to_string());
        let vanished = copies
            .iter()
            .flat_map(|c| [c.src, c.dst])
            .find(|&addr| state.piece_at(addr).is_some_and(|(_, piece)| piece.vanished));
        if let (None, Some(addr)) = (&fail, vanished) {
            fail = Some(format!(
                "a copy touched a peer's memory at {addr:#x} that vanished after it was opened (its owner freed \
                 it: an illegal address on a real GPU)"
            ));
        }
        if kernel {
            fail = fail.or_else(|| state.kernel_fault(copies, device, self.peer_access));
        }
        let ready = Instant::now() + self.copy_delay();
        let entry = state.streams.get_mut(&stream.0).expect("checked above");
        entry.kernels += usize::from(kernel);
        entry.pending.push_back(Work::Copies { ready, copies: resolved, fail, kernel });
        Ok(())
    }

    /// The tier for `copies` on `device`'s stream, from what the caller
    /// says of their ends (as the CUDA provider chooses it).
    fn tier(&self, state: &State, stream: u64, copies: &[Copy], sides: &[CopySides], device: u32) -> CopyMethod {
        let known = sides.len() == copies.len();
        let host_pinned = known
            && copies.iter().zip(sides).all(|(copy, sides)| {
                [(copy.src, sides.src), (copy.dst, sides.dst)]
                    .iter()
                    .all(|&(addr, place)| place != Place::Host || state.pinned(addr, copy.len))
            });
        let reachable = |place: Place| match place {
            Place::Device(other) => other == device || self.peer_access,
            Place::Host => true,
        };
        let peers_reachable = known && sides.iter().all(|s| reachable(s.src) && reachable(s.dst));
        let slots_free = state.streams.get(&stream).is_some_and(|s| s.kernels < KERNEL_SLOTS);
        choose_method(TierInputs {
            driver_version: self.driver_version,
            batch_api: true,
            kernel_ready: self.kernel_loads && slots_free && copies.len() <= KERNEL_SLOT_COPIES,
            host_pinned,
            peers_reachable,
        })
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
                numa_node: self.numa_node,
            })
            .collect())
    }

    fn classify(&self, addr: u64, len: u64) -> Result<Memory> {
        let state = self.lock();
        match state.run_at(addr) {
            None => Ok(Memory::Host),
            Some((device, base, _)) if state.pieces[&base].managed => Ok(Memory::Managed { ordinal: device }),
            Some((device, base, run_len)) => {
                if addr.saturating_add(len) > base + run_len {
                    return Err(past_allocation(device, addr, len, base, run_len));
                }
                Ok(Memory::Device { ordinal: device, base: DevicePtr(base), len: run_len })
            }
        }
    }

    fn alloc(&self, device: u32, len: u64) -> Result<DevicePtr> {
        let mut state = self.lock();
        self.check_device(&state, device)?;
        self.alloc_one(&mut state, device, len, false)
    }

    fn alloc_pieces(&self, device: u32, piece_len: u64, pieces: u32) -> Result<DevicePtr> {
        self.alloc_run(device, piece_len, pieces)
    }

    unsafe fn free(&self, ptr: DevicePtr) -> Result<()> {
        self.free_run(&mut self.lock(), ptr)
    }

    fn export(&self, addr: u64, len: u64) -> Result<Export> {
        self.export_range(&self.lock(), addr, len)
    }

    fn export_dmabuf(&self, addr: u64, len: u64) -> Result<DmaBuf> {
        if !self.dmabuf {
            return Err(gpu_error(0, "this driver exports no dma-buf (CUDA 11.7 and a supporting GPU needed)"));
        }
        self.dmabuf_range(&self.lock(), addr, len)
    }

    fn share(&self, handle: &IpcHandle) -> Result<Option<super::Shareable>> {
        self.share_handle(&self.lock(), handle).map(|fd| Some(super::Shareable::Fd(fd)))
    }

    fn open(&self, handles: &[IpcHandle], fds: super::FdSource<'_>) -> Result<DevicePtr> {
        check_handles(handles, 1).map_err(|reason| gpu_error(0, format!("a peer's export: {reason}")))?;
        // Refused before any is fetched: each FABRIC handle the exporter
        // hands out is a capability, and the simulator can open none.
        if handles[0].kind == super::HandleKind::Fabric {
            return Err(gpu_error(0, "a peer's export of FABRIC handles (the simulator opens descriptors only)"));
        }
        self.open_export(handles, fds)
    }

    unsafe fn close(&self, ptr: DevicePtr) -> Result<()> {
        self.close_run(&mut self.lock(), ptr)
    }

    fn create_stream(&self, device: u32) -> Result<Stream> {
        let mut state = self.lock();
        self.check_device(&state, device)?;
        let id = state.take_id();
        state.streams.insert(id, StreamState { device, pending: VecDeque::new(), kernels: 0 });
        Ok(Stream(id))
    }

    fn destroy_stream(&self, stream: Stream) -> Result<()> {
        self.lock().streams.remove(&stream.0).map(drop).ok_or_else(|| gpu_error(0, "no such stream"))
    }

    fn wait_caller_stream(&self, device: u32, stream: u64, timeout: Duration) -> Result<()> {
        // The simulator's streams are its own: a caller's default stream
        // (0) has nothing of kvring's queued; one of its streams is waited
        // for as a caller's would be; anything else is no stream.
        let deadline = crate::deadline::deadline_after(timeout);
        loop {
            let mut state = self.lock();
            self.check_device(&state, device)?;
            if stream == 0 {
                return Ok(());
            }
            state.progress(stream);
            let Some(entry) = state.streams.get(&stream) else {
                return Err(gpu_error(device, format!("{stream:#x} is not a stream of this process")));
            };
            if let Some(error) = state.sticky.get(&entry.device) {
                return Err(gpu_error(entry.device, error.clone()));
            }
            if entry.pending.is_empty() {
                return Ok(());
            }
            drop(state);
            if Instant::now() >= deadline {
                return Err(Error::Timeout { what: "the simulated GPU stream", waited: timeout });
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    fn copy_method(&self) -> CopyMethod {
        choose_method(TierInputs {
            driver_version: self.driver_version,
            batch_api: true,
            kernel_ready: self.kernel_loads,
            host_pinned: true,
            peers_reachable: true,
        })
    }

    unsafe fn copy_batch(&self, stream: Stream, copies: &[Copy], sides: &[CopySides]) -> Result<CopyMethod> {
        let mut state = self.lock();
        let device = self.usable_stream(&state, stream)?;
        if state.refuse_after == Some(0) {
            state.refuse_after = None;
            return Err(gpu_error(device, "the driver refused the copy call (injected)"));
        }
        let method = self.tier(&state, stream.0, copies, sides, device);
        let kernel = method == CopyMethod::Kernel;
        // SAFETY: forwarded from our caller.
        unsafe { self.queue(&mut state, stream, copies, kernel)? };
        state.refuse_after = state.refuse_after.map(|n| n - 1);
        self.copy_calls.fetch_add(1, Ordering::Relaxed);
        self.copies.fetch_add(copies.len() as u64, Ordering::Relaxed);
        Ok(method)
    }

    unsafe fn copy_one(&self, stream: Stream, copy: Copy) -> Result<()> {
        let mut state = self.lock();
        self.usable_stream(&state, stream)?;
        // SAFETY: forwarded from our caller.
        unsafe { self.queue(&mut state, stream, &[copy], false) }
    }

    fn create_event(&self, device: u32) -> Result<Event> {
        let mut state = self.lock();
        self.check_device(&state, device)?;
        let id = state.take_id();
        state.events.insert(id, EventState { device, stream: None, generation: 0, done: true });
        Ok(Event(id))
    }

    fn record(&self, stream: Stream, event: Event) -> Result<()> {
        let mut state = self.lock();
        let device = state.streams.get(&stream.0).ok_or_else(|| gpu_error(0, "no such stream"))?.device;
        self.check_device(&state, device)?;
        let entry = state.events.get_mut(&event.0).ok_or_else(|| gpu_error(device, "no such event"))?;
        entry.generation += 1;
        entry.stream = Some(stream.0);
        entry.done = false;
        let work = Work::Event { id: event.0, generation: entry.generation };
        state.streams.get_mut(&stream.0).expect("checked above").pending.push_back(work);
        Ok(())
    }

    fn query(&self, event: Event) -> Result<bool> {
        let mut state = self.lock();
        let entry = state.events.get(&event.0).ok_or_else(|| gpu_error(0, "no such event"))?;
        let (device, stream) = (entry.device, entry.stream);
        self.check_device(&state, device)?;
        let mut on = device;
        if let Some(stream) = stream {
            state.progress(stream);
            on = state.streams.get(&stream).map_or(device, |s| s.device);
        }
        if let Some(error) = state.sticky.get(&on) {
            return Err(gpu_error(on, error.clone()));
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

    fn host_is_pinned(&self, addr: u64) -> bool {
        self.is_host_registered(addr)
    }

    fn host_unregister(&self, addr: u64) -> Result<()> {
        self.lock()
            .registered
            .remove(&addr)
            .map(drop)
            .ok_or_else(|| gpu_error(0, format!("{addr:#x} is not registered")))
    }
}

/// The error of simulated device `device`.
fn gpu_error(device: u32, reason: impl Into<String>) -> Error {
    Error::Gpu { device: format!("sim-gpu-{device}"), reason: reason.into() }
}

#[cfg(test)]
mod tests;

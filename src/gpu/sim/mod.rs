//! A simulated GPU provider: every GPU code path of kvring runs on it, in
//! CI, on machines with no GPU.
//!
//! Device memory is host memory no host thread can touch: each piece is
//! mapped with no access at its device address, so any dereference of a
//! device pointer faults (the rule that no lane ever touches device memory
//! is enforced, not hoped for), and once more where only the stand-in copy
//! engine reaches it (`memory.rs`). Another process opens an export as it
//! would a real one: a legacy handle through `/proc/<pid>/fd`, a run of
//! pieces (the virtual memory API's shape) by taking the exporter's
//! descriptors with `pidfd_getfd`. Copies run when their stream is polled,
//! after a configurable delay, so "the copy finished" is only ever learnt
//! from an event, as with a real GPU. Faults can be injected: an open that
//! fails, a copy that errors (sticky afterwards, as CUDA's are), a device
//! that is lost; and the copy method can be set, as an older driver would
//! report it.

mod memory;

use super::{check_handles, Copy, CopyMethod, DevicePtr, Event, Export, Gpu, GpuDevice, IpcHandle, Memory, Stream};
use crate::error::{Error, Result};
use memory::{past_allocation, Piece};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Memory each simulated device reports.
const SIM_MEMORY_BYTES: u64 = 16 << 30;

/// The simulated provider.
#[derive(Debug)]
pub struct SimGpu {
    devices: u32,
    copy_delay: Duration,
    method: CopyMethod,
    numa_node: Option<u32>,
    state: Mutex<State>,
    copy_calls: AtomicU64,
    copies: AtomicU64,
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
    lost: HashSet<u32>,
    /// The first copy error: every later query reports it.
    sticky: Option<String>,
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
    /// they were queued, issued as one batched call.
    pub fn new(devices: u32, copy_delay: Duration) -> Self {
        Self {
            devices,
            copy_delay,
            method: CopyMethod::Batched,
            numa_node: None,
            state: Mutex::new(State { next_id: 1, ..State::default() }),
            copy_calls: AtomicU64::new(0),
            copies: AtomicU64::new(0),
        }
    }

    /// Reports `method` for its copies, as a driver without batched copies
    /// would (`PerCopy`); the bytes move the same.
    pub fn with_copy_method(mut self, method: CopyMethod) -> Self {
        self.method = method;
        self
    }

    /// Says every device sits on NUMA node `node` (for lane placement).
    pub fn with_numa_node(mut self, node: u32) -> Self {
        self.numa_node = Some(node);
        self
    }

    /// The copy engine's delay.
    pub fn copy_delay(&self) -> Duration {
        self.copy_delay
    }

    /// Calls to [`Gpu::copy_batch`] so far, and the copies they carried.
    pub fn copy_counts(&self) -> (u64, u64) {
        (self.copy_calls.load(Ordering::Relaxed), self.copies.load(Ordering::Relaxed))
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
}

impl State {
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

    fn open(&self, handles: &[IpcHandle]) -> Result<DevicePtr> {
        check_handles(handles, 1).map_err(|reason| gpu_error(0, format!("a peer's export: {reason}")))?;
        self.open_export(&mut self.lock(), handles)
    }

    unsafe fn close(&self, ptr: DevicePtr) -> Result<()> {
        self.close_run(&mut self.lock(), ptr)
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

    fn copy_method(&self) -> CopyMethod {
        self.method
    }

    unsafe fn copy_batch(&self, stream: Stream, copies: &[Copy]) -> Result<CopyMethod> {
        let mut state = self.lock();
        let device = state.streams.get(&stream.0).ok_or_else(|| gpu_error(0, "no such stream"))?.device;
        self.check_device(&state, device)?;
        let mut resolved = Vec::with_capacity(copies.len());
        for copy in copies {
            state.split_at_pieces(copy.src, copy.dst, copy.len, &mut resolved)?;
        }
        let fail = std::mem::take(&mut state.fail_next_copy);
        let ready = Instant::now() + self.copy_delay;
        let work = Work::Copies { ready, copies: resolved, fail };
        state.streams.get_mut(&stream.0).expect("checked above").pending.push_back(work);
        self.copy_calls.fetch_add(1, Ordering::Relaxed);
        self.copies.fetch_add(copies.len() as u64, Ordering::Relaxed);
        Ok(self.method)
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
        if let Some(stream) = stream {
            state.progress(stream);
        }
        if let Some(error) = &state.sticky {
            return Err(gpu_error(device, error.clone()));
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

/// The error of simulated device `device`.
fn gpu_error(device: u32, reason: impl Into<String>) -> Error {
    Error::Gpu { device: format!("sim-gpu-{device}"), reason: reason.into() }
}

#[cfg(test)]
mod tests;

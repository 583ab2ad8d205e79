//! Streams, events, copies (one, batched, and the copy kernel) and
//! modules. Each stream is a worker thread running its queue in order, the
//! fake's copy engine [ref: 6.18 Stream Management: work in one stream runs
//! in issue order, asynchronously to the host].

use super::mem::{End, Kind};
use super::{code, driver, err, put, with, CUcontext, CUdeviceptr, CUresult, Driver, COUNTERS};
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};

type Handle = *mut c_void;

/// One copy, its ends resolved when it was queued.
struct Move {
    src: End,
    dst: End,
    len: u64,
    /// The source bytes, where the call read them at once
    /// (`CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL`).
    snapshot: Option<Vec<u8>>,
}

enum Job {
    Moves(Vec<Move>),
    /// The copy kernel: its descriptors are read when it runs, as a kernel
    /// reads them [ref: 6.22 Execution Control, cuLaunchKernel].
    Kernel {
        descriptors: u64,
        count: u32,
    },
    /// `cuStreamWaitEvent`: nothing runs after it until `seq` of `stream`.
    Wait {
        stream: Arc<StreamObj>,
        seq: u64,
    },
}

type Queue = (VecDeque<(u64, Job)>, u64, bool);

pub struct StreamObj {
    device: i32,
    /// Queued jobs, the last sequence number given, and whether the stream is destroyed.
    queue: Mutex<Queue>,
    ready: Condvar,
    done: AtomicU64,
    finished: Condvar,
    finished_lock: Mutex<()>,
}

impl StreamObj {
    fn submitted(&self) -> u64 {
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).1
    }

    fn push(self: &Arc<Self>, job: Job) -> u64 {
        let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        queue.1 += 1;
        let seq = queue.1;
        queue.0.push_back((seq, job));
        self.ready.notify_one();
        seq
    }

    /// Blocks until everything queued up to `seq` has run.
    fn wait(&self, seq: u64) {
        let mut guard = self.finished_lock.lock().unwrap_or_else(|p| p.into_inner());
        while self.done.load(SeqCst) < seq {
            guard = self.finished.wait(guard).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn run(self: Arc<Self>) {
        loop {
            let (seq, job) = {
                let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if let Some(next) = queue.0.pop_front() {
                        break next;
                    }
                    if queue.2 {
                        return;
                    }
                    queue = self.ready.wait(queue).unwrap_or_else(|p| p.into_inner());
                }
            };
            let delay = match COUNTERS.delay_us.load(Relaxed) {
                -1 => super::env_num("FAKECUDA_DELAY_US", 0),
                us => us,
            };
            if delay > 0 {
                std::thread::sleep(std::time::Duration::from_micros(delay as u64));
            }
            self.execute(job);
            let _guard = self.finished_lock.lock().unwrap_or_else(|p| p.into_inner());
            self.done.store(seq, SeqCst);
            self.finished.notify_all();
        }
    }

    fn execute(&self, job: Job) {
        // Work queued in a poisoned context does not run [ref: 6.2].
        if driver().as_ref().is_some_and(|d| d.sticky(self.device) != err::SUCCESS) {
            return;
        }
        match job {
            Job::Moves(moves) => {
                for one in moves {
                    if !fault_now(self.device) {
                        // SAFETY: both ends were resolved to memory that is
                        // alive (device: held by `phys`; host: the caller's
                        // contract) and `len` long.
                        unsafe { do_move(&one) };
                    }
                }
            }
            Job::Kernel { descriptors, count } => self.kernel(descriptors, count),
            Job::Wait { stream, seq } => stream.wait(seq),
        }
    }

    /// The copy kernel: reads its descriptors and copies each, touching
    /// only memory a kernel on this device may dereference: its own
    /// memory, peers' with peer access, VMM mappings granted to it, and
    /// host memory pinned with DEVICEMAP. Anything else is a sticky
    /// `ILLEGAL_ADDRESS` [ref: 6.2 Error Handling, CUDA_ERROR_ILLEGAL_ADDRESS:
    /// "the context cannot be used, so it must be destroyed"].
    fn kernel(&self, descriptors: u64, count: u32) {
        COUNTERS.kernels.fetch_add(1, Relaxed);
        let mut guard = driver();
        let Some(d) = guard.as_mut() else { return };
        let reachable = |d: &Driver, end: &End| reachable_by_kernel(d, self.device, end);
        let table = d.mem.resolve(descriptors, count as u64 * 24);
        let Some(table) = table.filter(|t| reachable(d, t)) else {
            d.poison(self.device, err::ILLEGAL_ADDRESS);
            COUNTERS.faults.fetch_add(1, Relaxed);
            return;
        };
        let base = table.runs(count as u64 * 24)[0].0 as *const u64;
        let mut moves = Vec::with_capacity(count as usize);
        for i in 0..count as usize {
            // SAFETY: the table holds `count` 24-byte descriptors (resolved
            // above); read unaligned, as bytes over the bus.
            let [src, dst, len] = unsafe { [0, 1, 2].map(|w| base.add(i * 3 + w).read_unaligned()) };
            let ends = (d.mem.resolve(src, len), d.mem.resolve(dst, len));
            match ends {
                (Some(s), Some(t)) if reachable(d, &s) && reachable(d, &t) => {
                    moves.push(Move { src: s, dst: t, len, snapshot: None })
                }
                _ => {
                    d.poison(self.device, err::ILLEGAL_ADDRESS);
                    COUNTERS.faults.fetch_add(1, Relaxed);
                    return;
                }
            }
        }
        drop(guard);
        for one in moves {
            if !fault_now(self.device) {
                // SAFETY: as in `execute`.
                unsafe { do_move(&one) };
            }
        }
    }
}

fn reachable_by_kernel(d: &Driver, device: i32, end: &End) -> bool {
    match end {
        End::Host { devicemap, .. } => *devicemap,
        End::Device { kind, access, .. } => match kind {
            Kind::Alloc => d.peer_enabled(device, end.device().unwrap_or(device)),
            Kind::Ipc { context } => d.peer_enabled(device, *context),
            Kind::Vmm { .. } => access.contains(&device),
        },
    }
}

/// Counts down the injected fault; true (and the context poisoned) when
/// this copy is the one to fault.
fn fault_now(device: i32) -> bool {
    let left = COUNTERS.fault_after.load(Relaxed);
    if left < 0 {
        return false;
    }
    COUNTERS.fault_after.store(left - 1, Relaxed);
    if left > 0 {
        return false;
    }
    COUNTERS.faults.fetch_add(1, Relaxed);
    if let Some(d) = driver().as_mut() {
        d.poison(device, err::ILLEGAL_ADDRESS);
    }
    true
}

unsafe fn do_move(one: &Move) {
    COUNTERS.copies.fetch_add(1, Relaxed);
    let mut src = match &one.snapshot {
        Some(bytes) => vec![(bytes.as_ptr() as *mut u8, one.len)],
        None => one.src.runs(one.len),
    };
    let mut dst = one.dst.runs(one.len);
    src.reverse();
    dst.reverse();
    while let (Some((s, sn)), Some((d, dn))) = (src.pop(), dst.pop()) {
        let n = sn.min(dn);
        // SAFETY: forwarded from the caller; both runs hold `n` bytes.
        unsafe { std::ptr::copy(s, d, n as usize) };
        if sn > n {
            // SAFETY: still inside the same run.
            src.push((unsafe { s.add(n as usize) }, sn - n));
        }
        if dn > n {
            // SAFETY: as above.
            dst.push((unsafe { d.add(n as usize) }, dn - n));
        }
    }
}

struct EventObj {
    device: i32,
    recorded: Option<(Arc<StreamObj>, u64)>,
}

struct Module {
    device: i32,
    image: String,
}

#[derive(Default)]
pub struct Exec {
    streams: HashMap<usize, Arc<StreamObj>>,
    events: HashMap<usize, EventObj>,
    modules: HashMap<usize, Module>,
    functions: HashMap<usize, (i32, String)>,
    next: usize,
}

impl Exec {
    fn take(&mut self) -> usize {
        self.next += 1;
        0x5700_0000 + self.next * 0x10
    }

    /// Descriptors the streams' in-flight jobs keep open (none: jobs hold
    /// allocations through `Arc`, whose descriptors the maps count).
    pub fn held_fds(&self) -> Vec<c_int> {
        Vec::new()
    }
}

/// A stream handle the caller may pass: its own, or (for calls that take
/// them) the legacy ones, 0 and `CU_STREAM_LEGACY` (1).
fn stream_of(d: &Driver, h: Handle) -> Result<Option<Arc<StreamObj>>, CUresult> {
    match h as usize {
        0..=2 => Ok(None),
        id => d.exec.streams.get(&id).cloned().map(Some).ok_or(err::INVALID_HANDLE),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(out: *mut Handle, _flags: c_uint) -> CUresult {
    // [ref: 6.18, cuStreamCreate: in the current context.]
    code(with(|d| {
        let device = d.current()?;
        let stream = Arc::new(StreamObj {
            device,
            queue: Mutex::new((VecDeque::new(), 0, false)),
            ready: Condvar::new(),
            done: AtomicU64::new(0),
            finished: Condvar::new(),
            finished_lock: Mutex::new(()),
        });
        let worker = stream.clone();
        std::thread::Builder::new()
            .name("fakecuda-stream".into())
            .spawn(move || worker.run())
            .map_err(|_| err::OUT_OF_MEMORY)?;
        let id = d.exec.take();
        d.exec.streams.insert(id, stream);
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(out, id as Handle) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(h: Handle) -> CUresult {
    // [ref: 6.18, cuStreamDestroy: returns at once; work still queued
    // completes before the resources go.]
    code(with(|d| {
        let stream = d.exec.streams.remove(&(h as usize)).ok_or(err::INVALID_HANDLE)?;
        let mut queue = stream.queue.lock().unwrap_or_else(|p| p.into_inner());
        queue.2 = true;
        stream.ready.notify_one();
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(h: Handle) -> CUresult {
    // [ref: 6.18, cuStreamQuery: SUCCESS once all work is done, NOT_READY
    // before; errors of the stream's context are returned.]
    code(with(|d| match stream_of(d, h)? {
        None => d.current().map(|_| ()),
        Some(s) => {
            d.context_usable(s.device)?;
            match s.done.load(SeqCst) >= s.submitted() {
                true => Ok(()),
                false => Err(err::NOT_READY),
            }
        }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(h: Handle) -> CUresult {
    let stream = match with(|d| stream_of(d, h)) {
        Ok(s) => s,
        Err(e) => return e,
    };
    if let Some(s) = stream {
        s.wait(s.submitted());
        return code(with(|d| d.context_usable(s.device)));
    }
    err::SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCtx(h: Handle, ctx: *mut CUcontext) -> CUresult {
    // [ref: 6.18, cuStreamGetCtx: the context the stream belongs to; for
    // the legacy stream, the current context.]
    code(with(|d| {
        let device = match stream_of(d, h)? {
            Some(s) => s.device,
            None => d.current()?,
        };
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(ctx, super::context_handle(device)) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(h: Handle, event: Handle, flags: c_uint) -> CUresult {
    // [ref: 6.18, cuStreamWaitEvent: later work in the stream waits for the
    // event's latest recording; the event may be of another context.]
    code(with(|d| {
        if flags != 0 {
            return Err(err::INVALID_VALUE);
        }
        let stream = stream_of(d, h)?.ok_or(err::INVALID_HANDLE)?;
        let recorded = d.exec.events.get(&(event as usize)).ok_or(err::INVALID_HANDLE)?.recorded.clone();
        if let Some((target, seq)) = recorded {
            stream.push(Job::Wait { stream: target, seq });
        }
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(out: *mut Handle, _flags: c_uint) -> CUresult {
    // [ref: 6.19 Event Management, cuEventCreate: in the current context.]
    code(with(|d| {
        let device = d.current()?;
        let id = d.exec.take();
        d.exec.events.insert(id, EventObj { device, recorded: None });
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(out, id as Handle) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(event: Handle, h: Handle) -> CUresult {
    // [ref: 6.19, cuEventRecord: the event and the stream belong to the same
    // context (INVALID_HANDLE otherwise); it captures the stream's work so
    // far.]
    code(with(|d| {
        let stream = stream_of(d, h)?;
        let ev = d.exec.events.get(&(event as usize)).ok_or(err::INVALID_HANDLE)?;
        let stream_device = match &stream {
            Some(s) => s.device,
            None => d.current()?,
        };
        if stream_device != ev.device {
            return Err(err::INVALID_HANDLE);
        }
        d.context_usable(ev.device)?;
        let recorded = stream.map(|s| {
            let seq = s.submitted();
            (s, seq)
        });
        d.exec.events.get_mut(&(event as usize)).expect("found above").recorded = recorded;
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(event: Handle) -> CUresult {
    // [ref: 6.19, cuEventQuery: SUCCESS when the work captured is done (or
    // the event never recorded), NOT_READY before.]
    code(with(|d| {
        let ev = d.exec.events.get(&(event as usize)).ok_or(err::INVALID_HANDLE)?;
        d.context_usable(ev.device)?;
        match &ev.recorded {
            Some((s, seq)) if s.done.load(SeqCst) < *seq => Err(err::NOT_READY),
            _ => Ok(()),
        }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(event: Handle) -> CUresult {
    code(with(|d| d.exec.events.remove(&(event as usize)).map(|_| ()).ok_or(err::INVALID_HANDLE)))
}

/// Counts a copy between GPUs that the stream's device cannot reach
/// directly (no peer access): the driver stages it through the host
/// [ref: 6.29 Peer Context Memory Access]. A VMM mapping the device has no
/// access to is an error [ref: 6.14, cuMemSetAccess].
fn classify_reach(d: &Driver, device: i32, end: &End) -> Result<(), CUresult> {
    if let End::Device { kind, access, .. } = end {
        let direct = match kind {
            Kind::Alloc => d.peer_enabled(device, end.device().unwrap_or(device)),
            // [ref: 6.13, cuIpcOpenMemHandle: "Maps memory exported from
            // another process with cuIpcGetMemHandle into the current device
            // address space"; 6.29, cuCtxEnablePeerAccess: another device
            // reaches memory of that context only once it has peer access
            // to it.] A copy on another GPU's stream without it is staged.
            Kind::Ipc { context } => d.peer_enabled(device, *context),
            Kind::Vmm { .. } => {
                if !access.contains(&device) {
                    return Err(err::INVALID_VALUE);
                }
                true
            }
        };
        if !direct {
            COUNTERS.staged.fetch_add(1, Relaxed);
        }
    }
    Ok(())
}

fn is_pageable(end: &End) -> bool {
    matches!(end, End::Host { pinned: false, .. })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyAsync(dst: CUdeviceptr, src: CUdeviceptr, len: usize, h: Handle) -> CUresult {
    // [ref: 6.13 and "API synchronization behavior": a copy with pageable
    // host memory on either end is synchronous with respect to the host
    // (the stream is drained first); the legacy stream needs a current
    // context; each end must lie in one allocation.]
    let prepared = with(|d| {
        let stream = stream_of(d, h)?;
        let device = match &stream {
            Some(s) => s.device,
            None => d.current()?,
        };
        d.context_usable(device)?;
        let (s, t) = (d.mem.resolve(src, len as u64), d.mem.resolve(dst, len as u64));
        let (Some(s), Some(t)) = (s, t) else { return Err(err::INVALID_VALUE) };
        classify_reach(d, device, &s)?;
        classify_reach(d, device, &t)?;
        Ok((stream, Move { src: s, dst: t, len: len as u64, snapshot: None }))
    });
    let (stream, one) = match prepared {
        Ok(p) => p,
        Err(e) => return e,
    };
    match stream {
        Some(s) if !is_pageable(&one.src) && !is_pageable(&one.dst) => {
            s.push(Job::Moves(vec![one]));
        }
        Some(s) => {
            COUNTERS.sync_copies.fetch_add(1, Relaxed);
            let seq = s.push(Job::Moves(vec![one]));
            s.wait(seq);
        }
        None => {
            COUNTERS.sync_copies.fetch_add(1, Relaxed);
            // SAFETY: resolved above; the caller's contract for host ends.
            unsafe { do_move(&one) };
        }
    }
    err::SUCCESS
}

// Reached only through cuGetProcAddress, which the no-proc-address build
// leaves out (to test kvring against a driver lacking it).
#[cfg_attr(feature = "no-proc-address", allow(dead_code))]
/// `CUmemcpyAttributes` [ref: 7 Data Structures, CUmemcpyAttributes].
#[repr(C)]
pub struct CopyAttributes {
    src_access_order: u32,
    src_hint: [u32; 2],
    dst_hint: [u32; 2],
    flags: u32,
}

// Reached only through cuGetProcAddress, which the no-proc-address build
// leaves out (to test kvring against a driver lacking it).
#[cfg_attr(feature = "no-proc-address", allow(dead_code))]
/// `cuMemcpyBatchAsync`, the CUDA 12.8 ABI (with `failIdx`).
pub unsafe extern "C" fn batch_12080(
    dsts: *const CUdeviceptr,
    srcs: *const CUdeviceptr,
    sizes: *const usize,
    count: usize,
    attrs: *const CopyAttributes,
    attrs_idxs: *const usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    h: Handle,
) -> CUresult {
    // SAFETY: forwarded unchanged: the caller's pointers, under cuMemcpyBatchAsync's contract.
    unsafe { batch(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, fail_idx, h) }
}

// Reached only through cuGetProcAddress, which the no-proc-address build
// leaves out (to test kvring against a driver lacking it).
#[cfg_attr(feature = "no-proc-address", allow(dead_code))]
/// `cuMemcpyBatchAsync`, the CUDA 13.0 ABI (no `failIdx`).
pub unsafe extern "C" fn batch_13000(
    dsts: *const CUdeviceptr,
    srcs: *const CUdeviceptr,
    sizes: *const usize,
    count: usize,
    attrs: *const CopyAttributes,
    attrs_idxs: *const usize,
    num_attrs: usize,
    h: Handle,
) -> CUresult {
    // SAFETY: forwarded unchanged: the caller's pointers, under cuMemcpyBatchAsync's contract.
    unsafe { batch(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, std::ptr::null_mut(), h) }
}

/// [ref: 6.13, cuMemcpyBatchAsync: "The API does not support the legacy
/// default stream" (0 or CU_STREAM_LEGACY); `attrsIdxs[0]` must be 0 and
/// the indices increasing, `numAttrs` at most `count`; a valid
/// `srcAccessOrder`; each copy's source and destination each lie in one
/// allocation, and memory "cannot span registered and unregistered host
/// memory" (INVALID_VALUE, with `failIdx` naming the copy, or SIZE_MAX when
/// the error is not one copy's). A pageable source in stream order makes
/// the call wait for the stream; DURING_API_CALL reads it during the call.]
#[allow(clippy::too_many_arguments)]
#[cfg_attr(feature = "no-proc-address", allow(dead_code))]
unsafe fn batch(
    dsts: *const CUdeviceptr,
    srcs: *const CUdeviceptr,
    sizes: *const usize,
    count: usize,
    attrs: *const CopyAttributes,
    attrs_idxs: *const usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    h: Handle,
) -> CUresult {
    let fail = |i: usize| {
        if !fail_idx.is_null() {
            // SAFETY: a non-null out-pointer the caller passes under cuMemcpyBatchAsync's contract.
            unsafe { fail_idx.write(i) };
        }
    };
    fail(usize::MAX);
    // An injected refusal of the whole call: INVALID_VALUE with failIdx
    // SIZE_MAX, "if the error does not pertain to a specific copy"
    // [ref: cuMemcpyBatchAsync, failIdx]; nothing is queued.
    let refuse = COUNTERS.refuse_after.fetch_update(Relaxed, Relaxed, |n| (n >= 0).then(|| n - 1));
    if refuse == Ok(0) {
        return err::INVALID_VALUE;
    }
    COUNTERS.batches.fetch_add(1, Relaxed);
    let prepared = with(|d| {
        let stream = stream_of(d, h)?.ok_or(err::INVALID_VALUE)?;
        d.context_usable(stream.device)?;
        if count == 0 || dsts.is_null() || srcs.is_null() || sizes.is_null() || attrs.is_null() || attrs_idxs.is_null()
        {
            return Err(err::INVALID_VALUE);
        }
        if num_attrs == 0 || num_attrs > count {
            return Err(err::INVALID_VALUE);
        }
        // SAFETY: `num_attrs` indices at `attrs_idxs`, checked non-null above (the call's contract).
        let idxs = unsafe { std::slice::from_raw_parts(attrs_idxs, num_attrs) };
        if idxs[0] != 0 || idxs.windows(2).any(|w| w[0] >= w[1]) || idxs[num_attrs - 1] >= count {
            return Err(err::INVALID_VALUE);
        }
        // SAFETY: `num_attrs` attributes at `attrs`, checked non-null above (the call's contract).
        let attrs = unsafe { std::slice::from_raw_parts(attrs, num_attrs) };
        if attrs.iter().any(|a| !(1..=3).contains(&a.src_access_order)) {
            return Err(err::INVALID_VALUE);
        }
        // SAFETY: `count` entries at each, checked non-null above (the call's contract).
        let (dsts, srcs, sizes) = unsafe {
            (
                std::slice::from_raw_parts(dsts, count),
                std::slice::from_raw_parts(srcs, count),
                std::slice::from_raw_parts(sizes, count),
            )
        };
        let mut moves = Vec::with_capacity(count);
        let mut stall = false;
        for i in 0..count {
            let order = attrs[idxs.partition_point(|&j| j <= i) - 1].src_access_order;
            let len = sizes[i] as u64;
            let (s, t) = (d.mem.resolve(srcs[i], len), d.mem.resolve(dsts[i], len));
            let (Some(s), Some(t)) = (s, t) else {
                fail(i);
                return Err(err::INVALID_VALUE);
            };
            if let Err(e) = classify_reach(d, stream.device, &s).and_then(|()| classify_reach(d, stream.device, &t)) {
                fail(i);
                return Err(e);
            }
            let mut snapshot = None;
            if is_pageable(&s) {
                match order {
                    1 => stall = true, // STREAM
                    2 => {
                        // DURING_API_CALL: the source is read now.
                        let End::Host { at, .. } = s else { unreachable!() };
                        // SAFETY: the caller's source range, valid now.
                        snapshot = Some(unsafe { std::slice::from_raw_parts(at, len as usize) }.to_vec());
                    }
                    _ => {} // ANY
                }
            }
            moves.push(Move { src: s, dst: t, len, snapshot });
        }
        Ok((stream, moves, stall))
    });
    let (stream, moves, stall) = match prepared {
        Ok(p) => p,
        Err(e) => return e,
    };
    if stall {
        COUNTERS.stalls.fetch_add(1, Relaxed);
        stream.wait(stream.submitted());
    }
    stream.push(Job::Moves(moves));
    err::SUCCESS
}

/// JIT-compiles a PTX image into the current context: the module's id, or
/// the error and what the compiler's error log says.
///
/// [ref: 6.10 Module Management, cuModuleLoadData: loads into the current
/// context; PTX is JIT-compiled, which fails for a PTX ISA newer than the
/// driver (UNSUPPORTED_PTX_VERSION) or a target above the device
/// (INVALID_PTX).]
fn load_module(d: &mut Driver, image: *const c_void) -> Result<usize, (CUresult, String)> {
    let device = d.current().map_err(|e| (e, String::new()))?;
    if image.is_null() {
        return Err((err::INVALID_VALUE, String::new()));
    }
    // SAFETY: a NUL-terminated PTX image, checked non-null above (cuModuleLoadData's contract).
    let text = unsafe { CStr::from_ptr(image.cast::<c_char>()) }.to_string_lossy().into_owned();
    let field = |key: &str| text.lines().find_map(|l| l.trim().strip_prefix(key).map(|rest| rest.trim().to_owned()));
    let invalid = |why: &str| (err::INVALID_PTX, format!("ptxas fatal   : {why}"));
    let version = field(".version ").ok_or((err::INVALID_IMAGE, "ptxas fatal   : no .version directive".into()))?;
    let target = field(".target ").ok_or((err::INVALID_IMAGE, "ptxas fatal   : no .target directive".into()))?;
    let major: i32 = version.split('.').next().and_then(|v| v.parse().ok()).ok_or_else(|| invalid("bad .version"))?;
    // PTX ISA 7.x ships with CUDA 11, 8.x with 12, 9.x with 13.
    if (major + 4) * 1000 > d.version() {
        // CUDA_ERROR_UNSUPPORTED_PTX_VERSION
        return Err((222, format!("ptxas fatal   : Unsupported .version {version}")));
    }
    let sm: i32 = target
        .trim_start_matches("sm_")
        .split([',', ' '])
        .next()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| invalid("bad .target"))?;
    if sm > d.config.sm {
        return Err(invalid(&format!(
            "SM version specified by .target (sm_{sm}) is higher than the device's (sm_{})",
            d.config.sm
        )));
    }
    let id = d.exec.take();
    d.exec.modules.insert(id, Module { device, image: text });
    Ok(id)
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> CUresult {
    code(with(|d| {
        let id = load_module(d, image).map_err(|(e, _)| e)?;
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(module, id as Handle) }
    }))
}

/// Writes `text` (NUL-terminated, cut to fit) into a log buffer of
/// `size` bytes; the bytes written, NUL included.
unsafe fn write_log(buffer: *mut c_void, size: usize, text: &str) -> usize {
    if buffer.is_null() || size == 0 {
        return 0;
    }
    let n = text.len().min(size - 1);
    // SAFETY: the caller's buffer of `size` bytes (the option's contract); n + 1 <= size.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buffer.cast::<u8>(), n);
        buffer.cast::<u8>().add(n).write(0);
    }
    n + 1
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    module: *mut Handle,
    image: *const c_void,
    count: c_uint,
    options: *mut c_int,
    values: *mut *mut c_void,
) -> CUresult {
    // [ref: 6.10, cuModuleLoadDataEx, and 5 Enumerations, CUjit_option:
    // CU_JIT_INFO_LOG_BUFFER (3) / CU_JIT_ERROR_LOG_BUFFER (5) "Pointer to a
    // buffer in which to print any log messages"; their _SIZE_BYTES (4, 6)
    // "IN: Log buffer size in bytes ... OUT: Amount of log buffer filled
    // with messages", passed as the option value itself (an unsigned int).]
    let result = with(|d| Ok(load_module(d, image)));
    let loaded = match result {
        Ok(loaded) => loaded,
        Err(e) => return e,
    };
    let (error_text, info_text) = match &loaded {
        Ok(_) => (String::new(), "ptxas info    : kvring_copy compiled (fake JIT)".to_owned()),
        Err((_, log)) => (log.clone(), String::new()),
    };
    if count > 0 && (options.is_null() || values.is_null()) {
        return err::INVALID_VALUE;
    }
    let count = count as usize;
    // SAFETY: `count` options and values (the call's contract), non-null above.
    let (options, values) = unsafe {
        match count {
            0 => (&[][..], &mut [][..]),
            _ => (std::slice::from_raw_parts(options, count), std::slice::from_raw_parts_mut(values, count)),
        }
    };
    for (buffer_option, size_option, text) in [(5, 6, &error_text), (3, 4, &info_text)] {
        let buffer = options.iter().position(|&o| o == buffer_option);
        let size = options.iter().position(|&o| o == size_option);
        if let (Some(b), Some(n)) = (buffer, size) {
            // SAFETY: the log buffer and its size as the caller passed them.
            let written = unsafe { write_log(values[b], values[n] as usize, text) };
            values[n] = written as *mut c_void;
        }
    }
    match loaded {
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        Ok(id) => code(unsafe { put(module, id as Handle) }),
        Err((e, _)) => e,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(f: *mut Handle, module: Handle, name: *const c_char) -> CUresult {
    code(with(|d| {
        let m = d.exec.modules.get(&(module as usize)).ok_or(err::INVALID_HANDLE)?;
        // SAFETY: a NUL-terminated function name (cuModuleGetFunction's contract).
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
        if !m.image.contains(&format!(".entry {name}(")) {
            return Err(err::NOT_FOUND);
        }
        let device = m.device;
        let id = d.exec.take();
        d.exec.functions.insert(id, (device, name));
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(f, id as Handle) }
    }))
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: Handle,
    _gx: c_uint,
    _gy: c_uint,
    _gz: c_uint,
    _bx: c_uint,
    _by: c_uint,
    _bz: c_uint,
    _shared: c_uint,
    h: Handle,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    // [ref: 6.22 Execution Control, cuLaunchKernel: the function's context
    // is the stream's (INVALID_CONTEXT otherwise); parameters are copied at
    // launch.] Only kvring_copy(const KvringCopy*, unsigned) is emulated.
    code(with(|d| {
        let (device, name) = d.exec.functions.get(&(f as usize)).cloned().ok_or(err::INVALID_HANDLE)?;
        let stream = stream_of(d, h)?.ok_or(err::INVALID_VALUE)?;
        if stream.device != device {
            return Err(err::INVALID_CONTEXT);
        }
        d.context_usable(device)?;
        if name != "kvring_copy" || params.is_null() {
            return Err(err::NOT_SUPPORTED);
        }
        // SAFETY: kvring's kernel takes two parameters, each pointed to by `params` (cuLaunchKernel's contract).
        let (descriptors, count) = unsafe { ((*params).cast::<u64>().read(), (*params.add(1)).cast::<u32>().read()) };
        stream.push(Job::Kernel { descriptors, count });
        Ok(())
    }))
}

//! The `Engine` class of `kvring._native`.

use super::gpu::{location_name, wanted, SimDeviceBuffer, Wanted};
use super::lent::{Lent, LentEngine};
use super::open::{finish, Open};
use super::u64s::U64s;
use super::{op_is_write, raise, raise_code, seconds};
use crate::gpu::SimGpu;
use crate::kv::{CacheShape, KvLayout};
use crate::{BlockDesc, Engine, Error, MemoryKind, RegionId, RegionInfo, TransportKind};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// GPUs of the simulated provider (`gpu="sim"`).
const SIM_GPUS: u32 = 2;
/// Its copy engine's delay: copies land only when their event says so.
const SIM_COPY_DELAY: Duration = Duration::from_micros(10);

/// A kvring engine, for Python. Its methods take addresses and region ids;
/// `kvring.Engine` wraps it with buffer objects and defaults.
#[pyclass(module = "kvring._native", name = "Engine")]
pub struct PyEngine {
    open: Mutex<Option<Open>>,
    /// The process that created it: a forked child has no lanes.
    pid: u32,
    /// Set by `close`, read without the mutex.
    closed: std::sync::atomic::AtomicBool,
    /// Handles of the engine lent out of the lock; `close` waits for them.
    lent: Lent,
    /// Kept apart from `open` so reading them never waits on a transfer.
    name: String,
    control_addr: String,
    /// The simulated GPU, when the engine was made with `gpu="sim"`.
    sim: Option<Arc<SimGpu>>,
}

impl std::fmt::Debug for PyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("name", &self.name).field("control_addr", &self.control_addr).finish()
    }
}

impl PyEngine {
    /// Refuses a forked child. Checked with the GIL held (raising needs
    /// it) and without touching the mutex, which a transfer on another
    /// thread may hold: waiting for it with the GIL held would stall the
    /// whole interpreter.
    fn not_forked(&self) -> PyResult<()> {
        if std::process::id() != self.pid {
            return Err(raise_code(
                "FORK",
                "this engine was created before fork(); its lanes live in the parent: create a new Engine in the child"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The open engine, locked; taken only with the GIL released.
    fn lock(&self) -> MutexGuard<'_, Option<Open>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on a handle of the open engine with the GIL released and
    /// without the lock: a call that waits on a peer (an open) holds no
    /// other call on this engine past that call's own deadline.
    fn with_engine<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&crate::Engine) -> crate::Result<T> + Send,
    ) -> PyResult<T> {
        let engine = self.lend(py)?;
        py.allow_threads(|| f(&engine)).map_err(raise)
    }

    /// A handle of the open engine, for a call that runs without the lock;
    /// `close` waits until it is dropped.
    pub(super) fn lend(&self, py: Python<'_>) -> PyResult<LentEngine<'_>> {
        self.with_open(py, |open| Ok(self.lent.lend(&open.engine)))
    }

    /// Runs `f` on the open engine with the GIL released.
    pub(super) fn with_open<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Open) -> crate::Result<T> + Send,
    ) -> PyResult<T> {
        // Checked with the GIL held (raising needs it); the lock is taken
        // without it, so a long transfer on another thread never blocks
        // the interpreter.
        self.not_forked()?;
        py.allow_threads(|| {
            let mut guard = self.lock();
            match guard.as_mut() {
                Some(open) => f(open).map_err(Err),
                None => Err(Ok(())),
            }
        })
        .map_err(|e| match e {
            Err(error) => raise(error),
            Ok(()) => raise(Error::Shutdown),
        })
    }
}

#[pymethods]
impl PyEngine {
    /// Starts an engine. `listen` is the control address (port 0: any);
    /// `metadata` an `etcd://host:port[/prefix/]` URL or None (peer
    /// handshake); `name` the name it publishes under; `token` the
    /// cluster's pre-shared token (proven, never sent), or None; `gpu` the
    /// GPU provider: None (the CUDA driver where installed, loaded at the
    /// first registration), "cuda" (the driver, now, or an error), or
    /// "sim" (kvring's simulated GPUs: 2 of them, for tests). `rdma`:
    /// "auto" (default: RDMA where libibverbs lists a device with an active
    /// port), "on" (or an error saying why not) or "off"; `rdma_devices`
    /// the NICs to use by name (used, or refused by name);
    /// `rdma_gid_index` the RoCE GID index of every port (None: RoCE v2
    /// with an IPv4-mapped address first; one a port lacks is refused).
    /// `transports`: the transports this engine may reach peers by (None:
    /// every one; one name: that one required); a peer only others reach is
    /// refused with the reason (`kvring.errors.UnsupportedError`).
    /// `pin_host_memory`: pin registered host memory for GPU copies (off by
    /// default; memory its owner pinned is used as it is). `checksum`:
    /// every batch checksummed end to end unless it says otherwise.
    #[new]
    #[pyo3(signature = (name=None, listen="127.0.0.1:0", lanes=1, metadata=None, serve_tcp=true, pin=false, token=None, gpu=None, rdma=None, rdma_devices=None, rdma_gid_index=None, transports=None, pin_host_memory=false, checksum=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: Option<String>,
        listen: &str,
        lanes: usize,
        metadata: Option<String>,
        serve_tcp: bool,
        pin: bool,
        token: Option<Vec<u8>>,
        gpu: Option<&str>,
        rdma: Option<&str>,
        rdma_devices: Option<Vec<String>>,
        rdma_gid_index: Option<u8>,
        transports: Option<Vec<String>>,
        pin_host_memory: bool,
        checksum: bool,
    ) -> PyResult<Self> {
        let listen = listen
            .parse()
            .map_err(|e| raise(Error::invalid("listen", format!("{listen:?} is not host:port ({e})"))))?;
        let mut builder = Engine::builder()
            .listen(listen)
            .lanes(lanes)
            .serve_tcp(serve_tcp)
            .pin(pin)
            .pin_host_memory(pin_host_memory)
            .checksum(checksum);
        if let Some(name) = name {
            builder = builder.name(name);
        }
        if let Some(url) = metadata {
            builder = builder.metadata(crate::MetadataMode::parse(&url).map_err(raise)?);
        }
        if let Some(token) = token {
            builder = builder.token(token);
        }
        if let Some(names) = transports {
            let kinds: Vec<_> =
                names.iter().map(|n| TransportKind::parse(n)).collect::<crate::Result<_>>().map_err(raise)?;
            builder = builder.transports(kinds);
        }
        let sim = match gpu.map(str::trim).filter(|g| !g.is_empty()) {
            None => None,
            Some("sim") => Some(Arc::new(SimGpu::new(SIM_GPUS, SIM_COPY_DELAY))),
            Some("cuda") => {
                let cuda = py.allow_threads(crate::gpu::CudaGpu::load).map_err(raise)?;
                builder = builder.gpu(Arc::new(cuda));
                None
            }
            Some(other) => {
                return Err(raise(Error::invalid("gpu", format!("{other:?} is not None, \"cuda\" or \"sim\""))))
            }
        };
        if let Some(sim) = &sim {
            builder = builder.gpu(sim.clone());
        }
        let (mode, devices) = (rdma.unwrap_or("auto"), rdma_devices.unwrap_or_default());
        if let Some(index) = rdma_gid_index {
            builder = builder.rdma_gid_index(index);
        }
        builder = py
            .allow_threads(|| crate::config::with_rdma(builder, mode, devices, crate::rdma::IbOptions::default()))
            .map_err(raise)?;
        let engine = py.allow_threads(|| builder.build()).map_err(raise)?;
        let submitter = engine.submitter().map_err(raise)?;
        let (name, control_addr) = (engine.name().to_string(), engine.control_addr().to_string());
        let open = Open { engine, submitter, allocated: HashMap::new(), transports: HashMap::new() };
        let closed = std::sync::atomic::AtomicBool::new(false);
        let lent = Lent::default();
        Ok(Self { open: Mutex::new(Some(open)), pid: std::process::id(), closed, lent, name, control_addr, sim })
    }

    /// The engine's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// `host:port` peers open it by (the control address).
    #[getter]
    fn control_addr(&self) -> &str {
        &self.control_addr
    }

    /// True once closed.
    #[getter]
    fn closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Registers `length` bytes at `addr` (no copy); returns the region id.
    /// The memory must stay valid until `unregister`. `location` says where
    /// it lives: None, "auto" or "*" asks the GPU provider (host memory, or
    /// the GPU holding it, as Mooncake classifies an address); "host" or
    /// "cpu[:N]" for host memory, "gpu[:N]" or "cuda[:N]" for a GPU's
    /// (checked: a wrong claim is refused).
    #[pyo3(signature = (addr, length, location=None))]
    fn register(&self, py: Python<'_>, addr: u64, length: u64, location: Option<&str>) -> PyResult<u64> {
        if addr == 0 {
            return Err(raise(Error::invalid("address", "null")));
        }
        let len = usize::try_from(length).map_err(|_| raise(Error::invalid("length", "past the address space")))?;
        let wanted = wanted(location).map_err(raise)?;
        self.with_open(py, |open| {
            let memory = match wanted {
                Wanted::Memory(memory) => memory,
                Wanted::Classify { device_only } => match open.engine.memory_of(addr, length)? {
                    MemoryKind::Host if device_only => {
                        return Err(Error::invalid("memory", format!("{addr:#x}+{length} is not GPU memory")))
                    }
                    found => found,
                },
            };
            let info = match memory {
                MemoryKind::Host => RegionInfo::raw(),
                MemoryKind::Gpu(n) => RegionInfo::raw().on_gpu(n),
            };
            // SAFETY: the caller promises the range stays valid until it
            // unregisters it (this method's documented contract; the Python
            // layer holds buffer objects for that long).
            unsafe { open.engine.register(addr as *mut u8, len, info) }.map(|id| id.raw())
        })
    }

    /// Where a region lives: "host" or "gpu:N"; with `segment`, a peer's
    /// region (by id), else one of this engine's.
    #[pyo3(signature = (region, segment=None, timeout=5.0))]
    fn region_memory(&self, py: Python<'_>, region: u64, segment: Option<String>, timeout: f64) -> PyResult<String> {
        let timeout = seconds(timeout)?;
        let id = RegionId::from_raw(region);
        self.with_open(py, |open| {
            let memory = match &segment {
                None => open.engine.region_info(id)?.2.memory,
                Some(name) => {
                    let segment = open.segment(name, timeout)?;
                    let found = segment.regions().iter().find(|r| r.id == id).map(|r| r.memory);
                    found.ok_or(Error::UnknownRegion { side: crate::Side::Remote, region: id })?
                }
            };
            Ok(location_name(memory))
        })
    }

    /// For tests: `length` bytes of the simulated GPU `device`, as an
    /// object with `__cuda_array_interface__` and DLPack (engines made
    /// with `gpu="sim"` only).
    #[pyo3(signature = (length, device=0))]
    fn sim_device_buffer(&self, py: Python<'_>, length: u64, device: u32) -> PyResult<SimDeviceBuffer> {
        let sim = self.sim.clone().ok_or_else(|| {
            raise(Error::invalid("gpu", "sim_device_buffer needs an engine made with gpu=\"sim\"".to_string()))
        })?;
        py.allow_threads(|| SimDeviceBuffer::allocate(sim, device, length)).map_err(raise)
    }

    /// Unregisters a region by id (refused while a batch uses it).
    fn unregister(&self, py: Python<'_>, region: u64) -> PyResult<()> {
        self.with_open(py, |open| {
            open.engine.unregister(RegionId::from_raw(region))?;
            open.allocated.remove(&region);
            Ok(())
        })
    }

    /// The region starting exactly at `addr`.
    fn region_at(&self, py: Python<'_>, addr: u64) -> PyResult<u64> {
        self.with_open(py, |open| match open.engine.locate(addr, 1) {
            Ok((id, 0)) => Ok(id.raw()),
            _ => Err(Error::invalid("address", format!("{addr:#x} is not the start of a registered region"))),
        })
    }

    /// Allocates and registers `length` bytes of shared memory (page
    /// aligned, pre-faulted); returns (region id, address).
    fn alloc(&self, py: Python<'_>, length: usize) -> PyResult<(u64, u64)> {
        self.with_open(py, |open| {
            let region = open.engine.alloc_region(length, RegionInfo::raw())?;
            let found = (region.id().raw(), region.as_ptr() as u64);
            open.allocated.insert(found.0, region);
            Ok(found)
        })
    }

    /// Turns a local address range into (region id, offset).
    fn locate(&self, py: Python<'_>, addr: u64, length: u64) -> PyResult<(u64, u64)> {
        self.with_open(py, |open| open.engine.locate(addr, length).map(|(id, offset)| (id.raw(), offset)))
    }

    /// Opens a peer (`host:port`, or a name with etcd metadata) with a
    /// transport ("shm", "tcp", "rdma"; None: the engine's order); returns
    /// the transport chosen. Later calls naming the segment use it.
    #[pyo3(signature = (name, transport=None, timeout=5.0))]
    fn open_segment(&self, py: Python<'_>, name: String, transport: Option<&str>, timeout: f64) -> PyResult<String> {
        let (kind, timeout) = (super::transport(transport)?, seconds(timeout)?);
        // The handshake runs outside the engine's lock: a dead peer holds
        // up no other thread's wait or poll past their own deadlines.
        let chosen = self.with_engine(py, |engine| Ok(engine.open_segment_with(&name, kind, timeout)?.transport()))?;
        self.with_open(py, |open| {
            open.transports.insert(name, kind);
            Ok(chosen.name().to_string())
        })
    }

    /// Opens a TP group's peers at once (their handshakes concurrent);
    /// returns, per name in order, the transport chosen or the exception
    /// its open raised (returned, not raised: the others still opened).
    #[pyo3(signature = (names, transport=None, timeout=5.0))]
    fn open_segments(
        &self,
        py: Python<'_>,
        names: Vec<String>,
        transport: Option<&str>,
        timeout: f64,
    ) -> PyResult<Vec<PyObject>> {
        let (kind, timeout) = (super::transport(transport)?, seconds(timeout)?);
        // As in `open_segment`: the handshakes run outside the lock.
        let results = self.with_engine(py, |engine| Ok(engine.open_many(&names, kind, timeout)))?;
        let opened: Vec<Result<&'static str, Error>> = self.with_open(py, |open| {
            let named = names.iter().zip(results).map(|(name, result)| {
                let segment = result?;
                open.transports.insert(name.clone(), kind);
                Ok(segment.transport().name())
            });
            Ok(named.collect())
        })?;
        let objects = opened.into_iter().map(|result| match result {
            Ok(name) => pyo3::types::PyString::new(py, name).into_any().unbind(),
            Err(error) => raise(error).into_value(py).into_any(),
        });
        Ok(objects.collect())
    }

    /// This engine's segment descriptor as bytes (protobuf), for peers that
    /// exchange metadata out of band (NIXL's agent metadata).
    fn descriptor<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.with_open(py, |open| Ok(open.engine.descriptor_bytes()))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Opens the peer another engine's `descriptor()` bytes describe (a
    /// handshake with its control address; refused if it restarted since);
    /// returns (its name, the address later calls name it by, the
    /// transport chosen).
    #[pyo3(signature = (descriptor, transport=None, timeout=5.0))]
    fn open_described(
        &self,
        py: Python<'_>,
        descriptor: Vec<u8>,
        transport: Option<&str>,
        timeout: f64,
    ) -> PyResult<(String, String, String)> {
        let (kind, timeout) = (super::transport(transport)?, seconds(timeout)?);
        self.with_open(py, |open| {
            let segment = open.engine.open_described(&descriptor, kind, timeout)?;
            let addr = segment.opened_as().to_string();
            open.transports.insert(addr.clone(), kind);
            Ok((segment.name().to_string(), addr, segment.transport().name().to_string()))
        })
    }

    /// Opens a peer (or finds it open) and says who answered: (its name,
    /// its epoch, the transport).
    #[pyo3(signature = (name, timeout=5.0))]
    fn segment_info(&self, py: Python<'_>, name: String, timeout: f64) -> PyResult<(String, u64, String)> {
        let timeout = seconds(timeout)?;
        self.with_open(py, |open| {
            let segment = open.segment(&name, timeout)?;
            Ok((segment.name().to_string(), segment.epoch(), segment.transport().name().to_string()))
        })
    }

    /// Waits (at most `timeout` seconds) for the work queued so far on a
    /// caller's GPU stream (an int handle; 0: `device`'s default stream).
    #[pyo3(signature = (device, stream, timeout=30.0))]
    fn wait_gpu_stream(&self, py: Python<'_>, device: u32, stream: u64, timeout: f64) -> PyResult<()> {
        let timeout = seconds(timeout)?;
        self.with_open(py, |open| open.engine.wait_gpu_stream(device, stream, timeout))
    }

    /// A fresh handshake with a peer: raises unless it answers now, as the
    /// engine the handle was opened to.
    #[pyo3(signature = (name, timeout=5.0))]
    fn probe(&self, py: Python<'_>, name: String, timeout: f64) -> PyResult<()> {
        let timeout = seconds(timeout)?;
        self.with_open(py, |open| open.segment(&name, timeout)?.probe(timeout))
    }

    /// Closes this engine's handle to a peer: the next use opens it anew.
    fn close_segment(&self, py: Python<'_>, name: String) -> PyResult<()> {
        self.with_open(py, |open| {
            if let Ok(segment) = open.engine.open_segment_with(&name, None, Duration::ZERO) {
                open.engine.close_segment(&segment);
            }
            open.transports.remove(&name);
            Ok(())
        })
    }

    /// The peer's regions as (region id, address, length), in its order.
    #[pyo3(signature = (name, timeout=5.0))]
    fn segment_regions(&self, py: Python<'_>, name: String, timeout: f64) -> PyResult<Vec<(u64, u64, u64)>> {
        let timeout = seconds(timeout)?;
        self.with_open(py, |open| {
            let segment = open.segment(&name, timeout)?;
            Ok(segment.regions().iter().map(|r| (r.id.raw(), r.addr, r.len)).collect())
        })
    }

    /// Moves blocks given as (local region, local offset, remote region,
    /// remote offset, length) and waits; returns the bytes moved.
    /// `checksum`: CRC32C of every block verified at its destination
    /// (`None`: the engine's setting); a mismatch raises `CorruptError`.
    #[pyo3(signature = (name, op, descs, timeout=30.0, checksum=None))]
    fn transfer(
        &self,
        py: Python<'_>,
        name: String,
        op: &str,
        descs: Vec<(u64, u64, u64, u64, u64)>,
        timeout: f64,
        checksum: Option<bool>,
    ) -> PyResult<u64> {
        let (write, timeout) = (op_is_write(op)?, seconds(timeout)?);
        let descs: Vec<BlockDesc> = descs
            .into_iter()
            .map(|(lr, lo, rr, ro, len)| BlockDesc::new(RegionId::from_raw(lr), lo, RegionId::from_raw(rr), ro, len))
            .collect();
        self.with_open(py, |open| {
            let segment = open.segment(&name, timeout)?;
            open.run(&segment, write, &descs, timeout, checksum)
        })
    }

    // Same keyword signature as `submit_addrs`, on purpose: a Python method each (docs/DUPLICATES.md).
    /// Moves blocks named by local and remote addresses (Mooncake's
    /// convention) and waits; returns the bytes moved.
    #[pyo3(signature = (name, op, locals, remotes, lengths, timeout=30.0, checksum=None))]
    #[allow(clippy::too_many_arguments)] // a Python keyword signature
    fn transfer_addrs(
        &self,
        py: Python<'_>,
        name: String,
        op: &str,
        locals: U64s,
        remotes: U64s,
        lengths: U64s,
        timeout: f64,
        checksum: Option<bool>,
    ) -> PyResult<u64> {
        let (write, timeout) = (op_is_write(op)?, seconds(timeout)?);
        self.with_open(py, |open| {
            let (segment, descs) = open.descs_from_addrs(&name, &locals.0, &remotes.0, &lengths.0, timeout)?;
            open.run(&segment, write, &descs, timeout, checksum)
        })
    }

    /// Submits blocks named by addresses without waiting; returns the
    /// batch id for `poll` and `wait`.
    #[pyo3(signature = (name, op, locals, remotes, lengths, timeout=30.0, checksum=None))]
    #[allow(clippy::too_many_arguments)] // a Python keyword signature
    fn submit_addrs(
        &self,
        py: Python<'_>,
        name: String,
        op: &str,
        locals: U64s,
        remotes: U64s,
        lengths: U64s,
        timeout: f64,
        checksum: Option<bool>,
    ) -> PyResult<u64> {
        let (write, timeout) = (op_is_write(op)?, seconds(timeout)?);
        self.with_open(py, |open| {
            let (segment, descs) = open.descs_from_addrs(&name, &locals.0, &remotes.0, &lengths.0, timeout)?;
            open.submit(&segment, write, &descs, timeout, checksum).map(|id| id.raw())
        })
    }

    /// Waits up to `timeout` for a batch; returns its bytes, raises its
    /// error, or raises `TimeoutError` (the batch keeps running).
    #[pyo3(signature = (batch, timeout=30.0))]
    fn wait(&self, py: Python<'_>, batch: u64, timeout: f64) -> PyResult<u64> {
        let timeout = seconds(timeout)?;
        self.with_open(py, |open| finish(open.submitter.wait(crate::BatchId::from_raw(batch), timeout)?))
    }

    /// The transport that carries a batch ("shm", "tcp", ...), from its
    /// submission until `wait`, `poll` or `reap` consumes it.
    fn batch_transport(&self, py: Python<'_>, batch: u64) -> PyResult<&'static str> {
        self.with_open(py, |open| Ok(open.submitter.transport(crate::BatchId::from_raw(batch))?.name()))
    }

    /// Cancels a batch: blocks not yet posted are dropped; the batch ends
    /// (`CancelledError` from `wait`/`poll`) once every posted block has
    /// drained, so its memory is safe to reuse when that is seen. A batch
    /// that already ended is left as it ended.
    fn cancel(&self, py: Python<'_>, batch: u64) -> PyResult<()> {
        self.with_open(py, |open| open.submitter.cancel(crate::BatchId::from_raw(batch)))
    }

    /// A batch's bytes if it has ended well, None while it runs; raises
    /// its error if it failed. A batch still running yields the CPU once
    /// (after the lock is released): a caller polling in a tight loop
    /// (NIXL's `check_xfer_state`) then cedes its core to a lane that shares
    /// it instead of holding it for a whole time slice (milliseconds on a
    /// busy 2-core host).
    fn poll(&self, py: Python<'_>, batch: u64) -> PyResult<Option<u64>> {
        let found =
            self.with_open(py, |open| match open.submitter.wait(crate::BatchId::from_raw(batch), Duration::ZERO) {
                Err(Error::Timeout { .. }) => Ok(None),
                Err(error) => Err(error),
                Ok(outcome) => finish(outcome).map(Some),
            })?;
        if found.is_none() {
            py.allow_threads(std::thread::yield_now);
        }
        Ok(found)
    }

    /// Sends a notification to a peer (after the batches it announces).
    #[pyo3(signature = (name, message, timeout=5.0))]
    fn notify(&self, py: Python<'_>, name: String, message: Vec<u8>, timeout: f64) -> PyResult<()> {
        let timeout = seconds(timeout)?;
        self.with_open(py, |open| {
            let segment = open.segment(&name, timeout)?;
            open.engine.notify(&segment, &message, timeout)
        })
    }

    /// Notifications received since the last call, as (sender, message).
    fn notifications<'py>(&self, py: Python<'py>) -> PyResult<Vec<(String, Bound<'py, PyBytes>)>> {
        let taken =
            self.with_open(py, |open| Ok(std::iter::from_fn(|| open.engine.poll_notification()).collect::<Vec<_>>()))?;
        Ok(taken.into_iter().map(|n| (n.from, PyBytes::new(py, &n.message))).collect())
    }

    /// Describes this engine's KV cache: `attention` "mha" (dims: layers,
    /// blocks, kv_heads, head_dim, dtype_bytes, tokens_per_block, tp) or
    /// "mla" (layers, blocks, latent_dim, dtype_bytes, tokens_per_block,
    /// index_dim), laid out contiguously in `region` from `offset`.
    #[pyo3(signature = (attention, dims, region, offset=0))]
    fn set_kv_layout(&self, py: Python<'_>, attention: &str, dims: Vec<u64>, region: u64, offset: u64) -> PyResult<()> {
        let shape = match (attention, dims.as_slice()) {
            ("mha", &[layers, blocks, heads, head_dim, dtype, tokens, tp]) => {
                let layers = u32::try_from(layers).map_err(|_| PyValueError::new_err("layers past u32"))?;
                CacheShape::mha(layers, blocks, heads, head_dim, dtype, tokens, tp)
            }
            ("mla", &[layers, blocks, latent, dtype, tokens, index]) => {
                let layers = u32::try_from(layers).map_err(|_| PyValueError::new_err("layers past u32"))?;
                CacheShape::mla(layers, blocks, latent, dtype, tokens, index)
            }
            _ => {
                return Err(PyValueError::new_err(format!(
                    "attention {attention:?} with {} dims: \"mha\" takes 7, \"mla\" takes 6",
                    dims.len()
                )))
            }
        }
        .map_err(raise)?;
        self.with_open(py, |open| {
            open.engine.set_kv_layout(KvLayout::contiguous(shape, RegionId::from_raw(region), offset)?)
        })
    }

    /// Pushes (`op` "push") or pulls ("pull") blocks of every layer between
    /// this engine's KV layout and the peer's, and waits; with `layer`
    /// set, pushes that layer only; with `grant`, a push names it (the
    /// peer's `fence_blocks` of `dst_ids`). Returns the bytes moved.
    #[pyo3(signature = (name, op, src_ids, dst_ids, layer=None, timeout=30.0, grant=None))]
    #[allow(clippy::too_many_arguments)] // a Python keyword signature
    fn kv_transfer(
        &self,
        py: Python<'_>,
        name: String,
        op: &str,
        src_ids: Vec<u64>,
        dst_ids: Vec<u64>,
        layer: Option<u32>,
        timeout: f64,
        grant: Option<u32>,
    ) -> PyResult<u64> {
        let timeout = seconds(timeout)?;
        let push = match op {
            "push" => true,
            "pull" if layer.is_none() && grant.is_none() => false,
            other => {
                return Err(PyValueError::new_err(format!(
                    "op must be \"push\" or \"pull\" (whole blocks), got {other:?}"
                )))
            }
        };
        self.with_open(py, |open| {
            let segment = open.segment(&name, timeout)?;
            let mine = open.engine.kv_layout().ok_or_else(|| Error::invalid("kv layout", "set_kv_layout first"))?;
            let theirs = segment.kv_layout(timeout)?;
            let sub = &mut open.submitter;
            let (src, dst) = (&src_ids[..], &dst_ids[..]);
            let id = match (push, layer, grant) {
                (true, Some(layer), None) => sub.push_layer(&segment, &mine, &theirs, layer, src, dst)?,
                (true, Some(layer), Some(g)) => sub.push_layer_granted(&segment, &mine, &theirs, layer, src, dst, g)?,
                (true, None, None) => sub.push_blocks(&segment, &mine, &theirs, src, dst)?,
                (true, None, Some(g)) => sub.push_blocks_granted(&segment, &mine, &theirs, src, dst, g)?,
                (false, ..) => sub.pull_blocks(&segment, &mine, &theirs, src, dst)?,
            };
            finish(sub.wait(id, timeout)?)
        })
    }

    /// The same case through the Rust API, for the Python-overhead bench:
    /// `iterations` times, turns the addresses into descriptors, submits
    /// and waits, all in Rust with the GIL released; returns each
    /// iteration's nanoseconds.
    #[pyo3(signature = (name, op, locals, remotes, lengths, iterations, timeout=30.0))]
    #[allow(clippy::too_many_arguments)]
    fn rust_loop(
        &self,
        py: Python<'_>,
        name: String,
        op: &str,
        locals: U64s,
        remotes: U64s,
        lengths: U64s,
        iterations: usize,
        timeout: f64,
    ) -> PyResult<Vec<u64>> {
        let (write, timeout) = (op_is_write(op)?, seconds(timeout)?);
        self.with_open(py, |open| {
            let mut times = Vec::with_capacity(iterations);
            for _ in 0..iterations {
                let start = std::time::Instant::now();
                let (segment, descs) = open.descs_from_addrs(&name, &locals.0, &remotes.0, &lengths.0, timeout)?;
                open.run(&segment, write, &descs, timeout, None)?;
                times.push(start.elapsed().as_nanos() as u64);
            }
            Ok(times)
        })
    }

    /// Stops the engine: later calls raise `EngineClosedError`.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.not_forked()?;
        self.closed.store(true, std::sync::atomic::Ordering::Release);
        // Waits for a transfer in flight on another thread, then stops the
        // engine, then waits for the handles lent to calls running outside
        // the lock (each ends by its own deadline), so that the drop below
        // is the engine's last and joins its lanes: no peer reaches the
        // buffers the caller takes back once this returns. All without the
        // GIL.
        py.allow_threads(|| {
            let open = self.lock().take();
            if let Some(open) = &open {
                open.engine.shutdown();
            }
            self.lent.wait_all_back();
            drop(open);
        });
        Ok(())
    }
}

impl Drop for PyEngine {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A forked child's copy: its lanes are threads of the parent.
            let open = self.open.get_mut().map(Option::take).unwrap_or_else(|p| p.into_inner().take());
            std::mem::forget(open);
        }
    }
}

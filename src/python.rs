//! The Python extension module `kvring._native` (cargo feature `python`,
//! built by maturin; `python/kvring/` is the package around it).
//!
//! It speaks addresses and region ids, the shape both of kvring's own
//! Python API and of Mooncake's: buffer objects are turned into addresses
//! by the Python layer, which also keeps them alive while registered.
//! Every transfer and wait runs with the GIL released. Errors are raised as
//! the exception class the Python package registered for their error code
//! (`set_error_classes`), so each error kind is its own class.
//!
//! A process that forked after creating an engine has none of its lanes in
//! the child: every call there raises `ForkError`, and the child's copy is
//! leaked rather than joined (joining threads that do not exist would hang).

use crate::kv::{check_pd_topo, Attention, CacheShape, KvLayout, Mode, Rank, TopoCheck};
use crate::log::sink::{on_own_thread, set_sink};
use crate::{
    Batch, BlockDesc, Engine, Error, Outcome, Region, RegionId, RegionInfo, Segment, Submitter, TransportKind,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBytes, PyDict, PyList, PyType};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;
use tracing::Level;

/// Error code name (`"OUT_OF_BOUNDS"`, …) → exception class, set once by
/// the Python package at import.
static ERROR_CLASSES: GILOnceCell<Py<PyDict>> = GILOnceCell::new();

/// Raises `error` as the class registered for its code (or RuntimeError
/// before any are registered).
fn raise(error: Error) -> PyErr {
    raise_code(error.code().as_str_name(), error.to_string())
}

fn raise_code(code: &str, message: String) -> PyErr {
    Python::with_gil(|py| {
        let class = ERROR_CLASSES
            .get(py)
            .and_then(|classes| classes.bind(py).get_item(code).ok().flatten())
            .and_then(|class| class.downcast_into::<PyType>().ok());
        match class {
            Some(class) => PyErr::from_type(class, message),
            None => PyRuntimeError::new_err(format!("{code}: {message}")),
        }
    })
}

/// Registers the exception class for each error code (called once by
/// `kvring/errors.py`).
#[pyfunction]
fn set_error_classes(py: Python<'_>, classes: Bound<'_, PyDict>) -> PyResult<()> {
    let _ = ERROR_CLASSES.set(py, classes.unbind());
    Ok(())
}

fn seconds(timeout: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(timeout)
        .map_err(|_| PyValueError::new_err(format!("timeout must be a non-negative number of seconds, got {timeout}")))
}

fn transport(name: Option<&str>) -> PyResult<Option<TransportKind>> {
    name.filter(|n| !n.is_empty()).map(TransportKind::parse).transpose().map_err(raise)
}

fn op_is_write(op: &str) -> PyResult<bool> {
    match op {
        "write" => Ok(true),
        "read" => Ok(false),
        other => Err(PyValueError::new_err(format!("op must be \"write\" or \"read\", got {other:?}"))),
    }
}

/// A list of ints (addresses or lengths) taken from Python. Reading it is
/// most of the Python overhead of a 64-block batch: pyo3's generic path
/// costs ~35 ns an item under the stable ABI (a sequence protocol call and
/// an `__index__` conversion each), so a `list` of exact ints is read
/// through `PyList_GetItem` and `PyLong_AsUnsignedLong` directly;
/// anything else takes the generic path.
struct U64s(Vec<u64>);

// The fast path reads ints as `unsigned long`: 64 bits on LP64 Linux.
const _: () = assert!(std::mem::size_of::<std::os::raw::c_ulong>() == 8);

impl<'py> FromPyObject<'py> for U64s {
    fn extract_bound(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        let Ok(list) = obj.downcast::<PyList>() else {
            return obj.extract::<Vec<u64>>().map(U64s);
        };
        let len = list.len();
        let mut out = Vec::with_capacity(len);
        for index in 0..len {
            // No Python code runs in this loop, so the list cannot shrink.
            // SAFETY: the GIL is held (we have a `Bound`) and `index` is below
            // the length read under it: PyList_GetItem gives a live, borrowed item.
            let item = unsafe { pyo3::ffi::PyList_GetItem(list.as_ptr(), index as pyo3::ffi::Py_ssize_t) };
            // SAFETY: `item` is a live object (above). The exact-int check
            // makes the conversion a plain read, with no `__index__` call.
            let value = unsafe {
                if item.is_null() || pyo3::ffi::PyLong_CheckExact(item) == 0 {
                    None
                } else {
                    // `unsigned long` is 64 bits on the LP64 targets kvring
                    // builds for, and CPython converts it with a digit
                    // loop (its `long long` path goes through a byte
                    // array, about 3x slower for addresses).
                    match pyo3::ffi::PyLong_AsUnsignedLong(item) {
                        // Also the error value (negative, too large): drop
                        // the error it may have set; the generic path below
                        // tells an error from the number and raises its own.
                        u64::MAX => {
                            pyo3::ffi::PyErr_Clear();
                            None
                        }
                        value => Some(value),
                    }
                }
            };
            match value {
                Some(value) => out.push(value),
                None => out.push(list.get_item(index)?.extract::<u64>()?),
            }
        }
        Ok(U64s(out))
    }
}

/// What an open engine holds.
struct Open {
    engine: Engine,
    submitter: Submitter,
    /// Regions this module allocated (`alloc`), by raw id.
    allocated: HashMap<u32, Region>,
    /// The transport each segment name is opened with (None: the engine's order).
    transports: HashMap<String, Option<TransportKind>>,
}

impl Open {
    /// The segment for `name`, opened (or found in the engine's cache) with
    /// the transport asked for it.
    fn segment(&mut self, name: &str, timeout: Duration) -> crate::Result<Segment> {
        let kind = self.transports.get(name).copied().flatten();
        self.engine.open_segment_with(name, kind, timeout)
    }

    /// Turns (local address, remote address, length) triples into
    /// descriptors; a remote address the handle's region table lacks
    /// reopens the segment once (the peer may have registered it since).
    fn descs_from_addrs(
        &mut self,
        name: &str,
        locals: &[u64],
        remotes: &[u64],
        lengths: &[u64],
        timeout: Duration,
    ) -> crate::Result<(Segment, Vec<BlockDesc>)> {
        if locals.len() != remotes.len() || locals.len() != lengths.len() {
            return Err(Error::invalid(
                "batch",
                format!("{} local addresses, {} remote, {} lengths", locals.len(), remotes.len(), lengths.len()),
            ));
        }
        let mut segment = self.segment(name, timeout)?;
        let mut descs = Vec::with_capacity(locals.len());
        let mut reopened = false;
        for ((&local, &remote), &len) in locals.iter().zip(remotes).zip(lengths) {
            let (local_region, local_offset) = self.engine.locate(local, len)?;
            let (remote_region, remote_offset) = match segment.locate(remote, len) {
                Ok(found) => found,
                Err(_) if !reopened => {
                    reopened = true;
                    self.engine.close_segment(&segment);
                    segment = self.segment(name, timeout)?;
                    segment.locate(remote, len)?
                }
                Err(error) => return Err(error),
            };
            descs.push(BlockDesc::new(local_region, local_offset, remote_region, remote_offset, len));
        }
        Ok((segment, descs))
    }

    /// Submits one batch with `timeout` as its deadline.
    fn submit(
        &mut self,
        segment: &Segment,
        write: bool,
        descs: &[BlockDesc],
        timeout: Duration,
    ) -> crate::Result<crate::BatchId> {
        let batch = if write { Batch::write(segment) } else { Batch::read(segment) };
        self.submitter.submit(&batch.descs(descs).deadline(timeout))
    }

    /// Submits one batch and waits for it (a little past its deadline).
    fn run(&mut self, segment: &Segment, write: bool, descs: &[BlockDesc], timeout: Duration) -> crate::Result<u64> {
        let id = self.submit(segment, write, descs, timeout)?;
        finish(self.submitter.wait(id, timeout + Duration::from_secs(1))?)
    }
}

fn finish(outcome: Outcome) -> crate::Result<u64> {
    match outcome {
        Outcome::Done { bytes } => Ok(bytes),
        Outcome::Failed(error) => Err(error),
        Outcome::TimedOut { bytes } => Err(Error::DeadlinePassed { bytes }),
        Outcome::Cancelled { bytes } => Err(Error::invalid("batch", format!("cancelled after {bytes} bytes"))),
    }
}

/// A kvring engine, for Python. Its methods take addresses and region ids;
/// `kvring.Engine` wraps it with buffer objects and defaults.
#[pyclass(module = "kvring._native", name = "Engine")]
pub struct PyEngine {
    open: Mutex<Option<Open>>,
    /// The process that created it: a forked child has no lanes.
    pid: u32,
    /// Set by `close`, read without the mutex.
    closed: std::sync::atomic::AtomicBool,
    /// Kept apart from `open` so reading them never waits on a transfer.
    name: String,
    control_addr: String,
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

    /// Runs `f` on the open engine with the GIL released.
    fn with_open<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut Open) -> crate::Result<T> + Send) -> PyResult<T> {
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
    /// cluster's pre-shared token (proven, never sent), or None.
    #[new]
    #[pyo3(signature = (name=None, listen="127.0.0.1:0", lanes=1, metadata=None, serve_tcp=true, pin=false, token=None))]
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
    ) -> PyResult<Self> {
        let listen = listen
            .parse()
            .map_err(|e| raise(Error::invalid("listen", format!("{listen:?} is not host:port ({e})"))))?;
        let mut builder = Engine::builder().listen(listen).lanes(lanes).serve_tcp(serve_tcp).pin(pin);
        if let Some(name) = name {
            builder = builder.name(name);
        }
        if let Some(url) = metadata {
            builder = builder.metadata(crate::MetadataMode::parse(&url).map_err(raise)?);
        }
        if let Some(token) = token {
            builder = builder.token(token);
        }
        let engine = py.allow_threads(|| builder.build()).map_err(raise)?;
        let submitter = engine.submitter().map_err(raise)?;
        let (name, control_addr) = (engine.name().to_string(), engine.control_addr().to_string());
        let open = Open { engine, submitter, allocated: HashMap::new(), transports: HashMap::new() };
        let closed = std::sync::atomic::AtomicBool::new(false);
        Ok(Self { open: Mutex::new(Some(open)), pid: std::process::id(), closed, name, control_addr })
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
    /// The memory must stay valid until `unregister`.
    fn register(&self, py: Python<'_>, addr: u64, length: u64) -> PyResult<u32> {
        if addr == 0 {
            return Err(raise(Error::invalid("address", "null")));
        }
        let len = usize::try_from(length).map_err(|_| raise(Error::invalid("length", "past the address space")))?;
        self.with_open(py, |open| {
            // SAFETY: the caller promises the range stays valid until it
            // unregisters it (this method's documented contract; the Python
            // layer holds buffer objects for that long).
            unsafe { open.engine.register(addr as *mut u8, len, RegionInfo::raw()) }.map(|id| id.raw())
        })
    }

    /// Unregisters a region by id (refused while a batch uses it).
    fn unregister(&self, py: Python<'_>, region: u32) -> PyResult<()> {
        self.with_open(py, |open| {
            open.engine.unregister(RegionId::from_raw(region))?;
            open.allocated.remove(&region);
            Ok(())
        })
    }

    /// The region starting exactly at `addr`.
    fn region_at(&self, py: Python<'_>, addr: u64) -> PyResult<u32> {
        self.with_open(py, |open| match open.engine.locate(addr, 1) {
            Ok((id, 0)) => Ok(id.raw()),
            _ => Err(Error::invalid("address", format!("{addr:#x} is not the start of a registered region"))),
        })
    }

    /// Allocates and registers `length` bytes of shared memory (page
    /// aligned, pre-faulted); returns (region id, address).
    fn alloc(&self, py: Python<'_>, length: usize) -> PyResult<(u32, u64)> {
        self.with_open(py, |open| {
            let region = open.engine.alloc_region(length, RegionInfo::raw())?;
            let found = (region.id().raw(), region.as_ptr() as u64);
            open.allocated.insert(found.0, region);
            Ok(found)
        })
    }

    /// Turns a local address range into (region id, offset).
    fn locate(&self, py: Python<'_>, addr: u64, length: u64) -> PyResult<(u32, u64)> {
        self.with_open(py, |open| open.engine.locate(addr, length).map(|(id, offset)| (id.raw(), offset)))
    }

    /// Opens a peer (`host:port`, or a name with etcd metadata) with a
    /// transport ("shm", "tcp", "rdma"; None: the engine's order); returns
    /// the transport chosen. Later calls naming the segment use it.
    #[pyo3(signature = (name, transport=None, timeout=5.0))]
    fn open_segment(&self, py: Python<'_>, name: String, transport: Option<&str>, timeout: f64) -> PyResult<String> {
        let (kind, timeout) = (self::transport(transport)?, seconds(timeout)?);
        self.with_open(py, |open| {
            let segment = open.engine.open_segment_with(&name, kind, timeout)?;
            open.transports.insert(name, kind);
            Ok(segment.transport().name().to_string())
        })
    }

    /// The peer's regions as (region id, address, length), in its order.
    #[pyo3(signature = (name, timeout=5.0))]
    fn segment_regions(&self, py: Python<'_>, name: String, timeout: f64) -> PyResult<Vec<(u32, u64, u64)>> {
        let timeout = seconds(timeout)?;
        self.with_open(py, |open| {
            let segment = open.segment(&name, timeout)?;
            Ok(segment.regions().iter().map(|r| (r.id.raw(), r.addr, r.len)).collect())
        })
    }

    /// Moves blocks given as (local region, local offset, remote region,
    /// remote offset, length) and waits; returns the bytes moved.
    #[pyo3(signature = (name, op, descs, timeout=30.0))]
    fn transfer(
        &self,
        py: Python<'_>,
        name: String,
        op: &str,
        descs: Vec<(u32, u64, u32, u64, u64)>,
        timeout: f64,
    ) -> PyResult<u64> {
        let (write, timeout) = (op_is_write(op)?, seconds(timeout)?);
        let descs: Vec<BlockDesc> = descs
            .into_iter()
            .map(|(lr, lo, rr, ro, len)| BlockDesc::new(RegionId::from_raw(lr), lo, RegionId::from_raw(rr), ro, len))
            .collect();
        self.with_open(py, |open| {
            let segment = open.segment(&name, timeout)?;
            open.run(&segment, write, &descs, timeout)
        })
    }

    /// Moves blocks named by local and remote addresses (Mooncake's
    /// convention) and waits; returns the bytes moved.
    #[pyo3(signature = (name, op, locals, remotes, lengths, timeout=30.0))]
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
    ) -> PyResult<u64> {
        let (write, timeout) = (op_is_write(op)?, seconds(timeout)?);
        self.with_open(py, |open| {
            let (segment, descs) = open.descs_from_addrs(&name, &locals.0, &remotes.0, &lengths.0, timeout)?;
            open.run(&segment, write, &descs, timeout)
        })
    }

    /// Submits blocks named by addresses without waiting; returns the
    /// batch id for `poll` and `wait`.
    #[pyo3(signature = (name, op, locals, remotes, lengths, timeout=30.0))]
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
    ) -> PyResult<u64> {
        let (write, timeout) = (op_is_write(op)?, seconds(timeout)?);
        self.with_open(py, |open| {
            let (segment, descs) = open.descs_from_addrs(&name, &locals.0, &remotes.0, &lengths.0, timeout)?;
            open.submit(&segment, write, &descs, timeout).map(|id| id.raw())
        })
    }

    /// Waits up to `timeout` for a batch; returns its bytes, raises its
    /// error, or raises `TimeoutError` (the batch keeps running).
    #[pyo3(signature = (batch, timeout=30.0))]
    fn wait(&self, py: Python<'_>, batch: u64, timeout: f64) -> PyResult<u64> {
        let timeout = seconds(timeout)?;
        self.with_open(py, |open| finish(open.submitter.wait(crate::BatchId::from_raw(batch), timeout)?))
    }

    /// A batch's bytes if it has ended well, None while it runs; raises
    /// its error if it failed.
    fn poll(&self, py: Python<'_>, batch: u64) -> PyResult<Option<u64>> {
        self.with_open(py, |open| match open.submitter.wait(crate::BatchId::from_raw(batch), Duration::ZERO) {
            Err(Error::Timeout { .. }) => Ok(None),
            Err(error) => Err(error),
            Ok(outcome) => finish(outcome).map(Some),
        })
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
    fn set_kv_layout(&self, py: Python<'_>, attention: &str, dims: Vec<u64>, region: u32, offset: u64) -> PyResult<()> {
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
    /// set, pushes that layer only. Returns the bytes moved.
    #[pyo3(signature = (name, op, src_ids, dst_ids, layer=None, timeout=30.0))]
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
    ) -> PyResult<u64> {
        let timeout = seconds(timeout)?;
        let push = match op {
            "push" => true,
            "pull" if layer.is_none() => false,
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
            let id = match (push, layer) {
                (true, Some(layer)) => sub.push_layer(&segment, &mine, &theirs, layer, &src_ids, &dst_ids)?,
                (true, None) => sub.push_blocks(&segment, &mine, &theirs, &src_ids, &dst_ids)?,
                (false, _) => sub.pull_blocks(&segment, &mine, &theirs, &src_ids, &dst_ids)?,
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
                open.run(&segment, write, &descs, timeout)?;
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
        // engine (joining its lanes), all without the GIL.
        py.allow_threads(|| drop(self.lock().take()));
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

/// Checks whether two ranks can exchange KV blocks: returns
/// ("homogeneous" | "heterogeneous" | "invalid_local" | "invalid_remote",
/// reason). Ranks are (dp_size, tp_size, dp_rank, tp_rank).
#[pyfunction]
#[pyo3(name = "check_pd_topo")]
fn py_check_pd_topo(
    local: (u32, u32, u32, u32),
    remote: (u32, u32, u32, u32),
    mode: &str,
    attention: &str,
) -> PyResult<(&'static str, String)> {
    let rank = |(dp_size, tp_size, dp_rank, tp_rank)| Rank { dp_size, tp_size, dp_rank, tp_rank };
    let mode = match mode {
        "push" => Mode::Push,
        "pull" => Mode::Pull,
        other => return Err(PyValueError::new_err(format!("mode must be \"push\" or \"pull\", got {other:?}"))),
    };
    let attention = match attention {
        "mha" => Attention::Mha,
        "mla" => Attention::Mla,
        other => return Err(PyValueError::new_err(format!("attention must be \"mha\" or \"mla\", got {other:?}"))),
    };
    Ok(match check_pd_topo(rank(local), rank(remote), mode, attention) {
        TopoCheck::Homogeneous => ("homogeneous", String::new()),
        TopoCheck::Heterogeneous => ("heterogeneous", String::new()),
        TopoCheck::InvalidLocal(reason) => ("invalid_local", reason),
        TopoCheck::InvalidRemote(reason) => ("invalid_remote", reason),
    })
}

/// Which transports a Python engine can use. RDMA is not among them: the
/// module does not hand the engine a verbs provider (see the README).
#[pyfunction]
fn transports() -> Vec<&'static str> {
    vec!["shm", "cma", "tcp"]
}

/// Sends kvring's log events to `forward(level, target, message)` (None:
/// nowhere), `level` a name (`"WARN"`). A thread of its own calls it: who
/// logs (an engine's threads, a lane on a failure) never waits for the GIL.
#[pyfunction]
#[pyo3(signature = (forward=None))]
fn set_log_callback(py: Python<'_>, forward: Option<PyObject>) -> PyResult<()> {
    static FORWARDER: Mutex<Option<std::thread::JoinHandle<()>>> = Mutex::new(None);
    let (sink, thread) = match forward {
        Some(forward) => {
            let (sink, thread) = on_own_thread(move |level: Level, target, text| {
                Python::with_gil(|py| forward.call1(py, (level.as_str(), target, text)).map_err(|e| e.print(py))).ok();
            })?;
            (Some(sink), Some(thread))
        }
        None => (None, None),
    };
    set_sink(sink, "kvring=debug").map_err(PyRuntimeError::new_err)?;
    // The last forwarder ends with its sink: wait for it, so that none is
    // left to take the GIL while the interpreter finalizes (the package
    // calls this with None at exit).
    let last = std::mem::replace(&mut *FORWARDER.lock().unwrap_or_else(|p| p.into_inner()), thread);
    let _ = py.allow_threads(|| last.map(std::thread::JoinHandle::join));
    Ok(())
}

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_function(wrap_pyfunction!(set_error_classes, m)?)?;
    m.add_function(wrap_pyfunction!(py_check_pd_topo, m)?)?;
    m.add_function(wrap_pyfunction!(transports, m)?)?;
    m.add_function(wrap_pyfunction!(set_log_callback, m)?)?;
    Ok(())
}

//! GPU memory from Python: DLPack capsules read without torch (the
//! protocol's C structs, as `dlpack.h` lays them out), where a region
//! lives as Python names it (`"host"`, `"gpu:N"`), and — for tests only —
//! device memory on the simulated GPU that speaks both
//! `__cuda_array_interface__` and DLPack, as a CUDA tensor does.

use super::raise;
use crate::gpu::{Copy, DevicePtr, Gpu, SimGpu};
use crate::{Error, MemoryKind};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::ffi::{c_void, CStr};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// DLPack's device types kvring takes.
const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const KDL_CUDA_HOST: i32 = 3;
const KDL_CUDA_MANAGED: i32 = 13;
/// Most dimensions a tensor may claim (a bound on what is read).
const MAX_DIMS: i32 = 64;
/// The name of an unconsumed DLPack capsule.
const DLTENSOR: &CStr = c"dltensor";

/// `DLDevice`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// `DLDataType`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor`.
#[repr(C)]
#[derive(Debug)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// `DLManagedTensor` (DLPack before 1.0: what `__dlpack__()` returns
/// unless asked for a versioned capsule).
#[repr(C)]
#[derive(Debug)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// Where `tensor`'s bytes are: (first byte, length), checked to be one
/// dense, row-major range of at least one byte.
fn dense_range(tensor: &DlTensor) -> Result<(u64, u64), String> {
    if !(0..=MAX_DIMS).contains(&tensor.ndim) || (tensor.ndim > 0 && tensor.shape.is_null()) {
        return Err(format!("a tensor of {} dimensions with no shape", tensor.ndim));
    }
    let DlDataType { bits, lanes, .. } = tensor.dtype;
    if bits == 0 || bits % 8 != 0 || lanes == 0 {
        return Err(format!("elements of {bits} bits x {lanes} lanes are not whole bytes"));
    }
    let ndim = tensor.ndim as usize;
    // SAFETY: DLPack's contract: `shape` holds `ndim` entries, and
    // `strides` is null or holds `ndim` entries, for as long as the
    // capsule lives (our caller holds it).
    let shape = unsafe { slice(tensor.shape, ndim) };
    // SAFETY: as above.
    let strides = (!tensor.strides.is_null()).then(|| unsafe { slice(tensor.strides, ndim) });
    if shape.iter().any(|&d| d < 0) {
        return Err(format!("a negative dimension in shape {shape:?}"));
    }
    let elements = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64)).ok_or("its size overflows")?;
    let item = u64::from(bits / 8) * u64::from(lanes);
    let bytes = elements.checked_mul(item).ok_or("its size overflows")?;
    if bytes == 0 {
        return Err("an empty tensor cannot be registered".into());
    }
    if let Some(strides) = strides {
        let mut expected = 1i64;
        for (&dim, &stride) in shape.iter().zip(strides).rev() {
            if dim != 1 && stride != expected {
                return Err(format!(
                    "not contiguous (shape {shape:?}, strides {strides:?} in elements): kvring moves contiguous \
                     memory only; pass a contiguous tensor (.contiguous()) or its parts"
                ));
            }
            expected = expected.saturating_mul(dim);
        }
    }
    if tensor.data.is_null() {
        return Err("its data pointer is null".into());
    }
    let start = (tensor.data as u64).checked_add(tensor.byte_offset).ok_or("its byte offset overflows")?;
    Ok((start, bytes))
}

/// `len` entries at `ptr` (none when `len` is 0).
///
/// # Safety
///
/// `ptr` is valid for `len` reads of `i64` while the slice is used.
unsafe fn slice<'a>(ptr: *const i64, len: usize) -> &'a [i64] {
    match len {
        0 => &[],
        // SAFETY: per this function's contract.
        _ => unsafe { std::slice::from_raw_parts(ptr, len) },
    }
}

/// Reads a DLPack capsule (`obj.__dlpack__()`) without consuming it:
/// returns (address, bytes, location: "host" or "gpu:N"). The capsule
/// keeps its owner's deleter (it runs when the capsule is freed); the
/// caller keeps the tensor itself alive while the memory is registered.
#[pyfunction]
pub(super) fn dlpack_info(capsule: &Bound<'_, PyAny>) -> PyResult<(u64, u64, String)> {
    let object = capsule.as_ptr();
    // SAFETY: a live object (we hold a reference); the call only checks
    // its type and name.
    if unsafe { pyo3::ffi::PyCapsule_IsValid(object, DLTENSOR.as_ptr()) } != 1 {
        // SAFETY: as above; a non-capsule sets an error, cleared below.
        let name = unsafe { pyo3::ffi::PyCapsule_GetName(object) };
        let name = match name.is_null() {
            // SAFETY: a capsule's name is a NUL-terminated string it owns.
            false => unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned(),
            true => {
                // SAFETY: clears the error PyCapsule_GetName set.
                unsafe { pyo3::ffi::PyErr_Clear() };
                String::new()
            }
        };
        let why = match name.as_str() {
            "used_dltensor" => "a DLPack capsule already consumed (call __dlpack__ again)".to_string(),
            "dltensor_versioned" => "a versioned DLPack capsule: kvring reads the unversioned one".to_string(),
            "" => format!("{} is not a DLPack capsule", capsule.get_type().name()?),
            other => format!("a capsule named {other:?}, not \"dltensor\""),
        };
        return Err(raise(Error::invalid("memory", why)));
    }
    // SAFETY: a valid capsule of that name (checked above); its pointer is
    // a DLManagedTensor by the DLPack protocol, live while the capsule is.
    let managed = unsafe { pyo3::ffi::PyCapsule_GetPointer(object, DLTENSOR.as_ptr()) } as *const DlManagedTensor;
    if managed.is_null() {
        return Err(PyErr::fetch(capsule.py()));
    }
    // SAFETY: as above.
    let tensor = unsafe { &(*managed).dl_tensor };
    let (addr, bytes) = dense_range(tensor).map_err(|why| raise(Error::invalid("memory", why)))?;
    let DlDevice { device_type, device_id } = tensor.device;
    let memory = dlpack_location(device_type, device_id).map_err(raise)?;
    Ok((addr, bytes, location_name(memory)))
}

/// Where DLPack's device puts a region: host memory (CPU, pinned and
/// managed memory), or GPU n; anything else is refused, saying which
/// device type it was.
fn dlpack_location(device_type: i32, device_id: i32) -> crate::Result<MemoryKind> {
    match device_type {
        KDL_CPU | KDL_CUDA_HOST | KDL_CUDA_MANAGED => Ok(MemoryKind::Host),
        KDL_CUDA => u32::try_from(device_id)
            .map(MemoryKind::Gpu)
            .map_err(|_| Error::invalid("memory", format!("a CUDA tensor on device {device_id}"))),
        other => Err(Error::invalid(
            "memory",
            format!("a DLPack tensor on device type {other}: kvring takes CPU (1), CUDA (2), pinned (3) and managed (13) memory"),
        )),
    }
}

/// Where a region lives, as Python names it.
pub(super) fn location_name(memory: MemoryKind) -> String {
    match memory {
        MemoryKind::Host => "host".into(),
        MemoryKind::Gpu(n) => format!("gpu:{n}"),
    }
}

/// What a location string asks for: `None` to classify the address with
/// the GPU provider (`"auto"`, `"*"`, or no location), else host memory or
/// a GPU. `"gpu"`/`"cuda"` without a number: the GPU holding it.
pub(super) enum Wanted {
    Classify { device_only: bool },
    Memory(MemoryKind),
}

/// Parses a location: `auto`, `*`, `host`, `cpu[:N]`, `gpu[:N]`, `cuda[:N]`.
pub(super) fn wanted(location: Option<&str>) -> crate::Result<Wanted> {
    let Some(text) = location.map(str::trim).filter(|t| !t.is_empty() && *t != "*" && *t != "auto") else {
        return Ok(Wanted::Classify { device_only: false });
    };
    let (kind, number) = text.split_once(':').map_or((text, None), |(k, n)| (k, Some(n)));
    let refused = || {
        Error::invalid(
            "location",
            format!("{text:?} is not auto, host, cpu[:N], gpu[:N] or cuda[:N] (N a GPU's number)"),
        )
    };
    match (kind, number) {
        ("host" | "cpu", _) => Ok(Wanted::Memory(MemoryKind::Host)),
        ("gpu" | "cuda", None) => Ok(Wanted::Classify { device_only: true }),
        ("gpu" | "cuda", Some(n)) => n.parse().map(|n| Wanted::Memory(MemoryKind::Gpu(n))).map_err(|_| refused()),
        _ => Err(refused()),
    }
}

/// An allocation on the simulated GPU, freed with its last holder.
struct SimAllocation {
    gpu: Arc<SimGpu>,
    ptr: DevicePtr,
    len: u64,
    device: u32,
}

impl Drop for SimAllocation {
    fn drop(&mut self) {
        // SAFETY: the last holder (buffer views, DLPack exports) is gone;
        // kvring.Engine keeps a registered buffer until it is unregistered,
        // and the engine refuses to unregister a region a batch uses.
        let _ = unsafe { self.gpu.free(self.ptr) };
    }
}

/// For tests: memory of the simulated GPU (no host thread can touch it),
/// exposing `__cuda_array_interface__` and DLPack as a CUDA tensor does,
/// with blocking `write` and `read` through the simulated copy engine.
#[pyclass(module = "kvring._native", name = "SimDeviceBuffer")]
pub struct SimDeviceBuffer {
    alloc: Arc<SimAllocation>,
    /// Shape and strides, in bytes (elements are bytes).
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
}

impl std::fmt::Debug for SimDeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimDeviceBuffer").field("ptr", &self.alloc.ptr).field("shape", &self.shape).finish()
    }
}

impl SimDeviceBuffer {
    /// `len` bytes on `device` of `gpu`.
    pub(super) fn allocate(gpu: Arc<SimGpu>, device: u32, len: u64) -> crate::Result<Self> {
        let ptr = gpu.alloc(device, len)?;
        let alloc = Arc::new(SimAllocation { gpu, ptr, len, device });
        Ok(Self { alloc, shape: vec![len as i64], strides: None })
    }

    /// Runs one copy on a stream of its own and waits for it (bounded).
    ///
    /// # Safety
    ///
    /// The host side of `copy` stays valid until this returns.
    unsafe fn copy_blocking(&self, copy: Copy) -> crate::Result<()> {
        let gpu = &self.alloc.gpu;
        let stream = gpu.create_stream(self.alloc.device)?;
        let event = gpu.create_event(self.alloc.device)?;
        // SAFETY: forwarded from our caller; the wait below ends the copy.
        let queued = unsafe { gpu.copy_one(stream, copy) }.and_then(|()| gpu.record(stream, event));
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut done = queued.map(|()| false);
        while let Ok(false) = done {
            done = gpu.query(event);
            if Instant::now() > deadline {
                done = Err(Error::Timeout { what: "the GPU copy's event", waited: Duration::from_secs(10) });
            }
            std::thread::yield_now();
        }
        let _ = gpu.destroy_event(event);
        let _ = gpu.destroy_stream(stream);
        done.map(drop)
    }

    fn check(&self, offset: u64, len: u64) -> crate::Result<u64> {
        offset.checked_add(len).filter(|&end| end <= self.alloc.len).map(|_| self.alloc.ptr.0 + offset).ok_or_else(
            || Error::invalid("range", format!("{offset}+{len} past the buffer's {} bytes", self.alloc.len)),
        )
    }
}

#[pymethods]
impl SimDeviceBuffer {
    /// The device address.
    #[getter]
    fn ptr(&self) -> u64 {
        self.alloc.ptr.0
    }

    /// Bytes in the allocation.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.alloc.len
    }

    /// The simulated GPU it lives on.
    #[getter]
    fn device(&self) -> u32 {
        self.alloc.device
    }

    /// The CUDA array interface (version 3): bytes, this view's shape and
    /// strides.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let interface = PyDict::new(py);
        interface.set_item("shape", PyTuple::new(py, &self.shape)?)?;
        interface.set_item("typestr", "|u1")?;
        interface.set_item("data", (self.alloc.ptr.0, false))?;
        interface.set_item("version", 3)?;
        match &self.strides {
            Some(strides) => interface.set_item("strides", PyTuple::new(py, strides)?)?,
            None => interface.set_item("strides", py.None())?,
        }
        Ok(interface)
    }

    /// DLPack's device: (kDLCUDA, the GPU).
    fn __dlpack_device__(&self) -> (i32, i32) {
        (KDL_CUDA, self.alloc.device as i32)
    }

    /// An unversioned DLPack capsule of this view (uint8 elements); the
    /// allocation lives until the capsule's deleter runs.
    #[pyo3(signature = (stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<PyObject>,
        max_version: Option<PyObject>,
        dl_device: Option<PyObject>,
        copy: Option<PyObject>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = (stream, max_version, dl_device, copy); // one stream, no copies: nothing to do
        export(py, self)
    }

    /// A view of the same memory with another shape and, optionally,
    /// strides in bytes (to make non-contiguous objects for tests).
    #[pyo3(signature = (shape, strides=None))]
    fn view(&self, shape: Vec<i64>, strides: Option<Vec<i64>>) -> PyResult<Self> {
        let bad = |why: &str| raise(Error::invalid("view", why.to_string()));
        if shape.iter().any(|&d| d <= 0) || strides.as_ref().is_some_and(|s| s.len() != shape.len()) {
            return Err(bad("positive dimensions, and one stride per dimension"));
        }
        let strides_or_dense = strides.clone().unwrap_or_else(|| {
            let mut dense = vec![1i64; shape.len()];
            for i in (0..shape.len().saturating_sub(1)).rev() {
                dense[i] = dense[i + 1].saturating_mul(shape[i + 1]);
            }
            dense
        });
        let last: i64 = shape.iter().zip(&strides_or_dense).map(|(&d, &s)| (d - 1).saturating_mul(s)).sum();
        if strides_or_dense.iter().any(|&s| s < 0) || last >= self.alloc.len as i64 {
            return Err(bad("the view reaches past the allocation"));
        }
        Ok(Self { alloc: self.alloc.clone(), shape, strides })
    }

    /// Copies `data` to `offset` through the simulated copy engine.
    fn write(&self, py: Python<'_>, offset: u64, data: Vec<u8>) -> PyResult<()> {
        let dst = self.check(offset, data.len() as u64).map_err(raise)?;
        let copy = Copy { src: data.as_ptr() as u64, dst, len: data.len() as u64 };
        // SAFETY: `data` lives until this returns, after the copy.
        py.allow_threads(|| unsafe { self.copy_blocking(copy) }).map_err(raise)
    }

    /// Copies `length` bytes at `offset` out through the copy engine.
    fn read<'py>(&self, py: Python<'py>, offset: u64, length: u64) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let src = self.check(offset, length).map_err(raise)?;
        let mut out = vec![0u8; length as usize];
        let copy = Copy { src, dst: out.as_mut_ptr() as u64, len: length };
        // SAFETY: `out` lives until this returns, after the copy.
        py.allow_threads(|| unsafe { self.copy_blocking(copy) }).map_err(raise)?;
        Ok(pyo3::types::PyBytes::new(py, &out))
    }
}

/// What a capsule of ours owns: the managed tensor DLPack sees (first, so
/// its address is the tensor's), its shape and strides, and the memory.
#[repr(C)]
struct Exported {
    managed: DlManagedTensor,
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
    _alloc: Arc<SimAllocation>,
}

/// The deleter DLPack calls (the consumer, or our capsule's destructor).
///
/// # Safety
///
/// `tensor` came from [`export`] and is deleted once.
unsafe extern "C" fn delete_exported(tensor: *mut DlManagedTensor) {
    // SAFETY: `tensor` is the first field of a boxed `Exported` (repr(C)),
    // given up by `export` and deleted once (our contract).
    drop(unsafe { Box::from_raw(tensor.cast::<Exported>()) });
}

/// The capsule's destructor: an unconsumed capsule deletes its tensor; a
/// consumed one ("used_dltensor") belongs to its consumer.
///
/// # Safety
///
/// Called by Python, once, with a capsule [`export`] made.
unsafe extern "C" fn destroy_capsule(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by Python with the capsule being freed.
    if unsafe { pyo3::ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) } == 1 {
        // SAFETY: a valid "dltensor" capsule holds our managed tensor.
        let tensor = unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr()) }.cast::<DlManagedTensor>();
        // SAFETY: not consumed, so nobody else deletes it.
        unsafe { delete_exported(tensor) };
    }
}

/// A "dltensor" capsule of `buffer`'s view.
fn export<'py>(py: Python<'py>, buffer: &SimDeviceBuffer) -> PyResult<Bound<'py, PyAny>> {
    let mut exported = Box::new(Exported {
        managed: DlManagedTensor {
            dl_tensor: DlTensor {
                data: buffer.alloc.ptr.0 as *mut c_void,
                device: DlDevice { device_type: KDL_CUDA, device_id: buffer.alloc.device as i32 },
                ndim: buffer.shape.len() as i32,
                dtype: DlDataType { code: 1, bits: 8, lanes: 1 }, // kDLUInt, 8 bits
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_exported),
        },
        shape: buffer.shape.clone(),
        strides: buffer.strides.clone(),
        _alloc: buffer.alloc.clone(),
    });
    // The vectors' buffers do not move when the box does.
    exported.managed.dl_tensor.shape = exported.shape.as_mut_ptr();
    exported.managed.dl_tensor.strides = exported.strides.as_mut().map_or(std::ptr::null_mut(), |s| s.as_mut_ptr());
    let tensor = Box::into_raw(exported).cast::<c_void>();
    // SAFETY: `tensor` is a live DLManagedTensor; the name is static; the
    // destructor deletes it unless a consumer took it.
    let capsule = unsafe { pyo3::ffi::PyCapsule_New(tensor, DLTENSOR.as_ptr(), Some(destroy_capsule)) };
    if capsule.is_null() {
        // SAFETY: no capsule owns it: delete it here, once.
        unsafe { delete_exported(tensor.cast()) };
    }
    // SAFETY: a new reference, or null with an error set.
    unsafe { Bound::from_owned_ptr_or_err(py, capsule) }
}

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

//!
//! `engine.rs` is the `Engine` class, `arrivals.rs` arrival tags (grant,
//! wait, tagged layer pushes), `open.rs` what an open engine holds,
//! `metrics.rs` the engine's counters as Prometheus text,
//! `gpu.rs` GPU memory from Python (DLPack, locations, the simulated
//! device buffer for tests), `prepared.rs` descriptor lists located once and
//! transfers built from them (NIXL's), `u64s.rs` the fast reading of int lists (and of NIXL's
//! descriptor rows).

mod arrivals;
mod engine;
mod fence;
mod gpu;
mod lent;
mod metrics;
mod open;
mod prepared;
mod u64s;

use crate::kv::{check_pd_topo, Attention, Mode, Rank, TopoCheck};
use crate::log::sink::{on_own_thread, set_sink};
use crate::{Error, TransportKind};
use engine::PyEngine;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyType};
use std::sync::Mutex;
use std::time::Duration;
use tracing::Level;

/// Error code name (`"OUT_OF_BOUNDS"`, …) → exception class, set once by
/// the Python package at import.
static ERROR_CLASSES: GILOnceCell<Py<PyDict>> = GILOnceCell::new();

/// Raises `error` as the class registered for its code (or RuntimeError
/// before any are registered).
pub(super) fn raise(error: Error) -> PyErr {
    raise_code(error.code().as_str_name(), error.to_string())
}

pub(super) fn raise_code(code: &str, message: String) -> PyErr {
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

pub(super) fn seconds(timeout: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(timeout)
        .map_err(|_| PyValueError::new_err(format!("timeout must be a non-negative number of seconds, got {timeout}")))
}

pub(super) fn transport(name: Option<&str>) -> PyResult<Option<TransportKind>> {
    name.filter(|n| !n.is_empty()).map(TransportKind::parse).transpose().map_err(raise)
}

pub(super) fn op_is_write(op: &str) -> PyResult<bool> {
    match op {
        "write" => Ok(true),
        "read" => Ok(false),
        other => Err(PyValueError::new_err(format!("op must be \"write\" or \"read\", got {other:?}"))),
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

/// Which transports a Python engine can use (cuda_ipc needs a GPU
/// provider at run time: the CUDA driver, or `gpu="sim"`; rdma needs
/// libibverbs and a device with an active port at run time: asking for it
/// where there is none is an error naming why).
#[pyfunction]
fn transports() -> Vec<&'static str> {
    vec!["shm", "cma", "tcp", "cuda_ipc", "rdma"]
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
    m.add_class::<gpu::SimDeviceBuffer>()?;
    m.add_class::<prepared::Prepared>()?;
    m.add_class::<prepared::Xfer>()?;
    m.add_function(wrap_pyfunction!(prepared::prepare, m)?)?;
    m.add_function(wrap_pyfunction!(prepared::make_xfer, m)?)?;
    m.add_function(wrap_pyfunction!(prepared::post, m)?)?;
    m.add_function(wrap_pyfunction!(prepared::rust_loop_xfer, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::dlpack_info, m)?)?;
    m.add_function(wrap_pyfunction!(u64s::pack_desc_rows, m)?)?;
    m.add_function(wrap_pyfunction!(arrivals::arrival_tag, m)?)?;
    m.add_function(wrap_pyfunction!(fence::fence, m)?)?;
    m.add_function(wrap_pyfunction!(fence::fence_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(fence::write_granted, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::metrics_text, m)?)?;
    m.add_function(wrap_pyfunction!(arrivals::grant_arrival, m)?)?;
    m.add_function(wrap_pyfunction!(arrivals::landed, m)?)?;
    m.add_function(wrap_pyfunction!(arrivals::wait_landed, m)?)?;
    m.add_function(wrap_pyfunction!(arrivals::forget_arrival, m)?)?;
    m.add_function(wrap_pyfunction!(arrivals::push_layer_tagged, m)?)?;
    m.add_function(wrap_pyfunction!(arrivals::push_layer_heads_tagged, m)?)?;
    m.add_function(wrap_pyfunction!(arrivals::push_targets, m)?)?;
    m.add_function(wrap_pyfunction!(set_error_classes, m)?)?;
    m.add_function(wrap_pyfunction!(py_check_pd_topo, m)?)?;
    m.add_function(wrap_pyfunction!(transports, m)?)?;
    m.add_function(wrap_pyfunction!(set_log_callback, m)?)?;
    Ok(())
}

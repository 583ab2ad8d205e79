//! The engine's counters from Python: the Prometheus text `/metrics` would
//! answer (`Engine::metrics_text`), without serving the endpoint. A module
//! function taking the engine (as `fence.rs`), so `engine.rs` stays one
//! class.

use super::engine::PyEngine;
use pyo3::prelude::*;

/// `Engine::metrics_text`: the Prometheus text of this engine's counters
/// now (bytes and batches by transport, errors, latencies, the segment
/// cache, `kvring_memory_info_served_total`, ...).
#[pyfunction]
pub fn metrics_text(py: Python<'_>, engine: &PyEngine) -> PyResult<String> {
    engine.with_open(py, |open| Ok(open.engine.metrics_text()))
}

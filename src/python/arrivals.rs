//! Arrival tags from Python: a decode engine grants a request's layer its
//! blocks (`grant_arrival`, optionally for one proven sender) and waits for
//! them to land (`wait_landed`, with a deadline); a prefill engine pushes a
//! layer tagged for that request (`push_layer_tagged`). Module functions
//! taking the engine (as `prepared.rs`), so `engine.rs` stays one class.
//!
//! Waits run with the GIL released and without the engine's lock: a
//! thread waiting for a layer never stops another thread of the process
//! from using the engine (pushing, reading notifications).

use super::engine::PyEngine;
use super::open::finish;
use super::seconds;
use crate::{Engine, RegionId};
use pyo3::prelude::*;

/// The engine, cloned out of its lock (an `Arc`): for waits that must not
/// hold the lock.
fn engine(py: Python<'_>, engine: &PyEngine) -> PyResult<Engine> {
    engine.with_open(py, |open| Ok(open.engine.clone()))
}

/// `kv::arrival_tag(slot, layer)`: the tag of request slot `slot`'s
/// `layer` (`slot << 12 | layer`; slot 1 ..= 2^20 - 1, layer < 4096).
#[pyfunction]
pub fn arrival_tag(slot: u32, layer: u32) -> PyResult<u32> {
    crate::kv::arrival_tag(slot, layer).map_err(super::raise)
}

/// `Engine::grant_arrival` (`sender` None) or `grant_arrival_from`:
/// `ranges` are `(region, offset, len)` of this engine's regions.
#[pyfunction]
#[pyo3(signature = (engine, tag, ranges, sender=None))]
pub fn grant_arrival(
    py: Python<'_>,
    engine: &PyEngine,
    tag: u32,
    ranges: Vec<(u32, u64, u64)>,
    sender: Option<String>,
) -> PyResult<()> {
    let ranges: Vec<_> = ranges.into_iter().map(|(r, offset, len)| (RegionId::from_raw(r), offset, len)).collect();
    engine.with_open(py, |open| match &sender {
        Some(sender) => open.engine.grant_arrival_from(sender, tag, &ranges),
        None => open.engine.grant_arrival(tag, &ranges),
    })
}

/// Bytes landed under `tag` (under `sender`'s grant of it, with `sender`).
#[pyfunction]
#[pyo3(signature = (engine, tag, sender=None))]
pub fn landed(py: Python<'_>, engine: &PyEngine, tag: u32, sender: Option<String>) -> PyResult<u64> {
    let engine = self::engine(py, engine)?;
    Ok(match &sender {
        Some(sender) => engine.landed_from(sender, tag),
        None => engine.landed(tag),
    })
}

/// Waits until `bytes` have landed under `tag` (under `sender`'s grant,
/// with `sender`), bounded by `timeout` seconds: `TimeoutError` past it.
#[pyfunction]
#[pyo3(signature = (engine, tag, bytes, timeout, sender=None))]
pub fn wait_landed(
    py: Python<'_>,
    engine: &PyEngine,
    tag: u32,
    bytes: u64,
    timeout: f64,
    sender: Option<String>,
) -> PyResult<()> {
    let timeout = seconds(timeout)?;
    let engine = self::engine(py, engine)?;
    py.allow_threads(|| match &sender {
        Some(sender) => engine.wait_landed_from(sender, tag, bytes, timeout),
        None => engine.wait_landed(tag, bytes, timeout),
    })
    .map_err(super::raise)
}

/// Forgets `tag` (only `sender`'s grant of it, with `sender`); returns
/// the bytes it had counted.
#[pyfunction]
#[pyo3(signature = (engine, tag, sender=None))]
pub fn forget_arrival(py: Python<'_>, engine: &PyEngine, tag: u32, sender: Option<String>) -> PyResult<u64> {
    let engine = self::engine(py, engine)?;
    Ok(match &sender {
        Some(sender) => engine.forget_arrival_from(sender, tag),
        None => engine.forget_arrival(tag),
    })
}

/// `Submitter::push_layer_tagged` to the peer `name` between the two KV
/// layouts, then waits up to `timeout` seconds; returns the bytes moved.
#[pyfunction]
#[pyo3(signature = (engine, name, layer, slot, src_ids, dst_ids, timeout))]
#[allow(clippy::too_many_arguments)] // a Python signature
pub fn push_layer_tagged(
    py: Python<'_>,
    engine: &PyEngine,
    name: String,
    layer: u32,
    slot: u32,
    src_ids: Vec<u64>,
    dst_ids: Vec<u64>,
    timeout: f64,
) -> PyResult<u64> {
    let timeout = seconds(timeout)?;
    engine.with_open(py, |open| {
        let segment = open.segment(&name, timeout)?;
        let mine = open.engine.kv_layout().ok_or_else(|| crate::Error::invalid("kv layout", "set_kv_layout first"))?;
        let theirs = segment.kv_layout(timeout)?;
        let sub = &mut open.submitter;
        let id = sub.push_layer_tagged(&segment, &mine, &theirs, layer, slot, &src_ids, &dst_ids)?;
        finish(sub.wait(id, timeout)?)
    })
}

//! Arrival tags from Python: a decode engine grants a request's layer its
//! blocks (`grant_arrival`, optionally for one proven sender) and waits for
//! them to land (`wait_landed`, with a deadline); a prefill engine pushes a
//! layer tagged for that request (`push_layer_tagged`; head-sliced between
//! tensor-parallel sizes, `push_layer_heads_tagged`, routed by
//! `push_targets`). Module functions
//! taking the engine (as `prepared.rs`), so `engine.rs` stays one class.
//!
//! Waits run with the GIL released and without the engine's lock: a
//! thread waiting for a layer never stops another thread of the process
//! from using the engine (pushing, reading notifications).

use super::engine::PyEngine;
use super::open::finish;
use super::seconds;
use crate::kv::{HeadGeometry, HeadOrder, HeadRoute};
use crate::RegionId;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The engine, lent out of its lock: for waits that must not hold the
/// lock (`close` waits for it to come back).
fn engine<'a>(py: Python<'_>, engine: &'a PyEngine) -> PyResult<super::lent::LentEngine<'a>> {
    engine.lend(py)
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
    ranges: Vec<(u64, u64, u64)>,
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

/// `Submitter::push_layer_heads_tagged`: [`push_layer_tagged`] between
/// tensor-parallel ranks of different sizes of an MHA/GQA cache. `heads`
/// is `(kv_heads, head_bytes, tokens_per_block, order)` with `order`
/// `"hnd"` (a block is `[heads, tokens, head]`) or `"nhd"` (`[tokens,
/// heads, head]`); `src` and `dst` are `(tp_size, tp_rank)` of this rank
/// and of the peer. Moves the heads both hold (0 bytes, nothing sent,
/// when this rank writes none of the peer's heads); returns the bytes.
#[pyfunction]
// Takes `push_layer_tagged`'s parameters and more, on purpose: a Python function each (docs/DUPLICATES.md).
#[pyo3(signature = (engine, name, layer, slot, src_ids, dst_ids, heads, src, dst, timeout))]
#[allow(clippy::too_many_arguments)] // a Python signature
pub fn push_layer_heads_tagged(
    py: Python<'_>,
    engine: &PyEngine,
    name: String,
    layer: u32,
    slot: u32,
    src_ids: Vec<u64>,
    dst_ids: Vec<u64>,
    heads: (u64, u64, u64, String),
    src: (u32, u32),
    dst: (u32, u32),
    timeout: f64,
) -> PyResult<u64> {
    let timeout = seconds(timeout)?;
    let route = head_route(heads, src, dst)?;
    engine.with_open(py, |open| {
        let segment = open.segment(&name, timeout)?;
        let mine = open.engine.kv_layout().ok_or_else(|| crate::Error::invalid("kv layout", "set_kv_layout first"))?;
        let theirs = segment.kv_layout(timeout)?;
        let sub = &mut open.submitter;
        match sub.push_layer_heads_tagged(&segment, &mine, &theirs, &route, layer, slot, &src_ids, &dst_ids)? {
            Some(id) => finish(sub.wait(id, timeout)?),
            None => Ok(0),
        }
    })
}

fn head_route(heads: (u64, u64, u64, String), src: (u32, u32), dst: (u32, u32)) -> PyResult<HeadRoute> {
    let (kv_heads, head_bytes, tokens_per_block, order) = heads;
    let order = match order.as_str() {
        "hnd" => HeadOrder::Hnd,
        "nhd" => HeadOrder::Nhd,
        other => return Err(PyValueError::new_err(format!("order must be \"hnd\" or \"nhd\", got {other:?}"))),
    };
    HeadRoute::new(HeadGeometry { kv_heads, head_bytes, tokens_per_block, order }, src, dst).map_err(super::raise)
}

/// The decode ranks (of `dst_tp`) that prefill rank `src_rank` (of
/// `src_tp`) pushes to: with `kv_heads` (an MHA/GQA cache split by head)
/// those sharing a head with it (`kv::head_push_targets`), without (MLA:
/// every rank holds the whole cache) `kv::push_targets`.
#[pyfunction]
#[pyo3(signature = (src_rank, src_tp, dst_tp, kv_heads=None))]
pub fn push_targets(src_rank: u32, src_tp: u32, dst_tp: u32, kv_heads: Option<u64>) -> PyResult<Vec<u32>> {
    match kv_heads {
        Some(kv_heads) => crate::kv::head_push_targets(src_rank, src_tp, dst_tp, kv_heads).map_err(super::raise),
        None if src_tp == 0 || src_rank >= src_tp => {
            Err(PyValueError::new_err(format!("src_rank {src_rank} is not a rank of tp {src_tp}")))
        }
        // The answer has a rank per destination: its size is checked
        // before it is made (hostile review 3, finding 2).
        None if src_tp.max(dst_tp) > crate::kv::MAX_TP => Err(PyValueError::new_err(format!(
            "tp {} exceeds the most kvring routes over, {}",
            src_tp.max(dst_tp),
            crate::kv::MAX_TP
        ))),
        None => Ok(crate::kv::push_targets(src_rank, src_tp, dst_tp).collect()),
    }
}

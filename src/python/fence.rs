//! Fenced destinations from Python: a decode engine fences a request's
//! blocks (`fence`) and hands the grant to its sender with the block
//! table; the prefill engine names it on its push (`write_granted`). Module
//! functions taking the engine (as `arrivals.rs`), so `engine.rs` stays one
//! class.

use super::engine::PyEngine;
use super::seconds;
use crate::{BlockDesc, RegionId};
use pyo3::prelude::*;

/// `Engine::fence`: the new grant for `length` bytes at `offset` of this
/// engine's `region`.
#[pyfunction]
pub fn fence(py: Python<'_>, engine: &PyEngine, region: u64, offset: u64, length: u64) -> PyResult<u32> {
    engine.with_open(py, |open| open.engine.fence(RegionId::from_raw(region), offset, length))
}

/// `Engine::fence_blocks`: one grant for blocks `ids` of this engine's KV
/// layout, in every layer and kind.
#[pyfunction]
pub fn fence_blocks(py: Python<'_>, engine: &PyEngine, ids: Vec<u64>) -> PyResult<u32> {
    engine.with_open(py, |open| open.engine.fence_blocks(&ids))
}

/// A push of `descs` (local region, local offset, remote region, remote
/// offset, length) to `name` naming `grant`, waited for up to `timeout`
/// seconds; returns the bytes moved (`FencedError` under a stale grant).
#[pyfunction]
#[pyo3(signature = (engine, name, descs, grant, timeout=30.0))]
pub fn write_granted(
    py: Python<'_>,
    engine: &PyEngine,
    name: String,
    descs: Vec<(u64, u64, u64, u64, u64)>,
    grant: u32,
    timeout: f64,
) -> PyResult<u64> {
    let timeout = seconds(timeout)?;
    let descs: Vec<BlockDesc> = descs
        .into_iter()
        .map(|(lr, lo, rr, ro, len)| BlockDesc::new(RegionId::from_raw(lr), lo, RegionId::from_raw(rr), ro, len))
        .collect();
    engine.with_open(py, |open| {
        let segment = open.segment(&name, timeout)?;
        let batch = crate::Batch::write(&segment).descs(&descs).deadline(timeout).grant(grant);
        let id = open.submitter.submit(&batch)?;
        super::open::finish(open.submitter.wait(id, timeout + std::time::Duration::from_secs(1))?)
    })
}

//! Descriptor lists located once and transfers built from them: NIXL's
//! prepped dlists and transfer handles (`kvring.nixl`), so that posting a
//! transfer again is one submission of descriptors already checked.

use super::engine::PyEngine;
use super::open::finish;
use super::u64s::U64s;
use super::{op_is_write, raise, seconds};
use crate::{BlockDesc, Error, MemoryKind, RegionId};
use pyo3::prelude::*;

/// Where a list's memory must live: `None` anywhere, else host or GPU.
fn memory_matches(want_gpu: Option<bool>, memory: MemoryKind) -> bool {
    match (want_gpu, memory) {
        (None, _) => true,
        (Some(gpu), MemoryKind::Host) => !gpu,
        (Some(gpu), MemoryKind::Gpu(_)) => gpu,
    }
}

fn memory_refused(index: usize, addr: u64, memory: MemoryKind, want_gpu: bool) -> Error {
    let (said, is) = if want_gpu { ("VRAM", "host memory") } else { ("DRAM", "GPU memory") };
    Error::invalid("descriptor", format!("descriptor {index} ({addr:#x}, {memory:?}) is {is}, listed as {said}"))
}

/// A descriptor list located once: this engine's memory (no segment) or
/// a peer's, as (region, offset, length) per descriptor.
#[pyclass(module = "kvring._native", frozen)]
#[derive(Debug)]
pub struct Prepared {
    segment: Option<String>,
    epoch: u64,
    items: Vec<(RegionId, u64, u64)>,
}

#[pymethods]
impl Prepared {
    fn __len__(&self) -> usize {
        self.items.len()
    }

    /// The peer's segment name, or None for this engine's memory.
    #[getter]
    fn segment(&self) -> Option<&str> {
        self.segment.as_deref()
    }
}

/// A transfer built from two prepared lists: its descriptors, fixed.
#[pyclass(module = "kvring._native", frozen)]
#[derive(Debug)]
pub struct Xfer {
    segment: String,
    epoch: u64,
    write: bool,
    descs: Vec<BlockDesc>,
    bytes: u64,
}

#[pymethods]
impl Xfer {
    fn __len__(&self) -> usize {
        self.descs.len()
    }

    /// The bytes one posting moves.
    #[getter]
    fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The peer's segment name.
    #[getter]
    fn segment(&self) -> &str {
        &self.segment
    }
}

/// Locates `addrs`/`lengths` once: in this engine's registered memory
/// (`segment` None) or in a peer's; `want_gpu` (None: either) checks where
/// each descriptor's memory lives.
#[pyfunction]
#[pyo3(signature = (engine, segment, addrs, lengths, want_gpu=None, timeout=5.0))]
pub fn prepare(
    py: Python<'_>,
    engine: &PyEngine,
    segment: Option<String>,
    addrs: U64s,
    lengths: U64s,
    want_gpu: Option<bool>,
    timeout: f64,
) -> PyResult<Prepared> {
    let timeout = seconds(timeout)?;
    let (addrs, lengths) = (addrs.0, lengths.0);
    if addrs.len() != lengths.len() {
        return Err(raise(Error::invalid(
            "descriptors",
            format!("{} addresses, {} lengths", addrs.len(), lengths.len()),
        )));
    }
    engine.with_open(py, |open| {
        let mut items = Vec::with_capacity(addrs.len());
        let Some(name) = segment.as_deref() else {
            for (index, (&addr, &len)) in addrs.iter().zip(&lengths).enumerate() {
                let (id, offset) = open.engine.locate(addr, len)?;
                let memory = open.engine.region_info(id)?.2.memory;
                if !memory_matches(want_gpu, memory) {
                    return Err(memory_refused(index, addr, memory, want_gpu == Some(true)));
                }
                items.push((id, offset, len));
            }
            return Ok(Prepared { segment: None, epoch: open.engine.epoch(), items });
        };
        let mut peer = open.segment(name, timeout)?;
        let mut reopened = false;
        for (index, (&addr, &len)) in addrs.iter().zip(&lengths).enumerate() {
            let (id, offset) = match peer.locate(addr, len) {
                Ok(found) => found,
                // The peer may have registered it since the handle was made.
                Err(_) if !reopened => {
                    reopened = true;
                    open.engine.close_segment(&peer);
                    peer = open.segment(name, timeout)?;
                    peer.locate(addr, len)?
                }
                Err(error) => return Err(error),
            };
            let memory = peer.regions().iter().find(|r| r.id == id).map_or(MemoryKind::Host, |r| r.memory);
            if !memory_matches(want_gpu, memory) {
                return Err(memory_refused(index, addr, memory, want_gpu == Some(true)));
            }
            items.push((id, offset, len));
        }
        Ok(Prepared { segment: Some(name.to_string()), epoch: peer.epoch(), items })
    })
}

/// Builds a transfer of `op` ("write" or "read") from descriptors
/// `local_indices` of `local` (this engine's) paired with `remote_indices`
/// of `remote` (a peer's): equal counts, indices in range, and equal
/// lengths pair by pair.
#[pyfunction]
pub fn make_xfer(
    op: &str,
    local: &Prepared,
    local_indices: U64s,
    remote: &Prepared,
    remote_indices: U64s,
) -> PyResult<Xfer> {
    let write = op_is_write(op)?;
    let bad = |reason: String| raise(Error::invalid("transfer", reason));
    let Some(segment) = remote.segment.clone() else {
        return Err(bad("the remote list was prepared for this engine's own memory, not a peer's".into()));
    };
    if local.segment.is_some() {
        return Err(bad(format!("the local list was prepared for peer {:?}", local.segment)));
    }
    let (li, ri) = (local_indices.0, remote_indices.0);
    if li.len() != ri.len() {
        return Err(bad(format!("{} local indices, {} remote indices", li.len(), ri.len())));
    }
    let mut descs = Vec::with_capacity(li.len());
    let mut bytes = 0u64;
    for (n, (&l, &r)) in li.iter().zip(&ri).enumerate() {
        let pick = |list: &Prepared, index: u64, side: &str| {
            usize::try_from(index)
                .ok()
                .and_then(|i| list.items.get(i).copied())
                .ok_or_else(|| bad(format!("{side} index {index} (pair {n}) is past its list of {}", list.items.len())))
        };
        let (lr, lo, llen) = pick(local, l, "local")?;
        let (rr, ro, rlen) = pick(remote, r, "remote")?;
        if llen != rlen {
            return Err(bad(format!("pair {n}: local descriptor {l} is {llen} bytes, remote descriptor {r} {rlen}")));
        }
        bytes = bytes.checked_add(llen).ok_or_else(|| bad("total length overflows".into()))?;
        descs.push(BlockDesc::new(lr, lo, rr, ro, llen));
    }
    Ok(Xfer { segment, epoch: remote.epoch, write, descs, bytes })
}

/// Submits a transfer's descriptors as one batch (deadline `timeout`);
/// returns the batch id for `poll` and `wait`. A peer that restarted since
/// its list was prepared is `PeerRestarted`: its region ids are not the
/// ones prepared.
#[pyfunction]
#[pyo3(signature = (engine, xfer, timeout=30.0))]
pub fn post(py: Python<'_>, engine: &PyEngine, xfer: &Xfer, timeout: f64) -> PyResult<u64> {
    let timeout = seconds(timeout)?;
    engine.with_open(py, |open| {
        let segment = open.segment(&xfer.segment, timeout)?;
        check_epoch(&segment, xfer)?;
        open.submit(&segment, xfer.write, &xfer.descs, timeout, None).map(|id| id.raw())
    })
}

fn check_epoch(segment: &crate::Segment, xfer: &Xfer) -> crate::Result<()> {
    if segment.epoch() == xfer.epoch {
        return Ok(());
    }
    Err(Error::PeerRestarted {
        segment: xfer.segment.clone(),
        detail: "it restarted after these descriptors were prepared: load its metadata and prepare them again".into(),
    })
}

/// The Python-overhead bench's Rust side: posts `xfer` and waits for it,
/// `iterations` times, all in Rust with the GIL released; returns each
/// iteration's nanoseconds.
#[pyfunction]
#[pyo3(signature = (engine, xfer, iterations, timeout=30.0))]
pub fn rust_loop_xfer(
    py: Python<'_>,
    engine: &PyEngine,
    xfer: &Xfer,
    iterations: usize,
    timeout: f64,
) -> PyResult<Vec<u64>> {
    let timeout = seconds(timeout)?;
    engine.with_open(py, |open| {
        let mut times = Vec::with_capacity(iterations);
        for _ in 0..iterations {
            let start = std::time::Instant::now();
            let segment = open.segment(&xfer.segment, timeout)?;
            check_epoch(&segment, xfer)?;
            let id = open.submit(&segment, xfer.write, &xfer.descs, timeout, None)?;
            finish(open.submitter.wait(id, timeout + std::time::Duration::from_secs(1))?)?;
            times.push(start.elapsed().as_nanos() as u64);
        }
        Ok(times)
    })
}

//! `kvring bench --memory gpu`: blocks between GPU memory (or GPU and host
//! memory) of two processes on this host, over cuda_ipc.
//!
//! Each case is measured beside two baselines in the same run, on the same
//! provider and the same kinds of memory, in this process: one copy call
//! per block (what engines do today), and one large copy of the same bytes
//! (the roof). On the simulated provider the copy engine is a memcpy that
//! starts after a fixed delay, so the ratios measure kvring's own work
//! around it; the targets are for a real GPU.

use crate::args::{format_memory, format_size, GpuArgs, GpuChoice};
use crate::drive::{latency, median, move_bytes, seed_case, verify, Progress, Route, Sweep};
use kvring::gpu::{Copy, CopyMethod, CopyMethodCounts, CudaGpu, DevicePtr, Gpu, SimGpu};
use kvring::{MemoryKind, Opcode, Region, RegionId, Segment, Submitter};
use std::sync::Arc;
use std::time::Instant;

/// Rounds each case alternates with its baselines.
const ROUNDS: usize = 5;
/// GPUs the simulated provider offers.
const SIM_GPUS: u32 = 8;

/// The provider `--gpu` names: the simulated one, or the CUDA driver (a
/// clear error where there is none).
pub fn provider(args: &GpuArgs) -> Result<Arc<dyn Gpu>, String> {
    match args.gpu {
        GpuChoice::Sim => Ok(Arc::new(SimGpu::new(SIM_GPUS, args.sim_copy_delay))),
        GpuChoice::Cuda => CudaGpu::load()
            .map(|gpu| Arc::new(gpu) as Arc<dyn Gpu>)
            .map_err(|e| format!("{e}; `--gpu sim` runs the same bench on kvring's simulated GPU")),
    }
}

/// How the provider is described in the header.
pub fn describe(args: &GpuArgs, gpu: &dyn Gpu) -> String {
    let method = gpu.copy_method().name();
    match args.gpu {
        GpuChoice::Sim => {
            format!("simulated GPU (copy-engine delay {:?}, {method} copies)", args.sim_copy_delay)
        }
        GpuChoice::Cuda => {
            let name = gpu.devices().ok().and_then(|d| d.first().map(|d| d.name.clone())).unwrap_or_default();
            format!("{name} ({method} copies)")
        }
    }
}

/// What the GPU cases need besides the engine and its segment.
pub struct Plan<'a> {
    /// The cases to run.
    pub sweep: Sweep<'a>,
    /// (this side, the target's).
    pub memory: (MemoryKind, MemoryKind),
    pub gpu: Arc<dyn Gpu>,
    /// The initiator, whose lanes count the chunks by method.
    pub engine: &'a kvring::Engine,
}

impl Plan<'_> {
    /// Chunks of GPU copies the initiator's lanes issued so far, by method.
    fn chunks(&self) -> CopyMethodCounts {
        CopyMethodCounts::sum(self.engine.lane_stats().iter().map(|s| s.gpu_chunks))
    }
}

/// One case's figures.
pub struct GpuCase {
    pub op: Opcode,
    pub block: u64,
    pub gbps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// One copy call per block, same run.
    pub per_call_gbps: f64,
    /// One large copy of the same bytes, same run.
    pub one_copy_gbps: f64,
    /// The timed rounds' chunks, by the method each took.
    pub chunks: CopyMethodCounts,
    pub verified: bool,
}

/// Runs every (op, block size) case.
pub fn run(
    sub: &mut Submitter,
    segment: &Segment,
    local: &Region,
    remote: RegionId,
    region_bytes: u64,
    plan: &Plan,
) -> Result<Vec<GpuCase>, String> {
    let mut buffers = Baseline::new(plan, region_bytes)?;
    let mut cases = Vec::new();
    for &op in plan.sweep.ops {
        for &block in plan.sweep.block_sizes {
            let case = run_case(sub, segment, local, remote, region_bytes, (op, block), plan, &mut buffers)?;
            print(&case, plan);
            cases.push(case);
        }
    }
    Ok(cases)
}

#[allow(clippy::too_many_arguments)]
fn run_case(
    sub: &mut Submitter,
    segment: &Segment,
    local: &Region,
    remote: RegionId,
    region_bytes: u64,
    (op, block): (Opcode, u64),
    plan: &Plan,
    baseline: &mut Baseline,
) -> Result<GpuCase, String> {
    let seed = (block << 8) ^ op as u64;
    let label = format!("{} {}", op.name(), format_size(block));
    let route = Route { segment, local, remote };
    seed_case(sub, route, region_bytes, (op, block, seed), (plan.sweep.shape, plan.sweep.json), &label)?;
    let per_round = plan.sweep.total.div_ceil(ROUNDS as u64).div_ceil(block) * block;
    let covered = ((region_bytes / block) * block).min(per_round);
    let mut progress = Progress::new(label, per_round * ROUNDS as u64, plan.sweep.json);
    let (mut ours, mut per_call, mut one_copy) = (Vec::new(), Vec::new(), Vec::new());
    let mut chunks = CopyMethodCounts::default();
    for _ in 0..ROUNDS {
        per_call.push(baseline.per_call(op, block, per_round)?);
        one_copy.push(baseline.one_copy(op, per_round)?);
        let (started, before) = (Instant::now(), plan.chunks());
        let moved = move_bytes(sub, route, op, region_bytes, block, per_round, plan.sweep.shape, &mut progress)?;
        ours.push(moved as f64 / started.elapsed().as_secs_f64() / 1e9);
        chunks = CopyMethodCounts::sum([chunks, plan.chunks().since(&before)]);
    }
    drop(progress);
    let (p50_us, p99_us) = latency(sub, route, op, block, plan.sweep.latency_samples)?;
    let verified = verify(route, covered)?;
    Ok(GpuCase {
        op,
        block,
        gbps: median(&mut ours),
        p50_us,
        p99_us,
        per_call_gbps: median(&mut per_call),
        one_copy_gbps: median(&mut one_copy),
        chunks,
        verified,
    })
}

fn print(case: &GpuCase, plan: &Plan) {
    let (per_call, roof) = (case.gbps / case.per_call_gbps, case.gbps / case.one_copy_gbps);
    if plan.sweep.json {
        let line = serde_json::json!({
            "op": case.op.name(),
            "transport": "cuda_ipc",
            "memory": [format_memory(plan.memory.0), format_memory(plan.memory.1)],
            "provider": plan.gpu.provider(),
            "copy_method": plan.gpu.copy_method().name(),
            "block_bytes": case.block,
            "batch": plan.sweep.shape.batch,
            "gbps": case.gbps,
            "p50_us": case.p50_us,
            "p99_us": case.p99_us,
            "baseline_per_call_gbps": case.per_call_gbps,
            "ratio_per_call": per_call,
            "baseline_one_copy_gbps": case.one_copy_gbps,
            "ratio_one_copy": roof,
            "chunks": {
                "batched": case.chunks.batched,
                "kernel": case.chunks.kernel,
                "per_copy": case.chunks.per_copy,
            },
            "verified": case.verified,
        });
        println!("{line}");
    } else {
        println!(
            "{:5} {:>6}  {:8.2} GB/s  p50 {:7.2} us  p99 {:7.2} us  per-call {:8.2} GB/s ({:6.1}x it)  one-copy {:8.2} GB/s ({:5.1}% of it)  chunks {}  {}",
            case.op.name(),
            format_size(case.block),
            case.gbps,
            case.p50_us,
            case.p99_us,
            case.per_call_gbps,
            per_call,
            case.one_copy_gbps,
            roof * 100.0,
            chunk_text(&case.chunks),
            if case.verified { "verified" } else { "VERIFY FAILED" }
        );
    }
}

/// The chunks' methods, as `batched 40` or `kernel 30 + per-copy 2`.
fn chunk_text(chunks: &CopyMethodCounts) -> String {
    let parts: Vec<String> = CopyMethod::ALL
        .iter()
        .filter(|&&m| chunks.get(m) > 0)
        .map(|&m| format!("{} {}", m.name(), chunks.get(m)))
        .collect();
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(" + ")
    }
}

/// The baselines' memory, in this process: one buffer of each end's kind
/// (host memory pinned, as kvring's shm regions are), a stream and an
/// event on the GPU that carries the copies.
struct Baseline {
    gpu: Arc<dyn Gpu>,
    ours: Buffer,
    theirs: Buffer,
    len: u64,
    stream: kvring::gpu::Stream,
    event: kvring::gpu::Event,
}

/// One baseline buffer, freed (or unpinned) when dropped.
struct Buffer {
    gpu: Arc<dyn Gpu>,
    addr: u64,
    /// Host memory kept mapped while pinned.
    host: Option<memmap2::MmapMut>,
}

impl Buffer {
    fn new(gpu: &Arc<dyn Gpu>, memory: MemoryKind, len: u64) -> Result<Self, String> {
        match memory {
            MemoryKind::Gpu(ordinal) => {
                let ptr = gpu.alloc(ordinal, len).map_err(|e| format!("baseline memory: {e}"))?;
                Ok(Self { gpu: gpu.clone(), addr: ptr.0, host: None })
            }
            MemoryKind::Host => {
                let map = crate::scratch::shm_buffer(len as usize)?;
                let addr = map.as_ptr() as u64;
                // SAFETY: the mapping lives in `host` until this buffer
                // drops, which unpins it first.
                unsafe { gpu.host_register(addr, len) }.map_err(|e| format!("pinning baseline memory: {e}"))?;
                Ok(Self { gpu: gpu.clone(), addr, host: Some(map) })
            }
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.host.is_some() {
            let _ = self.gpu.host_unregister(self.addr);
        } else {
            // SAFETY: every copy on this buffer was waited for.
            let _ = unsafe { self.gpu.free(DevicePtr(self.addr)) };
        }
    }
}

impl Baseline {
    fn new(plan: &Plan, len: u64) -> Result<Self, String> {
        let gpu = plan.gpu.clone();
        let device = match plan.memory {
            (MemoryKind::Gpu(n), _) | (MemoryKind::Host, MemoryKind::Gpu(n)) => n,
            (MemoryKind::Host, MemoryKind::Host) => 0,
        };
        let ours = Buffer::new(&gpu, plan.memory.0, len)?;
        let theirs = Buffer::new(&gpu, plan.memory.1, len)?;
        let stream = gpu.create_stream(device).map_err(|e| e.to_string())?;
        let event = gpu.create_event(device).map_err(|e| e.to_string())?;
        Ok(Self { gpu, ours, theirs, len, stream, event })
    }

    /// Source and destination of a copy for `op` (WRITE: ours to theirs).
    fn ends(&self, op: Opcode) -> (u64, u64) {
        match op {
            Opcode::Write => (self.ours.addr, self.theirs.addr),
            Opcode::Read => (self.theirs.addr, self.ours.addr),
        }
    }

    /// `total` bytes in `block`-sized copies, one plain copy call each
    /// (`cuMemcpyAsync`, as engines issue them per block); GB/s.
    fn per_call(&mut self, op: Opcode, block: u64, total: u64) -> Result<f64, String> {
        let (src, dst) = self.ends(op);
        let blocks_in = (self.len / block).max(1);
        let started = Instant::now();
        for i in 0..total / block {
            let offset = (i % blocks_in) * block;
            let copy = Copy { src: src + offset, dst: dst + offset, len: block };
            // SAFETY: both buffers live as long as `self`, and `wait` runs
            // before this returns.
            unsafe { self.gpu.copy_one(self.stream, copy) }.map_err(|e| e.to_string())?;
        }
        self.wait()?;
        Ok(total as f64 / started.elapsed().as_secs_f64() / 1e9)
    }

    /// `total` bytes in copies as large as the buffers; GB/s.
    fn one_copy(&mut self, op: Opcode, total: u64) -> Result<f64, String> {
        let (src, dst) = self.ends(op);
        let started = Instant::now();
        let mut left = total;
        while left > 0 {
            let len = left.min(self.len);
            // SAFETY: as in `per_call`.
            unsafe { self.gpu.copy_one(self.stream, Copy { src, dst, len }) }.map_err(|e| e.to_string())?;
            left -= len;
        }
        self.wait()?;
        Ok(total as f64 / started.elapsed().as_secs_f64() / 1e9)
    }

    /// Records the event and polls it until the stream's copies are done.
    fn wait(&mut self) -> Result<(), String> {
        self.gpu.record(self.stream, self.event).map_err(|e| e.to_string())?;
        let deadline = Instant::now() + crate::drive::WAIT_TIMEOUT;
        while !self.gpu.query(self.event).map_err(|e| e.to_string())? {
            if Instant::now() > deadline {
                return Err("a baseline copy did not finish within 30 s".into());
            }
            std::hint::spin_loop();
        }
        Ok(())
    }
}

impl Drop for Baseline {
    fn drop(&mut self) {
        let _ = self.wait();
        let _ = self.gpu.destroy_event(self.event);
        let _ = self.gpu.destroy_stream(self.stream);
    }
}

/// Report rows for `--report`: the one-copy roof as the baseline.
pub fn report_rows(cases: &[GpuCase]) -> Vec<crate::report::Row> {
    cases
        .iter()
        .map(|c| crate::report::Row {
            transport: "cuda_ipc".into(),
            op: c.op.name().into(),
            block_bytes: c.block,
            gbps: c.gbps,
            p50_us: c.p50_us,
            p99_us: c.p99_us,
            baseline: Some(("one-copy".into(), c.one_copy_gbps)),
        })
        .collect()
}

/// True when either end of `--memory` is a GPU's.
pub fn involves_gpu(memory: Option<(MemoryKind, MemoryKind)>) -> bool {
    memory.is_some_and(|(local, remote)| local != MemoryKind::Host || remote != MemoryKind::Host)
}

/// The serve flags that give the bench's target `memory` on the same provider.
pub fn target_flags(memory: MemoryKind, args: &GpuArgs) -> Vec<String> {
    let gpu = match args.gpu {
        GpuChoice::Sim => "sim",
        GpuChoice::Cuda => "cuda",
    };
    let delay = format!("{}us", args.sim_copy_delay.as_micros());
    vec!["--memory".into(), format_memory(memory), "--gpu".into(), gpu.into(), "--sim-copy-delay".into(), delay]
}

/// The engine-side part: `local`'s region kind for this side.
pub fn local_info(memory: Option<(MemoryKind, MemoryKind)>) -> kvring::RegionInfo {
    let info = kvring::RegionInfo::raw();
    match memory {
        Some((MemoryKind::Gpu(n), _)) => info.on_gpu(n),
        _ => info,
    }
}

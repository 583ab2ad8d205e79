//! Per-lane counters for Prometheus, and their text rendering.
//!
//! Each lane owns one [`LaneMetrics`] and is its only writer, so a counter
//! is bumped with a plain load and store (no locked read-modify-write on
//! the data path); scrapers read them with relaxed loads and sum over
//! lanes only when `/metrics` is asked for. A scrape can see one counter
//! of a batch updated and another not yet: each series is exact on its
//! own, and monotonic.

use crate::gpu::{CopyCounters, CopyMethod, CopyMethodCounts};
use crate::proto::ErrorCode;
use crate::ring::Opcode;
use crate::sync::{AtomicU64, Ordering};
use crate::transport::TransportKind;
use std::fmt::Write as _;
use std::sync::Arc;

/// Ops counted: write, read.
pub const OPS: usize = 2;
/// Transports counted: shm, tcp, null, rdma, cuda_ipc, and "none" (no segment resolved).
pub const TRANSPORTS: usize = 7;
/// Error codes counted (the wire codes 0..CODES).
pub const CODES: usize = 32;
/// Upper bounds of the batch-latency histogram's buckets, in microseconds.
pub const LATENCY_BUCKETS_US: [u64; 14] =
    [5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 50_000, 250_000, 1_000_000];

/// One lane's counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaneStatsSnapshot {
    /// Batch parts executed.
    pub parts: u64,
    /// Descriptors executed (moved or failed).
    pub descs: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Times the lane parked.
    pub parks: u64,
    /// Most batch parts (and notifications) it has had in flight at once.
    pub peak_in_flight: u64,
    /// Chunks of GPU copies it issued, by the method each really took.
    pub gpu_chunks: CopyMethodCounts,
    /// Staging pools (tcp's pinned pages for GPU memory) it allocated and
    /// pinned: once per link or lane, never per transfer.
    pub staging_pools: u64,
    /// Those pools released (their memory unpinned and unmapped).
    pub staging_pools_released: u64,
    /// Staging pages held by chunks now.
    pub staging_pages_out: u64,
    /// Times the lane panicked (0 or 1: a lane that panicked is dead).
    pub panics: u64,
}

/// One lane's counters. Written by that lane only. The totals (parts,
/// descriptors, bytes, parks, peak) are always kept; the series by op,
/// transport and latency only while the engine's metrics are on.
#[derive(Debug)]
pub(crate) struct LaneMetrics {
    parts: AtomicU64,
    descs: AtomicU64,
    total_bytes: AtomicU64,
    parks: AtomicU64,
    peak_in_flight: AtomicU64,
    panics: AtomicU64,
    bytes: [[AtomicU64; TRANSPORTS]; OPS],
    batches: [[AtomicU64; TRANSPORTS]; OPS],
    errors: [AtomicU64; CODES],
    /// Cumulative counts per bucket are computed at render time; these are
    /// per-bucket counts, the last one past every bound.
    latency: [AtomicU64; LATENCY_BUCKETS_US.len() + 1],
    latency_sum_ns: AtomicU64,
    /// SQEs waiting in this lane's rings at its last look.
    sqes_waiting: AtomicU64,
    /// Parts and notifications in flight.
    in_flight: AtomicU64,
    /// GPU chunks by method, bumped by this lane's GPU copiers (always
    /// kept: one store per chunk of up to 256 copies).
    gpu_copies: Arc<CopyCounters>,
    /// Its tcp links' and served connections' staging pools.
    staging: Arc<crate::transport::stage::StageCounters>,
}

impl Default for LaneMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Adds to a counter that only the calling thread writes.
#[inline]
fn bump(counter: &AtomicU64, by: u64) {
    counter.store(counter.load(Ordering::Relaxed).wrapping_add(by), Ordering::Relaxed);
}

fn op_index(op: Opcode) -> usize {
    match op {
        Opcode::Write => 0,
        Opcode::Read => 1,
    }
}

fn transport_index(transport: Option<TransportKind>) -> usize {
    match transport {
        Some(TransportKind::Shm) => 0,
        Some(TransportKind::Tcp) => 1,
        Some(TransportKind::Null) => 2,
        Some(TransportKind::Rdma) => 3,
        Some(TransportKind::CudaIpc) => 4,
        Some(TransportKind::Cma) => 5,
        None => 6,
    }
}

const OP_NAMES: [&str; OPS] = ["write", "read"];
const TRANSPORT_NAMES: [&str; TRANSPORTS] = ["shm", "tcp", "null", "rdma", "cuda_ipc", "cma", "none"];

impl LaneMetrics {
    /// All zero.
    pub fn new() -> Self {
        Self {
            parts: AtomicU64::new(0),
            descs: AtomicU64::new(0),
            total_bytes: AtomicU64::new(0),
            parks: AtomicU64::new(0),
            peak_in_flight: AtomicU64::new(0),
            panics: AtomicU64::new(0),
            bytes: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
            batches: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
            errors: std::array::from_fn(|_| AtomicU64::new(0)),
            latency: std::array::from_fn(|_| AtomicU64::new(0)),
            latency_sum_ns: AtomicU64::new(0),
            sqes_waiting: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            gpu_copies: Arc::default(),
            staging: Arc::default(),
        }
    }

    /// The counters of this lane's staging pools.
    pub fn staging(&self) -> Arc<crate::transport::stage::StageCounters> {
        self.staging.clone()
    }

    /// The counters this lane's GPU copiers bump, one per chunk.
    pub fn gpu_copies(&self) -> Arc<CopyCounters> {
        self.gpu_copies.clone()
    }

    /// A batch part ended: `descs` descriptors executed, `bytes` moved.
    #[inline]
    pub fn part_executed(&self, descs: u64, bytes: u64) {
        bump(&self.parts, 1);
        bump(&self.descs, descs);
        bump(&self.total_bytes, bytes);
    }

    /// The lane parked.
    #[inline]
    pub fn parked(&self) {
        bump(&self.parks, 1);
    }

    /// A new peak of parts and notifications in flight.
    #[inline]
    pub fn peak_in_flight(&self, in_flight: u64) {
        self.peak_in_flight.store(in_flight, Ordering::Relaxed);
    }

    /// The lane panicked (and is dead).
    pub fn panicked(&self) {
        bump(&self.panics, 1);
    }

    /// The totals now.
    pub fn snapshot(&self) -> LaneStatsSnapshot {
        LaneStatsSnapshot {
            parts: load(&self.parts),
            descs: load(&self.descs),
            bytes: load(&self.total_bytes),
            parks: load(&self.parks),
            peak_in_flight: load(&self.peak_in_flight),
            gpu_chunks: self.gpu_copies.snapshot(),
            staging_pools: self.staging.pools_pinned.load(Ordering::Relaxed),
            staging_pools_released: self.staging.pools_released.load(Ordering::Relaxed),
            staging_pages_out: self.staging.pages_out.load(Ordering::Relaxed).max(0) as u64,
            panics: load(&self.panics),
        }
    }

    /// A batch part moved `bytes` (by op and transport).
    #[inline]
    pub fn part(&self, op: Opcode, transport: Option<TransportKind>, bytes: u64) {
        bump(&self.bytes[op_index(op)][transport_index(transport)], bytes);
    }

    /// A batch ended (on the lane that ended its last part): `result` is its
    /// CQE result (0, or a negated wire code), `latency_ns` the time since
    /// that lane took the part.
    #[inline]
    pub fn batch(&self, op: Opcode, transport: Option<TransportKind>, result: i32, latency_ns: u64) {
        bump(&self.batches[op_index(op)][transport_index(transport)], 1);
        if result != 0 {
            let code = (result.unsigned_abs() as usize).min(CODES - 1);
            bump(&self.errors[code], 1);
        }
        let us = latency_ns / 1_000;
        let bucket = LATENCY_BUCKETS_US.iter().position(|&bound| us <= bound).unwrap_or(LATENCY_BUCKETS_US.len());
        bump(&self.latency[bucket], 1);
        bump(&self.latency_sum_ns, latency_ns);
    }

    /// The lane's current ring backlog and work in flight.
    #[inline]
    pub fn occupancy(&self, sqes_waiting: u64, in_flight: u64) {
        if self.sqes_waiting.load(Ordering::Relaxed) != sqes_waiting {
            self.sqes_waiting.store(sqes_waiting, Ordering::Relaxed);
        }
        if self.in_flight.load(Ordering::Relaxed) != in_flight {
            self.in_flight.store(in_flight, Ordering::Relaxed);
        }
    }
}

/// Engine-wide values rendered beside the lanes' counters.
#[derive(Debug, Clone, Default)]
pub struct EngineSeries {
    /// Segment-cache hits, misses, evictions, stale evictions.
    pub cache: [u64; 4],
    /// Requests made to the metadata server by opens.
    pub metadata_calls: u64,
    /// Memory-info requests answered (peers fetching the KV layout).
    pub memory_info_served: u64,
}

/// Renders the Prometheus text exposition (version 0.0.4) of `lanes`,
/// summed, and of `engine`.
pub fn render(lanes: &[&LaneMetrics], engine: &EngineSeries) -> String {
    let mut out = String::with_capacity(8 * 1024);
    let sum = |f: &dyn Fn(&LaneMetrics) -> u64| -> u64 { lanes.iter().map(|l| f(l)).sum() };

    header(&mut out, "kvring_bytes_total", "counter", "Bytes moved, by op and transport.");
    header(&mut out, "kvring_batches_total", "counter", "Batches ended, by op and transport.");
    let bytes: fn(&LaneMetrics, usize, usize) -> u64 = |l, o, t| load(&l.bytes[o][t]);
    let batches: fn(&LaneMetrics, usize, usize) -> u64 = |l, o, t| load(&l.batches[o][t]);
    for (name, pick) in [("kvring_bytes_total", bytes), ("kvring_batches_total", batches)] {
        for (o, op) in OP_NAMES.iter().enumerate() {
            for (t, transport) in TRANSPORT_NAMES.iter().enumerate() {
                let value = sum(&|l| pick(l, o, t));
                let _ = writeln!(out, "{name}{{op=\"{op}\",transport=\"{transport}\"}} {value}");
            }
        }
    }
    header(&mut out, "kvring_errors_total", "counter", "Batches that did not end done, by error code.");
    for code in 1..CODES {
        let value = sum(&|l| load(&l.errors[code]));
        if value > 0 {
            let name = ErrorCode::try_from(code as i32).map_or("UNKNOWN", |c| c.as_str_name());
            let _ = writeln!(out, "kvring_errors_total{{code=\"{name}\"}} {value}");
        }
    }
    header(
        &mut out,
        "kvring_batch_latency_seconds",
        "histogram",
        "Time from a lane taking a batch's last part to the batch's end.",
    );
    let mut cumulative = 0;
    for (bucket, bound) in LATENCY_BUCKETS_US.iter().enumerate() {
        cumulative += sum(&|l| load(&l.latency[bucket]));
        let _ = writeln!(out, "kvring_batch_latency_seconds_bucket{{le=\"{}\"}} {cumulative}", *bound as f64 / 1e6);
    }
    cumulative += sum(&|l| load(&l.latency[LATENCY_BUCKETS_US.len()]));
    let _ = writeln!(out, "kvring_batch_latency_seconds_bucket{{le=\"+Inf\"}} {cumulative}");
    let seconds = sum(&|l| load(&l.latency_sum_ns)) as f64 / 1e9;
    let _ = writeln!(out, "kvring_batch_latency_seconds_sum {seconds}");
    let _ = writeln!(out, "kvring_batch_latency_seconds_count {cumulative}");

    header(&mut out, "kvring_gpu_chunks_total", "counter", "Chunks of GPU copies, by the method each took.");
    let chunks = CopyMethodCounts::sum(lanes.iter().map(|l| l.gpu_copies.snapshot()));
    for method in CopyMethod::ALL {
        let _ = writeln!(out, "kvring_gpu_chunks_total{{method=\"{}\"}} {}", method.name(), chunks.get(method));
    }
    header(&mut out, "kvring_ring_sqes_waiting", "gauge", "SQEs waiting in a lane's submission rings.");
    for (lane, metrics) in lanes.iter().enumerate() {
        let _ = writeln!(out, "kvring_ring_sqes_waiting{{lane=\"{lane}\"}} {}", load(&metrics.sqes_waiting));
    }
    header(&mut out, "kvring_lane_in_flight", "gauge", "Batch parts and notifications a lane has in flight.");
    for (lane, metrics) in lanes.iter().enumerate() {
        let _ = writeln!(out, "kvring_lane_in_flight{{lane=\"{lane}\"}} {}", load(&metrics.in_flight));
    }
    header(&mut out, "kvring_lane_panics_total", "counter", "Times a lane panicked (it is then dead).");
    for (lane, metrics) in lanes.iter().enumerate() {
        let _ = writeln!(out, "kvring_lane_panics_total{{lane=\"{lane}\"}} {}", load(&metrics.panics));
    }
    for (index, (name, help)) in [
        ("kvring_segment_cache_hits_total", "Opens answered from the segment cache."),
        ("kvring_segment_cache_misses_total", "Opens that resolved the name."),
        ("kvring_segment_cache_evictions_total", "Handles pushed out of the full cache."),
        ("kvring_segment_cache_stale_evictions_total", "Stale handles (restarted peers) evicted."),
    ]
    .into_iter()
    .enumerate()
    {
        header(&mut out, name, "counter", help);
        let _ = writeln!(out, "{name} {}", engine.cache[index]);
    }
    header(&mut out, "kvring_metadata_calls_total", "counter", "Requests made to the metadata server by opens.");
    let _ = writeln!(out, "kvring_metadata_calls_total {}", engine.metadata_calls);
    header(
        &mut out,
        "kvring_memory_info_served_total",
        "counter",
        "Memory-info requests answered (peers fetching this engine's KV layout).",
    );
    let _ = writeln!(out, "kvring_memory_info_served_total {}", engine.memory_info_served);
    out
}

fn load(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
        text.lines().filter(|l| l.starts_with(name)).collect()
    }

    #[test]
    fn counters_sum_over_lanes_and_render_as_prometheus_text() {
        let (a, b) = (LaneMetrics::new(), LaneMetrics::new());
        a.part(Opcode::Write, Some(TransportKind::Tcp), 4096);
        b.part(Opcode::Write, Some(TransportKind::Tcp), 4096);
        a.batch(Opcode::Write, Some(TransportKind::Tcp), 0, 30_000);
        b.batch(Opcode::Read, Some(TransportKind::Shm), -(ErrorCode::OutOfBounds as i32), 2_000_000_000);
        a.occupancy(3, 1);
        b.panicked();
        a.gpu_copies().count(CopyMethod::Kernel);
        b.gpu_copies().count(CopyMethod::Kernel);
        b.gpu_copies().count(CopyMethod::PerCopy);
        assert_eq!(b.snapshot().gpu_chunks, CopyMethodCounts { batched: 0, kernel: 1, per_copy: 1 });
        let text = render(&[&a, &b], &EngineSeries { cache: [5, 2, 1, 1], metadata_calls: 7, memory_info_served: 3 });
        assert!(text.contains("kvring_bytes_total{op=\"write\",transport=\"tcp\"} 8192"), "{text}");
        assert!(text.contains("kvring_batches_total{op=\"read\",transport=\"shm\"} 1"));
        assert!(text.contains("kvring_errors_total{code=\"OUT_OF_BOUNDS\"} 1"));
        assert!(text.contains("kvring_batch_latency_seconds_bucket{le=\"0.00005\"} 1"), "30 µs ≤ 50 µs");
        assert!(text.contains("kvring_batch_latency_seconds_bucket{le=\"1\"} 1"), "2 s is past every bound");
        assert!(text.contains("kvring_batch_latency_seconds_bucket{le=\"+Inf\"} 2"));
        assert!(text.contains("kvring_batch_latency_seconds_count 2"));
        assert!(text.contains("kvring_ring_sqes_waiting{lane=\"0\"} 3"));
        assert!(text.contains("kvring_segment_cache_stale_evictions_total 1"));
        assert!(text.contains("kvring_metadata_calls_total 7"));
        assert!(text.contains("kvring_memory_info_served_total 3"), "{text}");
        assert!(text.contains("kvring_lane_panics_total{lane=\"0\"} 0"), "{text}");
        assert!(text.contains("kvring_lane_panics_total{lane=\"1\"} 1"), "{text}");
        assert_eq!(b.snapshot().panics, 1);
        assert!(text.contains("kvring_gpu_chunks_total{method=\"kernel\"} 2"), "{text}");
        assert!(text.contains("kvring_gpu_chunks_total{method=\"per-copy\"} 1"), "{text}");
        assert!(text.contains("kvring_gpu_chunks_total{method=\"batched\"} 0"), "{text}");
        // Every series has a TYPE line before it, and every name is kvring_*.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            assert!(line.starts_with("kvring_"), "{line}");
        }
        assert_eq!(series(&text, "kvring_bytes_total{").len(), OPS * TRANSPORTS);
    }
}

//! The shm transport's throughput beside memcpy between the same kind of
//! memory (page-aligned, pre-faulted /dev/shm mappings), in the same run.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvring::{Batch, BlockDesc, Engine, RegionInfo, TransportKind};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

const REGION: usize = 64 << 20;
const BATCH: usize = 64;
const IN_FLIGHT: usize = 4;

fn shm_copy(c: &mut Criterion) {
    let engine = Engine::builder().name("bench-shm").build().expect("engine");
    let src = engine.alloc_region(REGION, RegionInfo::raw()).expect("region");
    let dst = engine.alloc_region(REGION, RegionInfo::raw()).expect("region");
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { src.fill_pattern(1) };
    let segment = engine.open_self(TransportKind::Shm).expect("loopback segment");
    let mut sub = engine.submitter().expect("submitter");
    if let Some(core) = core_affinity::get_core_ids().unwrap_or_default().first() {
        core_affinity::set_for_current(*core);
    }

    let mut group = c.benchmark_group("shm_copy");
    group.measurement_time(Duration::from_secs(3));
    group.sample_size(20);
    for block in [64usize << 10, 1 << 20] {
        let blocks = REGION / block;
        let batches = blocks.div_ceil(BATCH);
        group.throughput(Throughput::Bytes((blocks * block) as u64));
        group.bench_function(BenchmarkId::new("memcpy", block), |b| {
            b.iter(|| {
                for i in 0..blocks {
                    // SAFETY: both regions are REGION bytes and distinct;
                    // i * block + block <= REGION.
                    unsafe { std::ptr::copy(src.as_ptr().add(i * block), dst.as_ptr().add(i * block), block) };
                }
            })
        });
        let all: Vec<Vec<BlockDesc>> = (0..batches)
            .map(|b| {
                (b * BATCH..((b + 1) * BATCH).min(blocks))
                    .map(|i| BlockDesc::new(src.id(), (i * block) as u64, dst.id(), (i * block) as u64, block as u64))
                    .collect()
            })
            .collect();
        group.bench_function(BenchmarkId::new("kvring_write", block), |b| {
            b.iter_custom(|iters| {
                let started = Instant::now();
                for _ in 0..iters {
                    let mut in_flight = VecDeque::new();
                    for descs in &all {
                        if in_flight.len() == IN_FLIGHT {
                            assert!(sub
                                .wait(in_flight.pop_front().unwrap(), Duration::from_secs(10))
                                .unwrap()
                                .is_done());
                        }
                        in_flight.push_back(sub.submit(&Batch::write(&segment).descs(descs)).unwrap());
                    }
                    for id in in_flight {
                        assert!(sub.wait(id, Duration::from_secs(10)).unwrap().is_done());
                    }
                }
                started.elapsed()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, shm_copy);
criterion_main!(benches);

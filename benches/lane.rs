//! Submit-to-completion through a lane with the null transport: what kvring
//! itself costs per descriptor (rings, validation, status, completion).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvring::{Batch, BlockDesc, Engine, RegionInfo, TransportKind};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

const IN_FLIGHT: usize = 8;

fn lane(c: &mut Criterion) {
    let engine = Engine::builder().name("bench-lane").build().expect("engine");
    let region = engine.alloc_region(1 << 20, RegionInfo::raw()).expect("region");
    let segment = engine.open_self(TransportKind::Null).expect("loopback segment");
    let mut sub = engine.submitter().expect("submitter");
    if let Some(core) = core_affinity::get_core_ids().unwrap_or_default().first() {
        core_affinity::set_for_current(*core);
    }

    let mut group = c.benchmark_group("lane_null");
    group.measurement_time(Duration::from_secs(3));
    for batch in [64usize, 4096] {
        let descs: Vec<BlockDesc> = (0..batch as u64)
            .map(|i| BlockDesc::new(region.id(), (i % 256) * 4096, region.id(), (i % 256) * 4096, 4096))
            .collect();
        group.throughput(Throughput::Elements(batch as u64));
        group.bench_function(BenchmarkId::new("descs_per_batch", batch), |b| {
            b.iter_custom(|iters| {
                let mut in_flight = VecDeque::with_capacity(IN_FLIGHT);
                let started = Instant::now();
                let batch = Batch::write(&segment).descs(&descs);
                for _ in 0..iters {
                    loop {
                        if in_flight.len() < IN_FLIGHT {
                            match sub.submit(&batch) {
                                Ok(id) => {
                                    in_flight.push_back(id);
                                    break;
                                }
                                // Back-pressure (the arena holds 16384
                                // descriptors): reap the oldest and retry.
                                Err(kvring::Error::Busy { .. }) => {}
                                Err(e) => panic!("{e}"),
                            }
                        }
                        let id = in_flight.pop_front().expect("busy with nothing in flight");
                        assert!(sub.wait(id, Duration::from_secs(10)).unwrap().is_done());
                    }
                }
                for id in in_flight {
                    assert!(sub.wait(id, Duration::from_secs(10)).unwrap().is_done());
                }
                started.elapsed()
            })
        });
    }
    let one = [BlockDesc::new(region.id(), 0, region.id(), 4096, 4096)];
    group.throughput(Throughput::Elements(1));
    group.bench_function("round_trip_one_desc", |b| {
        b.iter(|| {
            let id = sub.submit(&Batch::write(&segment).descs(&one)).unwrap();
            sub.wait(id, Duration::from_secs(10)).unwrap()
        })
    });
    group.finish();
}

criterion_group!(benches, lane);
criterion_main!(benches);

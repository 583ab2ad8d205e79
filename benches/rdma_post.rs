//! Turning a batch into posted work requests: coalescing, keys, selective
//! signalling, then `post_send` in chains no longer than the send queue and
//! a CQ poll, through the simulated provider with the copy itself skipped.
//! Reported per descriptor (criterion's element throughput), batches of 64
//! and 4096; target ≤ 50 ns per descriptor at 64. Then the whole path:
//! submit through the ring, a lane validates and posts, polls the CQ,
//! completes; two engines on one simulated fabric, copy skipped.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvring::rdma::SimVerbs;
use kvring::rdma::*;
use kvring::testing::rdma::{build, KeyedBlock, Keys, PostConfig};
use std::hint::black_box;

struct Fixed(u32, u32);

impl Keys for Fixed {
    fn lkey(&self, _nic: usize, _region: u64) -> u32 {
        self.0
    }
    fn rkey(&self, _nic: usize, _region: u64) -> u32 {
        self.1
    }
}

const DEPTH: u32 = 1024;

fn rdma_post(c: &mut Criterion) {
    let sim = SimVerbs::new();
    sim.skip_copy(true);
    let len = 64usize << 20;
    let memory = (vec![0u8; len], vec![0u8; len]);
    let mut sides = Vec::new();
    for buffer in [&memory.0, &memory.1] {
        let context = sim.open("sim0").unwrap();
        let pd = sim.alloc_pd(context).unwrap();
        let cq = sim.create_cq(context, DEPTH).unwrap();
        // SAFETY: both buffers outlive the bench.
        let mr = unsafe { sim.reg_mr(pd, buffer.as_ptr() as u64, len as u64, MrAccess::ALL) }.unwrap();
        let caps = QpCaps { max_send_wr: DEPTH, max_inline: 64, port: 1, gid_index: 1, srq: None };
        let (qp, endpoint) = sim.create_qp(pd, cq, caps).unwrap();
        sides.push((cq, mr, qp, endpoint));
    }
    for (me, peer) in [(0, 1), (1, 0)] {
        sim.modify_qp(sides[me].2, QpTransition::Init).unwrap();
        sim.modify_qp(sides[me].2, QpTransition::ReadyToReceive(sides[peer].3)).unwrap();
        sim.modify_qp(sides[me].2, QpTransition::ReadyToSend).unwrap();
    }
    let (cq, local, qp, _) = sides[0];
    let remote = sides[1].1;
    let keys = Fixed(local.lkey, remote.rkey);
    let config = PostConfig::default();
    let mut group = c.benchmark_group("rdma_post_sim");
    for batch in [64u64, 4096] {
        // Every other 4 KiB block, so nothing coalesces: one request each.
        let blocks: Vec<KeyedBlock> = (0..batch)
            .map(|i| KeyedBlock {
                local_addr: local.addr + i * 8192,
                remote_addr: remote.addr + i * 8192,
                len: 4096,
                local_region: 0,
                remote_region: 0,
            })
            .collect();
        let mut out = vec![Vec::with_capacity(batch as usize)];
        let mut wcs = vec![Wc::new(0, WcStatus::Success); DEPTH as usize];
        group.throughput(Throughput::Elements(batch));
        group.bench_function(BenchmarkId::new("build_post_poll", batch), |b| {
            b.iter(|| {
                build(WrOp::Write, black_box(&blocks), &config, &keys, |s| s, &mut out);
                for chain in out[0].chunks(DEPTH as usize) {
                    sim.post_send(qp, chain).expect("room after the last poll");
                    while sim.outstanding(qp).unwrap_or(0) > 0 {
                        sim.poll_cq(cq, &mut wcs).unwrap();
                    }
                }
            })
        });
    }
    group.finish();
}

fn rdma_lane_path(c: &mut Criterion) {
    let sim = std::sync::Arc::new(SimVerbs::new());
    sim.skip_copy(true);
    let engine = |name: &str| kvring::Engine::builder().name(name).rdma(sim.clone()).build().expect("engine");
    let (target, initiator) = (engine("bench-decode"), engine("bench-prefill"));
    let remote = target.alloc_region(32 << 20, kvring::RegionInfo::raw()).expect("region");
    let local = initiator.alloc_region(32 << 20, kvring::RegionInfo::raw()).expect("region");
    let segment = initiator
        .open_segment_with(&target.control_addr().to_string(), Some(kvring::TransportKind::Rdma), WAIT)
        .expect("rdma segment");
    let mut sub = initiator.submitter().expect("submitter");
    let mut group = c.benchmark_group("rdma_lane_path_sim");
    for batch in [64u64, 4096] {
        let descs: Vec<kvring::BlockDesc> = (0..batch)
            .map(|i| kvring::BlockDesc::new(local.id(), (i % 4096) * 8192, remote.id(), (i % 4096) * 8192, 4096))
            .collect();
        group.throughput(Throughput::Elements(batch));
        group.bench_function(BenchmarkId::new("submit_to_completion", batch), |b| {
            b.iter(|| {
                let id = sub.submit(&kvring::Batch::write(&segment).descs(&descs)).expect("submit");
                assert!(sub.wait(id, WAIT).expect("wait").is_done());
            })
        });
    }
    group.finish();
}

const WAIT: std::time::Duration = std::time::Duration::from_secs(10);

criterion_group!(benches, rdma_post, rdma_lane_path);
criterion_main!(benches);

//! Planning a 128k-token DeepSeek-V3-like request: block ids to coalesced
//! descriptors (consecutive ids, and every other block: the worst case).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvring::kv::{plan_blocks, CacheShape, KvLayout};
use kvring::{Opcode, RegionId};
use std::hint::black_box;

fn kv_plan(c: &mut Criterion) {
    let blocks = 128 * 1024 / 64;
    let shape = CacheShape::mla(61, 2 * blocks, 576, 2, 64, 0).expect("shape");
    let prefill = KvLayout::contiguous(shape, RegionId::new(0, 1), 0).expect("layout");
    let decode = KvLayout::contiguous(shape, RegionId::new(1, 1), 0).expect("layout");
    let mut group = c.benchmark_group("kv_plan_deepseek_128k");
    for scattered in [false, true] {
        let src: Vec<u64> = (0..blocks).map(|i| if scattered { 2 * i } else { i }).collect();
        let dst: Vec<u64> = (0..blocks).map(|i| if scattered { 2 * i + 1 } else { blocks + i }).collect();
        let name = if scattered { "every_other_block" } else { "consecutive" };
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| plan_blocks(&prefill, &decode, Opcode::Write, black_box(&src), black_box(&dst)).expect("plan"))
        });
    }
    group.finish();
}

criterion_group!(benches, kv_plan);
criterion_main!(benches);

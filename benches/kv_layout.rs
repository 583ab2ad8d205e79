//! The per-layer cost of a KV push when the peer's layout is looked up per
//! call, as kvring's Python KV calls (`push_layer_tagged`, `push_blocks`)
//! do: 32 layer pushes of a small layout from one engine to another on this
//! host, over tcp with a token, in rounds that alternate (interleaved, in
//! the same run):
//!
//! - `fetched`: each layer asks the peer for its layout over a fresh
//!   control connection (connect, the token's mutual-proof handshake,
//!   memory info), as every call did before the segment handle kept it
//!   (`kvring::testing::kv_layout_uncached`);
//! - `cached`: each layer takes `Segment::kv_layout`, answered from the
//!   handle's copy after its first fetch.
//!
//! Both look the segment up by name per layer (as the Python calls do),
//! then plan, submit and wait for the layer's push (1 block, K and V, 2 KiB
//! each). `cargo bench --bench kv_layout -- --rounds 200` (`-- --test`: a
//! few rounds, the CI smoke run). Prints p50 and p99 of one layer's push,
//! in microseconds, and the ratio of the p50s.

use kvring::kv::{CacheShape, KvLayout};
use kvring::{Engine, RegionInfo, Segment, Submitter, TransportKind};
use std::time::{Duration, Instant};

#[path = "common/rounds.rs"]
mod rounds;

const LAYERS: u32 = 32;
const BLOCKS: u64 = 16;
const WAIT: Duration = Duration::from_secs(30);
const DEFAULT_ROUNDS: usize = 200;
const TOKEN: &[u8] = b"bench-kv-layout-token";

fn percentile(samples: &mut [Duration], p: f64) -> f64 {
    samples.sort();
    let at = ((samples.len() as f64 * p) as usize).min(samples.len() - 1);
    samples[at].as_secs_f64() * 1e6
}

/// An engine with a published cache of `shape` (one head of 64 x 2-byte
/// values, 16 tokens a block: 2 KiB blocks).
fn engine(name: &str, shape: CacheShape) -> (Engine, KvLayout, kvring::Region) {
    let engine = Engine::builder().name(name).token(TOKEN).build().expect("engine");
    let region = engine.alloc_region(shape.bytes().expect("shape") as usize, RegionInfo::raw()).expect("region");
    let layout = KvLayout::contiguous(shape, region.id(), 0).expect("layout");
    engine.set_kv_layout(layout.clone()).expect("publish");
    (engine, layout, region)
}

/// One request's 32 layer pushes, each timed from the name lookup to its
/// end; `fetch` is how the peer's layout is had.
fn request(
    initiator: &Engine,
    name: &str,
    sub: &mut Submitter,
    local: &KvLayout,
    fetch: &dyn Fn(&Segment) -> kvring::Result<KvLayout>,
    out: &mut Vec<Duration>,
) {
    for layer in 0..LAYERS {
        let started = Instant::now();
        let segment = initiator.open_segment_with(name, Some(TransportKind::Tcp), WAIT).expect("open");
        let remote = fetch(&segment).expect("layout");
        let id = sub.push_layer(&segment, local, &remote, layer, &[1], &[2]).expect("push");
        let outcome = sub.wait(id, WAIT).expect("wait");
        assert!(outcome.is_done(), "the push lands: {outcome:?}");
        out.push(started.elapsed());
    }
}

fn main() {
    let rounds = rounds::rounds(2, DEFAULT_ROUNDS);
    let shape = CacheShape::mha(LAYERS, BLOCKS, 1, 64, 2, 16, 1).expect("shape");
    let (target, _, _target_region) = engine("bench-layout-decode", shape);
    let (initiator, local, _region) = engine("bench-layout-prefill", shape);
    let name = target.control_addr().to_string();
    let mut sub = initiator.submitter().expect("submitter");
    let fetched = |segment: &Segment| kvring::testing::kv_layout_uncached(segment, WAIT);
    let cached = |segment: &Segment| segment.kv_layout(WAIT);
    // Warm: the segment open, the cached copy, the lanes' links.
    request(&initiator, &name, &mut sub, &local, &cached, &mut Vec::new());
    request(&initiator, &name, &mut sub, &local, &fetched, &mut Vec::new());

    let (mut before, mut after) = (Vec::new(), Vec::new());
    let served = target.memory_info_served();
    for round in 0..rounds {
        if round % 2 == 0 {
            request(&initiator, &name, &mut sub, &local, &fetched, &mut before);
            request(&initiator, &name, &mut sub, &local, &cached, &mut after);
        } else {
            request(&initiator, &name, &mut sub, &local, &cached, &mut after);
            request(&initiator, &name, &mut sub, &local, &fetched, &mut before);
        }
    }
    let fetches = target.memory_info_served() - served;
    assert_eq!(fetches, rounds as u64 * u64::from(LAYERS), "only the fetched rounds ask the peer");
    let (b50, b99) = (percentile(&mut before, 0.5), percentile(&mut before, 0.99));
    let (a50, a99) = (percentile(&mut after, 0.5), percentile(&mut after, 0.99));
    println!(
        "kv_layout/tcp+token: one layer's push, {rounds} rounds x {LAYERS} layers each: layout fetched per layer p50 {b50:.1} us (p99 {b99:.1}), cached p50 {a50:.1} us (p99 {a99:.1}); fetched/cached {:.2}x; memory-info requests answered {fetches} (fetched rounds only)",
        b50 / a50
    );
}

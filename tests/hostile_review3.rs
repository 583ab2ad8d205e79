//! Hostile review 3: probes of the surface added since e299c98
//! (head-sliced plans, the routes a caller asks for). Each test shows what
//! a caller's or a peer's input must end in: a typed error, never a hang,
//! an allocation sized by a number nobody checked, or a transfer that
//! reports success having moved only part of what it was asked.

use kvring::kv::{head_push_targets, plan_layer_heads, Attention, CacheShape, HeadGeometry, HeadOrder, HeadRoute};
use kvring::kv::{HeadShard, KvLayout};
use kvring::{Error, Opcode, RegionId};

/// Finding 2: a tensor-parallel size is a caller's number (and, through
/// `kvring.push_targets`, a Python caller's). `head_push_targets` walked
/// every destination rank and collected one entry per rank: with
/// `dst_tp = u32::MAX` and as many heads, a 16 GiB vector after minutes of
/// work (shown here at 2^24 ranks, which returned 16 M targets). A tp size
/// no cluster has is refused before any work is sized by it.
#[test]
fn a_tp_size_beyond_any_cluster_is_refused_before_work_is_sized_by_it() {
    let huge = 1u32 << 24;
    let refused = head_push_targets(0, 1, huge, u64::from(huge));
    assert!(matches!(refused, Err(Error::InvalidArgument { .. })), "{:?}", refused.map(|v| v.len()));
    assert!(matches!(HeadShard::of(u64::from(huge), huge, 0), Err(Error::InvalidArgument { .. })));
    let geometry = HeadGeometry { kv_heads: 8, head_bytes: 8, tokens_per_block: 4, order: HeadOrder::Hnd };
    assert!(HeadRoute::new(geometry, (huge, 0), (1, 0)).is_err());
    // The sizes clusters have still route.
    assert_eq!(head_push_targets(0, 1, 8, 8).unwrap(), (0..8).collect::<Vec<_>>());
}

fn shape(index_block_bytes: u64) -> CacheShape {
    CacheShape {
        attention: Attention::Mha,
        layers: 1,
        blocks: 4,
        key_block_bytes: 32,
        value_block_bytes: 32,
        index_block_bytes,
    }
}

/// Finding 3: `plan_layer_heads` paired the two layouts' buffers with
/// `zip` and never compared their kinds: a peer whose MHA layout has an
/// index buffer the initiator lacks (or the reverse) got a plan that
/// silently skipped that buffer, and the push reported success. It is a
/// `LayoutMismatch`, as `plan_layer` says (`check_compatible`).
#[test]
fn a_head_plan_refuses_layouts_whose_buffer_kinds_differ() {
    // One head of 8 B over 4 tokens per rank: 32 B a block on both sides.
    let geometry = HeadGeometry { kv_heads: 2, head_bytes: 8, tokens_per_block: 4, order: HeadOrder::Nhd };
    let route = HeadRoute::new(geometry, (2, 0), (2, 0)).unwrap();
    let plain = KvLayout::contiguous(shape(0), RegionId::new(1, 1), 0).unwrap();
    let indexed = KvLayout::contiguous(shape(32), RegionId::new(2, 1), 0).unwrap();
    for (local, remote) in [(&indexed, &plain), (&plain, &indexed)] {
        let plan = plan_layer_heads(local, remote, Opcode::Write, &route, 0, &[0, 1], &[2, 3]);
        assert!(
            matches!(plan, Err(Error::LayoutMismatch { field: "buffer kinds", .. })),
            "{:?}",
            plan.map(|descs| descs.len())
        );
    }
    // Same kinds on both sides: every buffer of both blocks is planned.
    let plan = plan_layer_heads(&indexed, &indexed, Opcode::Write, &route, 0, &[0, 1], &[2, 3]).unwrap();
    let bytes: u64 = plan.iter().map(|d| d.len).sum();
    assert_eq!(bytes, 2 * 3 * 32, "two blocks of key, value and index");
}

/// Finding 4: an `Nhd` head plan is one run per token, and tokens per
/// block is a caller's number that only had to agree with both layouts'
/// bytes per block (which need no memory behind them to be planned). A
/// 1 GiB block of 1-byte heads sized a 16 GiB run list; here 2^20 tokens
/// over 4 blocks, halving the heads per rank (no run coalesces), built 8 M
/// descriptors that no batch takes (its arena holds 16 Ki by default)
/// before any check. Now tokens per block and the plan's length are
/// bounded, with a typed error.
#[test]
fn a_head_plan_is_bounded_before_it_is_built_to_memorys_end() {
    let geometry =
        |tokens| HeadGeometry { kv_heads: 2, head_bytes: 1, tokens_per_block: tokens, order: HeadOrder::Nhd };
    assert!(matches!(HeadRoute::new(geometry(1 << 30), (1, 0), (2, 0)), Err(Error::InvalidArgument { .. })));
    let tokens = 1u64 << 20;
    let side = |block_bytes, region| {
        let shape = CacheShape {
            attention: Attention::Mha,
            layers: 1,
            blocks: 4,
            key_block_bytes: block_bytes,
            value_block_bytes: block_bytes,
            index_block_bytes: 0,
        };
        KvLayout::contiguous(shape, RegionId::new(region, 1), 0).unwrap()
    };
    // The source (tp 1) holds both heads, the destination (tp 2) one.
    let (src, dst) = (side(2 * tokens, 1), side(tokens, 2));
    let route = HeadRoute::new(geometry(tokens), (1, 0), (2, 0)).unwrap();
    let plan = plan_layer_heads(&src, &dst, Opcode::Write, &route, 0, &[0, 1, 2, 3], &[0, 1, 2, 3]);
    assert!(matches!(plan, Err(Error::InvalidArgument { .. })), "{:?}", plan.map(|d| d.len()));
    // One block of 16 tokens plans its 16 runs per buffer.
    let (src, dst) = (side(2 * 16, 1), side(16, 2));
    let route = HeadRoute::new(geometry(16), (1, 0), (2, 0)).unwrap();
    assert_eq!(plan_layer_heads(&src, &dst, Opcode::Write, &route, 0, &[3], &[1]).unwrap().len(), 2 * 16);
}

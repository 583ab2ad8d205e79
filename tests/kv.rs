//! The KV-cache layer end to end with real bytes: layouts exchanged over
//! the control plane, push and pull of block lists over shm and tcp,
//! heterogeneous tp for MLA and (head-sliced) for MHA, and the refusals that keep bad plans away from
//! the transports.

mod common;

use common::{engine, WAIT};
use kvring::kv::{
    check_pd_topo, push_targets, Attention, CacheShape, HeadGeometry, HeadOrder, HeadRoute, KvLayout, Mode, Rank,
    TopoCheck,
};
use kvring::{Engine, Error, Region, RegionInfo, Segment, TransportKind};

/// A cache region filled with a pattern from `seed`, published as the
/// engine's layout.
fn cache(engine: &Engine, shape: CacheShape, seed: u64) -> (Region, KvLayout) {
    let region = engine.alloc_region(shape.bytes().unwrap() as usize, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { region.fill_pattern(seed) };
    let layout = KvLayout::contiguous(shape, region.id(), 0).unwrap();
    engine.set_kv_layout(layout.clone()).unwrap();
    (region, layout)
}

fn block(region: &Region, layout: &KvLayout, layer: u32, kind_index: usize, id: u64) -> Vec<u8> {
    let buffer = layout.layer(layer).unwrap()[kind_index];
    let mut out = vec![0u8; buffer.block_bytes as usize];
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { region.read_at(buffer.offset + id * buffer.block_bytes, &mut out).unwrap() };
    out
}

/// Every (src → dst) block of every layer and kind holds the source bytes.
fn assert_moved(src: (&Region, &KvLayout), dst: (&Region, &KvLayout), src_ids: &[u64], dst_ids: &[u64]) {
    for layer in 0..src.1.layers() {
        for kind in 0..src.1.layer(layer).unwrap().len() {
            for (&s, &d) in src_ids.iter().zip(dst_ids) {
                assert_eq!(
                    block(src.0, src.1, layer, kind, s),
                    block(dst.0, dst.1, layer, kind, d),
                    "layer {layer} kind {kind} block {s}->{d}"
                );
            }
        }
    }
}

fn open(initiator: &Engine, target: &Engine, transport: TransportKind) -> Segment {
    initiator.open_segment_with(&target.control_addr().to_string(), Some(transport), WAIT).unwrap()
}

#[test]
fn homogeneous_push_and_pull_over_shm_and_tcp() {
    let shape = CacheShape::mha(4, 32, 8, 128, 2, 4, 2).unwrap();
    for transport in [TransportKind::Shm, TransportKind::Tcp] {
        let prefill = engine("prefill-0");
        let decode = engine("decode-0");
        let (p_region, p_layout) = cache(&prefill, shape, 1);
        let (d_region, d_layout) = cache(&decode, shape, 2);

        // Push: prefill writes its blocks 3, 4, 5, 9 into decode's 0, 1, 2, 7.
        let segment = open(&prefill, &decode, transport);
        let remote = segment.kv_layout(WAIT).unwrap();
        assert_eq!(remote, d_layout, "memory info returns the registered layout");
        p_layout.check_compatible(&remote).unwrap();
        let mut sub = prefill.submitter().unwrap();
        let id = sub.push_blocks(&segment, &p_layout, &remote, &[3, 4, 5, 9], &[0, 1, 2, 7]).unwrap();
        sub.wait(id, WAIT).unwrap().into_result().unwrap();
        assert_moved((&p_region, &p_layout), (&d_region, &d_layout), &[3, 4, 5, 9], &[0, 1, 2, 7]);
        // Blocks not named stay as they were.
        let untouched = block(&d_region, &d_layout, 0, 0, 3);
        let mut expected = vec![0u8; shape.bytes().unwrap() as usize];
        kvring::testing::fill_pattern(&mut expected, 2);
        let bb = shape.key_block_bytes as usize;
        assert_eq!(untouched, expected[3 * bb..4 * bb], "{transport:?}");

        // Layer by layer, as prefill computes them.
        for layer in 0..shape.layers {
            let id = sub.push_layer(&segment, &p_layout, &remote, layer, &[20, 21], &[30, 31]).unwrap();
            sub.wait(id, WAIT).unwrap().into_result().unwrap();
        }
        assert_moved((&p_region, &p_layout), (&d_region, &d_layout), &[20, 21], &[30, 31]);

        // Pull: decode reads prefill's blocks 10, 11 into its 12, 13.
        let back = open(&decode, &prefill, transport);
        let p_remote = back.kv_layout(WAIT).unwrap();
        let mut dsub = decode.submitter().unwrap();
        let id = dsub.pull_blocks(&back, &d_layout, &p_remote, &[10, 11], &[12, 13]).unwrap();
        dsub.wait(id, WAIT).unwrap().into_result().unwrap();
        assert_moved((&p_region, &p_layout), (&d_region, &d_layout), &[10, 11], &[12, 13]);
    }
}

#[test]
fn mla_push_from_prefill_tp2_to_decode_tp1_and_from_tp1_to_tp4() {
    let shape = CacheShape::mla(3, 16, 576, 2, 8, 0).unwrap();
    for transport in [TransportKind::Shm, TransportKind::Tcp] {
        // tp 2 -> tp 1: both prefill ranks hold the same (MLA) cache; the
        // routing sends each decode rank's blocks from exactly one of them.
        let prefills: Vec<_> = (0..2).map(|r| engine(&format!("prefill-{r}"))).collect();
        let caches: Vec<_> = prefills.iter().map(|p| cache(p, shape, 7)).collect();
        let decode = engine("decode-0");
        let (d_region, d_layout) = cache(&decode, shape, 8);
        for (rank, prefill) in prefills.iter().enumerate() {
            let local = Rank { dp_size: 1, tp_size: 2, dp_rank: 0, tp_rank: rank as u32 };
            let remote = Rank { dp_size: 1, tp_size: 1, dp_rank: 0, tp_rank: 0 };
            assert_eq!(check_pd_topo(local, remote, Mode::Push, Attention::Mla), TopoCheck::Heterogeneous);
            for target in push_targets(rank as u32, 2, 1) {
                assert_eq!(target, 0);
                let segment = open(prefill, &decode, transport);
                let mut sub = prefill.submitter().unwrap();
                let id = sub.push_blocks(&segment, &caches[rank].1, &d_layout, &[1, 2, 3], &[4, 5, 6]).unwrap();
                sub.wait(id, WAIT).unwrap().into_result().unwrap();
            }
        }
        assert_moved((&caches[0].0, &caches[0].1), (&d_region, &d_layout), &[1, 2, 3], &[4, 5, 6]);

        // tp 1 -> tp 4: the one prefill rank pushes to all four.
        let prefill = engine("prefill-solo");
        let (p_region, p_layout) = cache(&prefill, shape, 9);
        let decodes: Vec<_> = (0..4).map(|r| engine(&format!("decode-{r}"))).collect();
        let d_caches: Vec<_> = decodes.iter().map(|d| cache(d, shape, 10)).collect();
        let targets: Vec<u32> = push_targets(0, 1, 4).collect();
        assert_eq!(targets, [0, 1, 2, 3]);
        let mut sub = prefill.submitter().unwrap();
        for &t in &targets {
            let segment = open(&prefill, &decodes[t as usize], transport);
            let id = sub.push_blocks(&segment, &p_layout, &d_caches[t as usize].1, &[0, 5], &[15, 14]).unwrap();
            sub.wait(id, WAIT).unwrap().into_result().unwrap();
        }
        for (region, layout) in &d_caches {
            assert_moved((&p_region, &p_layout), (region, layout), &[0, 5], &[15, 14]);
        }
    }
}

#[test]
fn mha_with_different_tp_moves_heads_and_refuses_whole_blocks() {
    let local = Rank { dp_size: 1, tp_size: 2, dp_rank: 0, tp_rank: 0 };
    let remote = Rank { dp_size: 1, tp_size: 4, dp_rank: 0, tp_rank: 0 };
    assert_eq!(check_pd_topo(local, remote, Mode::Push, Attention::Mha), TopoCheck::Heterogeneous);
    assert!(matches!(check_pd_topo(local, remote, Mode::Pull, Attention::Mha), TopoCheck::InvalidRemote(_)));
    // A whole-block push between them is refused: the layouts disagree on bytes per block.
    let prefill = engine("prefill-tp2");
    let decode = engine("decode-tp4");
    let (p_region, p_layout) = cache(&prefill, CacheShape::mha(2, 8, 8, 128, 2, 4, 2).unwrap(), 1);
    let (d_region, _d) = cache(&decode, CacheShape::mha(2, 8, 8, 128, 2, 4, 4).unwrap(), 2);
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    let before = unsafe { d_region.checksum(0, d_region.len()).unwrap() };
    let segment = open(&prefill, &decode, TransportKind::Tcp);
    let remote = segment.kv_layout(WAIT).unwrap();
    let mut sub = prefill.submitter().unwrap();
    match sub.push_blocks(&segment, &p_layout, &remote, &[0], &[0]) {
        Err(Error::LayoutMismatch { layer: Some(0), field: "key bytes per block", .. }) => {}
        other => panic!("expected a layout mismatch, got {other:?}"),
    }
    assert_eq!(sub.in_flight(), 0, "nothing was queued");
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    assert_eq!(unsafe { d_region.checksum(0, d_region.len()).unwrap() }, before, "nothing moved");

    // The head plan: prefill rank 0 of tp 2 (heads 0..4 of 8) into decode
    // rank 1 of tp 4 (heads 2..4), blocks head-major: the second half of
    // each prefill block is the whole decode block.
    let geometry = HeadGeometry { kv_heads: 8, head_bytes: 128 * 2, tokens_per_block: 4, order: HeadOrder::Hnd };
    let route = HeadRoute::new(geometry, (2, 0), (4, 1)).unwrap();
    let d_layout = remote;
    let id = sub.push_layer_heads_tagged(&segment, &p_layout, &d_layout, &route, 1, 1, &[3, 6], &[7, 2]).unwrap();
    sub.wait(id.expect("rank 0 holds heads 2 and 3"), WAIT).unwrap().into_result().unwrap();
    for kind in 0..2 {
        for (src, dst) in [(3, 7), (6, 2)] {
            let whole = block(&p_region, &p_layout, 1, kind, src);
            assert_eq!(block(&d_region, &d_layout, 1, kind, dst), whole[whole.len() / 2..], "kind {kind} {src}->{dst}");
        }
    }
    // Rank 0 shares no head with decode rank 2: nothing is submitted.
    let route = HeadRoute::new(geometry, (2, 0), (4, 2)).unwrap();
    assert!(sub.push_layer_heads_tagged(&segment, &p_layout, &d_layout, &route, 1, 1, &[3], &[7]).unwrap().is_none());
}

#[test]
fn bad_block_lists_and_missing_layouts_get_distinct_errors() {
    let shape = CacheShape::mla(2, 8, 576, 2, 8, 0).unwrap();
    let prefill = engine("prefill-0");
    let decode = engine("decode-0");
    let (_p, p_layout) = cache(&prefill, shape, 1);
    let (_d, d_layout) = cache(&decode, shape, 2);
    let segment = open(&prefill, &decode, TransportKind::Shm);
    let mut sub = prefill.submitter().unwrap();
    assert!(matches!(
        sub.push_blocks(&segment, &p_layout, &d_layout, &[1, 2], &[1]),
        Err(Error::BlockCountMismatch { .. })
    ));
    assert!(matches!(sub.push_blocks(&segment, &p_layout, &d_layout, &[8], &[1]), Err(Error::BlockOutOfRange { .. })));
    assert!(matches!(
        sub.push_blocks(&segment, &p_layout, &d_layout, &[1, 2], &[3, 3]),
        Err(Error::DuplicateBlock { id: 3 })
    ));
    assert!(matches!(
        sub.push_layer(&segment, &p_layout, &d_layout, 5, &[1], &[1]),
        Err(Error::LayerOutOfRange { .. })
    ));
    assert_eq!(sub.in_flight(), 0);

    // An engine that published no layout says so.
    let bare = engine("bare");
    let _region = bare.alloc_region(4096, RegionInfo::raw()).unwrap();
    let segment = open(&prefill, &bare, TransportKind::Shm);
    let error = segment.kv_layout(WAIT).unwrap_err();
    assert!(error.to_string().contains("registered no KV-cache layout"), "{error}");
    // A layout outside registered memory is refused when published.
    let outside = KvLayout::contiguous(shape, _region.id(), 0).unwrap();
    assert!(matches!(bare.set_kv_layout(outside), Err(Error::OutOfBounds { .. })));
}

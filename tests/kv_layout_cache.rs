//! A peer's KV layout is fetched once per segment handle and kept: a
//! published layout is fixed for its engine's life (a second, different
//! one is refused), and a restarted peer is a new handle, whose layout is
//! fetched afresh.

mod common;

use common::{builder, WAIT};
use kvring::kv::{CacheShape, KvLayout};
use kvring::{Engine, Error, Region, RegionInfo, Segment, TransportKind};

const TOKEN: &[u8] = b"kv-layout-cache-token";

fn shape(blocks: u64) -> CacheShape {
    CacheShape::mha(4, blocks, 2, 64, 2, 4, 1).unwrap()
}

/// A tokened engine with a cache of `shape`, filled from `seed`, published.
fn tokened(
    name: &str,
    listen: Option<std::net::SocketAddr>,
    shape: CacheShape,
    seed: u64,
) -> (Engine, Region, KvLayout) {
    let mut engine = builder(name).token(TOKEN);
    if let Some(addr) = listen {
        engine = engine.listen(addr);
    }
    let engine = engine.build().unwrap();
    let region = engine.alloc_region(shape.bytes().unwrap() as usize, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the fill (none naming them is in flight).
    unsafe { region.fill_pattern(seed) };
    let layout = KvLayout::contiguous(shape, region.id(), 0).unwrap();
    engine.set_kv_layout(layout.clone()).unwrap();
    (engine, region, layout)
}

fn open_tcp(initiator: &Engine, target: &Engine) -> Segment {
    initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap()
}

/// The counter as `/metrics` shows it.
fn served_metric(engine: &Engine) -> u64 {
    let text = engine.metrics_text();
    let line =
        text.lines().find(|l| l.starts_with("kvring_memory_info_served_total ")).expect("the series is rendered");
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[test]
fn layer_by_layer_pushes_fetch_the_peer_layout_once() {
    let (prefill, _p_region, p_layout) = tokened("prefill-lc", None, shape(16), 1);
    let (decode, d_region, d_layout) = tokened("decode-lc", None, shape(16), 2);
    let segment = open_tcp(&prefill, &decode);
    let mut sub = prefill.submitter().unwrap();
    // As a connector does: per layer, look the segment up by name and ask
    // for the peer's layout, then push that layer.
    for layer in 0..p_layout.layers() {
        let again = open_tcp(&prefill, &decode);
        let remote = again.kv_layout(WAIT).unwrap();
        assert_eq!(remote, d_layout);
        let id = sub.push_layer(&again, &p_layout, &remote, layer, &[1, 2], &[5, 6]).unwrap();
        sub.wait(id, WAIT).unwrap().into_result().unwrap();
    }
    assert_eq!(segment.kv_layout(WAIT).unwrap(), d_layout);
    assert_eq!(decode.memory_info_served(), 1, "one fetch for {} layers", p_layout.layers());
    assert_eq!(served_metric(&decode), 1);
    // The bytes did move, by the layout fetched once.
    let block = d_layout.layer(3).unwrap()[1];
    let mut got = vec![0u8; block.block_bytes as usize];
    // SAFETY: the pushes have completed and nothing else writes there.
    unsafe { d_region.read_at(block.offset + 6 * block.block_bytes, &mut got).unwrap() };
    let source = common::pattern(shape(16).bytes().unwrap() as usize, 1);
    let src = p_layout.layer(3).unwrap()[1];
    let at = (src.offset + 2 * src.block_bytes) as usize;
    assert_eq!(got, source[at..at + src.block_bytes as usize]);
}

#[test]
fn a_peer_without_a_layout_is_asked_again_until_it_has_one() {
    let target = builder("late-lc").build().unwrap();
    let region = target.alloc_region(shape(8).bytes().unwrap() as usize, RegionInfo::raw()).unwrap();
    let initiator = builder("early-lc").build().unwrap();
    let segment = open_tcp(&initiator, &target);
    let error = segment.kv_layout(WAIT).unwrap_err();
    assert!(error.to_string().contains("registered no KV-cache layout"), "{error}");
    let layout = KvLayout::contiguous(shape(8), region.id(), 0).unwrap();
    target.set_kv_layout(layout.clone()).unwrap();
    assert_eq!(segment.kv_layout(WAIT).unwrap(), layout, "the refusal was not kept");
    assert_eq!(segment.kv_layout(WAIT).unwrap(), layout);
    assert_eq!(target.memory_info_served(), 1, "only answers are counted, and the answer is kept");
}

#[test]
fn a_published_layout_is_fixed_for_the_engine_s_life() {
    let engine = builder("fixed-lc").build().unwrap();
    let region = engine.alloc_region(shape(16).bytes().unwrap() as usize, RegionInfo::raw()).unwrap();
    let first = KvLayout::contiguous(shape(8), region.id(), 0).unwrap();
    engine.set_kv_layout(first.clone()).unwrap();
    engine.set_kv_layout(first.clone()).expect("the same layout again is no change");
    // Another shape, and the same shape at another offset: both refused.
    let fewer = KvLayout::contiguous(shape(4), region.id(), 0).unwrap();
    let error = engine.set_kv_layout(fewer).unwrap_err();
    assert!(matches!(error, Error::LayoutFixed { .. }), "{error:?}");
    assert!(error.to_string().contains("fixed once published"), "{error}");
    assert!(error.to_string().contains("blocks: 8") && error.to_string().contains("blocks: 4"), "says where: {error}");
    let moved = KvLayout::contiguous(shape(8), region.id(), 4096).unwrap();
    let error = engine.set_kv_layout(moved).unwrap_err();
    assert!(error.to_string().contains("other regions or at other offsets"), "{error}");
    assert_eq!(engine.kv_layout(), Some(first.clone()), "a refused layout changes nothing");
    let peer = builder("reader-lc").build().unwrap();
    assert_eq!(open_tcp(&peer, &engine).kv_layout(WAIT).unwrap(), first);
}

#[test]
fn a_restarted_peer_s_new_layout_is_seen_by_the_reopened_segment() {
    let (prefill, _p_region, p_layout) = tokened("prefill-rs", None, shape(16), 1);
    let (decode, d_region, first) = tokened("decode-rs", None, shape(16), 2);
    let addr = decode.control_addr();
    let segment = open_tcp(&prefill, &decode);
    assert_eq!(segment.kv_layout(WAIT).unwrap(), first);
    let untouched = open_tcp(&prefill, &decode);
    drop(d_region);
    drop(decode);

    // The same port, another epoch, another layout (32 blocks, not 16).
    let (decode, _region, second) = tokened("decode-rs", Some(addr), shape(32), 3);
    assert_ne!(first, second);
    // A handle to the old peer: its cached layout is never paired with the
    // new peer; its pushes fail, and it is stale from then on.
    let mut sub = prefill.submitter().unwrap();
    let id = sub.push_layer(&segment, &p_layout, &first, 0, &[1], &[1]).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().into_result().is_err(), "the old peer is gone");
    assert!(segment.is_stale());
    assert!(matches!(segment.kv_layout(WAIT), Err(Error::PeerRestarted { .. })));
    assert!(untouched.is_stale(), "the same handle");

    let reopened = open_tcp(&prefill, &decode);
    assert_eq!(reopened.epoch(), decode.epoch());
    assert_eq!(reopened.kv_layout(WAIT).unwrap(), second, "fetched afresh");
    assert_eq!(decode.memory_info_served(), 1);
}

#[test]
fn a_first_fetch_from_a_restarted_peer_is_refused_not_paired_with_the_old_handle() {
    // No token: the epoch comes from a probe on the fetch's connection.
    let initiator = builder("prefill-ep").build().unwrap();
    let target = builder("decode-ep").build().unwrap();
    let region = target.alloc_region(shape(8).bytes().unwrap() as usize, RegionInfo::raw()).unwrap();
    target.set_kv_layout(KvLayout::contiguous(shape(8), region.id(), 0).unwrap()).unwrap();
    let addr = target.control_addr();
    let segment = open_tcp(&initiator, &target);
    drop(region);
    drop(target);
    let target = builder("decode-ep").listen(addr).build().unwrap();
    let region = target.alloc_region(shape(16).bytes().unwrap() as usize, RegionInfo::raw()).unwrap();
    target.set_kv_layout(KvLayout::contiguous(shape(16), region.id(), 0).unwrap()).unwrap();
    match segment.kv_layout(WAIT) {
        Err(Error::PeerRestarted { detail, .. }) => assert!(detail.contains("epoch"), "{detail}"),
        other => panic!("expected PeerRestarted, got {other:?}"),
    }
    assert_eq!(target.memory_info_served(), 0, "the new peer's layout was not asked for");
}

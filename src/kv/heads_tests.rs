use super::*;
use crate::kv::{CacheShape, KvLayout};
use crate::RegionId;

const HEAD_BYTES: u64 = 8;
const TOKENS: u64 = 4;
const BLOCKS: u64 = 5;
const LAYERS: u32 = 2;

fn layout(kv_heads: u64, tp: u32, region: u32, base: u64) -> KvLayout {
    // CacheShape::mha's bytes per element x head_dim = HEAD_BYTES.
    let shape = CacheShape::mha(LAYERS, BLOCKS, kv_heads, HEAD_BYTES, 1, TOKENS, u64::from(tp)).unwrap();
    KvLayout::contiguous(shape, RegionId::new(region, 1), base).unwrap()
}

fn geometry(kv_heads: u64, order: HeadOrder) -> HeadGeometry {
    HeadGeometry { kv_heads, head_bytes: HEAD_BYTES, tokens_per_block: TOKENS, order }
}

/// Which (head, token, byte) a byte at `offset` of a shard's block holds.
fn cell(order: HeadOrder, shard: &HeadShard, offset: u64) -> (u64, u64, u64) {
    let (byte, rest) = (offset % HEAD_BYTES, offset / HEAD_BYTES);
    match order {
        HeadOrder::Nhd => (shard.first + rest % shard.count, rest / shard.count, byte),
        HeadOrder::Hnd => (shard.first + rest / TOKENS, rest % TOKENS, byte),
    }
}

/// For every split of 1..=8 heads over tp sizes 1..=8 on both sides, both
/// byte orders, pushes of one layer with scattered block ids: every byte
/// of every destination block (of that layer, both kinds) is written
/// exactly once, by one source rank, from the byte of the source block
/// that holds the same (head, token, byte), and nothing outside the
/// destination blocks (nor outside the source blocks) is touched.
#[test]
fn every_destination_byte_is_written_once_from_the_right_source_byte() {
    let (src_ids, dst_ids) = ([4u64, 0, 1, 3], [1u64, 2, 3, 0]);
    let layer = 1;
    let mut checked = 0;
    for kv_heads in 1..=8u64 {
        for src_tp in 1..=8u32 {
            for dst_tp in 1..=8u32 {
                if HeadShard::of(kv_heads, src_tp, 0).is_err() || HeadShard::of(kv_heads, dst_tp, 0).is_err() {
                    continue;
                }
                for order in [HeadOrder::Nhd, HeadOrder::Hnd] {
                    let g = geometry(kv_heads, order);
                    for d in 0..dst_tp {
                        let dst_layout = layout(kv_heads, dst_tp, 9, 64);
                        let dst = HeadShard::of(kv_heads, dst_tp, d).unwrap();
                        let block = dst_layout.shape().key_block_bytes;
                        // writer[kind][dst block slot][byte]
                        let mut written = vec![vec![vec![0u32; block as usize]; dst_ids.len()]; 2];
                        for s in 0..src_tp {
                            let src_layout = layout(kv_heads, src_tp, s + 1, 0);
                            let route = HeadRoute::new(g, (src_tp, s), (dst_tp, d)).unwrap();
                            let descs = plan_layer_heads(
                                &src_layout,
                                &dst_layout,
                                Opcode::Write,
                                &route,
                                layer,
                                &src_ids,
                                &dst_ids,
                            )
                            .unwrap();
                            assert_eq!(
                                head_push_targets(s, src_tp, dst_tp, kv_heads).unwrap().contains(&d),
                                !descs.is_empty()
                            );
                            for desc in descs {
                                for i in 0..desc.len {
                                    let (l, r) = (desc.local_offset + i, desc.remote_offset + i);
                                    let (kind, slot, at) = locate(&dst_layout, layer, &dst_ids, r)
                                        .unwrap_or_else(|| panic!("write outside the destination blocks at {r}"));
                                    let (skind, sslot, sat) = locate(&src_layout, layer, &src_ids, l)
                                        .unwrap_or_else(|| panic!("read outside the source blocks at {l}"));
                                    assert_eq!((kind, slot), (skind, sslot), "block pairs and kinds stay paired");
                                    let src = HeadShard::of(kv_heads, src_tp, s).unwrap();
                                    assert_eq!(cell(order, &dst, at), cell(order, &src, sat), "same head, token, byte");
                                    written[kind][slot][at as usize] += 1;
                                }
                            }
                        }
                        assert!(
                            written.iter().flatten().flatten().all(|&n| n == 1),
                            "heads {kv_heads} tp {src_tp}->{dst_tp} rank {d} {order:?}"
                        );
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 100, "{checked}");
}

/// (kind, index in `ids`, offset in block) of byte `offset` of a region,
/// if it lies in one of `ids`' blocks of `layer`.
fn locate(layout: &KvLayout, layer: u32, ids: &[u64], offset: u64) -> Option<(usize, usize, u64)> {
    for (kind, buffer) in layout.layer(layer).unwrap().iter().enumerate() {
        for (slot, &id) in ids.iter().enumerate() {
            let start = buffer.offset + id * buffer.block_bytes;
            if (start..start + buffer.block_bytes).contains(&offset) {
                return Some((kind, slot, offset - start));
            }
        }
    }
    None
}

#[test]
fn head_major_slices_are_one_run_per_block_and_whole_blocks_coalesce() {
    let g = geometry(2, HeadOrder::Hnd);
    let (full, half) = (layout(2, 1, 1, 0), layout(2, 2, 2, 0));
    // tp 2 -> 1: rank 1's head is the second half of each destination block.
    let route = HeadRoute::new(g, (2, 1), (1, 0)).unwrap();
    let descs = plan_layer_heads(&half, &full, Opcode::Write, &route, 0, &[0, 1], &[2, 3]).unwrap();
    let hb = TOKENS * HEAD_BYTES;
    assert_eq!(descs.len(), 2 * 2, "one run per block and kind: halves of consecutive blocks do not touch");
    assert_eq!((descs[0].local_offset, descs[0].remote_offset, descs[0].len), (0, 2 * 2 * hb + hb, hb));
    // tp 1 -> 2: the destination's whole block, read from the source's second half.
    let route = HeadRoute::new(g, (1, 0), (2, 1)).unwrap();
    let descs = plan_layer_heads(&full, &half, Opcode::Write, &route, 0, &[2, 3], &[0, 1]).unwrap();
    assert_eq!((descs[0].local_offset, descs[0].remote_offset, descs[0].len), (2 * 2 * hb + hb, 0, hb));
    // Equal tp: whole blocks, consecutive ids coalesce as plan_layer does.
    let route = HeadRoute::new(g, (1, 0), (1, 0)).unwrap();
    let descs = plan_layer_heads(&full, &full, Opcode::Write, &route, 1, &[0, 1, 2], &[3, 4, 0]).unwrap();
    let plain = crate::kv::plan_layer(&full, &full, Opcode::Write, 1, &[0, 1, 2], &[3, 4, 0]).unwrap();
    assert_eq!(descs.len(), 2 * 2);
    assert_eq!(descs.iter().map(|d| d.len).sum::<u64>(), plain.iter().map(|d| d.len).sum::<u64>());
}

#[test]
fn token_major_slices_are_one_run_per_token() {
    let g = geometry(4, HeadOrder::Nhd);
    let route = HeadRoute::new(g, (2, 1), (1, 0)).unwrap();
    let descs =
        plan_layer_heads(&layout(4, 2, 1, 0), &layout(4, 1, 2, 0), Opcode::Write, &route, 0, &[0], &[0]).unwrap();
    assert_eq!(descs.len(), 2 * TOKENS as usize);
    assert!(descs.iter().all(|d| d.len == 2 * HEAD_BYTES));
    assert_eq!(descs[1].remote_offset - descs[0].remote_offset, 4 * HEAD_BYTES);
}

#[test]
fn pulls_mirror_pushes() {
    let g = geometry(2, HeadOrder::Hnd);
    let (full, half) = (layout(2, 1, 1, 0), layout(2, 2, 2, 0));
    let route = HeadRoute::new(g, (2, 1), (1, 0)).unwrap();
    let push = plan_layer_heads(&half, &full, Opcode::Write, &route, 0, &[0], &[1]).unwrap();
    // The destination reads the same bytes: sides swapped.
    let pull = plan_layer_heads(&full, &half, Opcode::Read, &route, 0, &[1], &[0]).unwrap();
    assert_eq!(push.len(), pull.len());
    for (a, b) in push.iter().zip(&pull) {
        assert_eq!((a.local_offset, a.remote_offset, a.len), (b.remote_offset, b.local_offset, b.len));
    }
}

#[test]
fn replicated_heads_have_one_writer_and_bad_splits_are_refused() {
    // 2 heads on tp 4 -> tp 1: head 0 on ranks 0 and 1, only rank 0 writes it.
    assert_eq!(head_push_targets(0, 4, 1, 2).unwrap(), [0]);
    assert!(head_push_targets(1, 4, 1, 2).unwrap().is_empty());
    // ... into tp 4: destination 1 takes head 0 from source rank 1.
    assert_eq!(head_push_targets(1, 4, 4, 2).unwrap(), [1]);
    assert!(HeadShard::of(6, 4, 0).unwrap_err().to_string().contains("do not split evenly"));
    assert!(HeadShard::of(3, 2, 0).is_err());
    assert!(HeadShard::of(2, 2, 2).unwrap_err().to_string().contains("rank 2 of tp 2"));
    assert!(HeadShard::of(0, 1, 0).is_err());
    assert!(HeadRoute::new(HeadGeometry { head_bytes: 0, ..geometry(2, HeadOrder::Hnd) }, (1, 0), (1, 0)).is_err());
}

#[test]
fn bad_layouts_and_ids_are_typed_errors() {
    let g = geometry(2, HeadOrder::Hnd);
    let (full, half) = (layout(2, 1, 1, 0), layout(2, 2, 2, 0));
    let route = HeadRoute::new(g, (2, 0), (1, 0)).unwrap();
    // The layouts swapped: the source's blocks are not one head's.
    let err = plan_layer_heads(&full, &half, Opcode::Write, &route, 0, &[0], &[0]).unwrap_err();
    assert!(matches!(err, Error::LayoutMismatch { layer: Some(0), .. }), "{err}");
    let wrong_dim = HeadRoute::new(HeadGeometry { head_bytes: 16, ..g }, (2, 0), (1, 0)).unwrap();
    assert!(plan_layer_heads(&half, &full, Opcode::Write, &wrong_dim, 0, &[0], &[0]).is_err());
    assert!(matches!(
        plan_layer_heads(&half, &full, Opcode::Write, &route, 0, &[0], &[BLOCKS]),
        Err(Error::BlockOutOfRange { id: BLOCKS, .. })
    ));
    assert!(matches!(
        plan_layer_heads(&half, &full, Opcode::Write, &route, LAYERS, &[0], &[0]),
        Err(Error::LayerOutOfRange { .. })
    ));
    assert!(matches!(
        plan_layer_heads(&half, &full, Opcode::Write, &route, 0, &[0, 1], &[2, 2]),
        Err(Error::DuplicateBlock { id: 2 })
    ));
    let mla = KvLayout::contiguous(CacheShape::mla(LAYERS, BLOCKS, 16, 1, TOKENS, 0).unwrap(), RegionId::new(3, 1), 0)
        .unwrap();
    assert!(plan_layer_heads(&half, &mla, Opcode::Write, &route, 0, &[0], &[0])
        .unwrap_err()
        .to_string()
        .contains("not MHA"));
}

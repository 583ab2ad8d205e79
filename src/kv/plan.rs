//! Block plans: pairs of block ids (local, remote) become block
//! descriptors, one per layer and buffer kind for each run of consecutive
//! ids on both sides.
//!
//! Validation comes first and each violation has its own error: lists of
//! equal length, ids in range on both sides, no destination id twice, and
//! compatible layouts. Nothing invalid reaches a transport.

use super::layout::KvLayout;
use crate::desc::BlockDesc;
use crate::error::{Error, Result, Side};
use crate::ring::Opcode;

/// A run of consecutive ids on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    local: u64,
    remote: u64,
    len: u64,
}

pub(super) fn check_ids(
    local: &KvLayout,
    remote: &KvLayout,
    op: Opcode,
    local_ids: &[u64],
    remote_ids: &[u64],
) -> Result<()> {
    if local_ids.len() != remote_ids.len() {
        let (src, dst) = match op {
            Opcode::Write => (local_ids.len(), remote_ids.len()),
            Opcode::Read => (remote_ids.len(), local_ids.len()),
        };
        return Err(Error::BlockCountMismatch { src, dst });
    }
    for (side, ids, layout) in [(Side::Local, local_ids, local), (Side::Remote, remote_ids, remote)] {
        if let Some(&id) = ids.iter().find(|&&id| id >= layout.blocks()) {
            return Err(Error::BlockOutOfRange { side, id, blocks: layout.blocks() });
        }
    }
    let destination = match op {
        Opcode::Write => remote_ids,
        Opcode::Read => local_ids,
    };
    // Sorting a copy is sized by the caller's list, never by a layout's
    // block count (which a peer chooses).
    let mut sorted = destination.to_vec();
    sorted.sort_unstable();
    if let Some(pair) = sorted.windows(2).find(|pair| pair[0] == pair[1]) {
        return Err(Error::DuplicateBlock { id: pair[0] });
    }
    Ok(())
}

fn runs(local_ids: &[u64], remote_ids: &[u64]) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for (&l, &r) in local_ids.iter().zip(remote_ids) {
        match runs.last_mut() {
            Some(run) if run.local + run.len == l && run.remote + run.len == r => run.len += 1,
            _ => runs.push(Run { local: l, remote: r, len: 1 }),
        }
    }
    runs
}

fn plan_into(
    local: &KvLayout,
    remote: &KvLayout,
    layers: std::ops::Range<u32>,
    runs: &[Run],
    out: &mut Vec<BlockDesc>,
) -> Result<()> {
    let overflow = || Error::invalid("block plan", "offsets overflow 64 bits");
    for layer in layers {
        let (mine, theirs) = (local.layer(layer)?, remote.layer(layer)?);
        for run in runs {
            for (a, b) in mine.iter().zip(theirs) {
                let len = a.block_bytes.checked_mul(run.len).ok_or_else(overflow)?;
                let local_offset =
                    a.block_bytes.checked_mul(run.local).and_then(|o| o.checked_add(a.offset)).ok_or_else(overflow)?;
                let remote_offset =
                    b.block_bytes.checked_mul(run.remote).and_then(|o| o.checked_add(b.offset)).ok_or_else(overflow)?;
                out.push(BlockDesc::new(a.region, local_offset, b.region, remote_offset, len));
            }
        }
    }
    Ok(())
}

/// Descriptors moving blocks `local_ids[i]` ↔ `remote_ids[i]` of every
/// layer. `op` says which side is the destination (WRITE: remote; READ:
/// local), whose ids must not repeat. Runs of consecutive ids on both sides
/// become one descriptor per layer and buffer kind.
///
/// ```
/// use kvring::kv::{plan_blocks, CacheShape, KvLayout};
/// use kvring::{Opcode, RegionId};
/// let shape = CacheShape::mla(61, 2048, 576, 2, 64, 0)?;
/// let prefill = KvLayout::contiguous(shape, RegionId::new(0, 1), 0)?;
/// let decode = KvLayout::contiguous(shape, RegionId::new(3, 1), 0)?;
/// // Blocks 3, 4, 5 and 9 of every layer into decode blocks 10, 11, 12 and 40.
/// let descs = plan_blocks(&prefill, &decode, Opcode::Write, &[3, 4, 5, 9], &[10, 11, 12, 40])?;
/// assert_eq!(descs.len(), 61 * 2); // two runs per layer
/// # Ok::<(), kvring::Error>(())
/// ```
pub fn plan_blocks(
    local: &KvLayout,
    remote: &KvLayout,
    op: Opcode,
    local_ids: &[u64],
    remote_ids: &[u64],
) -> Result<Vec<BlockDesc>> {
    local.check_compatible(remote)?;
    check_ids(local, remote, op, local_ids, remote_ids)?;
    let runs = runs(local_ids, remote_ids);
    let kinds = local.shape().kinds().count();
    let mut out = Vec::with_capacity(runs.len() * kinds * local.layers() as usize);
    plan_into(local, remote, 0..local.layers(), &runs, &mut out)?;
    Ok(out)
}

/// [`plan_blocks`] for one layer: push a layer as soon as prefill has
/// computed it, so the transfer overlaps the next layer's compute.
pub fn plan_layer(
    local: &KvLayout,
    remote: &KvLayout,
    op: Opcode,
    layer: u32,
    local_ids: &[u64],
    remote_ids: &[u64],
) -> Result<Vec<BlockDesc>> {
    local.check_compatible(remote)?;
    if layer >= local.layers() {
        return Err(Error::LayerOutOfRange { layer, layers: local.layers() });
    }
    check_ids(local, remote, op, local_ids, remote_ids)?;
    let runs = runs(local_ids, remote_ids);
    let mut out = Vec::with_capacity(runs.len() * local.shape().kinds().count());
    plan_into(local, remote, layer..layer + 1, &runs, &mut out)?;
    Ok(out)
}

/// Merges several plans (e.g. from several source ranks to one destination)
/// into one, allocating once.
pub fn merge_plans(plans: &[&[BlockDesc]]) -> Vec<BlockDesc> {
    let mut out = Vec::with_capacity(plans.iter().map(|p| p.len()).sum());
    for plan in plans {
        out.extend_from_slice(plan);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::CacheShape;
    use crate::RegionId;

    fn layouts() -> (KvLayout, KvLayout) {
        let shape = CacheShape::mha(2, 16, 8, 128, 2, 16, 1).unwrap();
        (
            KvLayout::contiguous(shape, RegionId::new(0, 1), 0).unwrap(),
            KvLayout::contiguous(shape, RegionId::new(5, 1), 4096).unwrap(),
        )
    }

    #[test]
    fn consecutive_ids_coalesce_into_one_descriptor_per_layer_and_kind() {
        let (prefill, decode) = layouts();
        let bb = prefill.shape().key_block_bytes;
        let descs = plan_blocks(&prefill, &decode, Opcode::Write, &[3, 4, 5, 9], &[10, 11, 12, 13]).unwrap();
        // Runs: (3..6 -> 10..13) and (9 -> 13): 2 runs x 2 layers x 2 kinds.
        assert_eq!(descs.len(), 8);
        let first = descs[0];
        assert_eq!((first.local_offset, first.remote_offset, first.len), (3 * bb, 4096 + 10 * bb, 3 * bb));
        let value_l0 = descs[1];
        assert_eq!(value_l0.local_offset, 16 * bb + 3 * bb, "value buffer follows the key buffer");
        let layer1_key = descs[4];
        assert_eq!(layer1_key.local_offset, 2 * 16 * bb + 3 * bb);
        let total: u64 = descs.iter().map(|d| d.len).sum();
        assert_eq!(total, 4 * 2 * 2 * bb);
    }

    #[test]
    fn each_violation_has_its_own_error() {
        let (prefill, decode) = layouts();
        assert!(matches!(
            plan_blocks(&prefill, &decode, Opcode::Write, &[1, 2], &[1]),
            Err(Error::BlockCountMismatch { src: 2, dst: 1 })
        ));
        assert!(matches!(
            plan_blocks(&prefill, &decode, Opcode::Write, &[16], &[1]),
            Err(Error::BlockOutOfRange { side: Side::Local, id: 16, blocks: 16 })
        ));
        assert!(matches!(
            plan_blocks(&prefill, &decode, Opcode::Read, &[1], &[99]),
            Err(Error::BlockOutOfRange { side: Side::Remote, id: 99, .. })
        ));
        assert!(matches!(
            plan_blocks(&prefill, &decode, Opcode::Write, &[1, 2], &[7, 7]),
            Err(Error::DuplicateBlock { id: 7 })
        ));
        // Duplicate *sources* are fine for a push; duplicate local ids are
        // destinations of a pull.
        assert!(plan_blocks(&prefill, &decode, Opcode::Write, &[7, 7], &[1, 2]).is_ok());
        assert!(matches!(
            plan_blocks(&prefill, &decode, Opcode::Read, &[7, 7], &[1, 2]),
            Err(Error::DuplicateBlock { id: 7 })
        ));
        assert!(matches!(
            plan_layer(&prefill, &decode, Opcode::Write, 2, &[1], &[1]),
            Err(Error::LayerOutOfRange { layer: 2, layers: 2 })
        ));
        let other =
            KvLayout::contiguous(CacheShape::mha(3, 16, 8, 128, 2, 16, 1).unwrap(), RegionId::new(1, 1), 0).unwrap();
        assert!(matches!(plan_blocks(&prefill, &other, Opcode::Write, &[1], &[1]), Err(Error::LayoutMismatch { .. })));
    }

    #[test]
    fn one_layer_and_merged_plans() {
        let (prefill, decode) = layouts();
        let layer1 = plan_layer(&prefill, &decode, Opcode::Write, 1, &[0, 1], &[2, 3]).unwrap();
        assert_eq!(layer1.len(), 2);
        let all = plan_blocks(&prefill, &decode, Opcode::Write, &[0, 1], &[2, 3]).unwrap();
        assert_eq!(&all[2..], &layer1[..]);
        let merged = merge_plans(&[&all, &layer1]);
        assert_eq!(merged.len(), all.len() + layer1.len());
        assert_eq!(merged.capacity(), merged.len());
    }
}

//! Head-sliced block plans: heterogeneous tensor parallelism for MHA/GQA
//! caches, where each tensor-parallel rank holds a share of the KV heads.
//!
//! A rank of a `tp`-way instance with `kv_heads` KV heads holds heads
//! `[rank * kv_heads / tp, (rank + 1) * kv_heads / tp)` when `kv_heads >=
//! tp` (vLLM's and SGLang's split), and head `rank / (tp / kv_heads)` when
//! there are fewer heads than ranks (each head replicated on `tp /
//! kv_heads` consecutive ranks). Anything else (a split that does not
//! divide) is refused with a typed error.
//!
//! A source rank writes into a destination rank the heads both hold; when
//! a head is replicated on several source ranks, destination `d` takes it
//! from the `(d % replicas)`-th of them, so every destination byte has
//! exactly one writer.
//!
//! Where a head range sits inside a block depends on the block's byte
//! order ([`HeadOrder`]): token-major (`Nhd`, `[tokens, heads, head]`, what
//! `KvLayout` assumed so far) puts a head range in one run per token;
//! head-major (`Hnd`, `[heads, tokens, head]`, the layout vLLM's NIXL
//! connector switches to for heterogeneous TP) puts it in one run per
//! block. Both are planned; runs that touch on both sides coalesce, so a
//! slice that is a whole block on both sides becomes one descriptor per
//! run of consecutive blocks, as [`plan_layer`](super::plan_layer) gives.

use super::layout::{Attention, KvLayout};
use crate::desc::BlockDesc;
use crate::error::{Error, Result};
use crate::ring::Opcode;
use std::ops::Range;

/// Largest tensor-parallel size a head split accepts: more ranks than any
/// cluster has. A tp size is a caller's number, and
/// [`head_push_targets`] walks every destination rank, so an unchecked
/// `u32::MAX` would cost minutes and a 16 GiB answer (hostile review 3,
/// finding 2).
pub const MAX_TP: u32 = 1 << 16;

/// Most tokens per block a head geometry may say (engines use up to a
/// few thousand): an `Nhd` block is planned one run per token, so this
/// bounds the run lists a caller's number sizes (hostile review 3,
/// finding 4).
pub const MAX_TOKENS_PER_BLOCK: u64 = 1 << 20;

/// Most descriptors one head plan may hold after coalescing: far more than
/// a batch takes (`EngineBuilder::arena_descs`), so a plan this long is
/// refused as it grows rather than built to the caller's memory's end.
pub const MAX_HEAD_PLAN_DESCS: usize = 1 << 22;

/// Byte order inside one block of an MHA key or value buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeadOrder {
    /// `[tokens, heads, head_bytes]`: a head range is one run per token.
    Nhd,
    /// `[heads, tokens, head_bytes]`: a head range is one run per block.
    Hnd,
}

/// The geometry both sides' MHA blocks share: what a head is, and how a
/// block orders them. The heads a side holds come from its [`HeadShard`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadGeometry {
    /// KV heads of the model (all ranks together).
    pub kv_heads: u64,
    /// Bytes of one head of one token (`head_dim * dtype bytes`).
    pub head_bytes: u64,
    /// Tokens per block.
    pub tokens_per_block: u64,
    /// Byte order inside a block.
    pub order: HeadOrder,
}

/// The KV heads one tensor-parallel rank holds; made only by
/// [`HeadShard::of`], so its fields are always a valid split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShard {
    tp: u32,
    rank: u32,
    first: u64,
    count: u64,
}

impl HeadShard {
    /// The heads rank `rank` of `tp` holds of `kv_heads`; an error when
    /// the split does not divide (neither `kv_heads % tp == 0` nor `tp %
    /// kv_heads == 0`), the rank is outside `tp`, or `tp` exceeds
    /// [`MAX_TP`].
    ///
    /// ```
    /// use kvring::kv::HeadShard;
    /// assert_eq!(HeadShard::of(8, 2, 1)?.heads(), 4..8);
    /// assert_eq!(HeadShard::of(2, 4, 3)?.heads(), 1..2); // head 1 on ranks 2 and 3
    /// assert!(HeadShard::of(6, 4, 0).is_err());
    /// # Ok::<(), kvring::Error>(())
    /// ```
    pub fn of(kv_heads: u64, tp: u32, rank: u32) -> Result<Self> {
        let tp64 = u64::from(tp);
        if kv_heads == 0 || tp == 0 || rank >= tp {
            return Err(Error::invalid(
                "head shard",
                format!("rank {rank} of tp {tp} with {kv_heads} KV heads: need kv_heads >= 1 and rank < tp"),
            ));
        }
        if tp > MAX_TP {
            return Err(Error::invalid("head shard", format!("tp {tp} exceeds the most kvring splits over, {MAX_TP}")));
        }
        if kv_heads >= tp64 && kv_heads.is_multiple_of(tp64) {
            let count = kv_heads / tp64;
            return Ok(Self { tp, rank, first: u64::from(rank) * count, count });
        }
        if kv_heads < tp64 && tp64.is_multiple_of(kv_heads) {
            let replicas = tp64 / kv_heads;
            return Ok(Self { tp, rank, first: u64::from(rank) / replicas, count: 1 });
        }
        Err(Error::invalid(
            "head shard",
            format!("{kv_heads} KV heads do not split evenly over tp {tp} (nor replicate evenly)"),
        ))
    }

    /// The heads it holds.
    pub fn heads(&self) -> Range<u64> {
        self.first..self.first + self.count
    }

    /// Its tensor-parallel size and rank.
    pub fn tp_rank(&self) -> (u32, u32) {
        (self.tp, self.rank)
    }

    /// How many ranks hold each of its heads (1 unless there are fewer
    /// heads than ranks).
    fn replicas(&self, kv_heads: u64) -> u64 {
        (u64::from(self.tp) / kv_heads.max(1)).max(1)
    }
}

/// The heads source `src` writes into destination `dst` (empty when
/// none): the heads both hold, each from exactly one source (of a head
/// replicated on several source ranks, destination `d` takes it from the
/// `(d % replicas)`-th holder). Both shards come from [`HeadShard::of`]
/// with the same `kv_heads`, so the sums below stay within `kv_heads`.
fn head_slice(kv_heads: u64, src: HeadShard, dst: HeadShard) -> Range<u64> {
    let (lo, hi) = (src.first.max(dst.first), (src.first + src.count).min(dst.first + dst.count));
    if lo >= hi {
        return 0..0;
    }
    let replicas = src.replicas(kv_heads);
    // The holders of head `lo` are ranks `lo * replicas ..`; with one
    // replica, `src` is the only holder.
    let chosen = lo * replicas + u64::from(dst.rank) % replicas;
    if replicas == 1 || chosen == u64::from(src.rank) {
        lo..hi
    } else {
        0..0
    }
}

/// The destination ranks (of `dst_tp`) that source rank `src_rank` (of
/// `src_tp`) writes heads into, for a cache of `kv_heads` KV heads.
///
/// ```
/// use kvring::kv::head_push_targets;
/// assert_eq!(head_push_targets(1, 2, 1, 2)?, [0]); // tp 2 -> 1: both sources into rank 0
/// assert_eq!(head_push_targets(0, 1, 2, 2)?, [0, 1]); // tp 1 -> 2: one source into both
/// # Ok::<(), kvring::Error>(())
/// ```
pub fn head_push_targets(src_rank: u32, src_tp: u32, dst_tp: u32, kv_heads: u64) -> Result<Vec<u32>> {
    let src = HeadShard::of(kv_heads, src_tp, src_rank)?;
    let mut out = Vec::new();
    for d in 0..dst_tp {
        if !head_slice(kv_heads, src, HeadShard::of(kv_heads, dst_tp, d)?).is_empty() {
            out.push(d);
        }
    }
    Ok(out)
}

/// Where heads `heads` of a shard's block sit, relative to the block's
/// start: one (offset, len) per run.
fn runs_in_block(g: &HeadGeometry, shard: &HeadShard, heads: &Range<u64>, out: &mut Vec<(u64, u64)>) -> Option<()> {
    let skip = heads.start.checked_sub(shard.first)?;
    let n = heads.end.checked_sub(heads.start)?;
    match g.order {
        HeadOrder::Hnd => {
            let per_head = g.tokens_per_block.checked_mul(g.head_bytes)?;
            out.push((skip.checked_mul(per_head)?, n.checked_mul(per_head)?));
        }
        HeadOrder::Nhd => {
            let token_bytes = shard.count.checked_mul(g.head_bytes)?;
            let at = skip.checked_mul(g.head_bytes)?;
            let len = n.checked_mul(g.head_bytes)?;
            for t in 0..g.tokens_per_block {
                out.push((t.checked_mul(token_bytes)?.checked_add(at)?, len));
            }
        }
    }
    Some(())
}

fn check_side(layout: &KvLayout, g: &HeadGeometry, shard: &HeadShard, side: &'static str) -> Result<()> {
    if layout.shape().attention != Attention::Mha {
        return Err(Error::invalid(
            "head plan",
            format!("the {side} layout is not MHA: only MHA caches split by head"),
        ));
    }
    let expected = [shard.count, g.head_bytes, g.tokens_per_block]
        .iter()
        .try_fold(1u64, |acc, &v| acc.checked_mul(v))
        .ok_or_else(|| Error::invalid("head plan", "head geometry overflows 64 bits"))?;
    for layer in 0..layout.layers() {
        for buffer in layout.layer(layer)? {
            if buffer.block_bytes != expected {
                return Err(Error::LayoutMismatch {
                    layer: Some(layer),
                    field: "bytes per block for this rank's heads",
                    local: format!(
                        "{expected} ({side}: {} heads x {} B x {} tokens)",
                        shard.count, g.head_bytes, g.tokens_per_block
                    ),
                    remote: buffer.block_bytes.to_string(),
                });
            }
        }
    }
    Ok(())
}

/// The shards of the two sides of a head-sliced transfer: the source rank
/// (whose bytes are read) and the destination rank (written), with the
/// geometry both share. Made only by [`HeadRoute::new`], which checks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadRoute {
    geometry: HeadGeometry,
    src: HeadShard,
    dst: HeadShard,
}

impl HeadRoute {
    /// A route from rank `src_rank` of `src_tp` to rank `dst_rank` of
    /// `dst_tp`; every split is checked ([`HeadShard::of`]).
    pub fn new(geometry: HeadGeometry, src: (u32, u32), dst: (u32, u32)) -> Result<Self> {
        if geometry.head_bytes == 0 || geometry.tokens_per_block == 0 {
            return Err(Error::invalid("head plan", "head bytes and tokens per block must be at least 1"));
        }
        if geometry.tokens_per_block > MAX_TOKENS_PER_BLOCK {
            return Err(Error::invalid(
                "head plan",
                format!("{} tokens per block exceeds {MAX_TOKENS_PER_BLOCK}", geometry.tokens_per_block),
            ));
        }
        Ok(Self {
            geometry,
            src: HeadShard::of(geometry.kv_heads, src.0, src.1)?,
            dst: HeadShard::of(geometry.kv_heads, dst.0, dst.1)?,
        })
    }

    /// The geometry both sides share.
    pub fn geometry(&self) -> &HeadGeometry {
        &self.geometry
    }

    /// The source's and the destination's shards.
    pub fn shards(&self) -> (HeadShard, HeadShard) {
        (self.src, self.dst)
    }

    /// The heads this route moves (empty: the source writes nothing here).
    pub fn heads(&self) -> Range<u64> {
        head_slice(self.geometry.kv_heads, self.src, self.dst)
    }
}

/// [`plan_layer`](super::plan_layer) for MHA caches split by KV head:
/// descriptors moving, for every block pair, the heads `route` assigns
/// from the source's block into the destination's block, at their place
/// there. `local` is the initiator's layout; `op` says which side is the
/// destination (WRITE: remote). Block ids, layers and each side's bytes
/// per block (which must equal its heads × head bytes × tokens) are
/// checked before any descriptor is made; every offset is checked
/// arithmetic, and runs that touch on both sides coalesce.
#[allow(clippy::too_many_arguments)]
pub fn plan_layer_heads(
    local: &KvLayout,
    remote: &KvLayout,
    op: Opcode,
    route: &HeadRoute,
    layer: u32,
    local_ids: &[u64],
    remote_ids: &[u64],
) -> Result<Vec<BlockDesc>> {
    let (src_layout, dst_layout) = match op {
        Opcode::Write => (local, remote),
        Opcode::Read => (remote, local),
    };
    check_side(src_layout, &route.geometry, &route.src, "source")?;
    check_side(dst_layout, &route.geometry, &route.dst, "destination")?;
    if local.layers() != remote.layers() {
        return Err(Error::LayoutMismatch {
            layer: None,
            field: "layer count",
            local: local.layers().to_string(),
            remote: remote.layers().to_string(),
        });
    }
    if layer >= local.layers() {
        return Err(Error::LayerOutOfRange { layer, layers: local.layers() });
    }
    // Buffers pair by position below: a kind one side lacks (a peer's
    // index buffer) would otherwise be skipped while the push succeeds.
    let (mine, theirs) = (local.layer(layer)?, remote.layer(layer)?);
    if mine.len() != theirs.len() || mine.iter().zip(theirs).any(|(a, b)| a.kind != b.kind) {
        let kinds =
            |buffers: &[crate::kv::KvBuffer]| format!("{:?}", buffers.iter().map(|b| b.kind).collect::<Vec<_>>());
        return Err(Error::LayoutMismatch {
            layer: Some(layer),
            field: "buffer kinds",
            local: kinds(mine),
            remote: kinds(theirs),
        });
    }
    super::plan::check_ids(local, remote, op, local_ids, remote_ids)?;
    let heads = route.heads();
    let mut out = Vec::new();
    if heads.is_empty() {
        return Ok(out);
    }
    let (mut src_runs, mut dst_runs) = (Vec::new(), Vec::new());
    let overflow = || Error::invalid("head plan", "offsets overflow 64 bits");
    runs_in_block(&route.geometry, &route.src, &heads, &mut src_runs).ok_or_else(overflow)?;
    runs_in_block(&route.geometry, &route.dst, &heads, &mut dst_runs).ok_or_else(overflow)?;
    let (local_runs, remote_runs) = match op {
        Opcode::Write => (&src_runs, &dst_runs),
        Opcode::Read => (&dst_runs, &src_runs),
    };
    for (a, b) in mine.iter().zip(theirs) {
        for (&l, &r) in local_ids.iter().zip(remote_ids) {
            let local_block =
                a.block_bytes.checked_mul(l).and_then(|o| o.checked_add(a.offset)).ok_or_else(overflow)?;
            let remote_block =
                b.block_bytes.checked_mul(r).and_then(|o| o.checked_add(b.offset)).ok_or_else(overflow)?;
            for (&(lo, len), &(ro, _)) in local_runs.iter().zip(remote_runs) {
                let local_offset = local_block.checked_add(lo).ok_or_else(overflow)?;
                let remote_offset = remote_block.checked_add(ro).ok_or_else(overflow)?;
                push_coalesced(&mut out, BlockDesc::new(a.region, local_offset, b.region, remote_offset, len));
                if out.len() > MAX_HEAD_PLAN_DESCS {
                    return Err(Error::invalid(
                        "head plan",
                        format!("more than {MAX_HEAD_PLAN_DESCS} descriptors: push fewer blocks at a time"),
                    ));
                }
            }
        }
    }
    Ok(out)
}

/// Appends `next`, or grows the last descriptor when `next` continues it
/// on both sides (same regions, both ends touching).
fn push_coalesced(out: &mut Vec<BlockDesc>, next: BlockDesc) {
    if let Some(last) = out.last_mut() {
        let touches = last.local_region == next.local_region
            && last.remote_region == next.remote_region
            && last.local_offset.checked_add(last.len) == Some(next.local_offset)
            && last.remote_offset.checked_add(last.len) == Some(next.remote_offset);
        if let (true, Some(len)) = (touches, last.len.checked_add(next.len)) {
            last.len = len;
            return;
        }
    }
    out.push(next);
}

#[cfg(test)]
#[path = "heads_tests.rs"]
mod tests;

//! Prefill/decode topology: may these two ranks exchange KV blocks, and to
//! which decode ranks does a prefill rank push when tensor-parallel sizes
//! differ. Pure functions, tested on synthetic topologies.

use super::layout::Attention;

/// A rank's place in its instance: data-parallel and tensor-parallel sizes
/// and ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rank {
    /// Data-parallel size.
    pub dp_size: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// This rank's data-parallel index.
    pub dp_rank: u32,
    /// This rank's tensor-parallel index.
    pub tp_rank: u32,
}

/// Who moves the blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Decode reads from prefill.
    Pull,
    /// Prefill writes into decode.
    Push,
}

/// The verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TopoCheck {
    /// Same dp and tp sizes: rank i talks to rank i.
    Homogeneous,
    /// Different sizes that can still exchange blocks (see [`push_targets`]).
    Heterogeneous,
    /// The local rank description is impossible.
    InvalidLocal(String),
    /// The remote rank description is impossible, or cannot pair with ours.
    InvalidRemote(String),
}

fn invalid(rank: &Rank) -> Option<String> {
    if rank.dp_size == 0 || rank.tp_size == 0 {
        return Some(format!("dp size {} and tp size {} must be at least 1", rank.dp_size, rank.tp_size));
    }
    if rank.dp_rank >= rank.dp_size {
        return Some(format!("dp rank {} is outside dp size {}", rank.dp_rank, rank.dp_size));
    }
    if rank.tp_rank >= rank.tp_size {
        return Some(format!("tp rank {} is outside tp size {}", rank.tp_rank, rank.tp_size));
    }
    None
}

/// Checks whether `local` and `remote` can exchange KV blocks.
///
/// Equal dp and tp sizes are homogeneous. A different tp size is allowed
/// with push: MLA caches are identical on every tp rank, so any source rank
/// holds what any destination needs ([`push_targets`]); MHA/GQA caches are
/// split by KV head, so each source writes the heads it shares with each
/// destination ([`head_push_targets`](super::head_push_targets),
/// [`plan_layer_heads`](super::plan_layer_heads), which also refuses a head
/// count that does not split over either tp size). A different dp size
/// alone is heterogeneous: dp groups are independent replicas. Both
/// attentions have the same verdicts today; `attention` is kept so that a
/// caller states which cache it moves (the plan to use differs).
///
/// ```
/// use kvring::kv::{check_pd_topo, Attention, Mode, Rank, TopoCheck};
/// let prefill = Rank { dp_size: 1, tp_size: 2, dp_rank: 0, tp_rank: 1 };
/// let decode = Rank { dp_size: 1, tp_size: 1, dp_rank: 0, tp_rank: 0 };
/// assert_eq!(check_pd_topo(prefill, decode, Mode::Push, Attention::Mla), TopoCheck::Heterogeneous);
/// assert_eq!(check_pd_topo(prefill, decode, Mode::Push, Attention::Mha), TopoCheck::Heterogeneous);
/// assert!(matches!(check_pd_topo(prefill, decode, Mode::Pull, Attention::Mha), TopoCheck::InvalidRemote(_)));
/// ```
pub fn check_pd_topo(local: Rank, remote: Rank, mode: Mode, _attention: Attention) -> TopoCheck {
    if let Some(reason) = invalid(&local) {
        return TopoCheck::InvalidLocal(reason);
    }
    if let Some(reason) = invalid(&remote) {
        return TopoCheck::InvalidRemote(reason);
    }
    if local.tp_size != remote.tp_size {
        return match mode {
            Mode::Push => TopoCheck::Heterogeneous,
            Mode::Pull => TopoCheck::InvalidRemote(format!(
                "tp {} vs {}: a different tp size is supported for push only",
                local.tp_size, remote.tp_size
            )),
        };
    }
    if local.dp_size != remote.dp_size {
        return TopoCheck::Heterogeneous;
    }
    TopoCheck::Homogeneous
}

/// The destination tp ranks a source tp rank pushes to, within one dp
/// group, when tp sizes differ, for MLA (every rank holds the whole cache;
/// MHA: [`head_push_targets`](super::head_push_targets)).
/// Destination `d` is served by source `d % src_tp`, so every destination
/// receives every block from exactly one source, and the numbers of
/// destinations per source differ by at most one.
///
/// ```
/// use kvring::kv::push_targets;
/// assert_eq!(push_targets(0, 2, 1).collect::<Vec<_>>(), [0]);
/// assert_eq!(push_targets(1, 2, 1).count(), 0);
/// assert_eq!(push_targets(0, 1, 4).collect::<Vec<_>>(), [0, 1, 2, 3]);
/// ```
pub fn push_targets(src_rank: u32, src_tp: u32, dst_tp: u32) -> impl Iterator<Item = u32> {
    let valid = src_tp > 0 && src_rank < src_tp;
    (0..if valid { dst_tp } else { 0 }).filter(move |d| d % src_tp == src_rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(dp_size: u32, tp_size: u32, dp_rank: u32, tp_rank: u32) -> Rank {
        Rank { dp_size, tp_size, dp_rank, tp_rank }
    }

    #[test]
    fn verdicts_for_every_case() {
        let a = rank(2, 4, 1, 3);
        assert_eq!(check_pd_topo(a, a, Mode::Pull, Attention::Mha), TopoCheck::Homogeneous);
        assert_eq!(check_pd_topo(a, rank(4, 4, 0, 0), Mode::Pull, Attention::Mha), TopoCheck::Heterogeneous);
        assert_eq!(
            check_pd_topo(rank(1, 2, 0, 0), rank(1, 1, 0, 0), Mode::Push, Attention::Mla),
            TopoCheck::Heterogeneous
        );
        let TopoCheck::InvalidRemote(reason) =
            check_pd_topo(rank(1, 2, 0, 0), rank(1, 1, 0, 0), Mode::Pull, Attention::Mla)
        else {
            panic!()
        };
        assert!(reason.contains("push only"), "{reason}");
        for (src, dst) in [(2, 1), (1, 2), (2, 4)] {
            assert_eq!(
                check_pd_topo(rank(1, src, 0, 0), rank(1, dst, 0, 0), Mode::Push, Attention::Mha),
                TopoCheck::Heterogeneous,
                "MHA push tp {src} -> {dst}: head-sliced plans"
            );
        }
        let TopoCheck::InvalidRemote(reason) =
            check_pd_topo(rank(1, 2, 0, 0), rank(1, 4, 0, 0), Mode::Pull, Attention::Mha)
        else {
            panic!()
        };
        assert!(reason.contains("push only"), "{reason}");
        assert!(
            matches!(check_pd_topo(rank(0, 1, 0, 0), a, Mode::Push, Attention::Mla), TopoCheck::InvalidLocal(r) if r.contains("at least 1"))
        );
        assert!(
            matches!(check_pd_topo(a, rank(1, 1, 1, 0), Mode::Push, Attention::Mla), TopoCheck::InvalidRemote(r) if r.contains("dp rank 1"))
        );
        assert!(
            matches!(check_pd_topo(rank(1, 2, 0, 2), a, Mode::Push, Attention::Mla), TopoCheck::InvalidLocal(r) if r.contains("tp rank 2"))
        );
    }

    /// For every pair of tp sizes 1..=16: each destination receives from
    /// exactly one source, and per-source destination counts differ by at
    /// most one.
    #[test]
    fn push_routing_covers_every_destination_once_and_balances() {
        for src_tp in 1..=16u32 {
            for dst_tp in 1..=16u32 {
                let mut received = vec![0u32; dst_tp as usize];
                let mut per_source = Vec::new();
                for src in 0..src_tp {
                    let targets: Vec<u32> = push_targets(src, src_tp, dst_tp).collect();
                    per_source.push(targets.len());
                    for d in targets {
                        received[d as usize] += 1;
                    }
                }
                assert!(received.iter().all(|&n| n == 1), "src {src_tp} dst {dst_tp}: {received:?}");
                let (min, max) = (per_source.iter().min().unwrap(), per_source.iter().max().unwrap());
                assert!(max - min <= 1, "src {src_tp} dst {dst_tp}: {per_source:?}");
            }
        }
        assert_eq!(push_targets(5, 4, 8).count(), 0, "a rank outside its tp size pushes nowhere");
    }
}

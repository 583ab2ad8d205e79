//! The KV-cache layer: layouts, block plans (block ids to coalesced block
//! descriptors), the prefill/decode topology check and push routing for
//! heterogeneous tensor parallelism. It knows nothing of transports: it
//! turns "blocks [3, 4, 5, 9] of every layer" into `BlockDesc`s.

pub mod heads;
pub mod layout;
pub mod plan;
mod tag;
pub mod topo;

pub use heads::{
    head_push_targets, plan_layer_heads, HeadGeometry, HeadOrder, HeadRoute, HeadShard, MAX_HEAD_PLAN_DESCS,
    MAX_TOKENS_PER_BLOCK, MAX_TP,
};
pub use layout::{Attention, CacheShape, KvBuffer, KvLayout};
pub use plan::{merge_plans, plan_blocks, plan_layer};
pub use tag::{arrival_tag, MAX_REQUEST_SLOT};
pub use topo::{check_pd_topo, push_targets, Mode, Rank, TopoCheck};

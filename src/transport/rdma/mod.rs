//! The RDMA transport's building blocks: the verbs interface kvring uses
//! ([`verbs`]), a simulated provider that runs in-process ([`sim`]), device
//! discovery and lane placement ([`devices`]), turning blocks into work
//! requests ([`post`]), per-PD memory registration ([`mr_cache`]), and the
//! NICs nearest a GPU ([`topology`]). The real provider, [`ibverbs`],
//! loads libibverbs at run time and is in every build.
//!
//! [`node`] is an engine's RDMA side (NICs, PDs, per-region MRs, QPs it
//! accepted), and [`link`] the `Link` the lanes drive.

pub mod devices;
pub mod fences;
pub mod gpu_nics;
pub mod link;
pub mod mr_cache;
pub mod node;
pub mod post;
pub mod sim;
pub mod topology;
pub mod verbs;
pub mod verify;

pub mod ibverbs;

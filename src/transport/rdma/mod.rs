//! The RDMA transport's building blocks: the verbs interface kvring uses
//! ([`verbs`]), a simulated provider that runs in-process ([`sim`]), device
//! discovery and lane placement ([`devices`]), turning blocks into work
//! requests ([`post`]), and per-PD memory registration ([`mr_cache`]). The
//! real provider over rdma-sys is behind the cargo feature `rdma`.
//!
//! Not yet: the RDMA `Link` the lanes drive, and the QP exchange in the
//! control-plane handshake (see the README's status).

pub mod devices;
pub mod mr_cache;
pub mod post;
pub mod sim;
pub mod verbs;

#[cfg(feature = "rdma")]
pub mod ibverbs;

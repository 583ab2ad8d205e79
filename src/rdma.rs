//! The verbs interface an engine's RDMA transport runs on, for embedders and
//! tests that give an engine a provider ([`EngineBuilder::rdma`]):
//! [`SimVerbs`], an in-process simulator that checks keys and bounds and can
//! inject faults, and (cargo feature `rdma`) `IbVerbs`, the real provider
//! over rdma-sys. A provider of one's own implements [`Verbs`].
//!
//! [`EngineBuilder::rdma`]: crate::EngineBuilder::rdma

pub use crate::transport::rdma::sim::SimVerbs;
pub use crate::transport::rdma::verbs::{
    Context, Cq, DeviceInfo, Mr, MrAccess, MrHandle, ObjectCounts, Pd, PortInfo, PostError, PostFailure, Qp, QpCaps,
    QpEndpoint, QpTransition, SendWr, Verbs, Wc, WcStatus, WrOp,
};

#[cfg(feature = "rdma")]
pub use crate::transport::rdma::ibverbs::IbVerbs;

//! The verbs interface an engine's RDMA transport runs on, for embedders and
//! tests that give an engine a provider ([`EngineBuilder::rdma`]):
//! [`SimVerbs`], an in-process simulator that checks keys and bounds and can
//! inject faults, and [`IbVerbs`], the real provider over libibverbs
//! (loaded at run time: a host without it gets an error saying so). A provider of one's own implements [`Verbs`].
//! [`nearest`] is how an engine picks the NICs nearest a GPU, and
//! [`DeviceMrStats`] what registering GPU memory with the NICs did.
//!
//! [`EngineBuilder::rdma`]: crate::EngineBuilder::rdma

pub use crate::transport::rdma::node::DeviceMrStats;
pub use crate::transport::rdma::sim::{MrPath, SimVerbs};
pub use crate::transport::rdma::topology::{nearest, nearness, Nearness};
pub use crate::transport::rdma::verbs::{
    Context, Cq, DeviceInfo, LinkLayer, Mr, MrAccess, MrHandle, ObjectCounts, Pd, PortInfo, PostError, PostFailure, Qp,
    QpCaps, QpEndpoint, QpTransition, SendWr, Srq, Verbs, Wc, WcStatus, WrOp,
};

pub use crate::transport::rdma::ibverbs::{IbOptions, IbVerbs};

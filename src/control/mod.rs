//! The control plane: length-prefixed protobuf messages over TCP, off the
//! lanes. Handshake (segment descriptor, behind the token's mutual proof),
//! checksum (bench verification), notifications, memory info, RDMA connect.

pub mod client;
pub mod frame;
pub mod server;

pub use client::{ControlClient, Handshake, DEFAULT_CONTROL_TIMEOUT};
pub(crate) use server::ControlHandler;
pub use server::ControlServer;

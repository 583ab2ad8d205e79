//! The control plane: length-prefixed protobuf messages over TCP, off the
//! lanes. Handshake (segment descriptor), checksum (bench verification).

pub mod client;
pub mod frame;
pub mod server;
pub mod token;

pub use client::{ControlClient, DEFAULT_CONTROL_TIMEOUT};
pub use frame::CONTROL_VERSION;
pub use server::{ControlHandler, ControlServer};
pub use token::Token;

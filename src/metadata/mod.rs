//! Where segment descriptors are found. The default needs no server: ask the
//! peer itself over its control plane (the peer handshake). A cluster can
//! use etcd instead ([`etcd`]).

pub mod etcd;

use crate::control::{ControlClient, Token};
use crate::error::Result;
use crate::segment::SegmentDescriptor;
use std::time::Instant;

/// A way to turn a segment name into its descriptor.
pub trait MetadataStore: Send + Sync + std::fmt::Debug {
    /// Looks `name` up before `deadline`.
    fn resolve(&self, name: &str, initiator: &str, deadline: Instant) -> Result<SegmentDescriptor>;

    /// How names are resolved, for `kvring info` and errors.
    fn mode(&self) -> String;
}

/// The peer handshake: the name is the peer's control address
/// (`host:port`), and the peer answers with its own descriptor.
#[derive(Debug, Default, Clone)]
pub struct PeerHandshake {
    /// Pre-shared token sent in every handshake.
    pub token: Option<Token>,
}

impl MetadataStore for PeerHandshake {
    fn resolve(&self, name: &str, initiator: &str, deadline: Instant) -> Result<SegmentDescriptor> {
        ControlClient::connect(name, deadline)?.handshake(initiator, self.token.as_ref().map(Token::as_bytes), deadline)
    }

    fn mode(&self) -> String {
        "peer handshake (names are control addresses)".into()
    }
}

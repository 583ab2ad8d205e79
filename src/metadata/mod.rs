//! Where segment descriptors are found. The default needs no server: ask the
//! peer itself over its control plane (the peer handshake). A cluster can
//! use etcd instead ([`etcd`]).

pub mod etcd;

use crate::auth::{Initiator, Token};
use crate::control::{ControlClient, Handshake};
use crate::error::Result;
use std::time::Instant;

/// A way to turn a segment name into a handshake with it.
pub trait MetadataStore: Send + Sync + std::fmt::Debug {
    /// Looks `name` up and handshakes with it before `deadline`.
    fn resolve(&self, name: &str, initiator: &Initiator, deadline: Instant) -> Result<Handshake>;

    /// How names are resolved, for `kvring info` and errors.
    fn mode(&self) -> String;
}

/// The peer handshake: the name is the peer's control address
/// (`host:port`), and the peer answers with its own descriptor.
#[derive(Debug, Default, Clone)]
pub struct PeerHandshake {
    /// The cluster's token: proven in every handshake, never sent.
    pub token: Option<Token>,
}

impl MetadataStore for PeerHandshake {
    fn resolve(&self, name: &str, initiator: &Initiator, deadline: Instant) -> Result<Handshake> {
        ControlClient::connect(name, deadline)?.handshake(initiator, self.token.as_ref(), deadline)
    }

    fn mode(&self) -> String {
        "peer handshake (names are control addresses)".into()
    }
}

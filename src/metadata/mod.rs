//! Where segment descriptors are found. The default needs no server: ask the
//! peer itself over its control plane (the peer handshake). A cluster can
//! use etcd instead ([`etcd`]).

pub(crate) mod etcd;

pub use etcd::EtcdUrl;

use crate::auth::{Initiator, Token};
use crate::control::{ControlClient, Handshake};
use crate::error::{Error, Result};
use std::time::Instant;

/// How an engine turns a segment name into its peer: parsed once, from the
/// `metadata` setting, where the setting enters (builder, config file,
/// command line, Python).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum MetadataMode {
    /// No server: a name is the peer's control address, and the peer
    /// answers with its own descriptor. Spelled `P2PHANDSHAKE` (as in
    /// Mooncake), or left empty.
    #[default]
    PeerHandshake,
    /// Names are looked up in etcd, where this engine also publishes its
    /// own descriptor: `etcd://host:port[/prefix/]`.
    Etcd(EtcdUrl),
}

impl MetadataMode {
    /// Parses the `metadata` setting: `P2PHANDSHAKE` (or an empty string)
    /// or `etcd://host:port[/prefix/]`.
    ///
    /// ```
    /// use kvring::MetadataMode;
    /// assert_eq!(MetadataMode::parse("P2PHANDSHAKE").unwrap(), MetadataMode::PeerHandshake);
    /// assert!(matches!(MetadataMode::parse("etcd://10.0.0.1:2379").unwrap(), MetadataMode::Etcd(_)));
    /// assert!(MetadataMode::parse("zookeeper://x:1").is_err());
    /// ```
    pub fn parse(setting: &str) -> Result<Self> {
        match setting.trim() {
            "" | "P2PHANDSHAKE" => Ok(MetadataMode::PeerHandshake),
            url if url.starts_with("etcd://") => Ok(MetadataMode::Etcd(EtcdUrl::parse(url)?)),
            other => Err(Error::invalid(
                "metadata",
                format!("{other:?} is neither P2PHANDSHAKE nor etcd://host:port[/prefix/]"),
            )),
        }
    }

    /// `host:port` of the metadata server, if there is one: the advertised
    /// address is the one that routes to it.
    pub fn server_addr(&self) -> Option<&str> {
        match self {
            MetadataMode::PeerHandshake => None,
            MetadataMode::Etcd(url) => Some(&url.addr),
        }
    }
}

impl std::fmt::Display for MetadataMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MetadataMode::PeerHandshake => f.write_str("peer handshake (no server; names are control addresses)"),
            MetadataMode::Etcd(url) => write!(f, "etcd at {}, keys under {}", url.addr, url.prefix),
        }
    }
}

impl std::str::FromStr for MetadataMode {
    type Err = Error;

    fn from_str(setting: &str) -> Result<Self> {
        Self::parse(setting)
    }
}

/// A way to turn a segment name into a handshake with it.
pub(crate) trait MetadataStore: Send + Sync + std::fmt::Debug {
    /// Looks `name` up and handshakes with it before `deadline`.
    fn resolve(&self, name: &str, initiator: &Initiator, deadline: Instant) -> Result<Handshake>;
}

/// The peer handshake: the name is the peer's control address
/// (`host:port`), and the peer answers with its own descriptor.
#[derive(Debug, Default, Clone)]
pub(crate) struct PeerHandshake {
    /// The cluster's token: proven in every handshake, never sent.
    pub token: Option<Token>,
}

impl MetadataStore for PeerHandshake {
    fn resolve(&self, name: &str, initiator: &Initiator, deadline: Instant) -> Result<Handshake> {
        ControlClient::connect(name, deadline)?.handshake(initiator, self.token.as_ref(), deadline)
    }
}

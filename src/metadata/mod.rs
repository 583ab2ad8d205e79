//! Where segment descriptors are found. The default needs no server: ask the
//! peer itself over its control plane (the peer handshake). A cluster can
//! keep them in a key-value server instead ([`directory`]): etcd, redis, or
//! Mooncake's HTTP metadata server.

pub(crate) mod directory;
pub(crate) mod etcd;
pub(crate) mod mooncake_http;
pub(crate) mod redis;

pub use etcd::EtcdUrl;
pub use mooncake_http::HttpMetadataUrl;
pub use redis::RedisUrl;

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
    /// Names are looked up in redis, where this engine publishes its
    /// descriptor with a TTL it refreshes: `redis://host:port[/db]`.
    Redis(RedisUrl),
    /// Names are looked up on Mooncake's HTTP metadata server (its
    /// protocol: GET, PUT, DELETE on `/metadata?key=...`):
    /// `http://host:port/metadata`.
    Http(HttpMetadataUrl),
}

impl MetadataMode {
    /// Parses the `metadata` setting: `P2PHANDSHAKE` (or an empty string),
    /// `etcd://host:port[/prefix/]`, `redis://host:port[/db]` or
    /// `http://host:port/metadata`.
    ///
    /// ```
    /// use kvring::MetadataMode;
    /// assert_eq!(MetadataMode::parse("P2PHANDSHAKE").unwrap(), MetadataMode::PeerHandshake);
    /// assert!(matches!(MetadataMode::parse("etcd://10.0.0.1:2379").unwrap(), MetadataMode::Etcd(_)));
    /// assert!(matches!(MetadataMode::parse("redis://10.0.0.1:6379/2").unwrap(), MetadataMode::Redis(_)));
    /// assert!(matches!(MetadataMode::parse("http://10.0.0.1:8080/metadata").unwrap(), MetadataMode::Http(_)));
    /// assert!(MetadataMode::parse("zookeeper://x:1").is_err());
    /// ```
    pub fn parse(setting: &str) -> Result<Self> {
        match setting.trim() {
            "" | "P2PHANDSHAKE" => Ok(MetadataMode::PeerHandshake),
            url if url.starts_with("etcd://") => Ok(MetadataMode::Etcd(EtcdUrl::parse(url)?)),
            url if url.starts_with("redis://") => Ok(MetadataMode::Redis(RedisUrl::parse(url)?)),
            url if url.starts_with("http://") => Ok(MetadataMode::Http(HttpMetadataUrl::parse(url)?)),
            other => Err(Error::invalid(
                "metadata",
                format!(
                    "{other:?} is neither P2PHANDSHAKE nor etcd://host:port[/prefix/], redis://host:port[/db] or \
                     http://host:port/metadata"
                ),
            )),
        }
    }

    /// `host:port` of the metadata server, if there is one: the advertised
    /// address is the one that routes to it.
    pub fn server_addr(&self) -> Option<&str> {
        match self {
            MetadataMode::PeerHandshake => None,
            MetadataMode::Etcd(url) => Some(&url.addr),
            MetadataMode::Redis(url) => Some(&url.addr),
            MetadataMode::Http(url) => Some(&url.addr),
        }
    }
}

impl std::fmt::Display for MetadataMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MetadataMode::PeerHandshake => f.write_str("peer handshake (no server; names are control addresses)"),
            MetadataMode::Etcd(url) => write!(f, "etcd at {}, keys under {}", url.addr, url.prefix),
            MetadataMode::Redis(url) => {
                write!(f, "redis at {} (db {}), keys under {}", url.addr, url.db, directory::DEFAULT_PREFIX)
            }
            MetadataMode::Http(url) => write!(
                f,
                "the HTTP metadata server at {}{}, keys under {}",
                url.addr,
                url.path,
                directory::DEFAULT_PREFIX
            ),
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

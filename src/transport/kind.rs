//! Which transport carries a segment's blocks: named once, here, for the
//! selection rule, the command line, metrics and errors.

use crate::error::{Error, Result};

/// Transports a segment can be reached by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Same-host shared memory.
    Shm,
    /// TCP, any two hosts.
    Tcp,
    /// Moves nothing: measures kvring's own per-descriptor overhead.
    Null,
    /// RDMA (one-sided WRITE and READ through a verbs provider).
    Rdma,
}

impl TransportKind {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
            TransportKind::Null => "null",
            TransportKind::Rdma => "rdma",
        }
    }

    /// Parses a name as the command line spells it.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "shm" => Ok(TransportKind::Shm),
            "tcp" => Ok(TransportKind::Tcp),
            "null" => Ok(TransportKind::Null),
            "rdma" => Ok(TransportKind::Rdma),
            other => {
                Err(Error::Unsupported { what: format!("transport {other:?} (this build has: shm, tcp, rdma, null)") })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_an_unknown_one_lists_what_this_build_has() {
        for kind in [TransportKind::Shm, TransportKind::Tcp, TransportKind::Null, TransportKind::Rdma] {
            assert_eq!(TransportKind::parse(kind.name()).unwrap(), kind);
        }
        assert!(TransportKind::parse("ib").unwrap_err().to_string().contains("this build has: shm, tcp, rdma, null"));
    }
}

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
    /// Same host, GPU memory on either end: the peer's device memory opened
    /// by IPC handle, bytes moved by the GPU's copy engines (host memory of
    /// the peer over its shared-memory files, as shm).
    CudaIpc,
    /// Same host, any host memory of the peer (cross-memory attach:
    /// `process_vm_writev` / `process_vm_readv`, one kernel copy).
    Cma,
}

impl TransportKind {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
            TransportKind::Null => "null",
            TransportKind::Rdma => "rdma",
            TransportKind::CudaIpc => "cuda_ipc",
            TransportKind::Cma => "cma",
        }
    }

    /// Parses a name as the command line spells it.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "shm" => Ok(TransportKind::Shm),
            "tcp" => Ok(TransportKind::Tcp),
            "null" => Ok(TransportKind::Null),
            "rdma" => Ok(TransportKind::Rdma),
            "cuda_ipc" => Ok(TransportKind::CudaIpc),
            "cma" => Ok(TransportKind::Cma),
            other => Err(Error::Unsupported {
                what: format!("transport {other:?} (this build has: shm, cuda_ipc, cma, tcp, rdma, null)"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_an_unknown_one_lists_what_this_build_has() {
        let all = [
            TransportKind::Shm,
            TransportKind::Tcp,
            TransportKind::Null,
            TransportKind::Rdma,
            TransportKind::CudaIpc,
            TransportKind::Cma,
        ];
        for kind in all {
            assert_eq!(TransportKind::parse(kind.name()).unwrap(), kind);
        }
        let error = TransportKind::parse("ib").unwrap_err().to_string();
        assert!(error.contains("this build has: shm, cuda_ipc, cma, tcp, rdma, null"), "{error}");
    }
}

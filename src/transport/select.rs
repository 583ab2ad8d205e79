//! Which transport reaches a peer: the one documented order, in one place.

use crate::error::{Error, Result};
use crate::mem::MemoryKind;
use crate::segment::SegmentDescriptor;
use crate::transport::TransportKind;

/// What this engine brings to a peer.
#[derive(Debug, Clone, Copy)]
pub struct LocalReach<'a> {
    /// This host's id.
    pub host_id: &'a str,
    /// Serves RDMA: built with a verbs provider and a device with an
    /// active port.
    pub rdma: bool,
    /// Has a GPU provider (the builder's, or the CUDA driver).
    pub gpu: bool,
    /// Has registered GPU memory.
    pub device_regions: bool,
}

/// Chooses the transport to a peer.
///
/// 1. The caller's choice, if it names one; refused with a reason when it
///    cannot reach this peer (shm or cuda_ipc to another host, shm to a
///    peer with no shm-backed region, cuda_ipc without a GPU provider; tcp
///    to a peer serving no tcp listener; rdma without a device on both
///    ends).
/// 2. Otherwise cuda_ipc, when the peer is on this host, this engine has a
///    GPU provider, and either end has GPU memory.
/// 3. Otherwise rdma, when this engine serves RDMA and the peer lists
///    RDMA keys.
/// 4. Otherwise shm, when the peer is on this host and exposes at least one
///    shm-backed region.
/// 5. Otherwise tcp, when the peer serves it.
pub fn choose(requested: Option<TransportKind>, peer: &SegmentDescriptor, local: &LocalReach) -> Result<TransportKind> {
    let same_host = peer.host_id == local.host_id;
    let peer_device = peer.regions.iter().any(|r| r.memory != MemoryKind::Host);
    // Asked for, cuda_ipc needs the host and a provider (GPU memory may be
    // registered after the open); chosen by default, GPU memory on an end.
    let cuda_ipc_ok = |asked: bool| -> Result<()> {
        match () {
            _ if !same_host => unsupported(format!("cuda_ipc to {}: it is on another host", peer.name)),
            _ if !local.gpu => {
                unsupported("cuda_ipc: this engine has no GPU provider (no CUDA driver found)".to_string())
            }
            _ if !asked && !peer_device && !local.device_regions => {
                unsupported(format!("cuda_ipc to {}: neither end has registered GPU memory", peer.name))
            }
            _ => Ok(()),
        }
    };
    let rdma_ok = || -> Result<()> {
        if !local.rdma {
            return unsupported(
                "rdma: this engine has no RDMA device (build with the `rdma` feature, or give a provider)".into(),
            );
        }
        match peer.rdma {
            Some(_) => Ok(()),
            None => unsupported(format!("rdma to {}: it serves no RDMA", peer.name)),
        }
    };
    let has_shm = peer.regions.iter().any(|r| r.shm_path.is_some());
    let shm_ok = || -> Result<()> {
        if !same_host {
            return unsupported(format!("shm to {}: it is on another host", peer.name));
        }
        if !has_shm {
            return unsupported(format!(
                "shm to {}: none of its regions is shm-backed (allocate them with alloc_region)",
                peer.name
            ));
        }
        Ok(())
    };
    let tcp_ok = || -> Result<()> {
        match peer.tcp_addr {
            Some(_) => Ok(()),
            None => unsupported(format!("tcp to {}: it serves no tcp data listener", peer.name)),
        }
    };
    match requested {
        Some(TransportKind::CudaIpc) => cuda_ipc_ok(true).map(|()| TransportKind::CudaIpc),
        Some(TransportKind::Shm) => shm_ok().map(|()| TransportKind::Shm),
        Some(TransportKind::Tcp) => tcp_ok().map(|()| TransportKind::Tcp),
        Some(TransportKind::Null) => Ok(TransportKind::Null),
        Some(TransportKind::Rdma) => rdma_ok().map(|()| TransportKind::Rdma),
        None if cuda_ipc_ok(false).is_ok() => Ok(TransportKind::CudaIpc),
        None if rdma_ok().is_ok() => Ok(TransportKind::Rdma),
        None if shm_ok().is_ok() => Ok(TransportKind::Shm),
        None if tcp_ok().is_ok() => Ok(TransportKind::Tcp),
        None => unsupported(format!(
            "no transport reaches {}: not on this host with shm regions or GPU memory, and no tcp listener",
            peer.name
        )),
    }
}

fn unsupported<T>(what: String) -> Result<T> {
    Err(Error::Unsupported { what })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::{Access, RegionKind};
    use crate::segment::RemoteRegion;
    use crate::RegionId;

    fn peer(host: &str, shm: bool, tcp: bool) -> SegmentDescriptor {
        SegmentDescriptor {
            name: "p".into(),
            epoch: 1,
            host_id: host.into(),
            pid: 1,
            regions: vec![RemoteRegion {
                id: RegionId::new(0, 1),
                kind: RegionKind::Raw,
                len: 4096,
                access: Access::ALL,
                layer: 0,
                block_bytes: 0,
                shm_path: shm.then(|| "/dev/shm/kvring-1-1-1".into()),
                addr: 0,
                memory: crate::mem::MemoryKind::Host,
                gpu_export: Ok(Vec::new()),
            }],
            control_addr: "127.0.0.1:1".into(),
            tcp_addr: tcp.then(|| "127.0.0.1:2".into()),
            rdma: None,
        }
    }

    fn reach(host: &str, rdma: bool) -> LocalReach<'_> {
        LocalReach { host_id: host, rdma, gpu: false, device_regions: false }
    }

    #[test]
    fn every_branch_of_the_order() {
        // Default: shm on the same host with shm regions.
        assert_eq!(choose(None, &peer("h", true, true), &reach("h", false)).unwrap(), TransportKind::Shm);
        // Default: tcp when on another host...
        assert_eq!(choose(None, &peer("other", true, true), &reach("h", false)).unwrap(), TransportKind::Tcp);
        // ...or on this host without shm-backed regions.
        assert_eq!(choose(None, &peer("h", false, true), &reach("h", false)).unwrap(), TransportKind::Tcp);
        // Nothing reaches it.
        let err = choose(None, &peer("other", true, false), &reach("h", false)).unwrap_err();
        assert!(err.to_string().contains("no transport reaches p"), "{err}");
        // The caller's choice wins when it can work...
        assert_eq!(
            choose(Some(TransportKind::Tcp), &peer("h", true, true), &reach("h", false)).unwrap(),
            TransportKind::Tcp
        );
        assert_eq!(
            choose(Some(TransportKind::Null), &peer("x", false, false), &reach("h", false)).unwrap(),
            TransportKind::Null
        );
        // ...and is refused with a reason when it cannot.
        let err = choose(Some(TransportKind::Shm), &peer("other", true, true), &reach("h", false)).unwrap_err();
        assert!(err.to_string().contains("on another host"), "{err}");
        let err = choose(Some(TransportKind::Shm), &peer("h", false, true), &reach("h", false)).unwrap_err();
        assert!(err.to_string().contains("none of its regions is shm-backed"), "{err}");
        let err = choose(Some(TransportKind::Tcp), &peer("h", true, false), &reach("h", false)).unwrap_err();
        assert!(err.to_string().contains("serves no tcp data listener"), "{err}");
    }

    #[test]
    fn rdma_comes_first_when_both_sides_serve_it() {
        let mut both = peer("h", true, true);
        both.rdma = Some(crate::segment::RdmaInfo { nics: 1, regions: vec![] });
        assert_eq!(choose(None, &both, &reach("h", true)).unwrap(), TransportKind::Rdma);
        // This engine has no device: shm, as before.
        assert_eq!(choose(None, &both, &reach("h", false)).unwrap(), TransportKind::Shm);
        // The peer serves none: the usual order.
        assert_eq!(choose(None, &peer("other", true, true), &reach("h", true)).unwrap(), TransportKind::Tcp);
        let err = choose(Some(TransportKind::Rdma), &peer("h", true, true), &reach("h", true)).unwrap_err();
        assert!(err.to_string().contains("serves no RDMA"), "{err}");
        let err = choose(Some(TransportKind::Rdma), &both, &reach("h", false)).unwrap_err();
        assert!(err.to_string().contains("has no RDMA device"), "{err}");
    }

    #[test]
    fn cuda_ipc_comes_first_on_one_host_when_gpu_memory_is_involved() {
        let gpu = |device_regions| LocalReach { host_id: "h", rdma: true, gpu: true, device_regions };
        let mut on_gpu = peer("h", false, true);
        on_gpu.regions[0].memory = MemoryKind::Gpu(0);
        on_gpu.rdma = Some(crate::segment::RdmaInfo { nics: 1, regions: vec![] });
        // The peer's memory is on a GPU: cuda_ipc, before rdma and tcp.
        assert_eq!(choose(None, &on_gpu, &gpu(false)).unwrap(), TransportKind::CudaIpc);
        // Only ours is: still cuda_ipc (a host-memory peer reached by the GPU).
        assert_eq!(choose(None, &peer("h", true, true), &gpu(true)).unwrap(), TransportKind::CudaIpc);
        // Neither end has GPU memory: the host order.
        assert_eq!(choose(None, &peer("h", true, true), &gpu(false)).unwrap(), TransportKind::Shm);
        // Another host, or no provider here: never cuda_ipc.
        let mut far = on_gpu.clone();
        far.host_id = "other".into();
        assert_eq!(choose(None, &far, &gpu(true)).unwrap(), TransportKind::Rdma);
        let no_gpu = LocalReach { gpu: false, ..gpu(true) };
        assert_eq!(choose(None, &on_gpu, &no_gpu).unwrap(), TransportKind::Rdma);
        // Asked for, and refused with the reason.
        let refused = |peer: &SegmentDescriptor, local| {
            choose(Some(TransportKind::CudaIpc), peer, &local).unwrap_err().to_string()
        };
        assert!(refused(&far, gpu(true)).contains("on another host"));
        assert!(refused(&on_gpu, no_gpu).contains("no GPU provider"));
        // Asked for with no GPU memory yet: granted (it may be registered
        // after the open); not chosen by default.
        assert_eq!(
            choose(Some(TransportKind::CudaIpc), &peer("h", true, true), &gpu(false)).unwrap(),
            TransportKind::CudaIpc
        );
    }
}

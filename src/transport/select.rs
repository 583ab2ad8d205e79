//! Which transport reaches a peer: the one documented order, in one place.

use crate::error::{Error, Result};
use crate::mem::{Access, MemoryKind};
use crate::segment::{CmaReach, SegmentDescriptor};
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
    /// May reach same-host peers by cross-memory attach (its `cma`
    /// setting; false again after an attempt the kernel refused).
    pub cma: bool,
    /// Why a region of this engine's GPU memory is registered with none of
    /// its NICs, if one is not (rdma cannot move it).
    pub rdma_unreachable: Option<&'a str>,
}

/// What [`choose_allowed`] took, and what it passed over on the way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chosen {
    /// The transport.
    pub kind: TransportKind,
    /// The transports of the order before it that would have been a real
    /// choice for this peer (same host for shm, cma and cuda_ipc; RDMA on
    /// either end for rdma), each with why it was not taken. Empty: the
    /// link got the order's first choice (or the caller's).
    pub passed_over: Vec<(TransportKind, String)>,
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
/// 3. Otherwise rdma, when this engine serves RDMA, the peer lists RDMA
///    keys, and every region in GPU memory is registered with the NICs on
///    both ends (this engine's, and those of the peer's that peers may
///    use): GPUDirect RDMA. A device region a NIC could not register
///    refuses rdma with the reason (a caller asking for rdma gets it as
///    the error; by default the order goes on).
/// 4. Otherwise shm, when the peer is on this host and every host region it
///    exposes is shm-backed (at least one).
/// 5. Otherwise cma, when the peer is on this host and allows cross-memory
///    attach (its descriptor offers its page), and this engine may use it:
///    it reaches every host region, shm-backed or the caller's own.
/// 6. Otherwise shm, when the peer is on this host and exposes at least one
///    shm-backed region (its other regions are then out of reach).
/// 7. Otherwise tcp, when the peer serves it.
///
/// Steps 4 to 6 are skipped for a peer with GPU memory (reached here only
/// when neither cuda_ipc nor rdma can move it): tcp moves it, staged.
///
/// A cma chosen by default that then fails to open (the kernel refuses the
/// proof read) is reported by the caller, who asks again with
/// `local.cma = false`: the next transport in this order.
///
/// Within `allowed` (empty: every transport). A transport asked
/// for outside the list, or a peer that only transports outside it reach,
/// is refused with [`Error::TransportRefused`]: what reaches the peer, and
/// why each allowed transport does not. The order itself is unchanged: the
/// list only removes steps, so nothing outside it is ever taken.
pub fn choose_allowed(
    requested: Option<TransportKind>,
    peer: &SegmentDescriptor,
    local: &LocalReach,
    allowed: &[TransportKind],
) -> Result<Chosen> {
    let is_allowed = |kind: TransportKind| allowed.is_empty() || allowed.contains(&kind);
    if let Some(kind) = requested {
        let granted = reach(kind, true, peer, local);
        if !is_allowed(kind) {
            let outside = "it was asked for, and is not in this engine's transports";
            let (offered, why) = match granted {
                Ok(()) => (vec![kind.name()], outside.to_string()),
                Err(error) => (Vec::new(), format!("{outside} ({})", reason_of(&error))),
            };
            return Err(refused(peer, allowed, offered, vec![(kind.name(), why)]));
        }
        return granted.map(|()| Chosen { kind, passed_over: Vec::new() });
    }
    let steps = order_steps(peer, local);
    let mut passed_over: Vec<(TransportKind, String)> = Vec::new();
    for (kind, step) in &steps {
        let why = match step {
            Ok(()) if is_allowed(*kind) => return Ok(Chosen { kind: *kind, passed_over }),
            Ok(()) => "not in this engine's transports".to_string(),
            Err(error) => reason_of(error),
        };
        if candidate(*kind, peer, local) && !passed_over.iter().any(|(k, _)| k == kind) {
            passed_over.push((*kind, why));
        }
    }
    if allowed.is_empty() {
        return unsupported(format!(
            "no transport reaches {}: not on this host with shm regions, cma or GPU memory, and no tcp listener",
            peer.name
        ));
    }
    let mut offered: Vec<&'static str> = Vec::new();
    let mut reasons: Vec<(&'static str, String)> = Vec::new();
    for (kind, step) in &steps {
        match step {
            Ok(()) if !offered.contains(&kind.name()) => offered.push(kind.name()),
            // The later of shm's two steps holds its plain reason.
            Err(error) if is_allowed(*kind) => match reasons.iter_mut().find(|(k, _)| *k == kind.name()) {
                Some((_, why)) => *why = reason_of(error),
                None => reasons.push((kind.name(), reason_of(error))),
            },
            _ => {}
        }
    }
    for kind in allowed.iter().filter(|k| !steps.iter().any(|(s, _)| s == *k)) {
        reasons.push((kind.name(), "never chosen by default (ask for it by name)".into()));
    }
    Err(refused(peer, allowed, offered, reasons))
}

/// The documented order, every step judged (this runs once per open).
fn order_steps(peer: &SegmentDescriptor, local: &LocalReach) -> [(TransportKind, Result<()>); 6] {
    // A peer's GPU memory this engine cannot reach by cuda_ipc or rdma
    // moves over tcp (the peer stages it): shm and cma would leave it out
    // of reach.
    let peer_device = peer.regions.iter().any(|r| r.memory != MemoryKind::Host);
    let host_only = |step: Result<()>| match peer_device {
        true => unsupported(format!("{} has GPU memory, which only cuda_ipc, rdma or tcp (staged) reach", peer.name)),
        false => step,
    };
    let shm_only = peer.regions.iter().filter(|r| r.memory == MemoryKind::Host).all(|r| r.shm_path.is_some());
    let shm_first = match reach(TransportKind::Shm, false, peer, local) {
        Ok(()) if !shm_only => unsupported(format!(
            "shm to {}: some of its host regions are not shm-backed (cma reaches them all)",
            peer.name
        )),
        other => other,
    };
    [
        (TransportKind::CudaIpc, reach(TransportKind::CudaIpc, false, peer, local)),
        (TransportKind::Rdma, reach(TransportKind::Rdma, false, peer, local)),
        (TransportKind::Shm, host_only(shm_first)),
        (TransportKind::Cma, host_only(reach(TransportKind::Cma, false, peer, local))),
        (TransportKind::Shm, host_only(reach(TransportKind::Shm, false, peer, local))),
        (TransportKind::Tcp, reach(TransportKind::Tcp, false, peer, local)),
    ]
}

/// Whether `kind` can reach `peer` from this engine (`asked`: named by the
/// caller rather than tried by the order), or why not.
fn reach(kind: TransportKind, asked: bool, peer: &SegmentDescriptor, local: &LocalReach) -> Result<()> {
    let same_host = peer.host_id == local.host_id;
    let peer_device = peer.regions.iter().any(|r| r.memory != MemoryKind::Host);
    match kind {
        // Asked for, cuda_ipc needs the host and a provider (GPU memory may
        // be registered after the open); chosen by default, GPU memory on
        // an end.
        TransportKind::CudaIpc => match () {
            _ if !same_host => unsupported(format!("cuda_ipc to {}: it is on another host", peer.name)),
            _ if !local.gpu => {
                unsupported("cuda_ipc: this engine has no GPU provider (no CUDA driver found)".to_string())
            }
            _ if !asked && !peer_device && !local.device_regions => {
                unsupported(format!("cuda_ipc to {}: neither end has registered GPU memory", peer.name))
            }
            _ => Ok(()),
        },
        TransportKind::Rdma => {
            if !local.rdma {
                return unsupported(
                    "rdma: this engine has no RDMA device (build with the `rdma` feature, or give a provider)".into(),
                );
            }
            let Some(info) = &peer.rdma else {
                return unsupported(format!("rdma to {}: it serves no RDMA", peer.name));
            };
            if let Some(why) = local.rdma_unreachable {
                return unsupported(format!(
                    "rdma to {}: this engine's GPU memory is not registered with its NICs: {why}",
                    peer.name
                ));
            }
            device_regions_keyed(peer, info)
        }
        TransportKind::Shm if !same_host => unsupported(format!("shm to {}: it is on another host", peer.name)),
        TransportKind::Shm if !peer.regions.iter().any(|r| r.shm_path.is_some()) => unsupported(format!(
            "shm to {}: none of its regions is shm-backed (allocate them with alloc_region)",
            peer.name
        )),
        TransportKind::Shm | TransportKind::Null => Ok(()),
        TransportKind::Cma => match &peer.cma {
            _ if !local.cma => unsupported("cma: this engine does not use it (cma = false)".into()),
            _ if !same_host => unsupported(format!("cma to {}: it is on another host", peer.name)),
            None => unsupported(format!("cma to {}: it offers no cross-memory attach (an older kvring)", peer.name)),
            Some(CmaReach::Refused(why)) => unsupported(format!("cma to {}: it does not allow it: {why}", peer.name)),
            Some(CmaReach::Offered { .. }) => Ok(()),
        },
        TransportKind::Tcp => match peer.tcp_addr {
            Some(_) => Ok(()),
            None => unsupported(format!("tcp to {}: it serves no tcp data listener", peer.name)),
        },
    }
}

/// Steps whose loss a user would want to hear of: the rest could never
/// have reached this peer from this engine.
fn candidate(kind: TransportKind, peer: &SegmentDescriptor, local: &LocalReach) -> bool {
    let same_host = peer.host_id == local.host_id;
    let gpu_memory = local.device_regions || peer.regions.iter().any(|r| r.memory != MemoryKind::Host);
    match kind {
        TransportKind::CudaIpc => same_host && gpu_memory,
        // GPU memory that misses rdma is staged through host memory.
        TransportKind::Rdma => local.rdma || peer.rdma.is_some() || gpu_memory,
        TransportKind::Shm | TransportKind::Cma => same_host,
        TransportKind::Tcp | TransportKind::Null => true,
    }
}

/// The reason an [`Error::Unsupported`] step gives, without its prefix.
fn reason_of(error: &Error) -> String {
    match error {
        Error::Unsupported { what } => what.clone(),
        other => other.to_string(),
    }
}

fn refused(
    peer: &SegmentDescriptor,
    allowed: &[TransportKind],
    offered: Vec<&'static str>,
    reasons: Vec<(&'static str, String)>,
) -> Error {
    let allowed = allowed.iter().map(|kind| kind.name()).collect();
    Error::TransportRefused { peer: peer.name.clone(), allowed, offered, reasons }
}

/// Checks that every region of the peer's GPU memory that peers may use
/// has RDMA keys (is registered with its NICs), naming the first that has
/// not and the peer's reason.
fn device_regions_keyed(peer: &SegmentDescriptor, info: &crate::segment::RdmaInfo) -> Result<()> {
    let usable = |r: &&crate::segment::RemoteRegion| {
        r.memory != MemoryKind::Host && r.access.intersects(Access::REMOTE_READ | Access::REMOTE_WRITE)
    };
    if !peer.regions.iter().any(|r| usable(&r)) {
        return Ok(());
    }
    // A set, not a scan per region: a descriptor may list many thousands.
    let keyed: std::collections::HashSet<_> = info.regions.iter().map(|(id, _, _)| *id).collect();
    match peer.regions.iter().filter(usable).find(|r| !keyed.contains(&r.id)) {
        None => Ok(()),
        Some(region) => {
            let why = info.unreachable.iter().find(|(id, _)| *id == region.id).map(|(_, why)| why.as_str());
            let why = why.unwrap_or("it lists no RDMA keys for it");
            unsupported(format!(
                "rdma to {}: its GPU region {} is not registered with its NICs: {why}",
                peer.name, region.id
            ))
        }
    }
}

fn unsupported<T>(what: String) -> Result<T> {
    Err(Error::Unsupported { what })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The order with every transport allowed.
    fn choose(requested: Option<TransportKind>, peer: &SegmentDescriptor, local: &LocalReach) -> Result<TransportKind> {
        choose_allowed(requested, peer, local, &[]).map(|chosen| chosen.kind)
    }
    use crate::mem::RegionKind;
    use crate::segment::RemoteRegion;
    use crate::RegionId;

    fn peer(host: &str, shm: bool, tcp: bool) -> SegmentDescriptor {
        SegmentDescriptor {
            name: "p".into(),
            epoch: 1,
            host_id: host.into(),
            pid: 1,
            instance: 0,
            gpu_fds: None,
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
            cma: None,
        }
    }

    fn reach(host: &str, rdma: bool) -> LocalReach<'_> {
        LocalReach { host_id: host, rdma, gpu: false, device_regions: false, cma: true, rdma_unreachable: None }
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
        both.rdma = Some(crate::segment::RdmaInfo { nics: 1, regions: vec![], unreachable: vec![], arrivals: true });
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
        let gpu = |device_regions| LocalReach {
            host_id: "h",
            rdma: true,
            gpu: true,
            device_regions,
            cma: true,
            rdma_unreachable: None,
        };
        let mut on_gpu = peer("h", false, true);
        on_gpu.regions[0].memory = MemoryKind::Gpu(0);
        let keys = vec![(on_gpu.regions[0].id, 0x7f00_0000_0000, vec![7])];
        on_gpu.rdma = Some(crate::segment::RdmaInfo { nics: 1, regions: keys, unreachable: vec![], arrivals: true });
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

    fn offering(host: &str, shm: bool) -> SegmentDescriptor {
        let mut p = peer(host, shm, true);
        p.cma = Some(CmaReach::Offered { page: "/dev/shm/kvring-1-1-9".into(), page_addr: 4096, page_len: 4096 });
        p
    }

    #[test]
    fn cma_comes_after_shm_and_before_tcp_on_one_host() {
        let here = reach("h", false);
        // Caller memory on a same-host peer that allows it: cma, not tcp.
        assert_eq!(choose(None, &offering("h", false), &here).unwrap(), TransportKind::Cma);
        // Only shm-backed memory: shm still comes first.
        assert_eq!(choose(None, &offering("h", true), &here).unwrap(), TransportKind::Shm);
        // Mixed: cma reaches both kinds, shm only one.
        let mut mixed = offering("h", true);
        mixed.regions.push(RemoteRegion { id: RegionId::new(1, 1), shm_path: None, ..mixed.regions[0].clone() });
        assert_eq!(choose(None, &mixed, &here).unwrap(), TransportKind::Cma);
        // ...and without cma, shm for what it reaches.
        mixed.cma = None;
        assert_eq!(choose(None, &mixed, &here).unwrap(), TransportKind::Shm);
        // Another host, or this engine does not use it, or the kernel
        // refused it at open (asked again with cma off): tcp.
        assert_eq!(choose(None, &offering("other", false), &here).unwrap(), TransportKind::Tcp);
        let no_cma = LocalReach { cma: false, ..here };
        assert_eq!(choose(None, &offering("h", false), &no_cma).unwrap(), TransportKind::Tcp);
        // A peer that forbids it, or says nothing of it: tcp, and asked
        // for, the reason.
        let mut refusing = offering("h", false);
        refusing.cma = Some(CmaReach::Refused("cma = false on that engine".into()));
        assert_eq!(choose(None, &refusing, &here).unwrap(), TransportKind::Tcp);
        let asked = |p: &SegmentDescriptor, l: &LocalReach| choose(Some(TransportKind::Cma), p, l);
        assert!(asked(&refusing, &here).unwrap_err().to_string().contains("does not allow it: cma = false on that"));
        assert!(asked(&peer("h", false, true), &here).unwrap_err().to_string().contains("offers no cross-memory"));
        assert!(asked(&offering("other", false), &here).unwrap_err().to_string().contains("on another host"));
        assert!(asked(&offering("h", false), &no_cma).unwrap_err().to_string().contains("does not use it"));
        assert_eq!(asked(&offering("h", true), &here).unwrap(), TransportKind::Cma);
        // A same-host peer with GPU memory, and no GPU provider here (no
        // cuda_ipc): tcp, whose target stages it, not cma or shm.
        let mut with_gpu = offering("h", true);
        with_gpu.regions.push(RemoteRegion {
            id: RegionId::new(2, 1),
            memory: MemoryKind::Gpu(0),
            ..with_gpu.regions[0].clone()
        });
        assert_eq!(choose(None, &with_gpu, &here).unwrap(), TransportKind::Tcp);
    }

    /// A peer on another host with one region in GPU memory, registered with
    /// its NICs (`keyed`) or refused by them with a reason.
    fn far_gpu_peer(keyed: bool) -> SegmentDescriptor {
        let mut far = peer("other", false, true);
        far.regions[0].memory = MemoryKind::Gpu(0);
        let id = far.regions[0].id;
        far.rdma = Some(match keyed {
            true => crate::segment::RdmaInfo {
                nics: 1,
                regions: vec![(id, 0x7f00_0000_0000, vec![7])],
                unreachable: vec![],
                arrivals: true,
            },
            false => crate::segment::RdmaInfo {
                nics: 1,
                regions: vec![],
                unreachable: vec![(id, "GPU 0's memory could not be registered with NIC mlx5_0 (no dma-buf)".into())],
                arrivals: true,
            },
        });
        far
    }

    #[test]
    fn device_memory_across_hosts_takes_rdma_only_when_both_ends_registered_it_else_tcp() {
        let local = |rdma, unreachable| LocalReach {
            host_id: "h",
            rdma,
            gpu: true,
            device_regions: true,
            cma: true,
            rdma_unreachable: unreachable,
        };
        // Registered on both ends: rdma (GPUDirect), after cuda_ipc, which
        // needs one host.
        assert_eq!(choose(None, &far_gpu_peer(true), &local(true, None)).unwrap(), TransportKind::Rdma);
        // The peer's NIC could not register its GPU region: by default the
        // order goes on to tcp (which stages device memory)...
        assert_eq!(choose(None, &far_gpu_peer(false), &local(true, None)).unwrap(), TransportKind::Tcp);
        // ...and asked for, rdma is refused with the peer's reason.
        let refused = choose(Some(TransportKind::Rdma), &far_gpu_peer(false), &local(true, None)).unwrap_err();
        assert!(
            refused.to_string().contains("its GPU region") && refused.to_string().contains("no dma-buf"),
            "{refused}"
        );
        // This engine's NIC could not register its own GPU memory: the same.
        let ours = Some("GPU 1's memory could not be registered with NIC sim0 (peer memory: bad address)");
        assert_eq!(choose(None, &far_gpu_peer(true), &local(true, ours)).unwrap(), TransportKind::Tcp);
        let refused = choose(Some(TransportKind::Rdma), &far_gpu_peer(true), &local(true, ours)).unwrap_err();
        assert!(refused.to_string().contains("this engine's GPU memory") && refused.to_string().contains("GPU 1's"));
        // No RDMA here: tcp.
        assert_eq!(choose(None, &far_gpu_peer(true), &local(false, None)).unwrap(), TransportKind::Tcp);
        // A GPU region peers may not use needs no keys.
        let mut private = far_gpu_peer(false);
        private.regions[0].access = Access::LOCAL_READ | Access::LOCAL_WRITE;
        assert_eq!(choose(None, &private, &local(true, None)).unwrap(), TransportKind::Rdma);
        // A peer listing no keys and no reason: refused all the same.
        let mut silent = far_gpu_peer(false);
        silent.rdma.as_mut().unwrap().unreachable.clear();
        let refused = choose(Some(TransportKind::Rdma), &silent, &local(true, None)).unwrap_err();
        assert!(refused.to_string().contains("lists no RDMA keys"), "{refused}");
        // One host: cuda_ipc first, whatever the NICs did.
        let mut near = far_gpu_peer(false);
        near.host_id = "h".into();
        assert_eq!(choose(None, &near, &local(true, None)).unwrap(), TransportKind::CudaIpc);
    }

    const ALL: [TransportKind; 6] = [
        TransportKind::CudaIpc,
        TransportKind::Rdma,
        TransportKind::Shm,
        TransportKind::Cma,
        TransportKind::Tcp,
        TransportKind::Null,
    ];

    #[test]
    fn no_allow_list_takes_a_transport_outside_it_for_any_peer() {
        let mut peers = vec![peer("h", true, true), peer("h", false, true), peer("other", true, true)];
        peers.extend([offering("h", false), offering("h", true), far_gpu_peer(true), far_gpu_peer(false)]);
        let mut near_gpu = far_gpu_peer(true);
        near_gpu.host_id = "h".into();
        peers.push(near_gpu);
        let locals = [
            reach("h", false),
            reach("h", true),
            LocalReach { gpu: true, device_regions: true, ..reach("h", true) },
            LocalReach { cma: false, ..reach("h", false) },
        ];
        let mut refusals = 0;
        for peer in &peers {
            for local in &locals {
                for mask in 0u32..(1 << ALL.len()) {
                    let allowed: Vec<_> =
                        ALL.iter().enumerate().filter(|(i, _)| mask & (1 << i) != 0).map(|(_, k)| *k).collect();
                    for requested in std::iter::once(None).chain(ALL.iter().copied().map(Some)) {
                        match choose_allowed(requested, peer, local, &allowed) {
                            Ok(chosen) => {
                                assert!(
                                    allowed.is_empty() || allowed.contains(&chosen.kind),
                                    "{chosen:?} outside {allowed:?}"
                                );
                                // The list only removes steps: where the order's own
                                // choice is allowed, it is the one taken.
                                match choose(None, peer, local) {
                                    Ok(first) if requested.is_none() && allowed.contains(&first) => {
                                        assert_eq!(chosen.kind, first)
                                    }
                                    _ => {}
                                }
                            }
                            Err(Error::TransportRefused { allowed: listed, offered, reasons, .. }) => {
                                refusals += 1;
                                assert_eq!(listed, allowed.iter().map(|k| k.name()).collect::<Vec<_>>());
                                let outside = |name: &&str| !allowed.iter().any(|k| k.name() == *name);
                                let asked = requested.map(TransportKind::name);
                                assert!(offered.iter().all(|n| asked == Some(*n) || outside(n)), "{offered:?}");
                                assert!(!reasons.is_empty());
                            }
                            Err(_) => {}
                        }
                    }
                }
            }
        }
        assert!(refusals > 0);
    }

    #[test]
    fn each_fallback_is_refused_with_its_reason_when_the_list_excludes_it() {
        let here = reach("h", false);
        let why = |result: Result<Chosen>| match result {
            Err(error @ Error::TransportRefused { .. }) => error.to_string(),
            other => panic!("expected a refusal, got {other:?}"),
        };
        // shm not offered -> cma.
        let message = why(choose_allowed(None, &offering("h", false), &here, &[TransportKind::Shm]));
        assert!(
            message.contains("reachable by cma, tcp; shm: shm to p: none of its regions is shm-backed"),
            "{message}"
        );
        // cma refused by the peer -> tcp.
        let mut refusing = offering("h", false);
        refusing.cma = Some(CmaReach::Refused("cma = false on that engine".into()));
        let message = why(choose_allowed(None, &refusing, &here, &[TransportKind::Cma, TransportKind::Shm]));
        assert!(message.contains("cma: cma to p: it does not allow it"), "{message}");
        // GPU memory on a same-host peer, no provider here -> staged tcp.
        let mut with_gpu = offering("h", true);
        with_gpu.regions[0].memory = MemoryKind::Gpu(0);
        let message = why(choose_allowed(None, &with_gpu, &here, &[TransportKind::CudaIpc, TransportKind::Cma]));
        assert!(message.contains("cuda_ipc: cuda_ipc: this engine has no GPU provider"), "{message}");
        assert!(message.contains("cma: p has GPU memory"), "{message}");
        // rdma unavailable -> tcp.
        let message = why(choose_allowed(None, &far_gpu_peer(false), &reach("h", true), &[TransportKind::Rdma]));
        assert!(message.contains("its GPU region") && message.contains("no dma-buf"), "{message}");
        // null is never a default: listed alone, it says so.
        let message = why(choose_allowed(None, &peer("h", true, true), &here, &[TransportKind::Null]));
        assert!(message.contains("null: never chosen by default"), "{message}");
    }

    #[test]
    fn what_a_link_passed_over_is_what_a_user_would_have_expected() {
        let here = reach("h", false);
        let passed = |p: &SegmentDescriptor, l: &LocalReach, allowed: &[TransportKind]| {
            let chosen = choose_allowed(None, p, l, allowed).unwrap();
            (chosen.kind, chosen.passed_over.into_iter().map(|(k, _)| k).collect::<Vec<_>>())
        };
        // First choices: nothing to say.
        assert_eq!(passed(&peer("h", true, true), &here, &[]), (TransportKind::Shm, vec![]));
        assert_eq!(passed(&peer("other", true, true), &here, &[]), (TransportKind::Tcp, vec![]));
        // Fallbacks say what they passed.
        assert_eq!(passed(&offering("h", false), &here, &[]), (TransportKind::Cma, vec![TransportKind::Shm]));
        let no_cma = LocalReach { cma: false, ..here };
        assert_eq!(
            passed(&offering("h", false), &no_cma, &[]),
            (TransportKind::Tcp, vec![TransportKind::Shm, TransportKind::Cma])
        );
        assert_eq!(
            passed(&far_gpu_peer(false), &reach("h", true), &[]),
            (TransportKind::Tcp, vec![TransportKind::Rdma])
        );
        // A list that removes the first choice: said too.
        assert_eq!(passed(&peer("h", true, true), &here, &[TransportKind::Tcp]).1[0], TransportKind::Shm);
        let chosen = choose_allowed(None, &offering("h", false), &here, &[]).unwrap();
        assert!(chosen.passed_over[0].1.contains("none of its regions is shm-backed"), "{chosen:?}");
    }
}

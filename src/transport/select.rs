//! Which transport reaches a peer: the one documented order, in one place.

use crate::error::{Error, Result};
use crate::segment::SegmentDescriptor;
use crate::transport::TransportKind;

/// Chooses the transport to a peer.
///
/// 1. The caller's choice, if it names one; refused with a reason when it
///    cannot reach this peer (shm to another host, or to a peer with no
///    shm-backed region; tcp to a peer serving no tcp listener).
/// 2. Otherwise shm, when the peer is on this host and exposes at least one
///    shm-backed region.
/// 3. Otherwise tcp, when the peer serves it.
///
/// 0. Before shm and tcp: rdma, when this engine serves RDMA (`local_rdma`:
///    built with a verbs provider and a device with an active port) and the
///    peer lists RDMA keys.
pub fn choose(
    requested: Option<TransportKind>,
    peer: &SegmentDescriptor,
    local_host_id: &str,
    local_rdma: bool,
) -> Result<TransportKind> {
    let rdma_ok = || -> Result<()> {
        if !local_rdma {
            return Err(Error::Unsupported {
                what: "rdma: this engine has no RDMA device (build with the `rdma` feature, or give a provider)".into(),
            });
        }
        match peer.rdma {
            Some(_) => Ok(()),
            None => Err(Error::Unsupported { what: format!("rdma to {}: it serves no RDMA", peer.name) }),
        }
    };
    let same_host = peer.host_id == local_host_id;
    let has_shm = peer.regions.iter().any(|r| r.shm_path.is_some());
    let shm_ok = || -> Result<()> {
        if !same_host {
            return Err(Error::Unsupported { what: format!("shm to {}: it is on another host", peer.name) });
        }
        if !has_shm {
            return Err(Error::Unsupported {
                what: format!(
                    "shm to {}: none of its regions is shm-backed (allocate them with alloc_region)",
                    peer.name
                ),
            });
        }
        Ok(())
    };
    let tcp_ok = || -> Result<()> {
        match peer.tcp_addr {
            Some(_) => Ok(()),
            None => Err(Error::Unsupported { what: format!("tcp to {}: it serves no tcp data listener", peer.name) }),
        }
    };
    match requested {
        Some(TransportKind::Shm) => shm_ok().map(|()| TransportKind::Shm),
        Some(TransportKind::Tcp) => tcp_ok().map(|()| TransportKind::Tcp),
        Some(TransportKind::Null) => Ok(TransportKind::Null),
        Some(TransportKind::Rdma) => rdma_ok().map(|()| TransportKind::Rdma),
        None if rdma_ok().is_ok() => Ok(TransportKind::Rdma),
        None if shm_ok().is_ok() => Ok(TransportKind::Shm),
        None if tcp_ok().is_ok() => Ok(TransportKind::Tcp),
        None => Err(Error::Unsupported {
            what: format!("no transport reaches {}: not on this host with shm regions, and no tcp listener", peer.name),
        }),
    }
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
            }],
            control_addr: "127.0.0.1:1".into(),
            tcp_addr: tcp.then(|| "127.0.0.1:2".into()),
            rdma: None,
        }
    }

    #[test]
    fn every_branch_of_the_order() {
        // Default: shm on the same host with shm regions.
        assert_eq!(choose(None, &peer("h", true, true), "h", false).unwrap(), TransportKind::Shm);
        // Default: tcp when on another host...
        assert_eq!(choose(None, &peer("other", true, true), "h", false).unwrap(), TransportKind::Tcp);
        // ...or on this host without shm-backed regions.
        assert_eq!(choose(None, &peer("h", false, true), "h", false).unwrap(), TransportKind::Tcp);
        // Nothing reaches it.
        let err = choose(None, &peer("other", true, false), "h", false).unwrap_err();
        assert!(err.to_string().contains("no transport reaches p"), "{err}");
        // The caller's choice wins when it can work...
        assert_eq!(choose(Some(TransportKind::Tcp), &peer("h", true, true), "h", false).unwrap(), TransportKind::Tcp);
        assert_eq!(
            choose(Some(TransportKind::Null), &peer("x", false, false), "h", false).unwrap(),
            TransportKind::Null
        );
        // ...and is refused with a reason when it cannot.
        let err = choose(Some(TransportKind::Shm), &peer("other", true, true), "h", false).unwrap_err();
        assert!(err.to_string().contains("on another host"), "{err}");
        let err = choose(Some(TransportKind::Shm), &peer("h", false, true), "h", false).unwrap_err();
        assert!(err.to_string().contains("none of its regions is shm-backed"), "{err}");
        let err = choose(Some(TransportKind::Tcp), &peer("h", true, false), "h", false).unwrap_err();
        assert!(err.to_string().contains("serves no tcp data listener"), "{err}");
    }

    #[test]
    fn rdma_comes_first_when_both_sides_serve_it() {
        let mut both = peer("h", true, true);
        both.rdma = Some(crate::segment::RdmaInfo { nics: 1, regions: vec![] });
        assert_eq!(choose(None, &both, "h", true).unwrap(), TransportKind::Rdma);
        // This engine has no device: shm, as before.
        assert_eq!(choose(None, &both, "h", false).unwrap(), TransportKind::Shm);
        // The peer serves none: the usual order.
        assert_eq!(choose(None, &peer("other", true, true), "h", true).unwrap(), TransportKind::Tcp);
        let err = choose(Some(TransportKind::Rdma), &peer("h", true, true), "h", true).unwrap_err();
        assert!(err.to_string().contains("serves no RDMA"), "{err}");
        let err = choose(Some(TransportKind::Rdma), &both, "h", false).unwrap_err();
        assert!(err.to_string().contains("has no RDMA device"), "{err}");
    }
}

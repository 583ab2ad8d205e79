//! A peer's segment as this engine knows it: its checked descriptor and an
//! O(1) region table the lanes validate remote ranges against.

use super::descriptor::{RemoteRegion, SegmentDescriptor};
use crate::desc::RegionId;
use crate::error::{Error, Result, Side};
use std::sync::atomic::{AtomicBool, Ordering};

/// A peer's segment. Immutable once opened, apart from its `closed` flag.
#[derive(Debug)]
pub struct PeerSegment {
    descriptor: SegmentDescriptor,
    /// Indexed by the peer's region slot index.
    by_index: Vec<Option<usize>>,
    closed: AtomicBool,
    stale: AtomicBool,
}

impl PeerSegment {
    /// Builds the lookup table for a descriptor.
    pub fn new(descriptor: SegmentDescriptor) -> Self {
        let max_index = descriptor.regions.iter().map(|r| r.id.index() as usize).max().map_or(0, |m| m + 1);
        let mut by_index = vec![None; max_index];
        for (position, region) in descriptor.regions.iter().enumerate() {
            by_index[region.id.index() as usize] = Some(position);
        }
        Self { descriptor, by_index, closed: AtomicBool::new(false), stale: AtomicBool::new(false) }
    }

    /// The descriptor.
    pub fn descriptor(&self) -> &SegmentDescriptor {
        &self.descriptor
    }

    /// The peer's region with this id; a stale generation or unknown index
    /// is an error.
    #[inline]
    pub fn region(&self, id: RegionId) -> Result<&RemoteRegion> {
        let position = self.by_index.get(id.index() as usize).copied().flatten();
        match position.map(|p| &self.descriptor.regions[p]) {
            Some(region) if region.id == id => Ok(region),
            _ => Err(Error::UnknownRegion { side: Side::Remote, region: id }),
        }
    }

    /// Marks the handle closed: new submissions to it are refused.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// True once closed.
    #[inline]
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Marks the peer gone or restarted (a broken connection, another
    /// epoch): batches to this handle fail with `PeerRestarted`, and the
    /// engine's next open of its name evicts it and reconnects.
    pub fn mark_stale(&self) {
        self.stale.store(true, Ordering::Release);
    }

    /// True once marked stale.
    #[inline]
    pub fn is_stale(&self) -> bool {
        self.stale.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::{Access, RegionKind};

    #[test]
    fn region_lookup_checks_generation_and_index() {
        let region = |index, generation| RemoteRegion {
            id: RegionId::new(index, generation),
            kind: RegionKind::Raw,
            len: 10,
            access: Access::ALL,
            layer: 0,
            block_bytes: 0,
            shm_path: None,
            addr: 0,
            memory: crate::mem::MemoryKind::Host,
            gpu_export: Ok(Vec::new()),
        };
        let peer = PeerSegment::new(SegmentDescriptor {
            name: "p".into(),
            epoch: 1,
            host_id: String::new(),
            pid: 0,
            instance: 0,
            gpu_fds: None,
            regions: vec![region(0, 1), region(5, 2)],
            control_addr: String::new(),
            tcp_addr: None,
            rdma: None,
            cma: None,
        });
        assert_eq!(peer.region(RegionId::new(5, 2)).unwrap().id, RegionId::new(5, 2));
        assert!(peer.region(RegionId::new(5, 1)).is_err(), "stale generation");
        assert!(peer.region(RegionId::new(3, 1)).is_err(), "hole");
        assert!(peer.region(RegionId::new(60000, 1)).is_err(), "past the end");
        assert!(!peer.is_closed());
        peer.close();
        assert!(peer.is_closed());
    }
}

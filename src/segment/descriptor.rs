//! Segment descriptors: everything a peer needs to move bytes to or from an
//! engine, and their checked conversion from the wire.

use crate::desc::RegionId;
use crate::error::{Error, Result, Side};
use crate::mem::registry::{access_name, check_range};
use crate::mem::{Access, MemoryKind, RegionKind};
use crate::proto;
use std::path::PathBuf;

/// Most regions one descriptor may list (bounds a peer's handshake).
pub const MAX_DESCRIPTOR_REGIONS: usize = 1 << 16;
/// Longest segment name accepted.
pub const MAX_SEGMENT_NAME_BYTES: usize = 256;

/// One region of a peer, as its descriptor lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteRegion {
    /// The peer's id for it.
    pub id: RegionId,
    /// What it holds.
    pub kind: RegionKind,
    /// Length in bytes.
    pub len: u64,
    /// Rights the peer grants.
    pub access: Access,
    /// Model layer.
    pub layer: u32,
    /// Bytes per block.
    pub block_bytes: u64,
    /// File a same-host engine can map, for shm-backed regions.
    pub shm_path: Option<PathBuf>,
    /// Where the region starts in the owner's address space: only ever
    /// compared, to turn a remote address into (region, offset).
    pub addr: u64,
    /// Where its bytes live (GPUs as the owner numbers them).
    pub memory: MemoryKind,
    /// For GPU memory: what a same-host peer opens it by, or why the owner
    /// could not export it.
    pub(crate) gpu_export: super::gpu::GpuExport,
}

impl RemoteRegion {
    /// Checks a descriptor's remote range against this region.
    #[inline]
    pub fn check(&self, desc_index: u32, offset: u64, len: u64, needs: Access) -> Result<()> {
        if !self.access.contains(needs) {
            return Err(Error::AccessDenied {
                desc_index,
                side: Side::Remote,
                region: self.id,
                needs: access_name(needs),
            });
        }
        check_range(self.id, Side::Remote, desc_index, offset, len, self.len)
    }
    /// Checks and converts one region of a peer's descriptor.
    fn from_proto(r: proto::RegionDescriptor) -> Result<Self> {
        let bad = |reason: String| Error::malformed("segment descriptor", reason);
        let id = RegionId::from_raw(r.id);
        // Links keep a table by slot index: a peer's index past what any
        // registry issues would size it by 2^32.
        if id.index() as usize >= MAX_DESCRIPTOR_REGIONS {
            return Err(bad(format!("region {id} has a slot index past {}", MAX_DESCRIPTOR_REGIONS - 1)));
        }
        if r.len == 0 {
            return Err(bad(format!("region {id} has zero length")));
        }
        let kind =
            proto::RegionKind::try_from(r.kind).map_err(|_| bad(format!("region {id} has unknown kind {}", r.kind)))?;
        let shm_path = if r.shm_path.is_empty() {
            None
        } else {
            let path = shm_file(&r.shm_path).ok_or_else(|| {
                bad(format!("region {id} shm path {:?} is not a file directly under /dev/shm", r.shm_path))
            })?;
            Some(path)
        };
        if r.addr.checked_add(r.len).is_none() {
            return Err(bad(format!("region {id} at {:#x} with {} bytes wraps the address space", r.addr, r.len)));
        }
        let (memory, gpu_export) = super::gpu::from_proto(&r, bad)?;
        Ok(RemoteRegion {
            id,
            kind: RegionKind::from_proto(kind),
            len: r.len,
            access: Access::from_bits(r.access),
            layer: r.layer,
            block_bytes: r.block_bytes,
            shm_path,
            addr: r.addr,
            memory,
            gpu_export,
        })
    }
}

/// A segment: one engine's exposed regions, under a name and an epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentDescriptor {
    /// The engine's name.
    pub name: String,
    /// Random at every start of that engine.
    pub epoch: u64,
    /// Same value on the same host (boot id and hostname).
    pub host_id: String,
    /// The engine's process id.
    pub pid: u32,
    /// Its process's random instance id (`gpu::fd::instance`): what says
    /// "this very process", where a pid cannot (two containers' PID 1).
    pub instance: u64,
    /// The abstract Unix socket on which it passes its GPU regions'
    /// descriptors (`transport::gpu_fds`), if it serves one.
    pub gpu_fds: Option<String>,
    /// Its regions.
    pub regions: Vec<RemoteRegion>,
    /// Where its control plane listens.
    pub control_addr: String,
    /// Where its TCP data listener is, if it serves one.
    pub tcp_addr: Option<String>,
    /// How to reach its regions over RDMA, if it serves RDMA.
    pub rdma: Option<RdmaInfo>,
    /// Whether a same-host engine may reach its memory by cross-memory
    /// attach (`None`: it says nothing of it, as engines before it did).
    pub cma: Option<CmaReach>,
}

/// What an engine says about cross-memory attach to its memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CmaReach {
    /// Allowed: its shared page (a file directly under /dev/shm), where
    /// that page is mapped in its own address space, and its length.
    Offered {
        /// The page's file.
        page: PathBuf,
        /// The page's address in the engine's process.
        page_addr: u64,
        /// The page's length in bytes (the region part of the file).
        page_len: u64,
    },
    /// Not allowed, and why.
    Refused(String),
}

/// Largest shared page a peer may announce (its region table for 65,535
/// regions is about 1.6 MiB).
pub const MAX_CMA_PAGE_BYTES: u64 = 4 << 20;
/// Longest refusal reason kept from a peer.
const MAX_CMA_REASON_BYTES: usize = 512;

impl CmaReach {
    fn to_proto(&self) -> proto::CmaInfo {
        match self {
            CmaReach::Offered { page, page_addr, page_len } => proto::CmaInfo {
                page: page.display().to_string(),
                page_addr: *page_addr,
                page_len: *page_len,
                refused: String::new(),
            },
            CmaReach::Refused(why) => proto::CmaInfo { refused: why.clone(), ..Default::default() },
        }
    }

    /// Checks what a peer announced: a page directly under /dev/shm, of a
    /// bounded length that does not wrap its address; a short reason.
    fn from_proto(info: proto::CmaInfo) -> Result<Option<Self>> {
        let bad = |reason: String| Error::malformed("segment descriptor", format!("cma: {reason}"));
        if info.page.is_empty() {
            if info.refused.is_empty() {
                return Ok(None);
            }
            let mut why = info.refused;
            if why.len() > MAX_CMA_REASON_BYTES {
                let mut end = MAX_CMA_REASON_BYTES;
                while !why.is_char_boundary(end) {
                    end -= 1;
                }
                why.truncate(end);
            }
            return Ok(Some(CmaReach::Refused(why)));
        }
        let page = shm_file(&info.page)
            .ok_or_else(|| bad(format!("page {:?} is not a file directly under /dev/shm", info.page)))?;
        if info.page_len == 0 || info.page_len > MAX_CMA_PAGE_BYTES {
            return Err(bad(format!("page length {} is outside 1..={MAX_CMA_PAGE_BYTES}", info.page_len)));
        }
        if info.page_addr == 0 || info.page_addr.checked_add(info.page_len).is_none() {
            return Err(bad(format!(
                "page at {:#x} with {} bytes is not a valid range",
                info.page_addr, info.page_len
            )));
        }
        Ok(Some(CmaReach::Offered { page, page_addr: info.page_addr, page_len: info.page_len }))
    }
}

/// `text` as a path naming a file directly under /dev/shm, if it is one.
fn shm_file(text: &str) -> Option<PathBuf> {
    let path = PathBuf::from(text);
    let file_name_ok = path
        .strip_prefix(crate::mem::shm::SHM_DIR)
        .ok()
        .and_then(|rest| rest.to_str())
        .is_some_and(|rest| !rest.is_empty() && !rest.contains('/') && rest != "..");
    file_name_ok.then_some(path)
}

/// A peer's RDMA reach: its NIC count and each region's address and keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaInfo {
    /// NICs its regions are registered with.
    pub nics: u32,
    /// Per region: id, virtual address, one rkey per NIC.
    pub regions: Vec<(RegionId, u64, Vec<u32>)>,
    /// Regions in GPU memory its NICs could not register, with why.
    pub unreachable: Vec<(RegionId, String)>,
    /// Its NICs count WRITE_WITH_IMM arrivals (they have receive queues).
    pub arrivals: bool,
}

/// Most NICs a descriptor may list.
pub const MAX_RDMA_NICS: u32 = 16;

impl SegmentDescriptor {
    /// The wire form.
    pub fn to_proto(&self) -> proto::SegmentDescriptor {
        proto::SegmentDescriptor {
            name: self.name.clone(),
            epoch: self.epoch,
            host_id: self.host_id.clone(),
            pid: self.pid,
            instance: self.instance,
            gpu_fds: self.gpu_fds.clone().unwrap_or_default(),
            regions: self
                .regions
                .iter()
                .map(|r| {
                    let (gpu, gpu_handles, gpu_export_error, gpu_fabric_handles) =
                        super::gpu::to_proto(r.memory, &r.gpu_export);
                    proto::RegionDescriptor {
                        id: r.id.raw(),
                        kind: r.kind.to_proto() as i32,
                        len: r.len,
                        access: r.access.bits(),
                        layer: r.layer,
                        block_bytes: r.block_bytes,
                        shm_path: r.shm_path.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
                        addr: r.addr,
                        gpu,
                        gpu_handles,
                        gpu_export_error,
                        gpu_fabric_handles,
                    }
                })
                .collect(),
            endpoints: self
                .tcp_addr
                .iter()
                .map(|addr| proto::Endpoint { transport: proto::TransportKind::Tcp as i32, address: addr.clone() })
                .collect(),
            control_addr: self.control_addr.clone(),
            rdma: self.rdma.as_ref().map(|info| proto::RdmaInfo {
                nics: info.nics,
                regions: info
                    .regions
                    .iter()
                    .map(|(id, addr, rkeys)| proto::RdmaRegion { id: id.raw(), addr: *addr, rkeys: rkeys.clone() })
                    .collect(),
                unreachable: info
                    .unreachable
                    .iter()
                    .map(|(id, reason)| proto::RdmaUnreachable { id: id.raw(), reason: reason.clone() })
                    .collect(),
                arrivals: info.arrivals,
            }),
            cma: self.cma.as_ref().map(|cma| Box::new(cma.to_proto())),
        }
    }

    /// Checks and converts a descriptor received from a peer.
    pub fn from_proto(message: proto::SegmentDescriptor) -> Result<Self> {
        let bad = |reason: String| Error::malformed("segment descriptor", reason);
        if message.name.is_empty() || message.name.len() > MAX_SEGMENT_NAME_BYTES {
            return Err(bad(format!("name must be 1..={MAX_SEGMENT_NAME_BYTES} bytes, got {}", message.name.len())));
        }
        if message.regions.len() > MAX_DESCRIPTOR_REGIONS {
            return Err(bad(format!(
                "{} regions exceeds the limit of {MAX_DESCRIPTOR_REGIONS}",
                message.regions.len()
            )));
        }
        let mut regions = Vec::with_capacity(message.regions.len());
        let mut seen = std::collections::HashSet::with_capacity(message.regions.len());
        for r in message.regions {
            let id = RegionId::from_raw(r.id);
            if !seen.insert(id.index()) {
                return Err(bad(format!("region index {} listed twice", id.index())));
            }
            regions.push(RemoteRegion::from_proto(r)?);
        }
        let rdma = match message.rdma {
            None => None,
            Some(info) => {
                if info.nics == 0 || info.nics > MAX_RDMA_NICS {
                    return Err(bad(format!("rdma nics must be 1..={MAX_RDMA_NICS}, got {}", info.nics)));
                }
                if info.regions.len() > regions.len() {
                    return Err(bad(format!(
                        "rdma keys for {} regions but {} listed",
                        info.regions.len(),
                        regions.len()
                    )));
                }
                // One hash lookup per key entry: linear in what the peer
                // sent (a scan per entry made a 4 MiB handshake cost minutes).
                let mut listed: std::collections::HashSet<RegionId> = regions.iter().map(|r| r.id).collect();
                let mut keyed = Vec::with_capacity(info.regions.len());
                for r in info.regions {
                    let id = RegionId::from_raw(r.id);
                    if !listed.remove(&id) {
                        return Err(bad(format!("rdma keys for region {id}, which is not listed (or listed twice)")));
                    }
                    if r.rkeys.len() != info.nics as usize {
                        return Err(bad(format!("region {id} has {} rkeys for {} nics", r.rkeys.len(), info.nics)));
                    }
                    keyed.push((id, r.addr, r.rkeys));
                }
                let unreachable = check_unreachable(info.unreachable, &mut listed).map_err(bad)?;
                Some(RdmaInfo { nics: info.nics, regions: keyed, unreachable, arrivals: info.arrivals })
            }
        };
        let cma = match message.cma {
            Some(info) => CmaReach::from_proto(*info)?,
            None => None,
        };
        let tcp_addr = message
            .endpoints
            .iter()
            .find(|e| e.transport == proto::TransportKind::Tcp as i32)
            .map(|e| e.address.clone());
        Ok(Self {
            name: message.name,
            epoch: message.epoch,
            host_id: message.host_id,
            pid: message.pid,
            instance: message.instance,
            gpu_fds: match message.gpu_fds.as_str() {
                "" => None,
                name => Some(
                    crate::gpu::fd::check_socket_name(name)
                        .map_err(|reason| bad(format!("gpu_fds socket: {reason}")))?,
                ),
            },
            regions,
            control_addr: message.control_addr,
            tcp_addr,
            rdma,
            cma,
        })
    }
}

/// Checks a peer's unreachable regions: each listed, not keyed (taken out
/// of `listed`), its reason short.
fn check_unreachable(
    unreachable: Vec<proto::RdmaUnreachable>,
    listed: &mut std::collections::HashSet<RegionId>,
) -> std::result::Result<Vec<(RegionId, String)>, String> {
    let mut out = Vec::with_capacity(unreachable.len().min(listed.len()));
    for entry in unreachable {
        let id = RegionId::from_raw(entry.id);
        if !listed.remove(&id) {
            return Err(format!("rdma refusal for region {id}, which is not listed, keyed, or listed twice"));
        }
        if entry.reason.len() > super::gpu::MAX_EXPORT_ERROR_BYTES {
            return Err(format!("rdma refusal for region {id} of {} bytes", entry.reason.len()));
        }
        out.push((id, entry.reason));
    }
    Ok(out)
}

/// Identifies this host for the same-host check: boot id plus hostname,
/// read once per process (every handshake and open asks for it).
pub fn local_host_id() -> &'static str {
    static HOST_ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HOST_ID.get_or_init(|| {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}/{}", boot.trim(), host.trim())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> SegmentDescriptor {
        SegmentDescriptor {
            name: "decode-0".into(),
            epoch: 99,
            host_id: local_host_id().to_string(),
            pid: 1,
            instance: 7,
            gpu_fds: Some("kvring-gpu-fds-0000000000000007-0000000000000001".into()),
            regions: vec![RemoteRegion {
                id: RegionId::new(3, 1),
                kind: RegionKind::Key,
                len: 4096,
                access: Access::ALL,
                layer: 2,
                block_bytes: 512,
                shm_path: Some(PathBuf::from("/dev/shm/kvring-1-2-3")),
                addr: 0x7f00_0000_0000,
                memory: MemoryKind::Host,
                gpu_export: Ok(Vec::new()),
            }],
            control_addr: "127.0.0.1:9".into(),
            tcp_addr: Some("127.0.0.1:10".into()),
            rdma: Some(RdmaInfo {
                nics: 2,
                regions: vec![(RegionId::new(3, 1), 0x7f00_0000_0000, vec![11, 12])],
                unreachable: Vec::new(),
                arrivals: true,
            }),
            cma: Some(CmaReach::Offered {
                page: PathBuf::from("/dev/shm/kvring-1-2-4"),
                page_addr: 0x7f10_0000_0000,
                page_len: 8192,
            }),
        }
    }

    #[test]
    fn descriptor_round_trips() {
        let d = sample();
        assert_eq!(SegmentDescriptor::from_proto(d.to_proto()).unwrap(), d);
    }

    /// Each region adds its address and one rkey per NIC to the handshake,
    /// nothing more: an engine at the region limit with the most NICs
    /// still fits a control message many times over.
    #[test]
    #[cfg_attr(miri, ignore = "every region of the limit: minutes under Miri; the small descriptors run the same code")]
    fn rdma_keys_for_many_regions_keep_the_handshake_small() {
        use prost::Message;
        let regions = crate::engine::EngineConfig::default().max_regions;
        let nics = crate::engine::MAX_RDMA_NICS;
        let mut d = sample();
        d.regions = (0..regions as u32)
            .map(|i| RemoteRegion { id: RegionId::new(i, 1), shm_path: None, ..d.regions[0].clone() })
            .collect();
        let keyed = (0..regions as u32)
            .map(|i| {
                (
                    RegionId::new(i, 1),
                    0x7f00_0000_0000 + (u64::from(i) << 21),
                    (0..nics as u32).map(|n| 0x1_0000 + i * 8 + n).collect(),
                )
            })
            .collect();
        let plain = d.to_proto().encoded_len();
        d.rdma = Some(RdmaInfo { nics: nics as u32, regions: keyed, unreachable: Vec::new(), arrivals: true });
        let with_rdma = d.to_proto().encoded_len();
        let per_region = (with_rdma - plain) / regions;
        assert!(per_region <= 12 + 5 * nics, "{per_region} bytes per region for {nics} NICs");
        assert!(with_rdma * 8 < crate::control::frame::MAX_CONTROL_MESSAGE_BYTES as usize, "{with_rdma} bytes");
        assert_eq!(SegmentDescriptor::from_proto(d.to_proto()).unwrap(), d);
    }

    /// The largest descriptor a control message can carry, keyed for every
    /// region, decodes whole. (The check is meant to be linear in what a
    /// peer sends; a scan per key once made this take minutes. Time is not
    /// asserted here: a debug build on a loaded host proves nothing by it.)
    #[test]
    #[cfg_attr(
        miri,
        ignore = "4,095 regions take many minutes under Miri; the small descriptors' tests run the same code"
    )]
    fn a_maximal_descriptor_keyed_for_every_region_decodes_whole() {
        let mut p = sample().to_proto();
        let base = p.regions[0].clone();
        let keys = p.rdma.as_ref().unwrap().regions[0].clone();
        let count = MAX_DESCRIPTOR_REGIONS as u32 - 1;
        p.regions = (0..count)
            .map(|i| proto::RegionDescriptor { id: RegionId::new(i, 1).raw(), shm_path: String::new(), ..base.clone() })
            .collect();
        p.rdma.as_mut().unwrap().regions =
            (0..count).map(|i| proto::RdmaRegion { id: RegionId::new(i, 1).raw(), ..keys.clone() }).collect();
        // How long this takes is a figure, not a test (a quadratic check
        // would be ~4 billion comparisons here): that it decodes every
        // region is what is asserted.
        let d = SegmentDescriptor::from_proto(p).unwrap();
        assert_eq!(d.rdma.unwrap().regions.len(), count as usize);
    }

    #[test]
    fn hostile_descriptors_are_refused() {
        let mut p = sample().to_proto();
        p.regions[0].shm_path = "/dev/shm/../etc/passwd".into();
        assert!(SegmentDescriptor::from_proto(p)
            .unwrap_err()
            .to_string()
            .contains("not a file directly under /dev/shm"));
        let mut p = sample().to_proto();
        p.regions.push(p.regions[0].clone());
        assert!(SegmentDescriptor::from_proto(p).unwrap_err().to_string().contains("listed twice"));
        // A 64-bit id's slot past any registry's: refused, never a table
        // sized by it.
        let mut p = sample().to_proto();
        p.regions[0].id = RegionId::new(u32::MAX, 1).raw();
        assert!(SegmentDescriptor::from_proto(p).unwrap_err().to_string().contains("slot index past 65535"));
        let mut p = sample().to_proto();
        p.regions[0].id = RegionId::new(MAX_DESCRIPTOR_REGIONS as u32 - 1, u32::MAX).raw();
        p.rdma.as_mut().unwrap().regions[0].id = p.regions[0].id;
        assert!(SegmentDescriptor::from_proto(p).is_ok(), "the last index and generation decode");
        let mut p = sample().to_proto();
        p.rdma.as_mut().unwrap().regions[0].rkeys.pop();
        assert!(SegmentDescriptor::from_proto(p).unwrap_err().to_string().contains("1 rkeys for 2 nics"));
        let mut p = sample().to_proto();
        p.rdma.as_mut().unwrap().regions[0].id = RegionId::new(9, 1).raw();
        assert!(SegmentDescriptor::from_proto(p).unwrap_err().to_string().contains("which is not listed"));
        let refusal = |id: RegionId, reason: String| proto::RdmaUnreachable { id: id.raw(), reason };
        let mut p = sample().to_proto();
        p.rdma.as_mut().unwrap().unreachable.push(refusal(RegionId::new(3, 1), "no NIC took it".into()));
        assert!(SegmentDescriptor::from_proto(p).unwrap_err().to_string().contains("rdma refusal for region"));
        let mut p = sample().to_proto();
        p.rdma.as_mut().unwrap().regions.clear();
        p.rdma.as_mut().unwrap().unreachable.push(refusal(RegionId::new(3, 1), "x".repeat(5000)));
        assert!(SegmentDescriptor::from_proto(p).unwrap_err().to_string().contains("of 5000 bytes"));
        let mut p = sample().to_proto();
        p.rdma.as_mut().unwrap().regions.clear();
        p.rdma.as_mut().unwrap().unreachable.push(refusal(RegionId::new(3, 1), "no NIC took it".into()));
        let d = SegmentDescriptor::from_proto(p).unwrap();
        assert_eq!(d.rdma.unwrap().unreachable, [(RegionId::new(3, 1), "no NIC took it".to_string())]);
        let mut p = sample().to_proto();
        p.rdma.as_mut().unwrap().nics = 0;
        assert!(SegmentDescriptor::from_proto(p).unwrap_err().to_string().contains("rdma nics must be"));
        let mut p = sample().to_proto();
        p.regions[0].len = 0;
        assert!(SegmentDescriptor::from_proto(p).unwrap_err().to_string().contains("zero length"));
        let mut p = sample().to_proto();
        p.regions[0].kind = 42;
        assert!(SegmentDescriptor::from_proto(p).unwrap_err().to_string().contains("unknown kind 42"));
        let mut p = sample().to_proto();
        p.name.clear();
        assert!(SegmentDescriptor::from_proto(p).unwrap_err().to_string().contains("name must be"));
    }

    #[test]
    fn cma_offers_are_checked_and_refusals_kept_short() {
        let with = |f: &dyn Fn(&mut proto::CmaInfo)| {
            let mut p = sample().to_proto();
            f(p.cma.as_mut().unwrap());
            SegmentDescriptor::from_proto(p)
        };
        let refused = |f: &dyn Fn(&mut proto::CmaInfo)| with(f).unwrap_err().to_string();
        assert!(refused(&|c| c.page = "/etc/passwd".into()).contains("not a file directly under /dev/shm"));
        assert!(refused(&|c| c.page_len = 0).contains("outside 1..="));
        assert!(refused(&|c| c.page_len = MAX_CMA_PAGE_BYTES + 1).contains("outside 1..="));
        assert!(refused(&|c| c.page_addr = u64::MAX - 10).contains("not a valid range"));
        assert!(refused(&|c| c.page_addr = 0).contains("not a valid range"));
        let long = with(&|c| {
            c.page.clear();
            c.refused = "é".repeat(1000);
        })
        .unwrap();
        match long.cma {
            Some(CmaReach::Refused(why)) => assert!(why.len() <= MAX_CMA_REASON_BYTES && why.starts_with('é')),
            other => panic!("{other:?}"),
        }
        // Nothing said: an engine from before cma.
        let silent = with(&|c| *c = proto::CmaInfo::default()).unwrap();
        assert_eq!(silent.cma, None);
    }

    #[test]
    fn remote_checks_cover_rights_and_bounds() {
        let mut r = sample().regions[0].clone();
        assert!(r.check(0, 0, 4096, Access::REMOTE_WRITE).is_ok());
        assert!(matches!(
            r.check(1, 1, 4096, Access::REMOTE_WRITE),
            Err(Error::OutOfBounds { side: Side::Remote, .. })
        ));
        r.access = Access::REMOTE_READ;
        assert!(matches!(r.check(0, 0, 1, Access::REMOTE_WRITE), Err(Error::AccessDenied { side: Side::Remote, .. })));
    }
}

//! The same-host link, behind both `shm` and `cuda_ipc`: the peer's
//! shm-backed regions are mapped into this process and host-to-host blocks
//! are copied by the lane (one copy, no syscall, no peer thread); with a
//! GPU provider, the peer's device regions are opened too (`cuda_ipc.rs`)
//! and every block with GPU memory on either end goes to the GPU's copy
//! engines, one batched copy per chunk, ending when its event completes.

use super::cuda_ipc::{device_copy, DeviceCopier, FenceTables, PeerDevice, RemoteAt};
use super::{Block, ChunkEnd, LaneLink, Link, LinkState, Posted, TransportKind};
use crate::desc::BlockDesc;
use crate::error::{Error, Result, Side};
use crate::gpu::{CopyCounters, Gpu};
use crate::mem::fence::Pass;
use crate::mem::shm::{Entered, PeerRegion};
use crate::mem::ShmMapping;
use crate::ring::Opcode;
use crate::segment::SegmentDescriptor;
use std::sync::Arc;

/// A lane's view of one peer on this host: its shm-backed regions, indexed
/// by region slot, and (with a GPU provider) its device regions and this
/// lane's copier. The mappings and opened regions are made once and shared
/// by the lanes, so each lane's link holds pointers to them.
#[derive(Debug)]
pub(crate) struct ShmLink {
    pub(super) mappings: Arc<[Option<ShmMapping>]>,
    device: Option<(Arc<PeerDevice>, DeviceCopier)>,
    /// The mappings' share of `MAX_SHM_REGIONS_MAPPED`, given back when
    /// the last lane lets go of the peer.
    _budget: Arc<MappedBudget>,
}

impl ShmLink {
    /// Moves `blocks` as [`LaneLink::transfer`] does; with `sum`, continues
    /// it over each host block's source and destination as it is copied
    /// ([`LaneLink::transfer_summed`]).
    ///
    /// # Safety
    ///
    /// As [`LaneLink::transfer`].
    #[inline]
    unsafe fn transfer_with(
        &mut self,
        op: Opcode,
        ticket: u64,
        blocks: &[Block],
        mut sum: Option<&mut super::checksum::BlockSums>,
    ) -> Posted {
        // A link that moves GPU memory checks its peer is alive first (one
        // `poll`): its opened memory outlives the peer's process.
        if let Some(error) = self.device.as_ref().and_then(|(peer, _)| peer.gone()) {
            return Posted::Failed((error, 0));
        }
        let mut moved = 0;
        let mut failure = None;
        // The peer's region this chunk is inside, entered (its owner cannot
        // finish unregistering it until the guard drops): consecutive
        // blocks into one region enter it once.
        let mappings = self.mappings.clone();
        let mut entered: Option<(usize, Entered<'_>)> = None;
        // The fence table's pass of that region, for writes (`mem::fence`):
        // taken after `entered`, dropped before it.
        let mut fenced: Option<(usize, Pass<'_>)> = None;
        // On a link with a GPU, a write's count in a host region's table is
        // the copier's instead, kept until the chunk's copies ended (a GPU
        // copy into the mapping runs after this call returns).
        let host_tables = self.device.is_some().then(|| FenceTables::Mappings(self.mappings.clone()));
        for block in blocks {
            let index = block.desc.remote_region.index() as usize;
            if let Some(mapping) = mappings.get(index).and_then(Option::as_ref) {
                if entered.as_ref().map(|(at, _)| *at) != Some(index) {
                    fenced = None;
                    entered = None; // leave the previous region first
                    match mapping.enter() {
                        Some(guard) => entered = Some((index, guard)),
                        None => {
                            // Its owner unregistered it since this link
                            // mapped it: nothing may land there.
                            failure =
                                Some(Error::UnknownRegion { side: Side::Remote, region: block.desc.remote_region });
                            break;
                        }
                    }
                }
                let checked = match (&host_tables, self.device.as_mut()) {
                    (Some(tables), Some((_, copier))) if op == Opcode::Write => {
                        let range = (block.desc.remote_offset, block.desc.len);
                        copier.admit(tables, block.desc.remote_region, range, block.grant)
                    }
                    _ => admit(op, mapping, index, &mut fenced, block),
                };
                if let Err(error) = checked {
                    failure = Some(error);
                    break;
                }
            }
            let remote = match self.remote(op, &block.desc, block.desc_index) {
                Ok(remote) => remote,
                Err(error) => {
                    failure = Some(error);
                    break;
                }
            };
            if let Err(error) = self.admit_device(op, remote, block) {
                failure = Some(error);
                break;
            }
            // SAFETY: forwarded from our own contract; `remote` was found
            // for this block, inside the mapping entered above.
            match unsafe { self.copy_one(op, block, remote, sum.as_deref_mut()) } {
                Ok(host_bytes) => moved += host_bytes,
                Err(error) => {
                    failure = Some(error);
                    break;
                }
            }
        }
        drop(fenced);
        // Host copies are done: their region may be unregistered now. (A
        // GPU copy into a peer's host mapping was checked live when issued
        // but runs on after this; see docs/SECURITY.md.)
        drop(entered);
        match self.device.as_mut().map(|(_, copier)| copier).filter(|c| c.has_copies()) {
            // SAFETY: the blocks' local ranges stay valid until the chunk is
            // reported ended (our contract); the remote ones are the peer's
            // mappings and opened regions, which this link holds.
            Some(copier) => match unsafe { copier.issue(ticket, moved, failure) } {
                Ok(()) => Posted::InFlight,
                Err(error) => Posted::Failed((error, moved)),
            },
            None => {
                if let Some((_, copier)) = self.device.as_mut() {
                    copier.release_unissued();
                }
                match failure {
                    Some(error) => Posted::Failed((error, moved)),
                    None => Posted::Done(moved),
                }
            }
        }
    }

    /// A write into a peer's GPU memory: checked against the region's fence
    /// table page, the chunk counted there until its copies ended.
    fn admit_device(&mut self, op: Opcode, remote: RemoteAt, block: &Block) -> Result<()> {
        let (Opcode::Write, RemoteAt::Device(..), Some((peer, copier))) = (op, remote, self.device.as_mut()) else {
            return Ok(());
        };
        let region = block.desc.remote_region;
        copier.admit(peer.fences(region)?, region, (block.desc.remote_offset, block.desc.len), block.grant)
    }

    /// Copies one admitted block whose remote range is at `remote`: a host
    /// copy now (summed with `sum`), its bytes returned, or a GPU copy
    /// queued on the link's copier (0 bytes now).
    ///
    /// # Safety
    ///
    /// As [`LaneLink::transfer`], for `block`; `remote` is what
    /// [`ShmLink::remote`] found for it, its mapping entered.
    #[inline]
    unsafe fn copy_one(
        &mut self,
        op: Opcode,
        block: &Block,
        remote: RemoteAt,
        sum: Option<&mut super::checksum::BlockSums>,
    ) -> Result<u64> {
        let copier = self.device.as_mut().map(|(_, copier)| copier);
        match (device_copy(op, block.local as u64, block.memory, remote), copier, remote) {
            (Some(copy), Some(copier), _) if sum.is_none() => {
                copier.add(copy, block.desc.len);
                Ok(0)
            }
            // A checksummed block is summed where it is copied, and nothing
            // reads back a GPU copy (`verifies_landed`).
            (Some(_), _, _) if sum.is_some() => Err(super::checksum::device_refused()),
            (None, _, RemoteAt::Host(remote)) => {
                let (local, remote, len) = (block.local, remote as *mut u8, block.desc.len as usize);
                match sum {
                    // SAFETY: `local` is valid per our contract; `remote` is
                    // inside the peer's entered mapping (`remote` checked
                    // it); the lane alone touches the source meanwhile.
                    Some(sums) => unsafe {
                        let corrupt = super::checksum::take_corruption(super::checksum::landing_offset(op, block));
                        super::checksum_shm::copy_summed(op, (local, remote, len), sums, corrupt)
                    },
                    // SAFETY: as above.
                    None => unsafe { copy_host(op, local, remote, len) },
                }
                Ok(block.desc.len)
            }
            // GPU memory reaches a link only when it moves device memory
            // (the lane checks `moves_device_memory` first).
            _ => Err(Error::Unsupported { what: "GPU memory on a link without a GPU".into() }),
        }
    }

    /// Maps every shm-backed region of the peer, each only if its file
    /// proves to be that region of that peer (`ShmMapping::open_peer`), and
    /// with `gpu`, opens its device regions and pins the mappings. Fails
    /// when the peer is on another host, or exposes nothing this link can
    /// reach. Every lane gets a link over the same mappings, counting its
    /// GPU chunks in that lane's `counters`. Device memory's descriptors
    /// are fetched from the peer under `session` before `deadline`.
    pub fn open(
        descriptor: &SegmentDescriptor,
        lanes: &[Arc<CopyCounters>],
        kind: TransportKind,
        gpu: Option<Arc<dyn Gpu>>,
        session: Option<&crate::auth::Session>,
        deadline: std::time::Instant,
    ) -> Result<Link> {
        if descriptor.host_id != crate::segment::local_host_id() {
            return Err(Error::Unsupported {
                what: format!("{} to {}: the peer is on another host", kind.name(), descriptor.name),
            });
        }
        let budget = Arc::new(MappedBudget::take(descriptor)?);
        let mappings: Arc<[Option<ShmMapping>]> = map_peer(descriptor)?.into();
        let device = match &gpu {
            Some(gpu) => Some(Arc::new(PeerDevice::open(gpu.clone(), descriptor, session, deadline)?)),
            None => None,
        };
        let mapped = mappings.iter().flatten().count();
        if mapped == 0 && !device.as_ref().is_some_and(|d| d.has_regions()) && !descriptor.regions.is_empty() {
            return Err(Error::Unsupported {
                what: format!(
                    "{} to {}: none of its regions is shm-backed or GPU memory (allocate them with alloc_region)",
                    kind.name(),
                    descriptor.name
                ),
            });
        }
        if let Some(gpu) = &gpu {
            for mapping in mappings.iter().flatten() {
                // Copies between the GPU and the peer's memory then run at
                // full rate; without it they still run, staged by the driver.
                if let Err(error) = mapping.pin(gpu) {
                    tracing::debug!(%error, peer = %descriptor.name, "pinning a peer's region for the GPU");
                }
            }
        }
        let lanes = lanes
            .iter()
            .map(|counters| {
                let copier = |(d, g): (&Arc<PeerDevice>, &Arc<dyn Gpu>)| {
                    (d.clone(), DeviceCopier::new(g.clone(), counters.clone()))
                };
                let device = device.as_ref().zip(gpu.as_ref()).map(copier);
                Box::new(ShmLink { mappings: mappings.clone(), device, _budget: budget.clone() }) as Box<dyn LaneLink>
            })
            .collect();
        Ok(Link { state: LinkState::new(kind, false), lanes })
    }
}

/// The most shm-backed regions mapped from one peer. Each costs this
/// process a mapping (one of `vm.max_map_count`'s 65,530 by default) and
/// its pages faulted in; a descriptor may name 65,536 regions, and a peer
/// of this user can make region files that prove themselves as its own.
/// Equal to an engine's default region table, so two engines at their
/// defaults always reach each other (as `MAX_PEER_GPU_REGIONS`).
pub const MAX_PEER_SHM_REGIONS: usize = 4096;
const _: () = assert!(MAX_PEER_SHM_REGIONS == crate::mem::DEFAULT_MAX_REGIONS);

/// The most shm regions mapped from all peers together: eight peers at
/// `MAX_PEER_SHM_REGIONS`, half of `vm.max_map_count`'s default. The cap
/// per peer holds one handle; without this one, a process answering under
/// many names (each a handle of its own, 256 kept by default) could take
/// this process past `vm.max_map_count`, after which its own `mmap`s fail.
pub const MAX_SHM_REGIONS_MAPPED: usize = 8 * MAX_PEER_SHM_REGIONS;

/// Shm regions mapped from peers now, reserved before they are mapped.
static SHM_REGIONS_MAPPED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One peer's share of `MAX_SHM_REGIONS_MAPPED`, given back when dropped.
#[derive(Debug)]
struct MappedBudget(usize);

impl MappedBudget {
    /// Reserves room for the peer's shm-backed regions, or refuses them
    /// whole (`Busy`), before any file is opened.
    fn take(descriptor: &SegmentDescriptor) -> Result<Self> {
        use std::sync::atomic::Ordering;
        let backed = descriptor.regions.iter().filter(|r| r.shm_path.is_some()).count();
        if backed > MAX_PEER_SHM_REGIONS {
            // `map_peer` refuses it whole, by the cap per peer.
            return Ok(Self(0));
        }
        let reserved = SHM_REGIONS_MAPPED.fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
            now.checked_add(backed).filter(|&total| total <= MAX_SHM_REGIONS_MAPPED)
        });
        match reserved {
            Ok(_) => Ok(Self(backed)),
            // Retryable: room comes back as handles to other peers close.
            Err(_) => Err(Error::Busy {
                queue: "the shm regions mapped from all peers (MAX_SHM_REGIONS_MAPPED)",
                capacity: MAX_SHM_REGIONS_MAPPED,
            }),
        }
    }
}

impl Drop for MappedBudget {
    fn drop(&mut self) {
        SHM_REGIONS_MAPPED.fetch_sub(self.0, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Maps the peer's shm-backed regions, by region slot; a peer naming more
/// than `MAX_PEER_SHM_REGIONS` is refused whole (`PeerLimit`) before any
/// file is opened.
fn map_peer(descriptor: &SegmentDescriptor) -> Result<Vec<Option<ShmMapping>>> {
    let backed = descriptor.regions.iter().filter(|r| r.shm_path.is_some()).count();
    if backed > MAX_PEER_SHM_REGIONS {
        return Err(Error::PeerLimit {
            peer: descriptor.name.clone(),
            what: "shm regions",
            count: backed,
            limit: MAX_PEER_SHM_REGIONS,
            cap: "MAX_PEER_SHM_REGIONS",
        });
    }
    let max_index = descriptor.regions.iter().map(|r| r.id.index() as usize + 1).max().unwrap_or(0);
    let mut mappings: Vec<Option<ShmMapping>> = (0..max_index).map(|_| None).collect();
    for region in &descriptor.regions {
        if let Some(path) = &region.shm_path {
            let len = usize::try_from(region.len)
                .map_err(|_| Error::malformed("segment descriptor", format!("region {} too large", region.id)))?;
            let claim = PeerRegion { pid: descriptor.pid, epoch: descriptor.epoch, region: region.id, len };
            mappings[region.id.index() as usize] = Some(ShmMapping::open_peer(path, claim)?);
        }
    }
    Ok(mappings)
}

/// Blocks per chunk of host copies: the lane checks cancel and deadlines
/// between chunks.
pub const SHM_CHUNK_BLOCKS: usize = 16;
/// Blocks per chunk with a GPU: one batched copy each, so the more the
/// cheaper (the lane's chunk buffer holds at most this many).
pub const GPU_CHUNK_BLOCKS: usize = super::MAX_CHUNK_BLOCKS;

impl LaneLink for ShmLink {
    /// Host mappings are checked against their files' tables; the peer's
    /// GPU regions against their fence table pages, the chunk counted there
    /// until its copies ended.
    fn checks_grants(&self) -> bool {
        true
    }

    fn max_chunk(&self) -> usize {
        if self.device.is_some() {
            GPU_CHUNK_BLOCKS
        } else {
            SHM_CHUNK_BLOCKS
        }
    }

    fn moves_device_memory(&self) -> bool {
        self.device.is_some()
    }

    fn ends_on_its_own(&self) -> bool {
        self.device.is_some()
    }

    #[inline]
    unsafe fn transfer(&mut self, op: Opcode, _batch_id: u64, ticket: u64, blocks: &[Block]) -> Posted {
        // SAFETY: forwarded from our own contract.
        unsafe { self.transfer_with(op, ticket, blocks, None) }
    }

    unsafe fn transfer_summed(
        &mut self,
        op: Opcode,
        (_batch_id, ticket): (u64, u64),
        block: &Block,
        sums: &mut super::checksum::BlockSums,
    ) -> Posted {
        // SAFETY: forwarded from our own contract.
        unsafe { self.transfer_with(op, ticket, std::slice::from_ref(block), Some(sums)) }
    }
    fn verifies_landed(&self) -> bool {
        // A GPU provider's copies end later, on the copy engine: nothing is
        // read back there (docs/CHECKSUMS.md).
        self.device.is_none()
    }

    fn remote_crc32c(&mut self, op: Opcode, block: &Block, sum: &mut super::checksum::Crc32c) -> Result<()> {
        super::checksum_shm::remote_crc32c(self, op, block, sum)
    }

    fn corrupt_remote(&mut self, block: &Block) {
        super::checksum_shm::corrupt_remote(self, block)
    }

    fn poll(&mut self, ended: &mut Vec<ChunkEnd>) -> bool {
        self.device.as_mut().is_some_and(|(_, copier)| copier.poll(ended))
    }

    fn abort(&mut self, reason: &str, ended: &mut Vec<ChunkEnd>) {
        if let Some((_, copier)) = self.device.as_mut() {
            copier.abort(reason, ended);
        }
    }
}

impl ShmLink {
    /// Where a block's remote range is here: in a mapping, or in device
    /// memory opened here.
    #[inline]
    pub(super) fn remote(&self, op: Opcode, desc: &BlockDesc, desc_index: u32) -> Result<RemoteAt> {
        let index = desc.remote_region.index() as usize;
        if let Some(mapping) = self.mappings.get(index).and_then(Option::as_ref) {
            // The rights are the owner's, from its file's header: a
            // descriptor (a hostile peer's) cannot widen them.
            let needs = match op {
                Opcode::Write => crate::mem::Access::REMOTE_WRITE,
                Opcode::Read => crate::mem::Access::REMOTE_READ,
            };
            if !mapping.owner_access().contains(needs) {
                let needs = crate::mem::registry::access_name(needs);
                return Err(Error::AccessDenied { desc_index, side: Side::Remote, region: desc.remote_region, needs });
            }
            // The lane checked the range against the descriptor; the mapping
            // was made with the descriptor's length, so re-checking here is a
            // cheap second fence against ever touching memory outside it.
            crate::mem::registry::check_range(
                desc.remote_region,
                Side::Remote,
                desc_index,
                desc.remote_offset,
                desc.len,
                mapping.len() as u64,
            )?;
            // SAFETY: `remote_offset + len <= mapping.len()` (checked above).
            let at = unsafe { mapping.as_ptr().add(desc.remote_offset as usize) };
            return Ok(RemoteAt::Host(at as u64));
        }
        let device = self
            .device
            .as_ref()
            .and_then(|(peer, _)| peer.address(desc.remote_region, desc.remote_offset, desc.len, desc_index));
        match device {
            Some(found) => found.map(|(addr, ordinal)| RemoteAt::Device(addr, ordinal)),
            None => Err(Error::UnknownRegion { side: Side::Remote, region: desc.remote_region }),
        }
    }
}

/// Bytes of a block copied at a time ([`copy_pieces`]): on this machine
/// (AMD EPYC, glibc's AVX-512 `memmove`) a 1 MiB block copied in 8-16 KiB
/// pieces moved about 1.1x as fast as in one call, and a 64 KiB one as
/// fast. A checksummed block goes in smaller pieces of its own
/// (`checksum_shm::SUMMED_PIECE_BYTES`, 2 KiB), each summed, copied and
/// read back while it is in the L1 cache.
pub(crate) const COPY_PIECE_BYTES: usize = 8 << 10;

/// Copies one host block between local memory and a peer's mapping, in
/// pieces of [`COPY_PIECE_BYTES`].
///
/// # Safety
///
/// `local` is valid for `len` bytes as [`LaneLink::transfer`] requires, and
/// `remote` lies inside a mapping the link holds.
#[inline]
unsafe fn copy_host(op: Opcode, local: *mut u8, remote: *mut u8, len: usize) {
    let (src, dst) = match op {
        Opcode::Write => (local as *const u8, remote),
        Opcode::Read => (remote as *const u8, local),
    };
    if overlap(src, dst, len) {
        // Only when an engine maps its own region (loopback): one memmove.
        // SAFETY: per this function's contract.
        unsafe { std::ptr::copy(src, dst, len) };
        return;
    }
    // SAFETY: per this function's contract; the ranges do not overlap.
    unsafe { copy_pieces(src, dst, len) };
}

/// Copies `len` bytes from `src` to `dst` in pieces of
/// [`COPY_PIECE_BYTES`], each piece's destination lines fetched for writing
/// first: how shm copies a block (the checksummed copy goes by 2 KiB
/// pieces and sums each around its copy, `checksum_shm::copy_summed`).
///
/// # Safety
///
/// `src` is valid for reads and `dst` for writes of `len` bytes, and the
/// two ranges do not overlap.
#[inline]
pub(crate) unsafe fn copy_pieces(src: *const u8, dst: *mut u8, len: usize) {
    let mut done = 0;
    while done < len {
        let n = (len - done).min(COPY_PIECE_BYTES);
        prefetch_for_write(dst.wrapping_add(done), n);
        // SAFETY: `done + n <= len`, inside both ranges (per this
        // function's contract), which do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), n) };
        done += n;
    }
}

/// Asks for the cache lines of `len` bytes at `at` in the state for
/// writing (x86-64 `prefetchw`; nothing elsewhere). A hint: it never
/// faults, and a line it misses is fetched by the store as usual.
#[inline]
pub(super) fn prefetch_for_write(at: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0};
        let mut line = 0;
        while line < len {
            // SAFETY: SSE, which the intrinsic needs, is part of x86-64's
            // baseline; a prefetch reads and writes nothing, and never
            // faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_ET0>(at.wrapping_add(line).cast::<i8>()) };
            line += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (at, len);
}

/// Whether `len` bytes at `src` and at `dst` share a byte.
#[inline]
pub(super) fn overlap(src: *const u8, dst: *const u8, len: usize) -> bool {
    let (from, to) = (src as usize, dst as usize);
    from < to.wrapping_add(len) && to < from.wrapping_add(len)
}

/// A write's fence check (`mem::fence`): enters the region's fence table
/// once per run of blocks into it (the pass held in `fenced` until the
/// copies of the run end), then checks the block's range under its grant.
/// Reads are not fenced.
#[inline]
fn admit<'a>(
    op: Opcode,
    mapping: &'a ShmMapping,
    index: usize,
    fenced: &mut Option<(usize, Pass<'a>)>,
    block: &Block,
) -> Result<()> {
    if op != Opcode::Write {
        return Ok(());
    }
    let region = block.desc.remote_region;
    if fenced.as_ref().map(|(at, _)| *at) != Some(index) {
        *fenced = None;
        let pass = mapping.fences().enter().ok_or(Error::RegionBusy { region, in_flight: 0 })?;
        *fenced = Some((index, pass));
    }
    let Some((_, pass)) = fenced.as_ref() else { return Ok(()) };
    let start = block.desc.remote_offset;
    let end = start.saturating_add(block.desc.len);
    if pass.admits(start, end, block.grant) {
        Ok(())
    } else {
        Err(Error::Fenced { region, grant: block.grant })
    }
}

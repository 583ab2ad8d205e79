//! The GPU half of the same-host link (`cuda_ipc`): a peer's device regions,
//! opened once per segment by their IPC handles and closed when the last
//! lane lets go of the link, and each lane's copier, which turns a chunk
//! into one batched copy on the lane's own stream and learns its end by
//! polling an event in the lane's loop (never a blocking synchronize).
//!
//! Device bytes are never touched by a host thread: a chunk's copies go to
//! the GPU provider, and the chunk ends `Done` only once the event recorded
//! after them reports complete, so a batch is never reported done before
//! its bytes are in place (Mooncake PR #1918 is the bug this rules out).

pub(crate) use super::fence_holds::FenceTables;
use super::fence_holds::{release_if_done, FenceHold, STOP_FENCE_WAIT};
use crate::auth::Session;
use crate::desc::RegionId;
use crate::error::{Error, Result, Side};
use crate::gpu::{Copy, CopyCounters, CopySides, Event, Gpu, HandleKind, Memory, Place, Shareable, Stream};
use crate::mem::fence_file::SharedFences;
use crate::mem::Access;
use crate::mem::MemoryKind;
use crate::segment::{RemoteRegion, SegmentDescriptor};
use crate::transport::gpu_fds::{self, client::GpuFdClient};
use crate::transport::{ChunkEnd, TransferError};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use crate::gpu::MAX_PEER_GPU_REGIONS;
// Two engines at their defaults must reach each other.
const _: () = assert!(MAX_PEER_GPU_REGIONS == crate::mem::DEFAULT_MAX_REGIONS);

/// A peer region in device memory, as this process reaches it.
#[derive(Debug, Clone, Copy)]
struct OpenedRegion {
    /// Its first byte here.
    ptr: u64,
    len: u64,
    /// The GPU holding it, as this process numbers them.
    ordinal: u32,
    /// Opened from the peer's export (closed when dropped); false for a peer
    /// in this very process, whose device pointers are valid here as they are.
    opened: bool,
}

/// A peer's device regions, opened once per segment and shared by the
/// lanes' links; each is closed when the last link holding it is dropped
/// (after its chunks ended), so a restarted peer's memory is never used.
#[derive(Debug)]
pub(crate) struct PeerDevice {
    gpu: Arc<dyn Gpu>,
    name: String,
    /// By region index: where it is here, or why it cannot be reached.
    regions: Vec<Option<std::result::Result<OpenedRegion, String>>>,
    /// By region index, for regions peers may write: the region's fence
    /// table page as mapped here (`mem::fence_file`), or why it is not.
    fences: Vec<Option<std::result::Result<FenceTables, String>>>,
    /// The peer process (another than this one), watched for its exit:
    /// memory opened from a process that is gone must never be reported
    /// as its memory written.
    process: Option<(u32, std::os::fd::OwnedFd)>,
}

impl PeerDevice {
    /// Opens every device region of the peer. A handle that does not open
    /// (the peer exited, restarted or freed the memory) fails the whole
    /// open; a region its owner could not export is recorded with the
    /// reason, and only batches naming it fail. Descriptors come only from
    /// the peer's own socket, proven under `session` (`gpu_fds`); a peer
    /// in this very process (its instance id, and the pid the handshake
    /// bound to the process that answered, are ours) is reached through
    /// its engine's own registry, never at an address its descriptor names.
    pub fn open(
        gpu: Arc<dyn Gpu>,
        descriptor: &SegmentDescriptor,
        session: Option<&Session>,
        deadline: Instant,
    ) -> Result<Self> {
        let device = descriptor.regions.iter().filter(|r| r.memory != MemoryKind::Host).count();
        if device > MAX_PEER_GPU_REGIONS {
            // Refused before anything is opened or mapped, so the peer's
            // count costs this process nothing.
            return Err(Error::PeerLimit {
                peer: descriptor.name.clone(),
                what: "GPU regions",
                count: device,
                limit: MAX_PEER_GPU_REGIONS,
                cap: "MAX_PEER_GPU_REGIONS",
            });
        }
        let slots = descriptor.regions.iter().map(|r| r.id.index() as usize + 1).max().unwrap_or(0);
        let same_process = descriptor.instance == crate::gpu::fd::instance() && descriptor.pid == std::process::id();
        // Opened before its memory: a process that exits after this is
        // seen exited, whatever reuses its pid.
        let process = match same_process {
            true => None,
            false => crate::gpu::fd::pidfd_open(descriptor.pid).ok().map(|fd| (descriptor.pid, fd)),
        };
        let fences = (0..slots).map(|_| None).collect();
        let mut peer = PeerDevice { gpu, name: descriptor.name.clone(), regions: vec![None; slots], fences, process };
        let mut client: Option<GpuFdClient> = None;
        for region in descriptor.regions.iter().filter(|r| r.memory != MemoryKind::Host) {
            let at = region.id.index() as usize;
            if region.access.contains(Access::REMOTE_WRITE) && region.gpu_export.is_ok() {
                let page = match same_process {
                    true => peer.own_fences(descriptor, region.id),
                    false => connected(&mut client, descriptor, session, deadline)
                        .and_then(|c| c.fence_fd(region.id))
                        .map_err(|e| e.to_string())
                        .and_then(SharedFences::open_peer)
                        .map(Arc::new),
                };
                peer.fences[at] = Some(page.map(FenceTables::Page));
            }
            let reached = match &region.gpu_export {
                Err(reason) => Err(format!("its owner could not export it ({reason})")),
                Ok(_) if same_process => peer.own(descriptor, region),
                Ok(handles) => {
                    // One kind for the whole export (`check_handles`, in open).
                    let kind = handles.first().map_or(HandleKind::FileDescriptor, |h| h.kind);
                    let mut fds = |index: usize| -> Result<Shareable> {
                        connected(&mut client, descriptor, session, deadline)?.handle(
                            region.id,
                            kind,
                            handles.len(),
                            index,
                        )
                    };
                    let ptr = peer.gpu.open(handles, &mut fds).map_err(|e| opening(&descriptor.name, region.id, e))?;
                    // Recorded at once, so that dropping `peer` closes it
                    // whatever happens next.
                    let opened = OpenedRegion { ptr: ptr.0, len: region.len, ordinal: 0, opened: true };
                    peer.regions[at] = Some(Ok(opened));
                    // The GPU whose context maps it (a legacy handle's
                    // opener) carries its copies; else the GPU holding it.
                    let ordinal = match peer.gpu.opened_device(ptr) {
                        Some(device) => device,
                        None => {
                            peer.ordinal_of(ptr.0, region.len).map_err(|e| opening(&descriptor.name, region.id, e))?
                        }
                    };
                    peer.regions[at] = Some(Ok(OpenedRegion { ordinal, ..opened }));
                    continue;
                }
            };
            peer.regions[region.id.index() as usize] = Some(reached);
        }
        Ok(peer)
    }

    /// The fence table page of region `id` of an engine of this very
    /// process, as its own registry has it.
    fn own_fences(
        &self,
        descriptor: &SegmentDescriptor,
        id: RegionId,
    ) -> std::result::Result<Arc<SharedFences>, String> {
        let name = descriptor.gpu_fds.as_deref().ok_or("an engine of this process that serves no GPU socket")?;
        gpu_fds::server::local_fences(name, id).ok_or_else(|| format!("no engine of this process serves {name}"))?
    }

    /// The fence table page of peer region `region`, which a write into it
    /// checks (`Unsupported` with the reason when it could not be mapped:
    /// an unchecked write is never let through).
    pub fn fences(&self, region: RegionId) -> Result<&FenceTables> {
        match self.fences.get(region.index() as usize).and_then(Option::as_ref) {
            Some(Ok(page)) => Ok(page),
            Some(Err(reason)) => Err(Error::Unsupported {
                what: format!(
                    "a write into region {region} of {}: its fence table is not reachable ({reason})",
                    self.name
                ),
            }),
            None => Err(Error::Unsupported {
                what: format!("a write into region {region} of {}: its owner grants peers no write there", self.name),
            }),
        }
    }

    /// A region of an engine of this very process, where its own registry
    /// has it: at least as long, and granting peers every right the
    /// descriptor claims.
    fn own(&self, descriptor: &SegmentDescriptor, region: &RemoteRegion) -> std::result::Result<OpenedRegion, String> {
        let (id, len) = (region.id, region.len);
        let name = descriptor.gpu_fds.as_deref().ok_or("an engine of this process that serves no GPU socket")?;
        let (addr, registered, access) = gpu_fds::server::local_region(name, id)
            .ok_or_else(|| format!("no engine of this process serves {name}"))??;
        if registered < len {
            return Err(format!("region {id} is {registered} bytes here, not {len}"));
        }
        let claimed = Access::from_bits(region.access.bits() & (Access::REMOTE_READ | Access::REMOTE_WRITE).bits());
        if !access.contains(claimed) {
            return Err(format!("region {id} grants peers less here than its descriptor claims"));
        }
        self.local(addr, len)
    }

    /// A device range of this process, as this engine's provider sees it.
    fn local(&self, addr: u64, len: u64) -> std::result::Result<OpenedRegion, String> {
        let ordinal = self.ordinal_of(addr, len).map_err(|e| e.to_string())?;
        Ok(OpenedRegion { ptr: addr, len, ordinal, opened: false })
    }

    /// The GPU holding `addr..addr + len`, which must be device memory.
    fn ordinal_of(&self, addr: u64, len: u64) -> Result<u32> {
        match self.gpu.classify(addr, len)? {
            Memory::Device { ordinal, .. } => Ok(ordinal),
            _ => Err(Error::Gpu {
                device: self.gpu.provider().into(),
                reason: format!("{addr:#x}+{len} is not device memory to this engine's GPU provider"),
            }),
        }
    }

    /// `PeerRestarted` once the peer's process has exited (one `poll` of
    /// its pidfd): its opened memory may still be mapped here, but writing
    /// it would reach nobody, and reading it would return stale bytes.
    pub fn gone(&self) -> Option<Error> {
        let (pid, pidfd) = self.process.as_ref()?;
        crate::gpu::fd::exited(pidfd).then(|| Error::PeerRestarted {
            segment: self.name.clone(),
            detail: format!("its process {pid} exited; open the segment again to reach its successor"),
        })
    }

    /// True when the peer has a region in device memory.
    pub fn has_regions(&self) -> bool {
        self.regions.iter().any(Option::is_some)
    }

    /// Where `offset..offset + len` of peer region `region` is here, and on
    /// which GPU; `None` when the region is not in device memory.
    pub fn address(&self, region: RegionId, offset: u64, len: u64, desc_index: u32) -> Option<Result<(u64, u32)>> {
        let reached = self.regions.get(region.index() as usize)?.as_ref()?;
        Some(match reached {
            Err(reason) => Err(Error::Unsupported {
                what: format!("region {region} of {}: GPU memory this engine cannot open: {reason}", self.name),
            }),
            Ok(opened) => {
                // The lane checked the range against the descriptor; this
                // second fence keeps a copy inside what was opened.
                crate::mem::registry::check_range(region, Side::Remote, desc_index, offset, len, opened.len)
                    .map(|()| (opened.ptr + offset, opened.ordinal))
            }
        })
    }
}

impl Drop for PeerDevice {
    fn drop(&mut self) {
        for opened in self.regions.iter().flatten().flatten().filter(|r| r.opened) {
            // SAFETY: the last lane link using these regions is gone, and a
            // link is dropped only once its chunks in flight have ended.
            if let Err(error) = unsafe { self.gpu.close(crate::gpu::DevicePtr(opened.ptr)) } {
                tracing::debug!(%error, peer = %self.name, "closing a peer's GPU memory");
            }
        }
    }
}

/// The connection to the peer's GPU descriptor socket, made at first use.
fn connected<'a>(
    client: &'a mut Option<GpuFdClient>,
    descriptor: &SegmentDescriptor,
    session: Option<&Session>,
    deadline: Instant,
) -> Result<&'a mut GpuFdClient> {
    if client.is_none() {
        let name = descriptor.gpu_fds.as_deref().ok_or_else(|| Error::Unsupported {
            what: format!("{}: its GPU memory needs descriptors it serves no socket for", descriptor.name),
        })?;
        let made = GpuFdClient::connect(&descriptor.name, name, descriptor.pid, session, descriptor.epoch, deadline)?;
        *client = Some(made);
    }
    Ok(client.as_mut().expect("connected above"))
}

fn opening(peer: &str, region: RegionId, error: Error) -> Error {
    match error {
        // The peer's descriptor socket stalled past the open's deadline:
        // the caller's typed `Timeout`, not a device error to read.
        Error::Timeout { .. } => error,
        // The driver refused this process the peer's memory (a FABRIC
        // handle off the exporter's IMEX channel): typed as such.
        Error::Unauthorized { reason } => {
            Error::Unauthorized { reason: format!("opening region {region} of {peer}: {reason}") }
        }
        error => Error::Gpu {
            device: "cuda_ipc".into(),
            reason: format!("opening region {region} of {peer} (has it exited, restarted or freed it?): {error}"),
        },
    }
}

/// A chunk whose copies were issued and whose event is not yet seen
/// complete.
#[derive(Debug)]
struct Pending {
    ticket: u64,
    device: u32,
    event: Event,
    /// Bytes the chunk moves (its host copies done already, its device
    /// copies once the event completes).
    bytes: u64,
    /// A block of the chunk that was refused after earlier ones were
    /// issued: the chunk fails with it, once the earlier copies ended.
    failure: Option<Error>,
    /// Its writer counts in the fence tables of the peer regions it writes,
    /// released when cleared: after its event completed.
    holds: Vec<FenceHold>,
}

/// One lane's GPU copier: its streams and events (one per GPU it has used,
/// made at first use and reused), the chunk being built, and the chunks in
/// flight. Only its lane drives it.
#[derive(Debug)]
pub(crate) struct DeviceCopier {
    gpu: Arc<dyn Gpu>,
    streams: Vec<(u32, Stream)>,
    free_events: Vec<(u32, Event)>,
    in_flight: VecDeque<Pending>,
    /// The chunk being built, merged where blocks continue each other.
    copies: Vec<Copy>,
    /// Where each copy's ends live, for the provider's choice of method.
    sides: Vec<CopySides>,
    copy_bytes: u64,
    /// The lane's count of chunks by the method they really went by.
    counters: Arc<CopyCounters>,
    /// The GPU whose stream carries the chunk (its first device side).
    device: Option<u32>,
    /// The chunk being built's counts in fence tables (one per run of its
    /// blocks into one peer region).
    holds: Vec<FenceHold>,
    /// Emptied `holds` of ended chunks, reused.
    spare_holds: Vec<Vec<FenceHold>>,
    /// The allocations holding the last copy's source and destination, as
    /// far as the provider said (asked at the copy's first merge, once a
    /// copy): a merge never crosses into another allocation.
    spans: [Option<(u64, u64)>; 2],
}

impl DeviceCopier {
    /// A copier with nothing made yet, counting its chunks' methods in
    /// `counters` (its lane's).
    pub fn new(gpu: Arc<dyn Gpu>, counters: Arc<CopyCounters>) -> Self {
        Self {
            gpu,
            streams: Vec::new(),
            free_events: Vec::new(),
            in_flight: VecDeque::new(),
            copies: Vec::with_capacity(super::MAX_CHUNK_BLOCKS),
            sides: Vec::with_capacity(super::MAX_CHUNK_BLOCKS),
            copy_bytes: 0,
            counters,
            device: None,
            holds: Vec::new(),
            spare_holds: Vec::new(),
            spans: [None; 2],
        }
    }

    /// Checks a write of `len` bytes at `offset` of peer region `region`
    /// under `grant` against the region's fence table `page`, before the
    /// block's copy is added: the chunk enters the table once per run of
    /// blocks into one region and stays counted there until its copies
    /// ended (or it is dropped unissued), so once the owner's `fence`
    /// returned no stale copy of it can still land. `Fenced` when a newer
    /// fence covers the range; `RegionBusy` when fences kept flipping the
    /// table's phase.
    pub fn admit(
        &mut self,
        tables: &FenceTables,
        region: RegionId,
        (offset, len): (u64, u64),
        grant: u32,
    ) -> Result<()> {
        let slot = region.index() as usize;
        let view = tables.view(slot).ok_or(Error::UnknownRegion { side: Side::Remote, region })?;
        let words = view.words().as_ptr() as usize;
        if self.holds.last().is_none_or(|h| h.words != words) {
            let pass = view.enter().ok_or(Error::RegionBusy { region, in_flight: 0 })?;
            self.holds.push(FenceHold { _tables: tables.clone(), words, held: Some(pass.detach()) });
        }
        let held = self.holds.last().and_then(|h| h.held.as_ref()).expect("held until dropped");
        match view.admits_held(held, offset, offset.saturating_add(len), grant) {
            true => Ok(()),
            false => Err(Error::Fenced { region, grant }),
        }
    }

    /// Drops the counts of a chunk that issues no copy.
    pub fn release_unissued(&mut self) {
        self.holds.clear();
    }

    /// Adds a copy to the chunk being built; one that continues the last on
    /// both sides, in the same kinds of memory and the same allocations,
    /// extends it (adjacent blocks cost one copy, not one each). Blocks of
    /// two allocations that merely sit side by side (back-to-back
    /// `cudaMalloc`s) stay two copies: the driver refuses a copy spanning
    /// both, and would fail the whole chunk (GPU-REVIEW #9).
    pub fn add(&mut self, copy: DeviceCopy, len: u64) {
        let DeviceCopy { src, dst, sides, device } = copy;
        self.device.get_or_insert(device);
        self.copy_bytes += len;
        if let (Some(&last), Some(&last_sides)) = (self.copies.last(), self.sides.last()) {
            let continues = last.src + last.len == src && last.dst + last.len == dst && last_sides == sides;
            if continues
                && self.one_allocation(0, sides.src, last.src, src + len)
                && self.one_allocation(1, sides.dst, last.dst, dst + len)
            {
                self.copies.last_mut().expect("a last copy").len += len;
                return;
            }
        }
        self.copies.push(Copy { src, dst, len });
        self.sides.push(sides);
        self.spans = [None; 2];
    }

    /// True when `start..end` (one side of a merged copy, `side` 0 for the
    /// source, 1 for the destination) lies in one allocation, or the
    /// provider knows no bounds there (host memory).
    fn one_allocation(&mut self, side: usize, place: Place, start: u64, end: u64) -> bool {
        if place == Place::Host {
            return true;
        }
        let span = match self.spans[side] {
            Some(span) => span,
            None => match self.gpu.allocation_span(start) {
                Some(span) => *self.spans[side].insert(span),
                None => return true,
            },
        };
        span.0 <= start && end <= span.0.saturating_add(span.1)
    }

    /// Chunks whose copies are running.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// True when the chunk being built has copies.
    pub fn has_copies(&self) -> bool {
        !self.copies.is_empty()
    }

    /// Issues the chunk under `ticket`: one batched copy, then its event.
    /// `host_bytes` were moved by the host already; `failure`, when set,
    /// fails the chunk once its copies ended. On error nothing is in flight
    /// and the chunk being built is dropped.
    ///
    /// # Safety
    ///
    /// Every host range of the chunk's copies stays valid and untouched
    /// until the chunk is reported ended by [`DeviceCopier::poll`] or
    /// [`DeviceCopier::abort`].
    pub unsafe fn issue(&mut self, ticket: u64, host_bytes: u64, failure: Option<Error>) -> Result<()> {
        let device = self.device.take().unwrap_or(0);
        let bytes = host_bytes + std::mem::take(&mut self.copy_bytes);
        let issued = (|| {
            let stream = self.stream(device)?;
            let event = self.event(device)?;
            // SAFETY: forwarded from our caller; `sides` were taken from the
            // registry and the peer's descriptor, one per copy.
            let copied = unsafe { self.gpu.copy_batch(stream, &self.copies, &self.sides) };
            match copied.and_then(|method| self.gpu.record(stream, event).map(|()| method)) {
                Ok(method) => {
                    self.counters.count(method);
                    Ok(event)
                }
                Err(error) => {
                    self.free_events.push((device, event));
                    Err(error)
                }
            }
        })();
        self.copies.clear();
        self.sides.clear();
        // Released with the chunk when nothing was issued; the emptied
        // vectors come back for later chunks (no allocation per chunk).
        let spare = self.spare_holds.pop().unwrap_or_default();
        let holds = std::mem::replace(&mut self.holds, spare);
        let event = issued?;
        self.in_flight.push_back(Pending { ticket, device, event, bytes, failure, holds });
        Ok(())
    }

    /// The lane's stream on `device`, made at its first use.
    fn stream(&mut self, device: u32) -> Result<Stream> {
        if let Some(&(_, stream)) = self.streams.iter().find(|(d, _)| *d == device) {
            return Ok(stream);
        }
        let stream = self.gpu.create_stream(device)?;
        self.streams.push((device, stream));
        Ok(stream)
    }

    /// A free event of `device`, made when none is free.
    fn event(&mut self, device: u32) -> Result<Event> {
        match self.free_events.iter().position(|(d, _)| *d == device) {
            Some(at) => Ok(self.free_events.swap_remove(at).1),
            None => self.gpu.create_event(device),
        }
    }

    /// Ends the chunks whose events completed (each stream's in order: one
    /// not yet complete holds back the later ones of its stream). Returns
    /// true if any ended.
    pub fn poll(&mut self, ended: &mut Vec<ChunkEnd>) -> bool {
        let before = ended.len();
        let mut waiting: u64 = 0; // bit per stream index seen incomplete
        let mut index = 0;
        while index < self.in_flight.len() {
            let pending = &self.in_flight[index];
            let stream_bit = 1u64 << (self.streams.iter().position(|(d, _)| *d == pending.device).unwrap_or(0) % 64);
            if waiting & stream_bit != 0 {
                index += 1;
                continue;
            }
            let result = match self.gpu.query(pending.event) {
                Ok(false) => {
                    waiting |= stream_bit;
                    index += 1;
                    continue;
                }
                Ok(true) => Ok(()),
                Err(error) => Err(error),
            };
            let mut pending = self.in_flight.remove(index).expect("index is in range");
            self.free_events.push((pending.device, pending.event));
            match result {
                // The copies ended: a fence waiting for them may return.
                Ok(()) => pending.holds.clear(),
                // Whether they ended is unknown: they stay counted.
                Err(_) => pending.holds.drain(..).for_each(FenceHold::poison),
            }
            self.spare_holds.push(std::mem::take(&mut pending.holds));
            let end: std::result::Result<u64, TransferError> = match (result, pending.failure) {
                (Ok(()), None) => Ok(pending.bytes),
                (Ok(()), Some(failure)) => Err((failure, pending.bytes)),
                (Err(error), _) => Err((error, 0)),
            };
            ended.push((pending.ticket, end));
        }
        ended.len() > before
    }

    /// Ends every chunk in flight as failed (the lane is stopping): a copy
    /// cannot be recalled from the GPU, so this is for the lane's exit only.
    pub fn abort(&mut self, reason: &str, ended: &mut Vec<ChunkEnd>) {
        let deadline = std::time::Instant::now() + STOP_FENCE_WAIT;
        for mut pending in self.in_flight.drain(..) {
            let error = Error::Gpu { device: "cuda_ipc".into(), reason: reason.into() };
            ended.push((pending.ticket, Err((error, 0))));
            release_if_done(&*self.gpu, pending.event, &mut pending.holds, deadline);
            let _ = self.gpu.destroy_event(pending.event);
        }
    }
}

impl Drop for DeviceCopier {
    fn drop(&mut self) {
        for (_, event) in self.free_events.drain(..) {
            let _ = self.gpu.destroy_event(event);
        }
        let deadline = std::time::Instant::now() + STOP_FENCE_WAIT;
        for mut pending in self.in_flight.drain(..) {
            release_if_done(&*self.gpu, pending.event, &mut pending.holds, deadline);
            let _ = self.gpu.destroy_event(pending.event);
        }
        for (_, stream) in self.streams.drain(..) {
            let _ = self.gpu.destroy_stream(stream);
        }
    }
}

/// Where a block's remote bytes are for the same-host link.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RemoteAt {
    /// In the peer's shm mapping, here.
    Host(u64),
    /// In the peer's device memory opened here, on this GPU.
    Device(u64, u32),
}

/// One block's copy for the GPU: its ends, where they live, and the GPU
/// whose stream carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceCopy {
    pub src: u64,
    pub dst: u64,
    pub sides: CopySides,
    pub device: u32,
}

/// A block's copy for the GPU; `None` when both ends are host memory (the
/// host copies it). The remote end's GPU carries it where the remote end is
/// device memory: a peer's legacy IPC memory is mapped only in the context
/// that opened it ("into the current device address space",
/// `cuIpcOpenMemHandle`), which is that GPU, and it reaches the local
/// end by peer access (GPU-REVIEW #4); else the local end's GPU.
pub(crate) fn device_copy(
    op: crate::ring::Opcode,
    local: u64,
    memory: MemoryKind,
    remote: RemoteAt,
) -> Option<DeviceCopy> {
    let (remote_addr, remote_place) = match remote {
        RemoteAt::Host(addr) => (addr, Place::Host),
        RemoteAt::Device(addr, ordinal) => (addr, Place::Device(ordinal)),
    };
    let local_place = match memory {
        MemoryKind::Gpu(ordinal) => Place::Device(ordinal),
        MemoryKind::Host => Place::Host,
    };
    let device = match (local_place, remote_place) {
        (_, Place::Device(ordinal)) | (Place::Device(ordinal), Place::Host) => ordinal,
        (Place::Host, Place::Host) => return None,
    };
    Some(match op {
        crate::ring::Opcode::Write => DeviceCopy {
            src: local,
            dst: remote_addr,
            sides: CopySides { src: local_place, dst: remote_place },
            device,
        },
        crate::ring::Opcode::Read => DeviceCopy {
            src: remote_addr,
            dst: local,
            sides: CopySides { src: remote_place, dst: local_place },
            device,
        },
    })
}

/// Longest a stopping link or lane waits for its staging copies to end.
const STAGE_STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

impl DeviceCopier {
    /// Before `pool`'s staging pages are unmapped (a link or a lane
    /// stopping with chunks in flight): waits, bounded by
    /// [`STAGE_STOP_WAIT`], for the copies still running on them, dropping
    /// their ends (nobody waits for them any more). Past that the pages are
    /// leaked rather than unmapped under a copy: a GPU that never answers
    /// must not hang the engine's drop.
    pub fn drain_before_unmap(&mut self, ends: &mut Vec<ChunkEnd>, pool: &mut crate::transport::stage::StagePool) {
        let deadline = std::time::Instant::now() + STAGE_STOP_WAIT;
        let mut pause = std::time::Duration::from_micros(20);
        while self.in_flight() > 0 && std::time::Instant::now() < deadline {
            self.poll(ends);
            ends.clear();
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_millis(1));
        }
        if self.in_flight() > 0 {
            tracing::warn!("a staging copy did not end within {STAGE_STOP_WAIT:?}; its pages are leaked, not unmapped");
            let empty = crate::transport::stage::StagePool::new(pool.gpu().clone(), 1, Arc::default());
            std::mem::forget(std::mem::replace(pool, empty));
        }
    }
}

//! The simulated provider's device memory: allocations, their two views,
//! runs of pieces (the virtual memory API's shape), exports and opens.
//!
//! Every piece is a `memfd` mapped twice: at its device address with no
//! access at all (a host dereference faults), and once more, readable and
//! writable, where only the stand-in copy engine reaches it. A handle names
//! the allocation (or piece) by its address in the exporter; the memfd
//! itself reaches a peer only as the exporter shares it (`share`, passed
//! over the exporter's socket), the path real device memory of the virtual
//! memory API takes. An opened piece keeps its mappings, not its
//! descriptor.
use super::super::{fd, DevicePtr, DmaBuf, Export, FdSource, HandleKind, IpcHandle};
use super::{gpu_error, SimGpu, State};
use crate::error::{Error, Result};
use memmap2::MmapRaw;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;

/// Marks a simulated legacy IPC handle.
const HANDLE_MAGIC: [u8; 4] = *b"KVSG";
/// Marks a simulated piece's handle (a shareable descriptor's).
const PIECE_MAGIC: [u8; 4] = *b"KVSP";

/// One piece of device memory (an allocation, or one physical allocation
/// of a run): two views of one memfd.
#[derive(Debug)]
pub(super) struct Piece {
    pub device: u32,
    pub len: u64,
    /// The memfd, kept for this process's own memory (exported, shared);
    /// an opened piece needs only its mappings.
    file: Option<File>,
    /// The view at the device address: no access at all, or for managed
    /// memory read and write (held for its mapping).
    _view: View,
    /// The view the copy engine uses.
    pub alias: MmapRaw,
    /// Start of the run this piece belongs to (its own address when alone).
    pub run: u64,
    /// Allocated as a run of pieces (exported piece by piece, by descriptor).
    pub vmm: bool,
    /// Opened from another process's export (closed, not freed).
    pub opened: bool,
    /// Managed memory: the host may touch it; it cannot be exported.
    pub managed: bool,
    /// Opened from a peer whose memory then vanished (a fault injected):
    /// copies touching it fault.
    pub vanished: bool,
}

/// The mapping at a piece's device address (no access rights, so touching
/// it faults; or, for managed memory, read and write).
#[derive(Debug)]
struct View {
    addr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the handle is an address range and its length; moving it between
// threads moves no access (only the copy engine, under the provider's lock,
// or the owner of managed memory touches the bytes).
unsafe impl Send for View {}

impl Drop for View {
    fn drop(&mut self) {
        // SAFETY: the range was mapped by `map_view` and is unmapped once.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

impl State {
    /// The piece holding `addr`, if any, with its address.
    pub(super) fn piece_at(&self, addr: u64) -> Option<(u64, &Piece)> {
        let (&base, piece) = self.pieces.range(..=addr).next_back()?;
        (addr < base + piece.len).then_some((base, piece))
    }

    /// The pieces of the run starting at `run`, in address order.
    fn run_pieces(&self, run: u64) -> impl Iterator<Item = (u64, &Piece)> {
        self.pieces.range(run..).map(|(&a, p)| (a, p)).take_while(move |(_, p)| p.run == run)
    }

    /// The run holding `addr`: its device, start and length.
    pub(super) fn run_at(&self, addr: u64) -> Option<(u32, u64, u64)> {
        let (_, piece) = self.piece_at(addr)?;
        let end = self.run_pieces(piece.run).last().map(|(a, p)| a + p.len)?;
        Some((piece.device, piece.run, end - piece.run))
    }

    /// `addr..addr + len` resolved to where the copy engine reaches it: the
    /// alias of a device range (inside one piece: copies are split at piece
    /// ends by `split_at_pieces`), or the host address as it is.
    pub(super) fn resolve(&self, addr: u64, len: u64) -> Result<u64> {
        match self.piece_at(addr) {
            None => Ok(addr),
            Some((base, piece)) => {
                if self.lost.contains(&piece.device) {
                    return Err(gpu_error(piece.device, "the device was lost"));
                }
                let end = addr.checked_add(len).ok_or_else(|| gpu_error(piece.device, "a copy's range overflows"))?;
                if end > base + piece.len {
                    let (_, run, run_len) = self.run_at(addr).expect("inside a piece");
                    return Err(past_allocation(piece.device, addr, len, run, run_len));
                }
                Ok(piece.alias.as_ptr() as u64 + (addr - base))
            }
        }
    }

    /// Splits a copy where either side crosses from one piece of a run into
    /// the next (a real copy engine sees one virtual range; the stand-in
    /// copies through each piece's own alias).
    pub(super) fn split_at_pieces(&self, src: u64, dst: u64, len: u64, out: &mut Vec<(u64, u64, u64)>) -> Result<()> {
        for addr in [src, dst] {
            // A device side must lie inside one run: past its end is no
            // piece at all, which must never be read as host memory.
            if let Some((device, run, run_len)) = self.run_at(addr) {
                if addr.checked_add(len).is_none_or(|end| end > run + run_len) {
                    return Err(past_allocation(device, addr, len, run, run_len));
                }
            }
        }
        let room = |addr: u64| self.piece_at(addr).map(|(base, piece)| base + piece.len - addr);
        let (mut src, mut dst, mut left) = (src, dst, len);
        while left > 0 {
            let step = [room(src), room(dst), Some(left)].into_iter().flatten().min().expect("left is some");
            out.push((self.resolve(src, step)?, self.resolve(dst, step)?, step));
            (src, dst, left) = (src + step, dst + step, left - step);
        }
        Ok(())
    }
}

impl SimGpu {
    /// Allocates `pieces` physical allocations of `piece_len` bytes each on
    /// `device`, mapped back to back at one device address, as the virtual
    /// memory API (PyTorch's expandable segments) lays memory out: exported
    /// piece by piece, by shareable descriptor.
    pub(super) fn alloc_run(&self, device: u32, piece_len: u64, pieces: u32) -> Result<DevicePtr> {
        let mut state = self.lock();
        self.check_device(&state, device)?;
        let total = piece_len.checked_mul(pieces as u64).filter(|&t| t > 0);
        let total = total.ok_or_else(|| gpu_error(device, "a run of 0 bytes, or one that overflows"))?;
        let files = (0..pieces).map(|_| memfd(piece_len)).collect::<Result<Vec<_>>>()?;
        let base = reserve(total)?;
        let placed = files.into_iter().enumerate().try_for_each(|(i, file)| {
            let at = Some(base + i as u64 * piece_len);
            install(&mut state, Placed { device, file, at, run: base, vmm: true, opened: false, managed: false })
                .map(drop)
        });
        placed.map_err(|error| abandon(&mut state, base, total, error))?;
        Ok(DevicePtr(base))
    }

    /// Allocates `len` bytes of managed memory on `device`: the host may
    /// read and write it, and it cannot be exported (as CUDA's
    /// `cuMemAllocManaged`).
    pub fn alloc_managed(&self, device: u32, len: u64) -> Result<DevicePtr> {
        let mut state = self.lock();
        self.check_device(&state, device)?;
        self.alloc_one(&mut state, device, len, true)
    }

    /// Allocates one legacy-exportable allocation (the provider's `alloc`),
    /// or managed memory.
    pub(super) fn alloc_one(&self, state: &mut State, device: u32, len: u64, managed: bool) -> Result<DevicePtr> {
        if len == 0 {
            return Err(gpu_error(device, "an allocation of 0 bytes"));
        }
        let file = memfd(len)?;
        let placed = Placed { device, file, at: None, run: 0, vmm: false, opened: false, managed };
        Ok(DevicePtr(install(state, placed)?))
    }

    /// Frees what `alloc` or `alloc_pieces` returned (the whole run).
    pub(super) fn free_run(&self, state: &mut State, ptr: DevicePtr) -> Result<()> {
        match state.pieces.get(&ptr.0) {
            Some(piece) if !piece.opened && piece.run == ptr.0 => {
                let addrs: Vec<u64> = state.run_pieces(ptr.0).map(|(a, _)| a).collect();
                addrs.iter().for_each(|a| drop(state.pieces.remove(a)));
                Ok(())
            }
            _ => Err(gpu_error(0, format!("{:#x} is not an allocation of this process", ptr.0))),
        }
    }

    /// Exports `addr..addr + len`: one legacy handle, or one handle per
    /// piece of a run; each names the allocation by its address here.
    pub(super) fn export_range(&self, state: &State, addr: u64, len: u64) -> Result<Export> {
        let (device, run, _) = self.own_run(state, addr, len)?;
        let end = addr + len;
        let (first, piece) = state.piece_at(addr).expect("inside the run");
        if !piece.vmm {
            let bytes = fd::encode(HANDLE_MAGIC, first, device);
            let handle = IpcHandle { kind: HandleKind::Legacy, bytes, offset: addr - first, len: piece.len };
            return Ok(Export::new(vec![handle]));
        }
        let handles = state
            .run_pieces(run)
            .filter(|(at, p)| at + p.len > addr && *at < end)
            .map(|(at, piece)| IpcHandle {
                kind: HandleKind::FileDescriptor,
                bytes: fd::encode(PIECE_MAGIC, at, device),
                offset: addr.saturating_sub(at),
                len: piece.len,
            })
            .collect();
        Ok(Export::new(handles))
    }

    /// A new descriptor of the memory one of this process's own handles
    /// names (the exporter's side of passing it), or why there is none.
    pub(super) fn share_handle(&self, state: &State, handle: &IpcHandle) -> Result<OwnedFd> {
        let magic = match handle.kind {
            HandleKind::Legacy => HANDLE_MAGIC,
            HandleKind::FileDescriptor => PIECE_MAGIC,
            // The simulator makes no FABRIC-only memory.
            HandleKind::Fabric => return Err(gpu_error(0, "the simulated GPU makes no FABRIC handles")),
        };
        let (addr, device) = fd::decode(magic, &handle.bytes).ok_or_else(|| gpu_error(0, "not a simulated handle"))?;
        let piece =
            state.pieces.get(&addr).filter(|p| !p.managed && p.vmm == (handle.kind == HandleKind::FileDescriptor));
        let file = piece.and_then(|p| p.file.as_ref()).filter(|_| piece.is_some_and(|p| p.len == handle.len));
        let file = file.ok_or_else(|| {
            gpu_error(device, format!("{addr:#x} is no longer memory this process exported (freed?)"))
        })?;
        let shared = file.try_clone().map_err(|e| Error::io("sharing simulated device memory", e))?;
        Ok(OwnedFd::from(shared))
    }

    /// The memory of this process's own allocation that holds
    /// `addr..addr + len`, or an error naming why it is not one.
    fn own_run(&self, state: &State, addr: u64, len: u64) -> Result<(u32, u64, u64)> {
        let (device, run, run_len) = state
            .run_at(addr)
            .filter(|(_, run, _)| !state.pieces[run].opened && !state.pieces[run].managed)
            .ok_or_else(|| gpu_error(0, format!("{addr:#x} is not device memory this process allocated")))?;
        self.check_device(state, device)?;
        if len == 0 || addr.checked_add(len).is_none_or(|end| end > run + run_len) {
            return Err(past_allocation(device, addr, len, run, run_len));
        }
        Ok((device, run, run_len))
    }

    /// `addr..addr + len` as a dma-buf: the descriptor of the piece holding
    /// it (a memfd, as a real dma-buf is a descriptor of device pages) and
    /// the range's offset in it. One dma-buf covers one physical
    /// allocation: a range across pieces of a run is refused.
    pub(super) fn dmabuf_range(&self, state: &State, addr: u64, len: u64) -> Result<DmaBuf> {
        let (device, _, _) = self.own_run(state, addr, len)?;
        let (base, piece) = state.piece_at(addr).expect("inside a run");
        let file = piece.file.as_ref().ok_or_else(|| gpu_error(device, "not this process's own memory"))?;
        if addr + len > base + piece.len {
            return Err(gpu_error(
                device,
                format!("{addr:#x}+{len} spans more than one physical allocation: one dma-buf covers one"),
            ));
        }
        let fd = file.try_clone().map_err(|e| Error::io("exporting simulated device memory as dma-buf", e))?;
        Ok(DmaBuf { fd: OwnedFd::from(fd), offset: addr - base, len })
    }

    /// What a peer-memory module hands a NIC registering device pointer
    /// `addr..addr + len`: every piece under the range, in address order,
    /// with the part of it the range covers (descriptor, offset, length).
    /// The simulated NIC maps them back to back, as a real one maps the
    /// pages it pinned.
    pub fn nic_pages(&self, addr: u64, len: u64) -> Result<Vec<(std::fs::File, u64, u64)>> {
        let state = self.lock();
        let (_, run, _) = self.own_run(&state, addr, len)?;
        let end = addr + len;
        let mut pages = Vec::new();
        for (at, piece) in state.run_pieces(run).filter(|(at, p)| at + p.len > addr && *at < end) {
            let from = addr.max(at);
            let to = end.min(at + piece.len);
            let file = piece.file.as_ref().ok_or_else(|| gpu_error(piece.device, "not this process's own memory"))?;
            let file = file.try_clone().map_err(|e| Error::io("pinning simulated device memory", e))?;
            pages.push((file, from - at, to - from));
        }
        Ok(pages)
    }

    /// Opens a peer's export (handles already checked), each handle's
    /// memory from the descriptor `fds` hands over; returns the first
    /// exported byte's address. The provider's lock is not held while a
    /// descriptor is fetched (the exporter may be this process's own
    /// server, sharing through this very provider).
    pub(super) fn open_export(&self, handles: &[IpcHandle], fds: FdSource<'_>) -> Result<DevicePtr> {
        let first = handles[0];
        let device = u32::from_le_bytes(first.bytes[12..16].try_into().expect("4 bytes"));
        let own = {
            let mut state = self.lock();
            self.check_device(&state, device)?;
            if std::mem::take(&mut state.fail_next_open) {
                return Err(gpu_error(device, "opening the peer's memory failed (injected)"));
            }
            own_files(&state)
        };
        let total = handles.iter().map(|h| h.len).sum();
        let base = reserve(total)?;
        let vmm = first.kind == HandleKind::FileDescriptor;
        let mut at = base;
        // One descriptor at a time: taken, checked, mapped and closed.
        let placed = handles.iter().enumerate().try_for_each(|(i, handle)| {
            let shared = fds(i)?;
            let file = File::from(shared.into_fd().ok_or_else(|| {
                gpu_error(device, "a FABRIC handle for simulated memory (the simulator opens descriptors only)")
            })?);
            let meta = file.metadata().map_err(|e| Error::io("sizing a peer's export", e))?;
            if own.contains(&(meta.dev(), meta.ino())) {
                return Err(gpu_error(device, "a process cannot open its own export"));
            }
            if meta.len() != handle.len {
                return Err(gpu_error(
                    device,
                    format!("the exported memory is {} bytes, the handle says {}", meta.len(), handle.len),
                ));
            }
            let placed = Placed { device, file, at: Some(at), run: base, vmm, opened: true, managed: false };
            install(&mut self.lock(), placed)?;
            at += handle.len;
            Ok(())
        });
        placed.map_err(|error| abandon(&mut self.lock(), base, total, error))?;
        self.opens.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(DevicePtr(base + first.offset))
    }

    /// Closes an opened export (every piece of its run).
    pub(super) fn close_run(&self, state: &mut State, ptr: DevicePtr) -> Result<()> {
        let run = state.piece_at(ptr.0).filter(|(_, p)| p.opened).map(|(_, p)| p.run);
        let run = run.ok_or_else(|| gpu_error(0, format!("{:#x} was not opened from a peer", ptr.0)))?;
        let addrs: Vec<u64> = state.run_pieces(run).map(|(a, _)| a).collect();
        addrs.iter().for_each(|a| drop(state.pieces.remove(a)));
        self.closes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

/// The (device, inode) of every memfd this process's own memory is made of.
fn own_files(state: &State) -> std::collections::HashSet<(u64, u64)> {
    state.pieces.values().filter_map(|p| p.file.as_ref()?.metadata().ok()).map(|m| (m.dev(), m.ino())).collect()
}

/// Where and how a piece is installed.
struct Placed {
    device: u32,
    file: File,
    /// A fixed address inside a reservation, or anywhere.
    at: Option<u64>,
    /// The run's start (`at` for a lone piece placed anywhere: 0 here).
    run: u64,
    vmm: bool,
    opened: bool,
    managed: bool,
}

/// Maps a piece twice and records it at its device address.
fn install(state: &mut State, placed: Placed) -> Result<u64> {
    let len = placed.file.metadata().map_err(|e| Error::io("sizing simulated device memory", e))?.len();
    let prot = if placed.managed { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_NONE };
    let view = map_view(&placed.file, len, placed.at, prot)?;
    let alias = MmapRaw::map_raw(&placed.file).map_err(|e| Error::io("mapping simulated device memory", e))?;
    let addr = view.addr as u64;
    let run = if placed.at.is_some() { placed.run } else { addr };
    // An opened piece's memory lives on in its mappings; its descriptor is
    // closed now, so thousands of opened pieces hold no descriptor each.
    let file = (!placed.opened).then_some(placed.file);
    let piece = Piece {
        device: placed.device,
        len,
        file,
        _view: view,
        alias,
        run,
        vmm: placed.vmm,
        opened: placed.opened,
        managed: placed.managed,
        vanished: false,
    };
    state.pieces.insert(addr, piece);
    Ok(addr)
}

/// Undoes a run that could not be placed whole: its pieces leave the
/// table, and the rest of its reservation is unmapped.
fn abandon(state: &mut State, run: u64, len: u64, error: Error) -> Error {
    let addrs: Vec<u64> = state.run_pieces(run).map(|(a, _)| a).collect();
    addrs.iter().for_each(|a| drop(state.pieces.remove(a)));
    // SAFETY: the reservation was made by `reserve` for this run alone, and
    // none of its pieces is in the table any more.
    unsafe { libc::munmap(run as *mut libc::c_void, len as usize) };
    error
}

/// A new memfd of `len` bytes.
fn memfd(len: u64) -> Result<File> {
    // SAFETY: memfd_create with a NUL-terminated name; the descriptor is
    // owned by the File made from it below.
    let fd = unsafe { libc::memfd_create(c"kvring-sim-gpu".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::io("creating simulated device memory", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len).map_err(|e| Error::io("sizing simulated device memory", e))?;
    Ok(file)
}

/// Reserves `len` bytes of addresses (no access) for a run's pieces, which
/// are then mapped over it one by one and unmap their own parts.
fn reserve(len: u64) -> Result<u64> {
    let len = usize::try_from(len).map_err(|_| Error::invalid("allocation", "larger than the address space"))?;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    // SAFETY: a fresh anonymous mapping with no access; the kernel picks the
    // address.
    let addr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, flags, -1, 0) };
    if addr == libc::MAP_FAILED {
        return Err(Error::io("reserving simulated device addresses", std::io::Error::last_os_error()));
    }
    Ok(addr as u64)
}

/// Maps `file` with `prot` (no access, but for managed memory) at `at`
/// (inside a reservation) or anywhere.
fn map_view(file: &File, len: u64, at: Option<u64>, prot: libc::c_int) -> Result<View> {
    let len = usize::try_from(len).map_err(|_| Error::invalid("allocation", "larger than the address space"))?;
    let (hint, flags) = match at {
        Some(at) => (at as *mut libc::c_void, libc::MAP_SHARED | libc::MAP_FIXED),
        None => (std::ptr::null_mut(), libc::MAP_SHARED),
    };
    // SAFETY: a shared mapping of a file we hold; with MAP_FIXED only over
    // addresses this provider reserved for the run.
    let addr = unsafe { libc::mmap(hint, len, prot, flags, file.as_raw_fd(), 0) };
    if addr == libc::MAP_FAILED {
        return Err(Error::io("mapping simulated device addresses", std::io::Error::last_os_error()));
    }
    Ok(View { addr, len })
}

/// The error for a range past the allocation (or run) holding its start.
pub(super) fn past_allocation(device: u32, addr: u64, len: u64, base: u64, alloc_len: u64) -> Error {
    gpu_error(device, format!("{addr:#x}+{len} runs past its allocation ({base:#x}+{alloc_len})"))
}

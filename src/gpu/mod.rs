//! The narrow GPU interface kvring needs, in the spirit of the verbs layer
//! (`transport/rdma/verbs.rs`): find devices, classify a pointer, allocate
//! (tests and the bench), export device memory and open a peer's export,
//! streams, one batched copy of many (src, dst, len) triples, events a lane
//! polls (never a blocking synchronize on a lane), and host registration.
//! Objects are plain handles, so the trait stays object safe and the code
//! above it is the same over every provider.
//!
//! Providers: [`cuda::CudaGpu`], the CUDA driver API loaded at run time
//! (cudarc), and [`sim::SimGpu`], in-process, where device memory is a
//! mapping the host cannot touch (any dereference faults) and a stand-in
//! copy engine moves bytes after a configurable delay, with faults to
//! inject.
//!
//! Device memory crosses processes two ways, as CUDA has it: memory from
//! `cuMemAlloc` (`cudaMalloc`, PyTorch's default caching allocator) by a
//! legacy IPC handle, and memory from the virtual memory management API
//! (PyTorch's expandable segments: one address range over many physical
//! allocations) by one shareable file descriptor per physical allocation,
//! which the exporter itself passes to the opener over a Unix-domain socket
//! (`SCM_RIGHTS`, [`fd`]): [`Gpu::share`] on the exporting side, the `fds`
//! of [`Gpu::open`] on the opening side.

pub mod cuda;
pub(crate) mod fd;
pub mod sim;
pub mod tier;

/// The most GPU regions an engine opens from one peer. Each costs an IPC
/// open (a mapping) and, when peers may write it, a fence table page mapped
/// here: a descriptor may name 65,536 regions, which would take this
/// process near `vm.max_map_count` (65,530 by default). A descriptor with
/// more device regions is refused whole ([`crate::Error::PeerLimit`]).
/// It equals an engine's default region table, so two engines at their
/// defaults always reach each other.
pub const MAX_PEER_GPU_REGIONS: usize = 4096;
pub use cuda::CudaGpu;
pub use sim::SimGpu;
pub use tier::{choose_method, TierInputs};

use crate::error::Result;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// A device address (the provider's, not dereferenceable by the host).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevicePtr(pub u64);

/// A stream: copies on it run in order, asynchronously to the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stream(pub u64);

/// A marker the host records in a stream and polls: complete once
/// everything queued on the stream before its latest recording is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Event(pub u64);

/// One GPU as the host sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuDevice {
    /// The provider's ordinal.
    pub ordinal: u32,
    /// Its name ("NVIDIA H200", "sim-gpu-0").
    pub name: String,
    /// Its memory in bytes.
    pub memory_bytes: u64,
    /// Its PCI bus id (`0000:3b:00.0`), when it has one.
    pub pci_bus: Option<String>,
    /// Its NUMA node, when known.
    pub numa_node: Option<u32>,
}

/// Where a range of addresses lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Host memory (pageable or registered).
    Host,
    /// Memory of one device: the range lies inside `base..base + len`, one
    /// allocation or one run of physical allocations mapped back to back
    /// (the virtual memory API).
    Device {
        /// The device's ordinal.
        ordinal: u32,
        /// Start of the allocation (or run) holding the range.
        base: DevicePtr,
        /// Length of that allocation (or run).
        len: u64,
    },
    /// Managed (unified) memory, which the driver migrates on demand: the
    /// host may touch it, but it cannot be shared with other processes.
    Managed {
        /// The device it was allocated on.
        ordinal: u32,
    },
}

/// How an [`IpcHandle`] names device memory for another process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HandleKind {
    /// The driver's opaque IPC handle of a `cuMemAlloc` allocation
    /// (`cuIpcGetMemHandle`).
    Legacy,
    /// A shareable file descriptor of one physical allocation of the
    /// virtual memory API: the handle names the allocation in the
    /// exporter's address space, for the exporter alone; the descriptor
    /// itself comes from the exporter ([`Gpu::share`]) over a socket.
    FileDescriptor,
    /// A `CUmemFabricHandle` (64 bytes, no descriptor) of one physical
    /// allocation of the virtual memory API made with FABRIC handles only
    /// (PyTorch on a host with IMEX channels): the handle names the
    /// allocation in the exporter's address space, as for
    /// [`HandleKind::FileDescriptor`]; the fabric handle itself comes from
    /// the exporter ([`Gpu::share`]) over the same proven socket, never in
    /// a descriptor, since any process on the exporter's IMEX channel that
    /// holds its bytes can import the memory.
    Fabric,
}

impl HandleKind {
    /// The wire number.
    pub fn to_wire(self) -> u32 {
        match self {
            HandleKind::Legacy => 1,
            HandleKind::FileDescriptor => 2,
            HandleKind::Fabric => 3,
        }
    }

    /// From the wire number.
    pub fn from_wire(value: u32) -> Option<Self> {
        match value {
            1 => Some(HandleKind::Legacy),
            2 => Some(HandleKind::FileDescriptor),
            3 => Some(HandleKind::Fabric),
            _ => None,
        }
    }
}

/// Bytes of an [`IpcHandle`]'s payload (a CUDA legacy handle's size).
pub const IPC_HANDLE_BYTES: usize = 64;

/// One physical allocation as another process opens it: opaque bytes the
/// provider understands, the allocation's length, and where the exported
/// range starts in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle {
    /// How `bytes` name the memory.
    pub kind: HandleKind,
    /// The provider's handle.
    pub bytes: [u8; IPC_HANDLE_BYTES],
    /// Offset of the exported range's first byte in this allocation (0 for
    /// every allocation of an [`Export`] but the first).
    pub offset: u64,
    /// Length of the allocation.
    pub len: u64,
}

/// A device range as a dma-buf: what a NIC registers device memory by for
/// GPUDirect RDMA (`ibv_reg_dmabuf_mr`) where no peer-memory module lets it
/// register the device pointer itself.
#[derive(Debug)]
pub struct DmaBuf {
    /// The dma-buf. Closed when dropped: a registration made from it holds
    /// its own reference, so it is kept only while registering.
    pub fd: OwnedFd,
    /// Where the range's first byte lies in the dma-buf (the dma-buf covers
    /// whole pages around it).
    pub offset: u64,
    /// Bytes of the range.
    pub len: u64,
}

impl DmaBuf {
    /// The range, borrowed for a registration (`ibv_reg_dmabuf_mr`).
    pub fn range(&self) -> DmaBufRange<'_> {
        DmaBufRange { fd: self.fd.as_fd(), offset: self.offset, len: self.len }
    }
}

/// A range of a dma-buf to register: `ibv_reg_dmabuf_mr`'s descriptor,
/// offset and length as named fields, where three adjacent integers
/// (offset, length, and the registration's address beside them) could be
/// swapped unnoticed.
#[derive(Debug, Clone, Copy)]
pub struct DmaBufRange<'a> {
    /// The dma-buf.
    pub fd: BorrowedFd<'a>,
    /// Where the range's first byte lies in the dma-buf.
    pub offset: u64,
    /// Bytes of the range.
    pub len: u64,
}

/// Most physical allocations one exported range may span (a 64 GiB
/// expandable segment of PyTorch's 20 MiB pages is about 3,300).
pub const MAX_EXPORT_PIECES: usize = 1 << 14;

/// A device range exported for other processes: one handle per physical
/// allocation it spans, in address order and back to back. It holds no
/// descriptor: those a peer needs are made when the peer asks
/// ([`Gpu::share`]), passed, and closed at once, so an export of thousands
/// of pieces never holds thousands of descriptors open.
#[derive(Debug)]
pub struct Export {
    handles: Vec<IpcHandle>,
}

impl Export {
    /// An export of `handles`.
    pub fn new(handles: Vec<IpcHandle>) -> Self {
        Self { handles }
    }

    /// The handles, in address order.
    pub fn handles(&self) -> &[IpcHandle] {
        &self.handles
    }
}

/// Checks a peer's handles before any of them is opened: one legacy
/// handle, or 1..=[`MAX_EXPORT_PIECES`] file descriptors; offsets inside
/// the first allocation and zero after it; `need` bytes reachable from the
/// range's start without overflow. Returns the total mapped length.
pub fn check_handles(handles: &[IpcHandle], need: u64) -> std::result::Result<u64, String> {
    let first = handles.first().ok_or("no handle")?;
    if handles.len() > MAX_EXPORT_PIECES {
        return Err(format!("{} handles exceed the limit of {MAX_EXPORT_PIECES}", handles.len()));
    }
    if handles.iter().any(|h| h.kind != first.kind) {
        return Err("handles of different kinds".into());
    }
    if first.kind == HandleKind::Legacy && handles.len() != 1 {
        return Err("a legacy export is exactly one handle".into());
    }
    if first.offset >= first.len || handles[1..].iter().any(|h| h.offset != 0 || h.len == 0) {
        return Err("a handle's offset lies outside its allocation".into());
    }
    let total = handles.iter().try_fold(0u64, |sum, h| sum.checked_add(h.len)).ok_or("lengths overflow")?;
    let reachable = total - first.offset;
    if reachable < need {
        return Err(format!("the handles reach {reachable} bytes, the region is {need}"));
    }
    Ok(total)
}

/// Bytes of a `CUmemFabricHandle` (CUDA Driver API, Data Structures:
/// `unsigned char data[64]`).
pub const FABRIC_HANDLE_BYTES: usize = 64;

/// What a peer needs to open one handle of an export, made by its exporter
/// ([`Gpu::share`]) and passed over the exporter's socket. Its `Debug`
/// never shows a fabric handle's bytes: they are a capability.
pub enum Shareable {
    /// A descriptor of the allocation ([`HandleKind::FileDescriptor`]).
    Fd(OwnedFd),
    /// The allocation's `CUmemFabricHandle` ([`HandleKind::Fabric`]).
    Fabric([u8; FABRIC_HANDLE_BYTES]),
}

impl std::fmt::Debug for Shareable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shareable::Fd(fd) => f.debug_tuple("Fd").field(fd).finish(),
            Shareable::Fabric(_) => f.write_str("Fabric(..)"),
        }
    }
}

impl Shareable {
    /// The kind of handle this opens.
    pub fn kind(&self) -> HandleKind {
        match self {
            Shareable::Fd(_) => HandleKind::FileDescriptor,
            Shareable::Fabric(_) => HandleKind::Fabric,
        }
    }

    /// The descriptor, or `None` for a fabric handle.
    pub fn into_fd(self) -> Option<OwnedFd> {
        match self {
            Shareable::Fd(fd) => Some(fd),
            Shareable::Fabric(_) => None,
        }
    }
}

/// Where [`Gpu::open`] gets what opens a handle (its descriptor or fabric
/// handle), by the handle's index.
pub type FdSource<'a> = &'a mut dyn FnMut(usize) -> Result<Shareable>;

/// One copy of a batch: addresses are host pointers or device pointers, as
/// [`Gpu::classify`] tells them apart. Laid out as the copy kernel reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct Copy {
    /// Where the bytes come from.
    pub src: u64,
    /// Where they go.
    pub dst: u64,
    /// How many.
    pub len: u64,
}

/// Where one side of a copy lives, as the caller registered it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Place {
    /// Host memory.
    Host,
    /// Memory of this GPU (as this process numbers them).
    Device(u32),
}

/// Where both sides of one [`Copy`] live: what a provider needs to know
/// whether its copy kernel may dereference them ([`tier`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CopySides {
    /// The source's memory.
    pub src: Place,
    /// The destination's memory.
    pub dst: Place,
}

/// How a batch of copies is issued (reported by the bench).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyMethod {
    /// One batched driver call (`cuMemcpyBatchAsync`, CUDA 12.8 drivers).
    Batched,
    /// A copy kernel walking a descriptor array.
    Kernel,
    /// One copy call per triple (older drivers).
    PerCopy,
}

impl CopyMethod {
    /// Every method, in [`CopyMethod::index`] order.
    pub const ALL: [CopyMethod; 3] = [CopyMethod::Batched, CopyMethod::Kernel, CopyMethod::PerCopy];

    /// Lower-case name, as the bench prints it.
    pub fn name(self) -> &'static str {
        match self {
            CopyMethod::Batched => "batched",
            CopyMethod::Kernel => "kernel",
            CopyMethod::PerCopy => "per-copy",
        }
    }

    /// Its position in [`CopyMethod::ALL`] (and in counters).
    pub fn index(self) -> usize {
        match self {
            CopyMethod::Batched => 0,
            CopyMethod::Kernel => 1,
            CopyMethod::PerCopy => 2,
        }
    }
}

/// Chunks of GPU copies issued by each method: how the copies really went,
/// chunk by chunk (a driver's best method is not always the one taken: the
/// kernel needs pinned host memory and a free descriptor slot).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyMethodCounts {
    /// Chunks issued as one batched driver call.
    pub batched: u64,
    /// Chunks issued as one copy-kernel launch.
    pub kernel: u64,
    /// Chunks issued as one copy call per copy.
    pub per_copy: u64,
}

impl CopyMethodCounts {
    /// The count of `method`.
    pub fn get(&self, method: CopyMethod) -> u64 {
        match method {
            CopyMethod::Batched => self.batched,
            CopyMethod::Kernel => self.kernel,
            CopyMethod::PerCopy => self.per_copy,
        }
    }

    /// Every count since `earlier` (a snapshot taken before).
    pub fn since(&self, earlier: &CopyMethodCounts) -> CopyMethodCounts {
        CopyMethodCounts {
            batched: self.batched.wrapping_sub(earlier.batched),
            kernel: self.kernel.wrapping_sub(earlier.kernel),
            per_copy: self.per_copy.wrapping_sub(earlier.per_copy),
        }
    }

    /// The sum of each method's count over `all`.
    pub fn sum(all: impl IntoIterator<Item = CopyMethodCounts>) -> CopyMethodCounts {
        all.into_iter().fold(CopyMethodCounts::default(), |sum, c| CopyMethodCounts {
            batched: sum.batched + c.batched,
            kernel: sum.kernel + c.kernel,
            per_copy: sum.per_copy + c.per_copy,
        })
    }
}

/// One lane's [`CopyMethodCounts`], bumped by that lane only (a load and a
/// store, no locked instruction) and read by anyone.
#[derive(Debug, Default)]
pub(crate) struct CopyCounters {
    chunks: [std::sync::atomic::AtomicU64; 3],
}

impl CopyCounters {
    /// A chunk went out by `method`.
    #[inline]
    pub fn count(&self, method: CopyMethod) {
        use std::sync::atomic::Ordering::Relaxed;
        let counter = &self.chunks[method.index()];
        counter.store(counter.load(Relaxed).wrapping_add(1), Relaxed);
    }

    /// The counts now.
    pub fn snapshot(&self) -> CopyMethodCounts {
        use std::sync::atomic::Ordering::Relaxed;
        let [batched, kernel, per_copy] = &self.chunks;
        CopyMethodCounts {
            batched: batched.load(Relaxed),
            kernel: kernel.load(Relaxed),
            per_copy: per_copy.load(Relaxed),
        }
    }
}

/// The GPU operations kvring uses.
pub trait Gpu: Send + Sync + std::fmt::Debug {
    /// The provider's name (`sim`, `cuda`).
    fn provider(&self) -> &'static str;
    /// The devices this process can use.
    fn devices(&self) -> Result<Vec<GpuDevice>>;
    /// Where `addr..addr + len` lives; a range that starts in device memory
    /// and runs past the allocation (or run of mapped allocations) holding
    /// it is an error.
    fn classify(&self, addr: u64, len: u64) -> Result<Memory>;
    /// The start and length of the one device allocation (for the virtual
    /// memory API: the one mapping) holding `addr`, where the provider can
    /// tell; `None` for host memory or where it cannot. Copies are merged
    /// only inside one: the driver refuses a copy that spans two
    /// allocations (GPU-REVIEW #9).
    fn allocation_span(&self, addr: u64) -> Option<(u64, u64)> {
        let _ = addr;
        None
    }
    /// Allocates `len` bytes on `device`.
    fn alloc(&self, device: u32, len: u64) -> Result<DevicePtr>;
    /// Allocates `pieces` physical allocations of `piece_len` bytes each on
    /// `device`, mapped back to back at one address, as the virtual memory
    /// API lays PyTorch's expandable segments out (tests and the bench: such
    /// memory is exported piece by piece). `piece_len` must be a multiple of
    /// the device's allocation granularity (2 MiB on NVIDIA GPUs).
    fn alloc_pieces(&self, device: u32, piece_len: u64, pieces: u32) -> Result<DevicePtr>;
    /// Frees an allocation from [`Gpu::alloc`] or [`Gpu::alloc_pieces`].
    ///
    /// # Safety
    ///
    /// No copy in flight uses it, and no peer has it open.
    unsafe fn free(&self, ptr: DevicePtr) -> Result<()>;
    /// Exports `addr..addr + len` for other processes.
    fn export(&self, addr: u64, len: u64) -> Result<Export>;
    /// What a peer needs to open `handle`, one of this process's own
    /// exports (never bytes a peer sent): a new descriptor, which the
    /// caller passes on and closes, or the allocation's fabric handle;
    /// `None` when the handle needs nothing (a CUDA legacy handle is the
    /// driver's own capability).
    fn share(&self, handle: &IpcHandle) -> Result<Option<Shareable>>;
    /// Opens a peer's export (its handles, checked with
    /// [`check_handles`]); returns the first exported byte's address in
    /// this process. `fds` hands over what opens handle `i` (its descriptor
    /// or fabric handle), as the exporter passed it: asked in increasing
    /// order, each descriptor closed as soon as it is imported. kvring never opens an export of its own process
    /// (its pointers are valid here already); the simulator refuses it.
    fn open(&self, handles: &[IpcHandle], fds: FdSource<'_>) -> Result<DevicePtr>;
    /// The GPU whose context maps a peer's export opened at `ptr` by
    /// [`Gpu::open`], where the mapping belongs to one context (a legacy
    /// IPC handle is mapped "into the current device address space"):
    /// copies touching it run on that GPU (GPU-REVIEW #4). `None` where
    /// every GPU of this process maps it alike.
    fn opened_device(&self, ptr: DevicePtr) -> Option<u32> {
        let _ = ptr;
        None
    }
    /// Exports `addr..addr + len` of this process's device memory as a
    /// dma-buf for a NIC to register; an error where the driver, the GPU or
    /// the memory cannot (the NIC may then register the device pointer
    /// through a peer-memory module instead).
    fn export_dmabuf(&self, addr: u64, len: u64) -> Result<DmaBuf>;
    /// Makes the writes a NIC made into GPU `device`'s memory (GPUDirect
    /// RDMA) visible to work on that GPU, where the GPU does not order them
    /// for it itself: called before a consumer is told of them by a message
    /// that did not travel with the data (VERBS-REVIEW #15). True when a
    /// flush was needed and done; the default has nothing to flush.
    fn flush_rdma_writes(&self, device: u32) -> Result<bool> {
        let _ = device;
        Ok(false)
    }
    /// Closes what [`Gpu::open`] opened.
    ///
    /// # Safety
    ///
    /// No copy in flight uses it.
    unsafe fn close(&self, ptr: DevicePtr) -> Result<()>;
    /// A stream on `device`.
    fn create_stream(&self, device: u32) -> Result<Stream>;
    /// Destroys a stream (its work is finished or abandoned).
    fn destroy_stream(&self, stream: Stream) -> Result<()>;
    /// Waits, at most `timeout`, until the work queued so far on a stream
    /// the *caller* made (a `CUstream` / `cudaStream_t` as an integer; 0:
    /// `device`'s default stream) has finished: what Mooncake's
    /// `*_on_cuda` transfers start after. Polls, never blocks unbounded.
    fn wait_caller_stream(&self, device: u32, stream: u64, timeout: std::time::Duration) -> Result<()>;
    /// The best method [`Gpu::copy_batch`] has here (what the driver
    /// offers); a chunk whose host memory is not pinned, or that touches a
    /// GPU without peer access, may take a lesser one, which `copy_batch`
    /// returns.
    fn copy_method(&self) -> CopyMethod;
    /// Queues `copies` on `stream`, in no particular order among
    /// themselves, after what the stream already has, by the method
    /// [`tier::choose_method`] picks for them; returns that method.
    /// `sides` says where each copy's ends live (one entry per copy; empty
    /// when unknown, and then the copy kernel is never used).
    ///
    /// # Safety
    ///
    /// Every host range stays valid (for reads as a source, writes as a
    /// destination) and untouched by the host until an event recorded after
    /// this call completes; device ranges are checked by the provider.
    /// `sides`, when given, tells each end truly: the copy kernel
    /// dereferences what it is told is device memory.
    unsafe fn copy_batch(&self, stream: Stream, copies: &[Copy], sides: &[CopySides]) -> Result<CopyMethod>;
    /// Queues one plain copy on `stream` (`cuMemcpyAsync`): what engines
    /// issue per block today, the bench's per-call baseline, and the
    /// blocking copies kvring makes off the lanes.
    ///
    /// # Safety
    ///
    /// As [`Gpu::copy_batch`] for the copy's host range.
    unsafe fn copy_one(&self, stream: Stream, copy: Copy) -> Result<()>;
    /// An event on `device`, to record and poll many times.
    fn create_event(&self, device: u32) -> Result<Event>;
    /// Records `event` after the stream's work so far (replacing what it
    /// marked before).
    fn record(&self, stream: Stream, event: Event) -> Result<()>;
    /// True once everything before the event's latest recording has
    /// completed; an error if a copy before it failed (and from then on:
    /// GPU errors are sticky).
    fn query(&self, event: Event) -> Result<bool>;
    /// Destroys an event.
    fn destroy_event(&self, event: Event) -> Result<()>;
    /// Pins host memory so copies to and from it run at full rate.
    ///
    /// # Safety
    ///
    /// The range stays mapped until [`Gpu::host_unregister`].
    unsafe fn host_register(&self, addr: u64, len: u64) -> Result<()>;
    /// Unpins what [`Gpu::host_register`] pinned.
    fn host_unregister(&self, addr: u64) -> Result<()>;
    /// True when host memory at `addr` is page-locked for the GPUs already
    /// (by its owner: `cudaHostAlloc`, `cudaHostRegister`, PyTorch's
    /// `pin_memory`): kvring neither pins it again nor unpins it.
    fn host_is_pinned(&self, addr: u64) -> bool;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(kind: HandleKind, offset: u64, len: u64) -> IpcHandle {
        IpcHandle { kind, bytes: [0; IPC_HANDLE_BYTES], offset, len }
    }

    #[test]
    fn handles_from_a_peer_are_checked_before_anything_is_opened() {
        use HandleKind::*;
        assert_eq!(check_handles(&[handle(Legacy, 4096, 1 << 20)], (1 << 20) - 4096), Ok(1 << 20));
        let pieces = [handle(FileDescriptor, 100, 1000), handle(FileDescriptor, 0, 1000)];
        assert_eq!(check_handles(&pieces, 1900), Ok(2000));
        let refused = |handles: &[IpcHandle], need: u64| check_handles(handles, need).unwrap_err();
        assert!(refused(&[], 1).contains("no handle"));
        assert!(refused(&pieces, 1901).contains("reach 1900 bytes"));
        assert!(refused(&[handle(Legacy, 0, 10), handle(Legacy, 0, 10)], 1).contains("exactly one"));
        assert!(refused(&[handle(Legacy, 0, 10), handle(FileDescriptor, 0, 10)], 1).contains("different kinds"));
        assert!(refused(&[handle(Legacy, 10, 10)], 1).contains("outside its allocation"));
        assert!(refused(&[handle(FileDescriptor, 0, 10), handle(FileDescriptor, 5, 10)], 1).contains("outside"));
        assert!(refused(&[handle(FileDescriptor, 0, u64::MAX), handle(FileDescriptor, 0, 2)], 1).contains("overflow"));
        let many = vec![handle(FileDescriptor, 0, 1); MAX_EXPORT_PIECES + 1];
        assert!(refused(&many, 1).contains("exceed the limit"));
        let fabric = [handle(Fabric, 100, 1000), handle(Fabric, 0, 1000)];
        assert_eq!(check_handles(&fabric, 1900), Ok(2000));
        assert!(refused(&[handle(Fabric, 0, 10), handle(FileDescriptor, 0, 10)], 1).contains("different kinds"));
        for kind in [Legacy, FileDescriptor, Fabric] {
            assert_eq!(HandleKind::from_wire(kind.to_wire()), Some(kind));
        }
        assert_eq!(HandleKind::from_wire(0), None);
    }
}

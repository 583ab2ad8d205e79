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

pub mod cuda;
pub mod sim;

pub use cuda::CudaGpu;
pub use sim::SimGpu;

use crate::error::Result;

/// A device address (the provider's, not dereferenceable by the host).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevicePtr(pub u64);

/// A stream: copies on it run in order, asynchronously to the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stream(pub u64);

/// A point in a stream that the host polls.
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
    /// Memory of one device, inside one allocation.
    Device {
        /// The device's ordinal.
        ordinal: u32,
        /// Start of the allocation holding the range.
        base: DevicePtr,
        /// Length of that allocation.
        len: u64,
    },
}

/// What another process needs to open device memory: opaque bytes the
/// provider understands, and where the exported pointer sits in its
/// allocation (handles name whole allocations).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle {
    /// The provider's handle.
    pub bytes: [u8; 64],
    /// Offset of the exported pointer from its allocation's base.
    pub offset: u64,
    /// Length of the allocation.
    pub len: u64,
}

/// One copy of a batch: addresses are host pointers or device pointers, as
/// [`Gpu::classify`] tells them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    /// Where the bytes come from.
    pub src: u64,
    /// Where they go.
    pub dst: u64,
    /// How many.
    pub len: u64,
}

/// How a batch of copies was issued (reported by the bench).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyMethod {
    /// One batched driver call (`cuMemcpyBatchAsync`).
    Batched,
    /// A copy kernel walking a descriptor array.
    Kernel,
    /// One copy call per triple.
    PerCopy,
}

/// The GPU operations kvring uses.
pub trait Gpu: Send + Sync + std::fmt::Debug {
    /// The provider's name (`sim`, `cuda`).
    fn provider(&self) -> &'static str;
    /// The devices this process can use.
    fn devices(&self) -> Result<Vec<GpuDevice>>;
    /// Where `addr..addr + len` lives; a range that starts in a device
    /// allocation and runs past its end is an error.
    fn classify(&self, addr: u64, len: u64) -> Result<Memory>;
    /// Allocates `len` bytes on `device`.
    fn alloc(&self, device: u32, len: u64) -> Result<DevicePtr>;
    /// Frees an allocation from [`Gpu::alloc`].
    ///
    /// # Safety
    ///
    /// No copy in flight uses it, and no peer has it open.
    unsafe fn free(&self, ptr: DevicePtr) -> Result<()>;
    /// Exports the allocation holding `ptr` for another process.
    fn export(&self, ptr: DevicePtr) -> Result<IpcHandle>;
    /// Opens a peer's export; returns the pointer it exported, in this
    /// process. Opening a handle of this very process is refused (CUDA
    /// does the same).
    fn open(&self, handle: &IpcHandle) -> Result<DevicePtr>;
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
    /// Queues `copies` on `stream`, in no particular order among
    /// themselves, after what the stream already has.
    ///
    /// # Safety
    ///
    /// Every host range stays valid (for reads as a source, writes as a
    /// destination) and untouched by the host until an event recorded after
    /// this call completes; device ranges are checked by the provider.
    unsafe fn copy_batch(&self, stream: Stream, copies: &[Copy]) -> Result<CopyMethod>;
    /// Records an event after the stream's work so far.
    fn record(&self, stream: Stream) -> Result<Event>;
    /// True once everything before the event has completed; an error if a
    /// copy before it failed (and from then on: GPU errors are sticky).
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
}

//! The narrow verbs interface kvring uses: open a device, allocate a
//! protection domain, register memory (host memory by address, device
//! memory by dma-buf or, through a peer-memory module, by address), create
//! a CQ and an RC QP, move the QP through its states, post send lists, poll
//! the CQ; and for the target's arrival counters a shared receive queue,
//! receives to post, and a CQ that wakes a sleeping lane.
//!
//! Two providers implement it: [`super::sim::SimVerbs`], in-process, which
//! checks keys and bounds, executes WRITE and READ between registered memory
//! and can inject faults; and (with the `rdma` feature) `IbVerbs` over
//! rdma-sys. Objects are named by plain handles so the trait stays object
//! safe and the lane's code is the same over both.

use crate::error::Result;
use crate::gpu::DmaBufRange;
use std::os::fd::RawFd;

macro_rules! handle {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u64);
    )*};
}

handle!(
    /// An opened device.
    Context,
    /// A protection domain.
    Pd,
    /// A completion queue.
    Cq,
    /// A queue pair.
    Qp,
    /// A memory registration (see [`Mr`] for its keys).
    MrHandle,
    /// A shared receive queue (receives consumed by WRITE_WITH_IMM).
    Srq,
);

/// A memory registration: its handle, range and keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mr {
    /// Handle to deregister it with.
    pub handle: MrHandle,
    /// First byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Key for local scatter-gather entries.
    pub lkey: u32,
    /// Key peers use to reach it.
    pub rkey: u32,
}

/// Access a registration grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MrAccess {
    /// The NIC may write it locally (READ destinations).
    pub local_write: bool,
    /// Peers may RDMA-WRITE into it.
    pub remote_write: bool,
    /// Peers may RDMA-READ from it.
    pub remote_read: bool,
    /// The NIC may write it with PCIe relaxed ordering (what lets a NIC
    /// reach full rate into GPU memory); refused by some devices and
    /// kernels, so asked for and dropped on refusal.
    pub relaxed_ordering: bool,
}

impl MrAccess {
    /// Everything kvring's regions need.
    pub const ALL: MrAccess =
        MrAccess { local_write: true, remote_write: true, remote_read: true, relaxed_ordering: false };
}

/// A device port as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// Port number (from 1).
    pub port: u8,
    /// Active and usable.
    pub active: bool,
    /// Active MTU in bytes.
    pub mtu: u32,
    /// Local id (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// GID table: index, GID, and whether it is RoCE v2.
    pub gids: Vec<(u8, [u8; 16], bool)>,
    /// What the port runs over (ibv_query_port(3) `link_layer`).
    pub link_layer: LinkLayer,
}

/// A port's link layer: devices are chosen by it, and two NICs are paired
/// only when theirs agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LinkLayer {
    /// InfiniBand (routed by LID).
    InfiniBand,
    /// Ethernet: RoCE (routed by GID).
    Ethernet,
    /// Not reported (older kernels and providers report InfiniBand so).
    #[default]
    Unspecified,
}

impl std::fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LinkLayer::InfiniBand => "InfiniBand",
            LinkLayer::Ethernet => "Ethernet",
            LinkLayer::Unspecified => "unspecified",
        })
    }
}

/// A device as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name (`mlx5_0`).
    pub name: String,
    /// NUMA node of its PCI device, if known.
    pub numa_node: Option<u32>,
    /// Where its PCI device sits in the PCI tree (the real path of its
    /// sysfs `device` link: `/sys/devices/pci0000:17/0000:17:00.0/...`), for
    /// choosing the NIC nearest a GPU; `None` when unknown.
    pub pci_path: Option<std::path::PathBuf>,
    /// Its ports.
    pub ports: Vec<PortInfo>,
}

/// What a QP's peer needs to connect to it: exchanged in the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpEndpoint {
    /// QP number.
    pub qpn: u32,
    /// Initial packet sequence number.
    pub psn: u32,
    /// GID of the port.
    pub gid: [u8; 16],
    /// LID of the port (InfiniBand).
    pub lid: u16,
    /// Path MTU to use, bytes.
    pub mtu: u32,
}

impl QpEndpoint {
    /// The wire form, for the control plane's RDMA connect.
    pub fn to_proto(&self) -> crate::proto::QpEndpointInfo {
        crate::proto::QpEndpointInfo {
            qpn: self.qpn,
            psn: self.psn,
            gid: self.gid.to_vec(),
            lid: u32::from(self.lid),
            mtu: self.mtu,
        }
    }

    /// Checks and converts an endpoint a peer sent (fuzzed).
    pub fn from_proto(info: &crate::proto::QpEndpointInfo) -> crate::error::Result<Self> {
        use crate::error::Error;
        let gid: [u8; 16] = info
            .gid
            .as_slice()
            .try_into()
            .map_err(|_| Error::malformed("qp endpoint", format!("a gid of {} bytes, not 16", info.gid.len())))?;
        let lid = u16::try_from(info.lid).map_err(|_| Error::malformed("qp endpoint", format!("lid {}", info.lid)))?;
        if info.qpn > 0x00ff_ffff || info.psn > 0x00ff_ffff || !(256..=4096).contains(&info.mtu) {
            return Err(Error::malformed(
                "qp endpoint",
                format!("qpn {:#x}, psn {:#x} or mtu {} out of range", info.qpn, info.psn, info.mtu),
            ));
        }
        Ok(Self { qpn: info.qpn, psn: info.psn, gid, lid, mtu: info.mtu })
    }
}

/// Sizes a QP is created with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send-queue depth (work requests outstanding at once).
    pub max_send_wr: u32,
    /// Largest payload posted inline.
    pub max_inline: u32,
    /// Port to use.
    pub port: u8,
    /// GID index to use.
    pub gid_index: u8,
    /// The shared receive queue its receives come from (QPs that take
    /// WRITE_WITH_IMM); `None` for QPs that only send.
    pub srq: Option<Srq>,
}

/// State transitions kvring makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpTransition {
    /// RESET → INIT (access flags, port).
    Init,
    /// INIT → RTR, towards the peer's endpoint.
    ReadyToReceive(QpEndpoint),
    /// RTR → RTS.
    ReadyToSend,
    /// Any → RESET (after an error, before reconnecting).
    Reset,
    /// Any → ERR: a QP on a shared receive queue is moved here before it is
    /// reset or destroyed, so the receives it consumed complete and can be
    /// counted and re-posted (IBTA §10.3.1; VERBS-REVIEW finding 4).
    Error,
}

/// One-sided operations kvring posts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrOp {
    /// Local → remote.
    Write,
    /// Remote → local.
    Read,
    /// Local → remote, then the immediate value reported to the peer by a
    /// receive completion (with the bytes written), which consumes one
    /// receive of its shared receive queue.
    WriteImm(u32),
}

impl WrOp {
    /// True for the operations that write the peer's memory.
    pub fn writes(self) -> bool {
        matches!(self, WrOp::Write | WrOp::WriteImm(_))
    }
}

/// One work request with one scatter-gather entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr {
    /// Returned in its completion.
    pub wr_id: u64,
    /// The operation.
    pub op: WrOp,
    /// Local address.
    pub local_addr: u64,
    /// Bytes.
    pub len: u32,
    /// Local key.
    pub lkey: u32,
    /// Remote address.
    pub remote_addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Ask for a completion (selective signalling).
    pub signaled: bool,
    /// Send the payload inline (small writes).
    pub inline: bool,
}

/// How a work request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    /// Done.
    Success,
    /// The peer never acknowledged (gone, or its QP reset).
    RetryExceeded,
    /// The peer refused the key or range.
    RemoteAccess,
    /// A local key or range was wrong.
    LocalProtection,
    /// Flushed: the QP had already failed.
    Flushed,
    /// Anything else, with the provider's code.
    Other(u32),
}

/// One completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wc {
    /// The request's `wr_id` (a receive's, for a receive completion).
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
    /// Bytes a WRITE_WITH_IMM placed (receive completions; 0 otherwise).
    pub byte_len: u32,
    /// The immediate value of a WRITE_WITH_IMM (receive completions).
    pub imm: Option<u32>,
}

impl Wc {
    /// A send completion: `wr_id` ended with `status`.
    pub const fn new(wr_id: u64, status: WcStatus) -> Self {
        Self { wr_id, status, byte_len: 0, imm: None }
    }
}

/// Why a post stopped, and how many requests were posted before it.
#[derive(Debug)]
pub struct PostError {
    /// Requests accepted before the failure.
    pub posted: usize,
    /// The failure.
    pub error: PostFailure,
}

/// What stopped a post.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PostFailure {
    /// The send queue is full: poll the CQ, then post the rest.
    QueueFull,
    /// The request is invalid (bad key or range caught at post, QP not RTS).
    Invalid(String),
}

/// An asynchronous event of a device (ibv_get_async_event(3)), as kvring
/// acts on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsyncEvent {
    /// IBV_EVENT_PORT_ERR: the port left the ACTIVE state.
    PortError {
        /// The port.
        port: u8,
    },
    /// IBV_EVENT_PORT_ACTIVE: the port is ACTIVE again.
    PortActive {
        /// The port.
        port: u8,
    },
    /// IBV_EVENT_DEVICE_FATAL: the device is unusable until reopened.
    DeviceFatal,
    /// IBV_EVENT_CQ_ERR (a CQ overran: it completes nothing more) or
    /// IBV_EVENT_QP_FATAL (a QP failed without a completion saying so).
    QueueFatal,
    /// IBV_EVENT_GID_CHANGE: the port's GID table changed.
    GidChange {
        /// The port.
        port: u8,
    },
    /// IBV_EVENT_QP_LAST_WQE_REACHED: a QP on a shared receive queue, moved
    /// to ERR, will complete no more receives (its CQ can be drained).
    LastWqeReached {
        /// The QP.
        qp: Qp,
    },
    /// Any other event (taken and acknowledged, nothing else done), with
    /// its `ibv_event_type`.
    Other(u32),
}

/// Objects created and destroyed, for leak checks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ObjectCounts {
    /// QPs created / destroyed.
    pub qps: (u64, u64),
    /// MRs registered / deregistered.
    pub mrs: (u64, u64),
    /// CQs created / destroyed.
    pub cqs: (u64, u64),
    /// PDs allocated / deallocated.
    pub pds: (u64, u64),
    /// Shared receive queues created / destroyed.
    pub srqs: (u64, u64),
}

impl ObjectCounts {
    /// True when every object created was destroyed.
    pub fn balanced(&self) -> bool {
        [self.qps, self.mrs, self.cqs, self.pds, self.srqs].iter().all(|(made, gone)| made == gone)
    }
}

/// The verbs kvring uses.
pub trait Verbs: Send + Sync + std::fmt::Debug {
    /// Devices and their ports.
    fn devices(&self) -> Result<Vec<DeviceInfo>>;
    /// Opens a device by name.
    fn open(&self, device: &str) -> Result<Context>;
    /// Closes a device.
    fn close(&self, context: Context) -> Result<()>;
    /// Allocates a protection domain.
    fn alloc_pd(&self, context: Context) -> Result<Pd>;
    /// Frees a protection domain (its MRs and QPs must be gone).
    fn dealloc_pd(&self, pd: Pd) -> Result<()>;
    /// Registers `len` bytes at `addr`.
    ///
    /// # Safety
    ///
    /// The range must stay valid until [`Verbs::dereg_mr`]: the NIC (or the
    /// simulator) reads and writes it without the caller's involvement.
    unsafe fn reg_mr(&self, pd: Pd, addr: u64, len: u64, access: MrAccess) -> Result<Mr>;
    /// Registers `dmabuf.len` bytes of a dma-buf (device memory a GPU
    /// provider exported) from `dmabuf.offset` in it, addressed by work
    /// requests as `iova..iova + dmabuf.len` (`ibv_reg_dmabuf_mr`). An error
    /// when the device, kernel or library has no dma-buf registration.
    ///
    /// # Safety
    ///
    /// The memory behind the dma-buf stays allocated to its owner until
    /// [`Verbs::dereg_mr`]: the NIC reads and writes it on its own.
    unsafe fn reg_dmabuf_mr(&self, pd: Pd, dmabuf: DmaBufRange<'_>, iova: u64, access: MrAccess) -> Result<Mr>;
    /// Deregisters memory.
    fn dereg_mr(&self, mr: MrHandle) -> Result<()>;
    /// Creates a completion queue.
    fn create_cq(&self, context: Context, depth: u32) -> Result<Cq>;
    /// Creates a completion queue with a completion channel: its
    /// descriptor turns readable when a completion arrives after
    /// [`Verbs::arm_cq`], so a sleeping thread can wait on it in a poller.
    fn create_wakeable_cq(&self, context: Context, depth: u32) -> Result<(Cq, RawFd)>;
    /// Asks for one wake-up at the next completion of a wakeable CQ (poll
    /// it once more afterwards: a completion may have come just before).
    fn arm_cq(&self, cq: Cq) -> Result<()>;
    /// Takes the wake-ups a wakeable CQ's descriptor has (non-blocking).
    fn take_cq_events(&self, cq: Cq) -> Result<()>;
    /// Creates a shared receive queue of `depth` receives on `pd`.
    fn create_srq(&self, pd: Pd, depth: u32) -> Result<Srq>;
    /// Destroys a shared receive queue (its QPs must be gone).
    fn destroy_srq(&self, srq: Srq) -> Result<()>;
    /// Posts one receive without buffers per `wr_ids` entry (a
    /// WRITE_WITH_IMM places its bytes by address and consumes one).
    fn post_srq_recv(&self, srq: Srq, wr_ids: &[u64]) -> Result<()>;
    /// Destroys a completion queue (its QPs must be gone).
    fn destroy_cq(&self, cq: Cq) -> Result<()>;
    /// Creates an RC QP; returns it and its endpoint (for the peer).
    fn create_qp(&self, pd: Pd, cq: Cq, caps: QpCaps) -> Result<(Qp, QpEndpoint)>;
    /// Moves a QP to another state.
    fn modify_qp(&self, qp: Qp, transition: QpTransition) -> Result<()>;
    /// Destroys a QP.
    fn destroy_qp(&self, qp: Qp) -> Result<()>;
    /// Posts `wrs` in order as one list.
    fn post_send(&self, qp: Qp, wrs: &[SendWr]) -> std::result::Result<(), PostError>;
    /// Takes up to `out.len()` completions; returns how many.
    fn poll_cq(&self, cq: Cq, out: &mut [Wc]) -> Result<usize>;
    /// Objects created and destroyed so far.
    fn counts(&self) -> ObjectCounts;
    /// The descriptor that turns readable when `context` has an async
    /// event; `None` where the provider has none.
    fn async_fd(&self, _context: Context) -> Option<RawFd> {
        None
    }
    /// Takes (and acknowledges) the async events `context` has now,
    /// without waiting.
    fn take_async_events(&self, _context: Context, _out: &mut Vec<AsyncEvent>) -> Result<()> {
        Ok(())
    }
}

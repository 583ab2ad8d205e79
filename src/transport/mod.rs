//! Transports: how a lane moves validated blocks to or from a peer.
//!
//! Opening a peer over a transport yields a [`Link`]: one [`LaneLink`] per
//! lane, each handed to its lane and driven by that lane alone (no lock,
//! not `Sync`), and the [`LinkState`] they share with the engine's segment
//! handle. Every lane link is driven by the same lane loop, so the ring,
//! status, backoff and validation logic is exercised whatever moves the
//! bytes. A lane validates every block before it hands it to its link
//! (local range against the registry, remote range against the peer's
//! descriptor), in chunks of at most [`LaneLink::max_chunk`] blocks, and
//! checks cancel and deadlines between chunks.

pub(crate) mod checksum;
mod checksum_shm;
pub(crate) mod cma;
pub(crate) mod cuda_ipc;
mod fence_holds;
pub(crate) mod gpu_fds;
pub(crate) mod kind;
pub(crate) mod null;
pub(crate) mod rdma;
pub(crate) mod select;
pub(crate) mod shm;
pub(crate) mod stage;
pub(crate) mod tcp;

pub use kind::TransportKind;

use crate::desc::BlockDesc;
use crate::error::Error;
use crate::mem::MemoryKind;
use crate::ring::Opcode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Keys below this in a lane's poller are its service's connections; keys
/// from it up are its links' sockets (`LINK_KEY_BASE + arena index`).
pub(crate) const LINK_KEY_BASE: usize = 1 << 40;
/// The key of a lane's waker (its doorbell's eventfd).
pub(crate) const WAKER_KEY: mio::Token = mio::Token(usize::MAX);

/// A target's connections served from a lane's loop: accepted elsewhere,
/// adopted by the lane, driven by readiness from the lane's poller (every
/// key it registers is below [`LINK_KEY_BASE`]; registrations are
/// edge-triggered, so a connection is driven until its socket would block
/// or it must wait for its own replies to drain). Only its lane calls it.
pub(crate) trait Service: Send + std::fmt::Debug {
    /// Takes a connection accepted under admission id `id` and registers it
    /// with `registry`.
    fn adopt(&mut self, registry: &mio::Registry, stream: std::net::TcpStream, id: u64, now: std::time::Instant);
    /// Ends connection `id` (evicted to make room, or too late to prove
    /// itself: then it is told so first).
    fn evict(&mut self, registry: &mio::Registry, id: u64, too_late: bool);
    /// Serves a readiness event of `key`; true when anything moved.
    fn ready(&mut self, registry: &mio::Registry, key: usize, now: std::time::Instant) -> bool;
    /// Drives again the connections that stopped at their read budget (so
    /// one busy peer never holds the lane); true when anything moved.
    fn drive_again(&mut self, registry: &mio::Registry, now: std::time::Instant) -> bool;
    /// True while GPU copies of staged bytes are running: nothing wakes the
    /// lane when they end, so it must look again soon.
    fn waiting_on_copies(&self) -> bool;
    /// Closes what passed a deadline and frees idle buffers; returns when
    /// it next needs to look (`None`: it holds no connection).
    fn tick(&mut self, registry: &mio::Registry, now: std::time::Instant) -> Option<std::time::Instant>;
    /// Closes every connection (the lane stops), giving back their leases.
    fn close_all(&mut self, registry: &mio::Registry);
}

/// A target's receive completions (RDMA's WRITE_WITH_IMM, which count
/// arrivals), polled from one lane's loop. Only that lane calls it.
pub(crate) trait Receiver: Send + std::fmt::Debug {
    /// Takes what arrived (bounded per call); returns how many completions.
    fn poll(&mut self) -> usize;
    /// Descriptors that turn readable when something arrives after
    /// [`Receiver::arm`]: the lane waits on them when it parks.
    fn wake_fds(&self) -> Vec<std::os::fd::RawFd>;
    /// Asks to be woken at the next arrival, then looks once more; true
    /// when something arrived meanwhile (the lane then polls, not parks).
    fn arm(&mut self) -> bool;
}

/// The key of a lane's receiver's descriptors in its poller: above every
/// service key, so a wake-up from them is never taken for a connection.
pub(crate) const RECEIVER_KEY: mio::Token = mio::Token(usize::MAX - 1);

/// Most blocks any link takes per chunk; a lane's chunk buffer is
/// allocated once with this capacity.
pub(crate) const MAX_CHUNK_BLOCKS: usize = 256;

/// One validated block: where its local bytes are, and its descriptor.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Block {
    /// First byte of the local range (inside a leased, registered region):
    /// a host address, or a device address (`memory`) never dereferenced.
    pub local: *mut u8,
    /// Where the local range lives.
    pub memory: MemoryKind,
    /// The descriptor (its remote range was checked against the peer's).
    pub desc: BlockDesc,
    /// Its index in the caller's batch, for errors.
    pub desc_index: u32,
    /// The batch's arrival tag (0: none), for links that carry it.
    pub tag: u32,
    /// Checksummed end to end: set only on links that carry the checksum
    /// in their frames ([`LaneLink::checksums_on_wire`]); the lane verifies
    /// one-sided links.
    pub checksum: bool,
    /// The grant the batch names for its destination (0: none); a write
    /// lands only where no newer fence covers it (`mem::fence`).
    pub grant: u32,
}

/// A chunk's failure: the error, and the bytes moved before it.
pub(crate) type TransferError = (Error, u64);

/// How a chunk ended, or that it will end later.
#[derive(Debug)]
pub(crate) enum Posted {
    /// Moved now (synchronous links): the bytes moved.
    Done(u64),
    /// Failed now: the error and the bytes moved before it.
    Failed(TransferError),
    /// Handed to the link; its end comes from [`LaneLink::poll`] under the
    /// chunk's ticket. The chunk's memory must stay leased until then.
    InFlight,
}

/// A chunk that ended after [`Posted::InFlight`]: its ticket and result.
pub(crate) type ChunkEnd = (u64, Result<u64, TransferError>);

/// What every lane's link to one peer shares with the engine's segment
/// handle: which transport it is, and whether it broke.
#[derive(Debug)]
pub(crate) struct LinkState {
    kind: TransportKind,
    carries_notifications: bool,
    broken: AtomicBool,
}

impl LinkState {
    /// A healthy link of `kind`.
    pub fn new(kind: TransportKind, carries_notifications: bool) -> Arc<Self> {
        Arc::new(Self { kind, carries_notifications, broken: AtomicBool::new(false) })
    }

    /// Which transport this is.
    pub fn kind(&self) -> TransportKind {
        self.kind
    }

    /// True when the transport carries notifications on its own path
    /// ([`LaneLink::post_notification`]); otherwise the engine sends them on
    /// the control plane.
    pub fn carries_notifications(&self) -> bool {
        self.carries_notifications
    }

    /// True once a lane's link can carry nothing more (a connection closed,
    /// an RDMA QP in the error state): the lane marks its segment stale at
    /// the first failure, of whatever kind, so the next open reconnects.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Records that a lane's link broke.
    pub fn mark_broken(&self) {
        self.broken.store(true, Ordering::Release);
    }
}

/// A connection to one peer segment over one transport, as opened on the
/// caller's thread: the shared state, and one lane link per lane, in lane
/// order, each then sent to its lane.
#[derive(Debug)]
pub(crate) struct Link {
    /// Shared by the lane links and the segment handle.
    pub state: Arc<LinkState>,
    /// One per lane.
    pub lanes: Vec<Box<dyn LaneLink>>,
}

/// One lane's own connection to one peer: its socket, its queue pairs, its
/// mappings. Only that lane calls it, so it takes `&mut self` and needs no
/// lock.
pub(crate) trait LaneLink: Send + std::fmt::Debug {
    /// Most blocks the lane hands over at once.
    fn max_chunk(&self) -> usize;

    /// Moves `blocks` in order, now ([`Posted::Done`], [`Posted::Failed`])
    /// or later ([`Posted::InFlight`]: the end is reported by
    /// [`LaneLink::poll`] under `ticket`).
    ///
    /// # Safety
    ///
    /// Each block's `local..local + desc.len` must lie within one registered
    /// local region that stays registered, valid for reads (WRITE) or writes
    /// (READ), and not otherwise accessed until the chunk has ended: on
    /// return for `Done` and `Failed`, when `poll` or `abort` reports its
    /// ticket for `InFlight`.
    unsafe fn transfer(&mut self, op: Opcode, batch_id: u64, ticket: u64, blocks: &[Block]) -> Posted;

    /// Moves one block (a piece of one) as [`LaneLink::transfer`] does,
    /// continuing `sums`: `sent` over its source's bytes as they are before
    /// they are copied, `landed` over its destination's read back after
    /// they landed (the `testing` feature's hook corrupts them in between);
    /// only where [`LaneLink::verifies_landed`]. This default sums the
    /// source, moves the block, then reads the destination back; shm does
    /// all three per few KiB while they are in the L1 cache.
    ///
    /// # Safety
    ///
    /// As [`LaneLink::transfer`].
    unsafe fn transfer_summed(
        &mut self,
        op: Opcode,
        (batch_id, ticket): (u64, u64),
        block: &Block,
        sums: &mut checksum::BlockSums,
    ) -> Posted {
        let len = block.desc.len as usize;
        match op {
            // SAFETY: the block's local range is valid for reads and not
            // otherwise written until the chunk ends (our contract).
            Opcode::Write => unsafe { sums.sent.update_raw(block.local, len) },
            Opcode::Read => {
                if let Err(error) = self.remote_crc32c(op, block, &mut sums.sent) {
                    return Posted::Failed((error, 0));
                }
            }
        }
        // SAFETY: forwarded from our own contract.
        let moved = match unsafe { self.transfer(op, batch_id, ticket, std::slice::from_ref(block)) } {
            Posted::Done(moved) => moved,
            other => return other,
        };
        if len > 0 && checksum::take_corruption(checksum::landing_offset(op, block)) {
            match op {
                Opcode::Write => self.corrupt_remote(block),
                // SAFETY: the local range is valid for writes and this lane
                // alone writes it during a READ (our contract).
                Opcode::Read => unsafe { checksum::flip_first_byte(block.local) },
            }
        }
        match op {
            Opcode::Write => {
                if let Err(error) = self.remote_crc32c(op, block, &mut sums.landed) {
                    return Posted::Failed((error, moved));
                }
            }
            // SAFETY: as above; the copy into it has ended.
            Opcode::Read => unsafe { sums.landed.update_raw(block.local, len) },
        }
        Posted::Done(moved)
    }

    /// True when the link moves GPU memory (local or remote): the lane
    /// refuses a GPU region on any other link before it is touched.
    fn moves_device_memory(&self) -> bool {
        false
    }

    /// True when chunks in flight end on their own, whatever the peer does
    /// (a GPU's copies): a part past its deadline then waits for them to end
    /// (and ends `TimedOut`) rather than have [`LaneLink::abort`] close the
    /// link, since they cannot be recalled and the segment is healthy.
    fn ends_on_its_own(&self) -> bool {
        false
    }

    /// Makes progress on the chunks in flight and appends those that ended
    /// to `ended`. Returns true if anything moved.
    fn poll(&mut self, _ended: &mut Vec<ChunkEnd>) -> bool {
        false
    }

    /// Ends every chunk in flight at once (a batch passed its deadline, the
    /// lane stops): closes what carries them, so no byte of theirs is read
    /// or written afterwards, and reports each as failed with `reason`.
    fn abort(&mut self, _reason: &str, _ended: &mut Vec<ChunkEnd>) {}

    /// The engine retired the segment handle (closed, evicted, or found
    /// stale). A link that broke hands back what it can reuse now (reset
    /// QPs, for the reconnect that usually follows at once), failing what
    /// it still had in flight; a healthy one keeps everything until
    /// dropped, so its chunks in flight still end.
    fn retire(&mut self, _ended: &mut Vec<ChunkEnd>) {}

    /// True while GPU copies of this link's staged chunks run: their ends
    /// raise no edge on its socket, so a parked lane must look again soon.
    fn waiting_on_copies(&self) -> bool {
        false
    }

    /// Ends (into `ended`, as failed) the chunks of `ticket` that have not
    /// left yet and may simply be dropped; returns how many. A part past its
    /// deadline whose every chunk is withdrawn needs no [`LaneLink::abort`];
    /// a cancelled part's withdrawn chunks are what its cancel saved.
    fn withdraw(&mut self, _ticket: u64, _ended: &mut Vec<ChunkEnd>) -> usize {
        0
    }

    /// Most bytes of local GPU memory one chunk may carry (links that stage
    /// them through bounce pages): the lane cuts chunks, and splits larger
    /// blocks, at this.
    fn max_staged_chunk_bytes(&self) -> u64 {
        u64::MAX
    }

    /// Whether the target counts the arrival tags this link carries (tcp,
    /// rdma); a tagged part on a link that does not is refused.
    fn counts_arrivals(&self) -> bool {
        false
    }

    /// Whether a write's grant is checked against its destination's fences
    /// on this link (tcp, shm, cma: `mem::fence`); a granted write on a link
    /// that does not is refused rather than landing unchecked.
    fn checks_grants(&self) -> bool {
        false
    }

    /// The socket whose readability (a reply) or writability (room in a
    /// send buffer that was full) means this link has something to poll,
    /// so that a parked lane waits on it instead of a timer.
    fn wake_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }

    /// True once after the link's [`LaneLink::wake_fd`] came to name
    /// another socket (a data connection dialled again): the lane registers
    /// it with its poller again, since the old socket's registration closed
    /// with it.
    fn rewoken(&mut self) -> bool {
        false
    }

    /// True when the link reads the peer's bytes itself (one-sided: shm
    /// maps them, cma reads them with `process_vm_readv`), so the lane can
    /// checksum both ends of a block ([`LaneLink::remote_crc32c`]).
    fn verifies_landed(&self) -> bool {
        false
    }

    /// True when the link verifies a checksummed chunk ([`Block::checksum`])
    /// after it completed and before it ends, off the lane (rdma: the
    /// target sums what landed, `rdma/verify.rs`).
    fn verifies_completed(&self) -> bool {
        false
    }

    /// Continues `sum` over the peer's bytes under `block`'s remote range,
    /// read now with the rights `op` needs there; only where
    /// [`LaneLink::verifies_landed`].
    fn remote_crc32c(&mut self, _op: Opcode, _block: &Block, _sum: &mut checksum::Crc32c) -> Result<(), Error> {
        Err(Error::Unsupported { what: "reading a peer's bytes back on this transport".into() })
    }

    /// True when what `op` moves is checksummed on this link's own path
    /// ([`Block::checksum`]): tcp's WRITE frames carry each frame's CRC32C
    /// and the target checks it before it acks; its READ_DATA frames carry
    /// the CRC32C of what the target sent, checked once it landed here.
    fn checksums_on_wire(&self, _op: Opcode) -> bool {
        false
    }

    /// Corrupts the first byte of `block`'s remote range (the `testing`
    /// feature's corruption of a landed block); only where
    /// [`LaneLink::verifies_landed`].
    fn corrupt_remote(&mut self, _block: &Block) {}

    /// Queues an encoded notification after everything queued before it; it
    /// ends, like a chunk, through `poll` under `ticket`.
    fn post_notification(&mut self, _ticket: u64, _payload: Vec<u8>) -> Result<(), Error> {
        Err(Error::Unsupported { what: "notifications on this transport's data path".into() })
    }
}

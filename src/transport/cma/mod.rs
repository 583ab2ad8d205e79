//! Cross-memory attach (`cma`): a same-host peer's memory that is not
//! kvring's shared memory (numpy arrays, PyTorch CPU tensors, a C caller's
//! buffers) moved with one kernel copy, `process_vm_writev` (WRITE) or
//! `process_vm_readv` (READ), in iovec batches of up to [`IOV_MAX`] entries
//! per call, from the lane.
//!
//! **Proof, at open** (`CmaPeer::open`). The peer's descriptor names its
//! pid and its shared page (`page.rs`). The page file must prove itself
//! like a region file (kvring's name for that pid and epoch, this user,
//! mode 0600, a header its owner wrote) and its head must name the same
//! pid, epoch and address. Then a pidfd of the pid is opened, and the
//! page's head is read *through that pid's address space* at the address
//! the peer announced: only the process that created the page maps it
//! there, so a peer cannot point our writes at another process by naming
//! its pid. Last, the pidfd must show the process still running: had it
//! exited and its pid been handed out again between the pidfd's opening
//! and the read, the pidfd would say so. A kernel that refuses the read
//! (another user, Yama, a process that is not dumpable) is reported with
//! the reason, and the engine takes the next transport in the order.
//!
//! **Before every call** (`CmaLink::move_all`), a retry after `EINTR` or
//! after a short count included. The link marks, in its user slot in the
//! page, the regions the call touches, then checks, in this order and
//! before any syscall: the page's epoch (0 once the target engine
//! stopped), the page's *liveness word* (`alive.rs`: a robust futex of a
//! target thread, which the kernel itself releases when that thread goes,
//! at the process's exit or at an exec of any of its threads, before the
//! new image exists), the pidfd (readable once the process exited), and
//! the state word, address and length of every region the call touches,
//! read again from the page. A process that exec'd keeps its pid, and its
//! pidfd does not fire, but its liveness word is released, so it gets no
//! call; the page file it left behind, whose epoch nobody zeroed, is not
//! what is asked. Every block was checked before that against the region
//! as the target's page lists it (rights, bounds with checked arithmetic),
//! on top of the lane's check against the descriptor. A pidfd never names
//! another process, so a target that exited fails its next call with
//! `PeerRestarted` without one byte written, and the next open picks up
//! the restarted target's new pid from its new descriptor.
//!
//! **The window left.** Between the last check and the syscall itself (no
//! `process_vm_*` takes a pidfd) the target may still, in that time:
//! exec (the call then writes into the new image, if it maps the
//! addresses); or exit, be reaped by its parent, and have its pid handed to
//! a new process, which the kernel does cyclically, after `pid_max` others,
//! or at once where pids are set on purpose (`ns_last_pid`, CRIU). The new
//! process must be one the kernel lets this process reach: one of the same
//! user that is dumpable, or, where this process runs as root or holds
//! `CAP_SYS_PTRACE` (most containers, this project's CI), *any* process.
//! The window is one check-to-syscall gap per call (microseconds), and the
//! writes stay inside the ranges the target's page listed.
//!
//! **Short counts.** The kernel may move fewer bytes than asked (it stops
//! at the first fault); the link resumes from the exact byte, so a call
//! that moved part of an entry continues with the rest of it, and a fault
//! that persists fails the chunk with the bytes moved before it.

mod alive;
#[cfg(feature = "testing")]
pub(crate) mod cost;
pub(crate) mod owner;
mod page;
mod revoke;
mod sockdiag;
pub(crate) mod sys;
mod taker;
#[cfg(test)]
mod tests;
mod verify;

pub(crate) use page::{CmaExport, CmaPeer};
#[cfg(feature = "testing")]
pub(crate) use sockdiag::identity_from_reply as sockdiag_identity_from_reply;

use super::{Block, LaneLink, Link, LinkState, Posted, TransportKind, MAX_CHUNK_BLOCKS};
use crate::error::{Error, Side};
use crate::mem::fence::Pass;
use crate::mem::registry::{access_name, check_range};
use crate::mem::Access;
use crate::ring::Opcode;
use crate::segment::SegmentDescriptor;
use std::sync::Arc;
use sys::{IoVec, Pidfd, Yama, IOV_MAX};

/// How a call moves bytes: [`sys::vm_copy`], or a stand-in in tests.
///
/// # Safety
///
/// As [`sys::vm_copy`].
pub(crate) type CopyFn = unsafe fn(Opcode, u32, &[IoVec], &[IoVec]) -> std::io::Result<usize>;

/// Why proving a target failed.
#[derive(Debug)]
enum Proof {
    /// Its process is gone.
    Gone(String),
    /// The kernel or the page says no.
    Refused(String),
}

/// Reads the page's head through process `pidfd` at `page_addr` and
/// compares it with `ours` (see the module docs).
fn prove(ours: &[u8; page::PROOF_BYTES], pidfd: &Pidfd, page_addr: u64) -> Result<(), Proof> {
    let mut theirs = [0u8; page::PROOF_BYTES];
    let local = [IoVec { base: theirs.as_mut_ptr() as usize, len: theirs.len() }];
    let remote = [IoVec { base: page_addr as usize, len: theirs.len() }];
    let pid = pidfd.pid();
    // SAFETY: `theirs` is ours, valid for writes, and unused during the call.
    match unsafe { sys::vm_copy(Opcode::Read, pid, &local, &remote) } {
        Ok(n) if n == theirs.len() => {}
        Ok(n) => return Err(Proof::Refused(format!("reading its page through pid {pid} gave {n} bytes"))),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
            return Err(Proof::Gone(format!("its process {pid} exited")))
        }
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
            return Err(Proof::Refused(format!(
                "the kernel refuses this process access to pid {pid} ({e}): the target must run as the same user and \
                 be dumpable; {}",
                Yama::current().explain()
            )))
        }
        Err(e) => return Err(Proof::Refused(format!("reading its page through pid {pid}: {e}"))),
    }
    if !page::same_fixed_head(ours, &theirs) {
        return Err(Proof::Refused(format!(
            "pid {pid} does not map the announced page at {page_addr:#x}: it is not the engine that described itself"
        )));
    }
    if pidfd.exited() {
        return Err(Proof::Gone(format!("its process {pid} exited")));
    }
    Ok(())
}

/// One lane's cma link to one peer: the peer (shared by the lanes) and
/// this lane's preallocated iovec lists.
#[derive(Debug)]
pub(crate) struct CmaLink {
    peer: Arc<CmaPeer>,
    local: Vec<IoVec>,
    remote: Vec<IoVec>,
    /// Region indices the chunk touches, to check before the call.
    touched: Vec<usize>,
    copy: CopyFn,
    /// Syscalls made (tests check that none is made after the target went).
    calls: u64,
}

impl CmaLink {
    /// Proves the peer and opens one link per lane over it.
    pub fn open(descriptor: &SegmentDescriptor, lanes: usize) -> crate::error::Result<Link> {
        if descriptor.host_id != crate::segment::local_host_id() {
            return Err(Error::Unsupported {
                what: format!("cma to {}: the peer is on another host", descriptor.name),
            });
        }
        let peer = Arc::new(CmaPeer::open(descriptor)?);
        let lanes = (0..lanes).map(|_| Box::new(Self::new(peer.clone(), sys::vm_copy)) as Box<dyn LaneLink>).collect();
        Ok(Link { state: LinkState::new(TransportKind::Cma, false), lanes })
    }

    /// A link over `peer` moving bytes with `copy`.
    fn new(peer: Arc<CmaPeer>, copy: CopyFn) -> Self {
        Self {
            peer,
            local: Vec::with_capacity(MAX_CHUNK_BLOCKS),
            remote: Vec::with_capacity(MAX_CHUNK_BLOCKS),
            touched: Vec::with_capacity(MAX_CHUNK_BLOCKS),
            copy,
            calls: 0,
        }
    }

    /// Checks each block against the region as the target's page lists it
    /// and appends its iovecs (merged with the previous entry when both
    /// sides continue it). Stops at the first bad block, returning its
    /// error; the blocks before it are in the lists.
    fn gather(&mut self, op: Opcode, blocks: &[Block], fenced: Option<&Pass<'_>>) -> Option<Error> {
        self.local.clear();
        self.remote.clear();
        self.touched.clear();
        let needs = match op {
            Opcode::Write => Access::REMOTE_WRITE,
            Opcode::Read => Access::REMOTE_READ,
        };
        for block in blocks {
            let desc = &block.desc;
            let index = desc.remote_region.index() as usize;
            let unknown = Error::UnknownRegion { side: Side::Remote, region: desc.remote_region };
            let Some(at) = self.peer.region(index) else { return Some(unknown) };
            if (at.state >> 32) as u32 != desc.remote_region.generation() {
                return Some(unknown);
            }
            if !at.access.contains(needs) {
                let (region, desc_index) = (desc.remote_region, block.desc_index);
                return Some(Error::AccessDenied { desc_index, side: Side::Remote, region, needs: access_name(needs) });
            }
            if let Err(error) =
                check_range(desc.remote_region, Side::Remote, block.desc_index, desc.remote_offset, desc.len, at.len)
            {
                return Some(error);
            }
            // In range of a region that does not wrap (checked at open
            // against the descriptor), so neither sum overflows.
            let (remote, len) = ((at.addr + desc.remote_offset) as usize, desc.len as usize);
            // A write's grant, against the target's table (by address).
            if fenced.is_some_and(|pass| !pass.admits(remote as u64, (remote + len) as u64, block.grant)) {
                return Some(Error::Fenced { region: desc.remote_region, grant: block.grant });
            }
            let local = block.local as usize;
            match (self.local.last_mut(), self.remote.last_mut()) {
                (Some(l), Some(r))
                    if l.base + l.len == local && r.base + r.len == remote && l.len <= usize::MAX / 2 =>
                {
                    l.len += len;
                    r.len += len;
                }
                _ => {
                    self.local.push(IoVec { base: local, len });
                    self.remote.push(IoVec { base: remote, len });
                }
            }
            if self.touched.last() != Some(&index) {
                self.touched.push(index);
            }
        }
        None
    }

    /// Moves everything gathered, [`IOV_MAX`] entries per call, resuming
    /// after short counts; checks the target before every call. Returns
    /// the bytes moved, or the error and the bytes moved before it.
    fn move_all(&mut self, op: Opcode) -> Result<u64, (Error, u64)> {
        let peer = self.peer.clone();
        // Marked with the regions the chunk touches: an unregister of
        // another region does not wait for this call.
        let entered = peer.enter(&self.touched);
        let gone = |peer: &CmaPeer| Error::PeerRestarted { segment: peer.name.clone(), detail: peer.why_not_live() };
        let (mut start, mut moved, mut interrupted) = (0usize, 0u64, 0u32);
        while start < self.local.len() {
            // Before *every* call, a retry after EINTR or a short count
            // included: the target checked again, through its own address
            // space, and every region the chunk touches still listed as it
            // was (state, address and length).
            if !peer.live(&entered) {
                return Err((gone(&peer), moved));
            }
            if let Some(&index) = self.touched.iter().find(|&&index| !peer.listed(&entered, index)) {
                let generation = peer.region(index).map_or(0, |r| (r.state >> 32) as u32);
                let region = crate::desc::RegionId::new(index as u32, generation);
                return Err((Error::UnknownRegion { side: Side::Remote, region }, moved));
            }
            let end = (start + IOV_MAX).min(self.local.len());
            let want: usize = self.local[start..end].iter().map(|v| v.len).sum();
            self.calls += 1;
            // SAFETY: every local entry lies in a block the lane validated
            // against a leased region (our `transfer`'s contract), and at most
            // IOV_MAX entries go per call on each side.
            let result = unsafe { (self.copy)(op, peer.pid(), &self.local[start..end], &self.remote[start..end]) };
            match result {
                Ok(n) if n == want => {
                    moved += n as u64;
                    start = end;
                }
                Ok(0) => return Err((self.fault(&peer, start, "the kernel moved nothing"), moved)),
                Ok(n) => {
                    moved += n as u64;
                    start = self.advance(start, n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted && interrupted < 100 => interrupted += 1,
                Err(e) => return Err((self.call_error(&peer, start, e), moved)),
            }
        }
        Ok(moved)
    }

    /// After a short count of `n` bytes from entry `start`: drops the
    /// entries fully moved and trims the one moved in part (the local and
    /// remote lists have equal lengths entry by entry, so both stop at the
    /// same place). Returns the first entry left.
    fn advance(&mut self, mut start: usize, mut n: usize) -> usize {
        while n > 0 {
            let len = self.local[start].len;
            if n >= len {
                n -= len;
                start += 1;
            } else {
                for list in [&mut self.local, &mut self.remote] {
                    list[start].base += n;
                    list[start].len -= n;
                }
                n = 0;
            }
        }
        start
    }

    fn call_error(&self, peer: &CmaPeer, at: usize, error: std::io::Error) -> Error {
        match error.raw_os_error() {
            Some(libc::ESRCH) => Error::PeerRestarted { segment: peer.name.clone(), detail: peer.why_not_live() },
            Some(libc::EPERM) => Error::PeerRestarted {
                segment: peer.name.clone(),
                detail: format!("the kernel no longer lets this process reach pid {} ({error})", peer.pid()),
            },
            Some(libc::EFAULT) => self.fault(peer, at, "not mapped in its process"),
            _ => Error::io(format!("cma to {}", peer.name), error),
        }
    }

    /// A registered range of the target that its process does not map
    /// (it freed memory without unregistering it).
    fn fault(&self, peer: &CmaPeer, at: usize, why: &str) -> Error {
        let range = self.remote.get(at).copied().unwrap_or_default();
        Error::io(
            format!(
                "cma to {}: its registered memory at {:#x}+{} is {why} (freed without being unregistered?)",
                peer.name, range.base, range.len
            ),
            std::io::Error::from_raw_os_error(libc::EFAULT),
        )
    }
}

impl LaneLink for CmaLink {
    fn checks_grants(&self) -> bool {
        true
    }

    fn max_chunk(&self) -> usize {
        // One call per chunk: the lane checks cancel and deadlines between.
        MAX_CHUNK_BLOCKS.min(IOV_MAX)
    }

    fn verifies_landed(&self) -> bool {
        true
    }

    fn remote_crc32c(
        &mut self,
        op: Opcode,
        block: &Block,
        sum: &mut crate::transport::checksum::Crc32c,
    ) -> crate::error::Result<()> {
        self.read_crc32c(op, block, sum)
    }

    fn corrupt_remote(&mut self, block: &Block) {
        self.flip_remote(block)
    }

    unsafe fn transfer(&mut self, op: Opcode, _batch_id: u64, _ticket: u64, blocks: &[Block]) -> Posted {
        // A write counts itself in the target's fence table before it
        // checks its grants, and stays counted until its calls end
        // (`mem::fence`): a fence that returned sees no stale call after.
        let peer = self.peer.clone();
        let fenced = match op {
            Opcode::Write => match peer.fences().enter() {
                Some(pass) => Some(pass),
                None => {
                    let region = blocks.first().map_or(crate::desc::RegionId::from_raw(0), |b| b.desc.remote_region);
                    return Posted::Failed((Error::RegionBusy { region, in_flight: 0 }, 0));
                }
            },
            Opcode::Read => None,
        };
        let bad = self.gather(op, blocks, fenced.as_ref());
        let moved = match self.local.is_empty() {
            true => Ok(0),
            false => self.move_all(op),
        };
        drop(fenced);
        match (moved, bad) {
            (Ok(bytes), None) => Posted::Done(bytes),
            (Ok(bytes), Some(error)) => Posted::Failed((error, bytes)),
            (Err(failed), _) => Posted::Failed(failed),
        }
    }
}

//! The cma link against a target in this very process (a pid may attach to
//! itself): transfers, short counts, the checks before every call, the
//! revocation handshake, the proof, the quota of initiator slots. Tests
//! across real processes are in tests/cma.rs.

use super::page::{CmaExport, CmaPeer, MAX_CMA_USERS};
use super::sys::{IoVec, Pidfd};
use super::*;
use crate::desc::{BlockDesc, RegionId};
use crate::mem::{Access, MemoryKind, RegionKind};
use crate::segment::{local_host_id, CmaReach, RemoteRegion};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

const LEN: usize = 64 << 10;

/// A target in this process: its page, and one region over `memory`.
struct Target {
    export: CmaExport,
    memory: Vec<u8>,
    id: RegionId,
    epoch: u64,
}

impl Target {
    fn new(access: Access) -> Self {
        let epoch = u64::from_le_bytes(crate::auth::random_bytes()) | 1;
        let export = CmaExport::create(epoch, 16).unwrap();
        let mut memory = vec![0u8; LEN];
        let id = RegionId::new(3, 7);
        export.publish(id, memory.as_mut_ptr() as usize, LEN, access);
        Self { export, memory, id, epoch }
    }

    fn descriptor(&self) -> SegmentDescriptor {
        SegmentDescriptor {
            name: "self".into(),
            epoch: self.epoch,
            host_id: local_host_id().to_string(),
            pid: std::process::id(),
            instance: 0,
            gpu_fds: None,
            regions: vec![RemoteRegion {
                id: self.id,
                kind: RegionKind::Raw,
                len: LEN as u64,
                // What the descriptor claims; the page's own rights decide.
                access: Access::ALL,
                layer: 0,
                block_bytes: 0,
                shm_path: None,
                addr: self.memory.as_ptr() as u64,
                memory: MemoryKind::Host,
                gpu_export: Ok(Vec::new()),
            }],
            control_addr: String::new(),
            tcp_addr: None,
            rdma: None,
            cma: Some(self.export.reach()),
        }
    }

    fn link(&self, copy: CopyFn) -> CmaLink {
        CmaLink::new(Arc::new(CmaPeer::open(&self.descriptor()).unwrap()), copy)
    }
}

fn blocks(local: &mut [u8], remote: RegionId, count: usize, len: usize) -> Vec<Block> {
    (0..count)
        .map(|i| Block {
            // SAFETY: i * len + len <= local.len() for every caller here.
            local: unsafe { local.as_mut_ptr().add(i * len) },
            memory: MemoryKind::Host,
            desc: BlockDesc::new(RegionId::new(0, 1), (i * len) as u64, remote, (i * len) as u64, len as u64),
            desc_index: i as u32,
            tag: 0,
            checksum: false,
            grant: 0,
        })
        .collect()
}

fn transfer(link: &mut CmaLink, op: Opcode, blocks: &[Block]) -> Posted {
    // SAFETY: every block's local range lies in a Vec the test keeps alive
    // and does not touch during the call.
    unsafe { link.transfer(op, 1, 1, blocks) }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn write_and_read_move_every_byte() {
    let mut target = Target::new(Access::ALL);
    let mut link = target.link(sys::vm_copy);
    let mut source = pattern(LEN, 1);
    let chunk = blocks(&mut source, target.id, 16, 4096);
    assert!(matches!(transfer(&mut link, Opcode::Write, &chunk), Posted::Done(n) if n == LEN as u64));
    assert_eq!(target.memory, source);
    // Contiguous blocks were merged: one entry per side, one call.
    assert_eq!((link.local.len(), link.calls), (1, 1));
    target.memory.copy_from_slice(&pattern(LEN, 9));
    let mut back = vec![0u8; LEN];
    let chunk = blocks(&mut back, target.id, 16, 4096);
    assert!(matches!(transfer(&mut link, Opcode::Read, &chunk), Posted::Done(n) if n == LEN as u64));
    assert_eq!(back, target.memory);
}

/// Moves at most 1000 bytes a call, splitting entries anywhere.
///
/// # Safety
///
/// As [`sys::vm_copy`].
unsafe fn stingy(op: Opcode, pid: u32, local: &[IoVec], remote: &[IoVec]) -> std::io::Result<usize> {
    let (mut left, mut l, mut r) = (1000usize, Vec::new(), Vec::new());
    for (a, b) in local.iter().zip(remote) {
        let take = a.len.min(left);
        l.push(IoVec { base: a.base, len: take });
        r.push(IoVec { base: b.base, len: take });
        left -= take;
        if left == 0 {
            break;
        }
    }
    // SAFETY: a prefix of what our caller passed.
    unsafe { sys::vm_copy(op, pid, &l, &r) }
}

#[test]
fn short_counts_resume_from_the_exact_byte() {
    let target = Target::new(Access::ALL);
    let mut link = target.link(stingy);
    let mut source = pattern(LEN, 3);
    // Every other block, so entries are not merged: 8 entries of 4 KiB.
    let mut chunk = blocks(&mut source, target.id, 16, 4096);
    chunk.retain(|b| b.desc_index % 2 == 0);
    assert!(matches!(transfer(&mut link, Opcode::Write, &chunk), Posted::Done(n) if n == 8 * 4096));
    for block in &chunk {
        let at = block.desc.remote_offset as usize;
        assert_eq!(target.memory[at..at + 4096], source[at..at + 4096]);
        assert!(target.memory[at + 4096..at + 8192].iter().all(|&b| b == 0), "the gaps stay untouched");
    }
    assert_eq!(link.calls, (8 * 4096usize).div_ceil(1000) as u64);
}

#[test]
fn a_fault_in_the_target_fails_the_chunk_with_what_moved_before_it() {
    // The page lists two pages, but the target's process maps only the first.
    let map = |len| {
        // SAFETY: an anonymous private mapping of `len` bytes.
        unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        }
    };
    let base = map(8192) as usize;
    assert_ne!(base as *mut libc::c_void, libc::MAP_FAILED);
    let target = Target::new(Access::ALL);
    target.export.publish(RegionId::new(4, 1), base, 8192, Access::ALL);
    let mut descriptor = target.descriptor();
    let mut second = descriptor.regions[0].clone();
    (second.id, second.addr, second.len) = (RegionId::new(4, 1), base as u64, 8192);
    descriptor.regions.push(second);
    // SAFETY: the second page of our own mapping, which nothing else uses.
    assert_eq!(unsafe { libc::munmap((base + 4096) as *mut libc::c_void, 4096) }, 0);
    let mut link = CmaLink::new(Arc::new(CmaPeer::open(&descriptor).unwrap()), sys::vm_copy);
    let mut source = pattern(8192, 5);
    let chunk = blocks(&mut source, RegionId::new(4, 1), 2, 4096);
    match transfer(&mut link, Opcode::Write, &chunk) {
        Posted::Failed((error, moved)) => {
            assert_eq!(moved, 4096);
            assert!(error.to_string().contains("not mapped in its process"), "{error}");
        }
        other => panic!("{other:?}"),
    }
    // SAFETY: the first page, still mapped, holds what was written.
    assert_eq!(unsafe { std::slice::from_raw_parts(base as *const u8, 4096) }, &source[..4096]);
    // SAFETY: our own mapping's first page.
    unsafe { libc::munmap(base as *mut libc::c_void, 4096) };
}

static CALLS: AtomicU64 = AtomicU64::new(0);

/// Counts calls and makes none.
///
/// # Safety
///
/// None needed: it touches no memory.
unsafe fn counting(_: Opcode, _: u32, local: &[IoVec], _: &[IoVec]) -> std::io::Result<usize> {
    CALLS.fetch_add(1, Ordering::SeqCst);
    Ok(local.iter().map(|v| v.len).sum())
}

#[test]
fn a_stopped_target_or_a_revoked_region_gets_no_call() {
    let target = Target::new(Access::ALL);
    let mut source = pattern(LEN, 7);
    let chunk = blocks(&mut source, target.id, 1, 4096);
    // The region taken off the page: refused before any call.
    let mut link = target.link(counting);
    target.export.revoke(target.id).unwrap();
    match transfer(&mut link, Opcode::Write, &chunk) {
        Posted::Failed((Error::UnknownRegion { side: Side::Remote, .. }, 0)) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(link.calls, 0);
    // Listed again, then the engine stops: its epoch goes first.
    target.export.publish(target.id, target.memory.as_ptr() as usize, LEN, Access::ALL);
    let mut link = target.link(counting);
    assert!(matches!(transfer(&mut link, Opcode::Write, &chunk), Posted::Done(4096)));
    target.export.close();
    match transfer(&mut link, Opcode::Write, &chunk) {
        Posted::Failed((Error::PeerRestarted { detail, .. }, 0)) => {
            assert!(detail.contains("engine stopped"), "{detail}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(link.calls, 1, "only the call before the stop");
    // A new open sees the closed epoch and refuses.
    assert!(CmaPeer::open(&target.descriptor()).unwrap_err().to_string().contains("another start"));
}

static INSIDE: AtomicUsize = AtomicUsize::new(0);

/// A call that takes 150 ms, announcing that it started.
///
/// # Safety
///
/// None needed: it touches no memory.
unsafe fn slow(_: Opcode, _: u32, local: &[IoVec], _: &[IoVec]) -> std::io::Result<usize> {
    INSIDE.store(1, Ordering::SeqCst);
    std::thread::sleep(std::time::Duration::from_millis(150));
    Ok(local.iter().map(|v| v.len).sum())
}

#[test]
fn revoking_waits_for_a_call_in_progress() {
    let target = Arc::new(Target::new(Access::ALL));
    let mut link = target.link(slow);
    let region = target.id;
    let caller = std::thread::spawn(move || {
        let mut source = pattern(4096, 1);
        let chunk = blocks(&mut source, region, 1, 4096);
        matches!(transfer(&mut link, Opcode::Write, &chunk), Posted::Done(4096))
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while INSIDE.load(Ordering::SeqCst) == 0 {
        assert!(std::time::Instant::now() < deadline, "the call never started");
        std::thread::yield_now();
    }
    let started = std::time::Instant::now();
    target.export.revoke(region).unwrap();
    assert!(started.elapsed() >= std::time::Duration::from_millis(100), "{:?}", started.elapsed());
    assert!(caller.join().unwrap());
}

#[test]
fn rights_and_bounds_come_from_the_targets_own_page() {
    // The descriptor claims every right; the page lists read only.
    let target = Target::new(Access::REMOTE_READ | Access::LOCAL_READ | Access::LOCAL_WRITE);
    let mut link = target.link(counting);
    let mut source = pattern(LEN, 2);
    let chunk = blocks(&mut source, target.id, 1, 4096);
    match transfer(&mut link, Opcode::Write, &chunk) {
        Posted::Failed((Error::AccessDenied { side: Side::Remote, .. }, 0)) => {}
        other => panic!("{other:?}"),
    }
    let mut past = chunk.clone();
    past[0].desc.remote_offset = LEN as u64 - 100;
    match transfer(&mut link, Opcode::Read, &past) {
        Posted::Failed((Error::OutOfBounds { .. }, 0)) => {}
        other => panic!("{other:?}"),
    }
    past[0].desc.remote_offset = u64::MAX - 10;
    match transfer(&mut link, Opcode::Read, &past) {
        Posted::Failed((Error::LengthOverflow { .. }, 0)) => {}
        other => panic!("{other:?}"),
    }
    // A region the page does not list as the descriptor says (another
    // generation): unknown.
    past[0].desc = BlockDesc::new(RegionId::new(0, 1), 0, RegionId::new(3, 8), 0, 16);
    assert!(matches!(transfer(&mut link, Opcode::Read, &past), Posted::Failed((Error::UnknownRegion { .. }, 0))));
    assert_eq!(link.calls, 0);
}

#[test]
fn a_descriptor_that_is_not_the_page_is_refused() {
    let target = Target::new(Access::ALL);
    let refused = |descriptor: SegmentDescriptor| CmaPeer::open(&descriptor).unwrap_err().to_string();
    let mut other = target.descriptor();
    other.epoch ^= 2;
    assert!(refused(other).contains("not the name kvring gives"));
    let mut moved = target.descriptor();
    if let Some(CmaReach::Offered { page_addr, .. }) = moved.cma.as_mut() {
        *page_addr += 4096;
    }
    assert!(refused(moved).contains("mapped elsewhere"));
    let mut refusing = target.descriptor();
    refusing.cma = Some(CmaReach::Refused("cma = off".into()));
    assert!(refused(refusing).contains("does not allow it: cma = off"));
    // A region listed in the descriptor at another address than the page
    // says is not reachable.
    let mut lying = target.descriptor();
    lying.regions[0].addr += 4096;
    let peer = CmaPeer::open(&lying).unwrap();
    assert!(peer.region(3).is_none());
}

#[test]
fn the_proof_reads_the_page_through_the_named_process() {
    let target = Target::new(Access::ALL);
    let peer = CmaPeer::open(&target.descriptor()).unwrap();
    let Some(CmaReach::Offered { page_addr, .. }) = target.descriptor().cma else { unreachable!() };
    let mut ours = [0u8; page::PROOF_BYTES];
    // SAFETY: the page's head, mapped by the export for the test's life.
    unsafe { std::ptr::copy_nonoverlapping(page_addr as *const u8, ours.as_mut_ptr(), ours.len()) };
    assert!(prove(&ours, &Pidfd::open(std::process::id()).unwrap(), page_addr).is_ok());
    // Another process of this user, which does not map the page there.
    let mut child = std::process::Command::new("sleep").arg("10").spawn().unwrap();
    let pidfd = Pidfd::open(child.id()).unwrap();
    match prove(&ours, &pidfd, page_addr) {
        Err(Proof::Refused(why)) => assert!(why.contains(&format!("pid {}", child.id())), "{why}"),
        other => panic!("{other:?}"),
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(matches!(prove(&ours, &pidfd, page_addr), Err(Proof::Gone(_))));
    drop(peer);
}

#[test]
fn initiator_slots_are_a_quota_and_closed_links_give_theirs_back() {
    let target = Target::new(Access::ALL);
    let peers: Vec<CmaPeer> = (0..MAX_CMA_USERS).map(|_| CmaPeer::open(&target.descriptor()).unwrap()).collect();
    let error = CmaPeer::open(&target.descriptor()).unwrap_err();
    assert!(matches!(error, Error::Busy { capacity: MAX_CMA_USERS, .. }), "{error}");
    drop(peers);
    let again: Vec<CmaPeer> = (0..4).map(|_| CmaPeer::open(&target.descriptor()).unwrap()).collect();
    assert_eq!(again.len(), 4);
}

#[test]
fn an_id_listed_again_at_another_address_gets_no_call() {
    // The slot is revoked and listed again under the very same state word
    // (what a wrapped generation would give) for another buffer: the link
    // opened before must not write at the address it captured, nor at the
    // new one.
    let target = Target::new(Access::ALL);
    let mut link = target.link(counting);
    let mut other = vec![0u8; LEN];
    target.export.revoke(target.id).unwrap();
    target.export.publish(target.id, other.as_mut_ptr() as usize, LEN, Access::ALL);
    let mut source = pattern(LEN, 4);
    let chunk = blocks(&mut source, target.id, 1, 4096);
    match transfer(&mut link, Opcode::Write, &chunk) {
        Posted::Failed((Error::UnknownRegion { side: Side::Remote, .. }, 0)) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(link.calls, 0);
    assert!(other.iter().all(|&b| b == 0));
    assert!(target.memory.iter().all(|&b| b == 0));
}

/// The page's epoch word of the target the `interrupted` copy stops.
static EPOCH_WORD: AtomicUsize = AtomicUsize::new(0);

/// Stops the target's engine (its epoch to 0) and fails with `EINTR`, as a
/// signal landing in the call would.
///
/// # Safety
///
/// `EPOCH_WORD` holds the address of a live page's epoch word.
unsafe fn interrupted(_: Opcode, _: u32, _: &[IoVec], _: &[IoVec]) -> std::io::Result<usize> {
    let word = EPOCH_WORD.load(Ordering::SeqCst) as *const AtomicU64;
    // SAFETY: per this function's contract.
    unsafe { (*word).store(0, Ordering::SeqCst) };
    Err(std::io::Error::from_raw_os_error(libc::EINTR))
}

#[test]
fn a_retry_after_eintr_checks_the_target_again() {
    let target = Target::new(Access::ALL);
    let Some(CmaReach::Offered { page_addr, .. }) = target.descriptor().cma else { unreachable!() };
    EPOCH_WORD.store(page_addr as usize + 32, Ordering::SeqCst);
    let mut link = target.link(interrupted);
    let mut source = pattern(LEN, 6);
    let chunk = blocks(&mut source, target.id, 1, 4096);
    match transfer(&mut link, Opcode::Write, &chunk) {
        Posted::Failed((Error::PeerRestarted { detail, .. }, 0)) => assert!(detail.contains("stopped"), "{detail}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(link.calls, 1, "no retry once the target stopped");
}

/// The initiator's own mapping of the page still says "running" (nobody
/// zeroes the epoch when a target execs or dies), but the kernel released
/// the page's liveness word when the target's owning thread went: not
/// live, no call. (A real exec: tests/hostile_local.rs.)
#[test]
fn liveness_is_the_word_the_kernel_releases_when_the_target_goes() {
    let Target { export, memory, id, epoch } = Target::new(Access::ALL);
    let target = Target { export, memory, id, epoch };
    let peer = CmaPeer::open(&target.descriptor()).unwrap();
    assert!(peer.live(&peer.enter(&[])));
    assert!(peer.live_by_head_read(&peer.enter(&[])));
    let Target { export, memory, .. } = target;
    // The owning thread exits (as it does at exit, or killed by an exec).
    drop(export);
    assert!(!peer.live(&peer.enter(&[])), "the released word is seen");
    assert!(peer.why_not_live().contains("no longer maps its cma page"), "{}", peer.why_not_live());
    drop(memory);
}

/// Open while a test's copy must stay inside the call.
static GATE: AtomicUsize = AtomicUsize::new(0);
/// Calls inside [`stalled`] now.
static STALLED: AtomicUsize = AtomicUsize::new(0);

/// A call that stays inside until [`GATE`] opens (bounded: 20 s).
///
/// # Safety
///
/// None needed: it touches no memory.
unsafe fn stalled(_: Opcode, _: u32, local: &[IoVec], _: &[IoVec]) -> std::io::Result<usize> {
    STALLED.fetch_add(1, Ordering::SeqCst);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while GATE.load(Ordering::SeqCst) == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    STALLED.fetch_sub(1, Ordering::SeqCst);
    Ok(local.iter().map(|v| v.len).sum())
}

/// A write over `peer` into one block of each of `into`, stalled inside
/// its call until [`GATE`] opens; returns once it is inside.
fn stall(peer: &Arc<CmaPeer>, into: Vec<RegionId>) -> std::thread::JoinHandle<bool> {
    GATE.store(0, Ordering::SeqCst);
    let mut link = CmaLink::new(peer.clone(), stalled);
    let caller = std::thread::spawn(move || {
        let mut source = pattern(LEN, 1);
        let chunk: Vec<Block> = into
            .iter()
            .enumerate()
            .map(|(i, &region)| Block {
                desc_index: i as u32,
                ..blocks(&mut source[i * 64..], region, 1, 64).remove(0)
            })
            .collect();
        matches!(transfer(&mut link, Opcode::Write, &chunk), Posted::Done(_))
    });
    while STALLED.load(Ordering::SeqCst) == 0 {
        assert!(!caller.is_finished(), "the stalled call never started");
        std::thread::yield_now();
    }
    caller
}

/// Lets a [`stall`]ed write go; it must complete.
fn release(caller: std::thread::JoinHandle<bool>) {
    GATE.store(1, Ordering::SeqCst);
    assert!(caller.join().unwrap(), "the stalled write completes once let go");
}

/// The drain waits only on calls into the region it takes off: a call
/// stalled inside a write into region B does not hold up the unregister of
/// region A; one into A (alone, or beside B in one chunk, or among more
/// regions than a user slot has marks) does.
#[test]
fn unregistering_one_region_waits_only_for_calls_into_it() {
    const REGIONS: usize = super::revoke::MARKS + 2;
    let target = Target::new(Access::ALL);
    let part = LEN / REGIONS;
    let base = target.memory.as_ptr() as usize;
    let mut descriptor = target.descriptor();
    let template = descriptor.regions[0].clone();
    let publish = |descriptor: &mut SegmentDescriptor, n: usize, generation: u32| {
        let id = RegionId::new(n as u32, generation);
        target.export.publish(id, base + n * part, part, Access::ALL);
        let region = RemoteRegion { id, len: part as u64, addr: (base + n * part) as u64, ..template.clone() };
        descriptor.regions.retain(|r| r.id.index() != id.index());
        descriptor.regions.push(region);
        id
    };
    descriptor.regions.clear();
    let ids: Vec<RegionId> = (0..REGIONS).map(|n| publish(&mut descriptor, n, 1)).collect();
    let peer = Arc::new(CmaPeer::open(&descriptor).unwrap());
    let (a, b) = (ids[0], ids[1]);
    // Stalled in B: A comes off at once, with B's call still inside.
    let caller = stall(&peer, vec![b]);
    assert_eq!(target.export.revoke(a), Ok(()));
    assert_eq!(STALLED.load(Ordering::SeqCst), 1, "B's call was still inside when A came off");
    assert_eq!(target.export.revoke(b), Err(1), "B's own unregister waits for it");
    release(caller);
    // A listed again (a new generation): a call into A, or into A and B at
    // once, holds A's unregister.
    let a = publish(&mut descriptor, 0, 2);
    let peer = Arc::new(CmaPeer::open(&descriptor).unwrap());
    for into in [vec![a], vec![b, a]] {
        let caller = stall(&peer, into);
        assert_eq!(target.export.revoke(a), Err(1), "a call into A holds A's unregister");
        release(caller);
    }
    // Blocks alternating between A and B: two marks, not a count.
    let caller = stall(&peer, [a, b].repeat(REGIONS));
    assert_eq!(target.export.revoke(ids[REGIONS - 1]), Ok(()), "a region the call does not touch comes off");
    assert_eq!(target.export.revoke(a), Err(1));
    release(caller);
    let last = publish(&mut descriptor, REGIONS - 1, 2);
    let peer = Arc::new(CmaPeer::open(&descriptor).unwrap());
    let ids: Vec<RegionId> = ids[..REGIONS - 1].iter().copied().chain([last]).collect();
    // More regions than marks: the call is counted for every region.
    let caller = stall(&peer, ids[1..].iter().copied().chain([a]).collect());
    assert_eq!(target.export.revoke(ids[REGIONS - 1]), Err(1));
    assert_eq!(target.export.revoke(a), Err(1));
    release(caller);
    // Nothing inside: every region comes off at once.
    for id in ids[1..].iter().copied().chain([a]) {
        assert_eq!(target.export.revoke(id), Ok(()));
    }
}

//! The shared page between a target and its cross-memory-attach
//! initiators: what the target allows, and the handshake in memory that
//! keeps an initiator from ever writing where the target no longer
//! allows it.
//!
//! The target creates the page as a kvring shm file (`ShmMapping::create`,
//! so it is named, owned and headed like a region file and proven the same
//! way by whoever opens it). It holds:
//!
//! - a head: magic, version, the target's pid, a random nonce, the epoch
//!   (set to 0 when the engine stops), where the page is mapped in the
//!   target's own address space, the table sizes, the liveness word
//!   (`alive.rs`);
//! - one *user slot* per initiator link (`pid << 32 | calls in progress
//!   counted for every region`, then the initiator process's start time, so
//!   that a pid handed to another process is not taken for it, then six
//!   marks, each naming a region slot a call in progress touches), each on
//!   its own cache line: at
//!   most [`MAX_CMA_USERS`], a quota every initiator fills one slot of,
//!   reclaimed from initiators that died;
//! - one *region slot* per registry slot: the region's raw id, rights and a
//!   live bit in one word, then its address and length.
//!
//! **Revocation.** Before every `process_vm_*` call an initiator marks, in
//! its user slot, the regions the call touches (or adds one to the slot's
//! count, standing for every region, when it has no free mark), then
//! checks the epoch and the state of every region the call touches, and
//! clears its marks after the call. A target that unregisters a region (or
//! stops) first clears the region's state (or the epoch), then waits until
//! no live initiator has a call in progress marked with that region (or
//! counted; a stop waits for every call). A sequentially consistent fence
//! splits each side's write from its read, so either the initiator's check
//! sees the cleared word (and makes no call), or the target's wait sees the
//! initiator's mark (and waits for the call to end): memory the caller
//! frees after `unregister` returns is never reached. The handshake itself is in `revoke.rs`, modelled with loom. The
//! wait is bounded; a region whose initiators do not finish in time stays
//! registered and `unregister` says `RegionBusy`.

pub(crate) use super::revoke::Entered;
use super::revoke::{self, CLAIMING};
use super::sys::{pid_alive, process_start, same_process, Pidfd};
use crate::desc::RegionId;
use crate::error::{Error, Result};
use crate::mem::shm::PeerRegion;
use crate::mem::{Access, ShmMapping};
use crate::segment::{CmaReach, SegmentDescriptor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// "KVRINGCM".
const MAGIC: [u8; 8] = *b"KVRINGCM";
/// 2: calls carry marks naming their regions (an initiator of version 1
/// would only count, which a target of version 2 still honours, but a
/// version 1 target would not see a version 2 initiator's marks).
/// 3: a region's state word holds its slot's 32-bit generation, not a
/// 32-bit raw id (the slot is the word's place on the page).
/// 4: the fence table's `issued` word (`mem::fence`), which writers check.
const VERSION: u32 = 4;
/// Initiator links one target serves over cma at once (each holds a slot).
pub const MAX_CMA_USERS: usize = 256;
const LINE: usize = 64;
const HEAD_BYTES: usize = 64;
const USERS_OFFSET: usize = HEAD_BYTES;
const REGIONS_OFFSET: usize = USERS_OFFSET + MAX_CMA_USERS * LINE;
const REGION_SLOT_BYTES: usize = 24;
/// The region state word's live bit (rights in bits 8..16, the slot's
/// generation above 32; the slot is the word's place on the page).
const LIVE: u64 = 1;
/// Longest a target waits for initiators' calls in progress to end.
pub const CMA_REVOKE_WAIT: Duration = Duration::from_secs(2);

/// The page's head, as the target writes it once before announcing it.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
struct Head {
    magic: [u8; 8],
    version: u32,
    pid: u32,
    nonce: [u8; 16],
    /// Atomic in the page (`epoch()`); this copy is what was read.
    epoch: u64,
    self_addr: u64,
    capacity: u32,
    users: u32,
    /// The liveness word (`alive.rs`): the TID of the thread owning it
    /// while the target's image lives, `FUTEX_OWNER_DIED` once it is gone.
    alive: u64,
}

const _: () = assert!(std::mem::size_of::<Head>() == HEAD_BYTES);
/// Where the epoch word sits in the head.
const EPOCH_OFFSET: usize = 32;
/// Where the liveness word sits in the head.
const ALIVE_OFFSET: usize = 56;
/// The head's bytes that never change once written: what an initiator
/// compares with the copy it reads through the target's own address space.
const FIXED: [std::ops::Range<usize>; 2] = [0..32, 40..56];

fn state_word(id: RegionId, access: Access) -> u64 {
    (u64::from(id.generation()) << 32) | (u64::from(access.bits() & 0xff) << 8) | LIVE
}

/// The page bytes of `mapping`, with accessors for its words.
#[derive(Debug)]
struct Page {
    mapping: ShmMapping,
    capacity: usize,
}

impl Page {
    fn len_for(capacity: usize) -> usize {
        REGIONS_OFFSET + capacity * REGION_SLOT_BYTES
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset.is_multiple_of(8) && offset + 8 <= self.mapping.len());
        // The mapping is page aligned and at least `offset + 8` bytes long
        // (checked at open and create); the word is only ever accessed
        // atomically, by every process that maps the page.
        // SAFETY: in bounds and aligned (above), and it lives as long as `self`.
        unsafe { &*self.mapping.as_ptr().add(offset).cast::<AtomicU64>() }
    }

    fn epoch(&self) -> &AtomicU64 {
        self.word(EPOCH_OFFSET)
    }

    fn alive(&self) -> &AtomicU64 {
        self.word(ALIVE_OFFSET)
    }

    fn user(&self, index: usize) -> &AtomicU64 {
        self.word(USERS_OFFSET + index * LINE)
    }

    /// User slot `index`'s words of the revocation handshake: its word,
    /// then (after the start time) its marks.
    fn user_slot(&self, index: usize) -> revoke::User<'_> {
        let at = USERS_OFFSET + index * LINE;
        revoke::User { word: self.word(at), marks: std::array::from_fn(|m| self.word(at + 16 + 8 * m)) }
    }

    /// When the process holding user slot `index` started (0: not known).
    fn user_start(&self, index: usize) -> &AtomicU64 {
        self.word(USERS_OFFSET + index * LINE + 8)
    }

    /// (state, address, length) words of region slot `index`.
    fn region(&self, index: usize) -> [&AtomicU64; 3] {
        let at = REGIONS_OFFSET + index * REGION_SLOT_BYTES;
        [self.word(at), self.word(at + 8), self.word(at + 16)]
    }

    fn read_head(&self) -> Head {
        // SAFETY: the head lies at the mapping's start (at least HEAD_BYTES
        // long, page aligned); any bytes are a valid Head. Volatile: another
        // process may write the page.
        let mut head = unsafe { self.mapping.as_ptr().cast::<Head>().read_volatile() };
        head.epoch = self.epoch().load(Ordering::SeqCst);
        head
    }

    fn head_bytes(&self) -> [u8; HEAD_BYTES] {
        let mut bytes = [0u8; HEAD_BYTES];
        // SAFETY: as in `read_head`.
        unsafe { std::ptr::copy_nonoverlapping(self.mapping.as_ptr(), bytes.as_mut_ptr(), HEAD_BYTES) };
        bytes
    }

    /// Waits until no live initiator has a call in progress that may touch
    /// region slot `region` (`None`: any call), or `deadline`; returns how
    /// many still have.
    fn drain(&self, region: Option<usize>, deadline: Instant) -> u32 {
        let mut pause = Duration::from_micros(5);
        loop {
            let busy = (0..MAX_CMA_USERS)
                .filter(|&i| {
                    // A slot still being claimed counts no call.
                    let (pid, calling) = revoke::calls_in(self.user_slot(i), region);
                    calling && same_process(pid, self.user_start(i).load(Ordering::SeqCst))
                })
                .count() as u32;
            if busy == 0 || Instant::now() >= deadline {
                return busy;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

/// A target's side: the page it created and keeps current as regions come
/// and go.
#[derive(Debug)]
pub(crate) struct CmaExport {
    /// Declared (so dropped) before `page`: its thread exits, and the
    /// kernel marks the liveness word, while the page is still mapped.
    _sentinel: super::alive::Sentinel,
    page: Page,
    /// Held by an `unregister` from before it looks the region up until it
    /// has re-listed it (or not): two unregisters of one region never
    /// interleave, so the loser finds it gone and never lists it again.
    unregistering: std::sync::Mutex<()>,
}

impl CmaExport {
    /// Creates the page for the engine at `epoch` with room for `capacity`
    /// regions (the registry's).
    pub fn create(epoch: u64, capacity: usize) -> Result<Self> {
        let mapping = ShmMapping::create(Page::len_for(capacity), epoch)?;
        let head = Head {
            magic: MAGIC,
            version: VERSION,
            pid: std::process::id(),
            nonce: crate::auth::random_bytes(),
            epoch: 0,
            self_addr: mapping.as_ptr() as u64,
            capacity: capacity as u32,
            users: MAX_CMA_USERS as u32,
            alive: 0,
        };
        // SAFETY: the new mapping is ours alone (nobody knows its name yet),
        // page aligned and longer than a Head.
        unsafe { mapping.as_ptr().cast::<Head>().write_volatile(head) };
        let page = Page { mapping, capacity };
        page.epoch().store(epoch, Ordering::SeqCst);
        let sentinel = super::alive::Sentinel::start(page.alive())
            .map_err(|e| Error::io("starting the cma page's liveness thread", e))?;
        Ok(Self { _sentinel: sentinel, page, unregistering: std::sync::Mutex::new(()) })
    }

    /// What the engine's descriptor says of it.
    pub fn reach(&self) -> CmaReach {
        CmaReach::Offered {
            page: self.page.mapping.path().to_path_buf(),
            page_addr: self.page.mapping.as_ptr() as u64,
            page_len: self.page.mapping.len() as u64,
        }
    }

    /// Lists a registered host region: initiators may reach it from now on.
    pub fn publish(&self, id: RegionId, addr: usize, len: usize, access: Access) {
        let index = id.index() as usize;
        if index >= self.page.capacity {
            return;
        }
        let [state, at, length] = self.page.region(index);
        at.store(addr as u64, Ordering::Relaxed);
        length.store(len as u64, Ordering::Relaxed);
        // Release: an initiator that reads this state (Acquire at open)
        // reads the address and length written before it.
        state.store(state_word(id, access), Ordering::Release);
    }

    /// The fence table of every region on the page, keyed by address in
    /// this process (`mem::fence`): in the page file's header page, which
    /// every initiator maps.
    pub fn fences(&self) -> crate::mem::fence::FenceView<'_> {
        self.page.mapping.fences()
    }

    /// Serialises unregisters: hold the guard across looking the region
    /// up, [`revoke`](Self::revoke), the registry's unregister and any
    /// re-listing after it failed.
    pub fn serialize(&self) -> std::sync::MutexGuard<'_, ()> {
        // A panic while holding it poisons nothing we rely on (the page's
        // words are atomics): go on.
        self.unregistering.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes a region off the page and waits until no initiator can still
    /// be inside a call that might touch it. On `Err(busy)` the region is
    /// listed again (it stays registered): `busy` initiators did not finish
    /// within [`CMA_REVOKE_WAIT`]. A slot that lists another id (or none) is
    /// left as it is: only `id` is taken off.
    pub fn revoke(&self, id: RegionId) -> std::result::Result<(), u32> {
        let index = id.index() as usize;
        if index >= self.page.capacity {
            return Ok(());
        }
        let [state, ..] = self.page.region(index);
        let Some(before) = revoke::take_off(state, id.generation(), LIVE) else { return Ok(()) };
        match self.page.drain(Some(index), Instant::now() + CMA_REVOKE_WAIT) {
            0 => Ok(()),
            busy => {
                revoke::put_back(state, before);
                Err(busy)
            }
        }
    }

    /// The engine stops: the epoch goes to 0, so no initiator starts
    /// another call, and those in progress are waited for (bounded).
    pub fn close(&self) {
        revoke::stop(self.page.epoch());
        let busy = self.page.drain(None, Instant::now() + CMA_REVOKE_WAIT);
        if busy > 0 {
            tracing::warn!(busy, "stopping with same-host cma initiators still inside a copy");
        }
    }
}

/// Where one region of the target is, as its page listed it at open.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RegionAt {
    /// The state word it must still have for a call to touch it.
    pub state: u64,
    /// Its first byte in the target's address space.
    pub addr: u64,
    /// Its length.
    pub len: u64,
    /// Its rights, from the target's own page.
    pub access: Access,
}

/// An initiator's side: the target's page, proven; a pidfd of its process;
/// one user slot held until dropped; its regions as listed at open.
#[derive(Debug)]
pub(crate) struct CmaPeer {
    page: Page,
    pidfd: Pidfd,
    epoch: u64,
    /// Where the target maps the page in its own address space.
    page_addr: u64,
    /// The liveness word as the target's owning thread wrote it.
    alive: u64,
    user: usize,
    regions: Vec<Option<RegionAt>>,
    /// The target's name, for errors.
    pub name: String,
}

impl CmaPeer {
    /// The target's fence table for its regions on the page, keyed by
    /// address in the target's process (`mem::fence`).
    pub fn fences(&self) -> crate::mem::fence::FenceView<'_> {
        self.page.mapping.fences()
    }

    /// Proves the target and takes a user slot (see [`open`](super::open)).
    pub fn open(descriptor: &SegmentDescriptor) -> Result<Self> {
        let refuse = |why: String| Error::Unsupported { what: format!("cma to {}: {why}", descriptor.name) };
        let (path, page_addr, page_len) = match &descriptor.cma {
            Some(CmaReach::Offered { page, page_addr, page_len }) => (page, *page_addr, *page_len),
            Some(CmaReach::Refused(why)) => return Err(refuse(format!("it does not allow it: {why}"))),
            None => return Err(refuse("it offers no cross-memory attach (an older kvring)".into())),
        };
        let len = usize::try_from(page_len).map_err(|_| refuse("its page is too large".into()))?;
        let claim = PeerRegion { pid: descriptor.pid, epoch: descriptor.epoch, region: RegionId::from_raw(0), len };
        let mapping = ShmMapping::open_peer(path, claim).map_err(|e| refuse(e.to_string()))?;
        let page = Page { mapping, capacity: 0 };
        let capacity = page.check_head(descriptor, page_addr).map_err(refuse)?;
        let page = Page { capacity, ..page };
        let pidfd = Pidfd::open(descriptor.pid)
            .map_err(|e| gone(descriptor, format!("its process {}: {e}", descriptor.pid)))?;
        super::prove(&page.head_bytes(), &pidfd, page_addr).map_err(|e| match e {
            super::Proof::Gone(why) => gone(descriptor, why),
            super::Proof::Refused(why) => refuse(why),
        })?;
        // Read after the proof: had the target exec'd or exited since, its
        // word is released already, and no call is made.
        let alive = page.alive().load(Ordering::SeqCst);
        if !super::alive::holds(alive, alive) {
            return Err(gone(descriptor, "its cma page's liveness word is released (it exec'd or is exiting)".into()));
        }
        let user = claim_user(&page)
            .ok_or(Error::Busy { queue: "the target's cma initiator slots", capacity: MAX_CMA_USERS })?;
        let mut peer = Self {
            page,
            pidfd,
            epoch: descriptor.epoch,
            page_addr,
            alive,
            user,
            regions: Vec::new(),
            name: descriptor.name.clone(),
        };
        peer.regions = peer.read_regions(descriptor);
        Ok(peer)
    }

    /// Every host region of the descriptor that the page lists the same
    /// way (id, address, length), by region index.
    fn read_regions(&self, descriptor: &SegmentDescriptor) -> Vec<Option<RegionAt>> {
        let max_index = descriptor.regions.iter().map(|r| r.id.index() as usize + 1).max().unwrap_or(0);
        let mut regions = vec![None; max_index.min(self.page.capacity)];
        for region in &descriptor.regions {
            let index = region.id.index() as usize;
            if index >= regions.len() || region.memory != crate::mem::MemoryKind::Host {
                continue;
            }
            let [state, at, length] = self.page.region(index);
            // Acquire pairs with `publish`'s Release; read again after, so a
            // slot rewritten meanwhile is not taken with a torn address.
            let before = state.load(Ordering::Acquire);
            let (addr, len) = (at.load(Ordering::Relaxed), length.load(Ordering::Relaxed));
            let after = state.load(Ordering::Acquire);
            let listed = before == after
                && before & LIVE != 0
                && (before >> 32) as u32 == region.id.generation()
                && addr == region.addr
                && len == region.len;
            if listed {
                let access = Access::from_bits(((before >> 8) & 0xff) as u32);
                regions[index] = Some(RegionAt { state: before, addr, len, access });
            }
        }
        regions
    }

    /// The region at `index` as listed at open, if the page listed it.
    #[inline]
    pub fn region(&self, index: usize) -> Option<&RegionAt> {
        self.regions.get(index).and_then(Option::as_ref)
    }

    /// Starts a call into region slots `regions`: marked (or counted) in
    /// this link's user slot until the guard drops. Check
    /// [`live`](Self::live) and [`listed`](Self::listed) after.
    #[inline]
    pub fn enter(&self, regions: &[usize]) -> Entered<'_> {
        revoke::enter(self.page.user_slot(self.user), regions)
    }

    /// True while the target engine still runs at the epoch it was opened
    /// at, and the image that proved itself at open still lives: the check
    /// before every call.
    ///
    /// The image is judged by the page's liveness word (`alive.rs`), which
    /// the kernel itself releases when the target's owning thread goes, by
    /// exit or by exec, before an exec'd image exists: a process that
    /// exec'd keeps its pid, and its pidfd stays quiet, but its word is
    /// released (nobody needs to zero the epoch in the file it left). The
    /// pidfd is asked too: a target that cleared its own robust list and
    /// exited, its pid then handed to another process, is still seen gone.
    /// One load of our own mapping and one `poll`, where a
    /// `process_vm_readv` of the head through the target's address space
    /// (`live_by_head_read`, kept for the bench) cost a remote read.
    #[inline]
    pub fn live(&self, entered: &Entered<'_>) -> bool {
        entered.still(self.page.epoch(), self.epoch)
            && entered.still(self.page.alive(), self.alive)
            && !self.pidfd.exited()
    }

    /// The check [`live`](Self::live) replaced: the head read through the
    /// target's own address space (`process_vm_readv`) before every call.
    /// Kept to measure the two against each other.
    #[cfg(any(test, feature = "testing"))]
    pub fn live_by_head_read(&self, entered: &Entered<'_>) -> bool {
        if !entered.still(self.page.epoch(), self.epoch) {
            return false;
        }
        let mut theirs = [0u8; HEAD_BYTES];
        let local = [super::sys::IoVec { base: theirs.as_mut_ptr() as usize, len: HEAD_BYTES }];
        let remote = [super::sys::IoVec { base: self.page_addr as usize, len: HEAD_BYTES }];
        // SAFETY: `theirs` is ours, valid for writes and unused during the
        // call; one entry on each side.
        let read = unsafe { super::sys::vm_copy(crate::ring::Opcode::Read, self.pidfd.pid(), &local, &remote) };
        let epoch = u64::from_le_bytes(theirs[EPOCH_OFFSET..EPOCH_OFFSET + 8].try_into().expect("8 bytes"));
        matches!(read, Ok(HEAD_BYTES))
            && same_fixed_head(&self.page.head_bytes(), &theirs)
            && epoch == self.epoch
            && !self.pidfd.exited()
    }

    /// True while the region at `index` is still listed as it was at open:
    /// its state word (id, rights, live bit), address and length, all read
    /// again from the page after the call was counted in (an id that came
    /// back for another buffer at another address is not the region).
    #[inline]
    pub fn listed(&self, entered: &Entered<'_>, index: usize) -> bool {
        match self.region(index) {
            Some(region) => {
                let [state, at, length] = self.page.region(index);
                entered.still(state, region.state)
                    && entered.still(at, region.addr)
                    && entered.still(length, region.len)
            }
            None => false,
        }
    }

    /// The target's pid.
    pub fn pid(&self) -> u32 {
        self.pidfd.pid()
    }

    /// Why a call may not start, for the error.
    pub fn why_not_live(&self) -> String {
        if self.pidfd.exited() {
            format!("its process {} exited", self.pidfd.pid())
        } else if self.page.epoch().load(Ordering::SeqCst) != self.epoch {
            "its engine stopped (its cma page's epoch changed)".to_string()
        } else {
            format!(
                "its process {} no longer maps its cma page at {:#x}: the kernel released the page's liveness word \
                 (it exec'd another program, or its engine stopped)",
                self.pidfd.pid(),
                self.page_addr
            )
        }
    }
}

impl Drop for CmaPeer {
    fn drop(&mut self) {
        // Give the slot back if it is still ours (no call is in progress:
        // every lane link holding this peer has dropped).
        let ours = u64::from(std::process::id()) << 32;
        let _ = self.page.user(self.user).compare_exchange(ours, 0, Ordering::SeqCst, Ordering::Relaxed);
    }
}

impl Page {
    /// Checks the head, as an initiator's mapping shows it, against the
    /// descriptor; returns the region table's capacity.
    fn check_head(&self, descriptor: &SegmentDescriptor, page_addr: u64) -> std::result::Result<usize, String> {
        let head = self.read_head();
        let capacity = head.capacity as usize;
        let checks = [
            (head.magic == MAGIC && head.version == VERSION, "its page is not a kvring cma page of this version"),
            (head.pid == descriptor.pid, "its page names another pid"),
            (head.epoch == descriptor.epoch, "its page is of another start of the engine (epoch)"),
            (head.self_addr == page_addr, "its page says it is mapped elsewhere"),
            (head.users as usize == MAX_CMA_USERS, "its page has another number of initiator slots"),
            (Page::len_for(capacity) <= self.mapping.len(), "its page is shorter than its region table"),
        ];
        match checks.iter().find(|(ok, _)| !ok) {
            Some((_, why)) => Err(why.to_string()),
            None => Ok(capacity),
        }
    }
}

/// Takes a free user slot, or one left by a process that is gone (its pid
/// free, or naming a process that started at another time). In two steps:
/// the slot is marked as being claimed by this pid, its start time is
/// written, and only then is it published; a claimer never pairs its pid
/// with another process's start time, where a racing claimer would take
/// the slot as a dead process's and the target would stop draining it.
fn claim_user(page: &Page) -> Option<usize> {
    let me = std::process::id();
    let ours = u64::from(me) << 32;
    let start = process_start(me).unwrap_or(0);
    let claimed = (0..MAX_CMA_USERS).find(|&i| {
        let slot = page.user(i);
        let word = slot.load(Ordering::SeqCst);
        let pid = (word >> 32) as u32;
        let free = word == 0
            || if word & CLAIMING != 0 {
                !pid_alive(pid)
            } else {
                !same_process(pid, page.user_start(i).load(Ordering::SeqCst))
            };
        free && slot.compare_exchange(word, ours | CLAIMING, Ordering::SeqCst, Ordering::Relaxed).is_ok()
    })?;
    // Marks a dead owner left (it died inside a call) name no call of ours.
    for mark in page.user_slot(claimed).marks {
        mark.store(0, Ordering::SeqCst);
    }
    page.user_start(claimed).store(start, Ordering::SeqCst);
    // Published: (pid, start) now agree. Nobody else writes a slot marked by
    // a live claimer, and calls are counted only after this returns.
    page.user(claimed).store(ours, Ordering::SeqCst);
    Some(claimed)
}

/// The error for a target whose process or engine is gone.
fn gone(descriptor: &SegmentDescriptor, detail: String) -> Error {
    Error::PeerRestarted { segment: descriptor.name.clone(), detail }
}

/// The head bytes that an initiator compares through the target's own
/// address space.
pub(crate) fn same_fixed_head(ours: &[u8; HEAD_BYTES], theirs: &[u8; HEAD_BYTES]) -> bool {
    FIXED.iter().all(|range| ours[range.clone()] == theirs[range.clone()])
}

/// Bytes of the head an initiator reads through the kernel.
pub(crate) const PROOF_BYTES: usize = HEAD_BYTES;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_left_by_a_dead_initiator_is_taken_again() {
        let page = Page { mapping: ShmMapping::create(Page::len_for(1), 1).unwrap(), capacity: 1 };
        let dead = {
            let mut child = std::process::Command::new("true").spawn().unwrap();
            let pid = child.id();
            child.wait().unwrap();
            pid
        };
        let alive = u64::from(std::process::id()) << 32;
        for i in 0..MAX_CMA_USERS {
            page.user(i).store(alive | 1, Ordering::SeqCst);
        }
        assert_eq!(claim_user(&page), None, "every slot is held by a live process");
        // A dead initiator, killed inside a call (its count still 1).
        page.user(17).store(u64::from(dead) << 32 | 1, Ordering::SeqCst);
        assert_eq!(claim_user(&page), Some(17));
        assert_eq!(page.user(17).load(Ordering::SeqCst), alive);
        // And a target's drain does not wait for the dead.
        page.user(17).store(u64::from(dead) << 32 | 1, Ordering::SeqCst);
        for i in (0..MAX_CMA_USERS).filter(|&i| i != 17) {
            page.user(i).store(0, Ordering::SeqCst);
        }
        assert_eq!(page.drain(None, Instant::now() + Duration::from_secs(1)), 0);
        // A live pid whose process started at another time: the initiator
        // died inside a call and its pid went to another process.
        page.user(17).store(alive | 1, Ordering::SeqCst);
        let start = process_start(std::process::id()).unwrap();
        page.user_start(17).store(start + 1, Ordering::SeqCst);
        assert_eq!(page.drain(None, Instant::now() + Duration::from_secs(1)), 0, "a reused pid is not waited for");
        page.user_start(17).store(start, Ordering::SeqCst);
        assert_eq!(page.drain(None, Instant::now()), 1, "the same process inside a call is waited for");
    }

    /// The claim race a hostile review found: a slot whose new pid sat
    /// beside its old owner's start time looked dead to a second claimer,
    /// and the target stopped draining it. A slot being claimed by a live
    /// process is now skipped by other claimers and counts no call; one
    /// whose claimer died is taken again.
    #[test]
    fn a_slot_being_claimed_is_skipped_by_other_claimers_and_counts_no_call() {
        let page = Page { mapping: ShmMapping::create(Page::len_for(1), 1).unwrap(), capacity: 1 };
        let me = u64::from(std::process::id()) << 32;
        let stale_start = process_start(std::process::id()).unwrap() + 1;
        for i in 0..MAX_CMA_USERS {
            // A live claimer halfway: its pid, the previous owner's start.
            page.user(i).store(me | CLAIMING, Ordering::SeqCst);
            page.user_start(i).store(stale_start, Ordering::SeqCst);
        }
        assert_eq!(claim_user(&page), None, "a live claimer's slot is not taken");
        assert_eq!(page.drain(None, Instant::now()), 0, "a slot being claimed counts no call");
        let dead = {
            let mut child = std::process::Command::new("true").spawn().unwrap();
            let pid = child.id();
            child.wait().unwrap();
            pid
        };
        page.user(5).store(u64::from(dead) << 32 | CLAIMING, Ordering::SeqCst);
        assert_eq!(claim_user(&page), Some(5), "a dead claimer's slot is taken again");
        assert_eq!(page.user(5).load(Ordering::SeqCst), me, "published with no mark and no call");
        assert_eq!(page.user_start(5).load(Ordering::SeqCst), stale_start - 1, "beside its own start");
    }
}

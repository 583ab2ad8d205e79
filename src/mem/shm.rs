//! Shared-memory backing for regions: files in `/dev/shm`, mapped with memmap2.
//!
//! The owner creates the file (mode 0600, a name of kvring's choosing:
//! `kvring-<pid>-<epoch>-<seq>`), sizes it, allocates its pages with
//! `fallocate` and maps it with `MAP_POPULATE`, so neither the owner nor the
//! lane pays a page fault (~15 µs each here) on the data path. The file's
//! first page is a header the owner writes: magic, the owner's pid and
//! epoch, the region's id, rights and length. The region's bytes follow.
//! The rights a peer's link uses are the header's, never more than what a
//! descriptor claims: a descriptor cannot widen them.
//!
//! A same-host peer maps a file only when it proves to be the region the
//! descriptor announced ([`ShmMapping::open_peer`]): the name is the one
//! kvring gives that owner's pid and epoch; it is opened with `O_NOFOLLOW`;
//! it is a regular file of this user, mode 0600, of exactly the announced
//! size; and after mapping, its header names the same pid, epoch, region
//! and length. A peer claiming to be on this host can therefore point our
//! writes at nothing but its own region: not another engine's, not another
//! application's shared memory, not a file of another user.
//!
//! **Revocation.** The header also holds two words the owner and its peers
//! share: `live` (1 while the region is registered) and `busy` (copies of
//! peers in progress). A peer's link adds one to `busy`, then checks `live`,
//! before it copies into or out of the region, and subtracts one after
//! ([`ShmMapping::enter`]). The owner that unregisters the region first
//! clears `live`, then waits until `busy` is 0 ([`ShmMapping::revoke`]).
//! Both sides use sequentially consistent operations (`mem/revoke.rs`, the
//! cma page's handshake; modelled in `loom_tests/`), so either the peer's check sees the
//! cleared word and copies nothing (the batch fails `UnknownRegion`), or the
//! owner's wait sees the peer's count and lets the copy end first: once
//! `unregister` returned, no peer's byte lands in the region. The wait is
//! bounded; a copy that does not end in time (its process stopped or
//! killed inside it) leaves the region registered and `unregister` says
//! `RegionBusy`.
//!
//! The owner removes the file when the mapping is dropped; files left by a
//! crashed process of this user are swept at the next engine start.

use crate::desc::RegionId;
use crate::error::{Error, Result};
use crate::mem::Access;
use memmap2::{MmapOptions, MmapRaw};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Where kvring puts its shared-memory files.
pub const SHM_DIR: &str = "/dev/shm";
/// Prefix of every kvring shared-memory file name.
pub const SHM_PREFIX: &str = "kvring-";
/// Bytes before a region's first byte in its file: the header page.
pub const SHM_HEADER_BYTES: usize = 4096;
/// The only mode a region file may have: its owner's, read and write.
pub const SHM_MODE: u32 = 0o600;
/// "KVRINGSH".
const HEADER_MAGIC: [u8; 8] = *b"KVRINGSH";
/// 2: the header carries the owner's rights (`access`, 0 in version 1).
/// 3: and the `live` and `busy` words of revocation.
/// 4: and the region's fence table at [`FENCE_OFFSET`] (`mem::fence`).
/// 5: the region id is 64 bits (a 32-bit generation).
/// 6: the fence table's `issued` word (`mem::fence`), which writers check.
const HEADER_VERSION: u32 = 6;
/// Where the region's fence table sits in the header page.
pub const FENCE_OFFSET: usize = 1024;
const _: () = assert!(FENCE_OFFSET + super::fence::FENCE_WORDS * 8 <= SHM_HEADER_BYTES);
/// Longest an owner's `unregister` waits for peers' copies in progress.
pub const SHM_REVOKE_WAIT: Duration = Duration::from_secs(2);

static NEXT_SHM_SEQ: AtomicU64 = AtomicU64::new(0);

/// The header at the start of every region file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
struct ShmHeader {
    magic: [u8; 8],
    version: u32,
    pid: u32,
    epoch: u64,
    /// Raw region id; 0 until the owner registered the region.
    region: u64,
    /// The rights the owner registered the region with ([`Access`] bits):
    /// what a peer may do with it, whatever a descriptor says. 0 until the
    /// owner registered the region.
    access: u32,
    /// Zero.
    reserved: u32,
    len: u64,
    /// 1 while the owner has the region registered, 0 before and after:
    /// shared with peers, only ever touched atomically ([`ShmMapping::live`]).
    live: u64,
    /// Peers' copies in progress: shared, only ever touched atomically.
    busy: u64,
}

// `live` and `busy` are used as `AtomicU64`s in place: 8-aligned offsets in
// a page-aligned header (the SAFETY arguments of `live` and `busy` rest on it).
const _: () = assert!(std::mem::offset_of!(ShmHeader, live) == 48 && std::mem::offset_of!(ShmHeader, busy) == 56);

/// What a peer's descriptor says about one of its shm regions: the file
/// must prove every field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerRegion {
    /// The owner's pid.
    pub pid: u32,
    /// The owner's epoch.
    pub epoch: u64,
    /// The region's id on the owner.
    pub region: RegionId,
    /// The region's length.
    pub len: usize,
}

pub use super::revoke::Entered;

/// A shared mapping of a `/dev/shm` region file.
#[derive(Debug)]
pub struct ShmMapping {
    map: MmapRaw,
    path: PathBuf,
    /// The creator unlinks the file on drop; a peer's mapping does not.
    owner: bool,
    /// The GPU provider the mapping is pinned with, unpinned on drop.
    pinned: std::sync::OnceLock<std::sync::Arc<dyn crate::gpu::Gpu>>,
    /// Held by the owner's `unregister` from revocation to the registry's
    /// verdict, so that two unregisters of one region never interleave (a
    /// loser's restore must not re-open a region the winner freed).
    pub(crate) unregistering: std::sync::Mutex<()>,
}

/// The name kvring gives a region file of the engine `pid` at `epoch`,
/// without its sequence number.
fn name_prefix(pid: u32, epoch: u64) -> String {
    format!("{SHM_PREFIX}{pid}-{epoch:016x}-")
}

impl ShmMapping {
    /// Creates a new region file of `len` bytes for the engine at `epoch`
    /// (mode 0600, header written), allocates and maps it. The mapping is
    /// page aligned.
    pub fn create(len: usize, epoch: u64) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid("region length", "must be greater than zero"));
        }
        let total = len
            .checked_add(SHM_HEADER_BYTES)
            .ok_or_else(|| Error::invalid("region length", format!("{len} bytes overflow")))?;
        let seq = NEXT_SHM_SEQ.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let path = Path::new(SHM_DIR).join(format!("{}{seq}", name_prefix(pid, epoch)));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(SHM_MODE)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
        let mapping = Self::size_and_map(file, &path, total).inspect(|mapping| {
            let header = ShmHeader {
                magic: HEADER_MAGIC,
                version: HEADER_VERSION,
                pid,
                epoch,
                region: 0,
                access: 0,
                reserved: 0,
                len: len as u64,
                live: 0,
                busy: 0,
            };
            mapping.write_header(&header);
        });
        if mapping.is_err() {
            let _ = std::fs::remove_file(&path);
        }
        mapping
    }

    fn size_and_map(file: File, path: &Path, total: usize) -> Result<Self> {
        // The umask may have taken bits away; never leave any extra.
        file.set_permissions(std::fs::Permissions::from_mode(SHM_MODE))
            .map_err(|e| Error::io(format!("setting the mode of {}", path.display()), e))?;
        file.set_len(total as u64).map_err(|e| Error::io(format!("sizing {}", path.display()), e))?;
        // SAFETY: fallocate on an fd we own, within the file's length.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, total as libc::off_t) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return Err(Error::io(
                format!("allocating {total} bytes for {} (is /dev/shm big enough?)", path.display()),
                e,
            ));
        }
        let map = MmapOptions::new()
            .len(total)
            .populate()
            .map_raw(&file)
            .map_err(|e| Error::io(format!("mapping {}", path.display()), e))?;
        Ok(Self {
            map,
            path: path.to_path_buf(),
            owner: true,
            pinned: Default::default(),
            unregistering: Default::default(),
        })
    }

    fn header_ptr(&self) -> *mut ShmHeader {
        self.map.as_mut_ptr().cast()
    }

    fn write_header(&self, header: &ShmHeader) {
        // SAFETY: the mapping is at least SHM_HEADER_BYTES long and page
        // aligned, so a ShmHeader fits at its start, aligned.
        unsafe { self.header_ptr().write_volatile(*header) };
    }

    fn read_header(&self) -> ShmHeader {
        // SAFETY: as in `write_header`; any bytes are a valid ShmHeader.
        unsafe { self.header_ptr().read_volatile() }
    }

    /// Records the region id the owner registered this mapping under, and
    /// the rights it registered it with, in the header peers check, and
    /// marks it live. Call before the id is published (no peer has the
    /// file yet, so the header is written whole).
    pub fn set_region(&self, region: RegionId, access: Access) {
        let mut header = self.read_header();
        header.region = region.raw();
        header.access = access.bits();
        self.write_header(&header);
        // SeqCst, as every operation on `live` and `busy` (see `enter`).
        self.live().store(1, Ordering::SeqCst);
    }

    /// The rights the owner wrote in the file's header: for a peer's
    /// mapping, the most a link may do with it (a descriptor that claims
    /// more, from a confused or hostile peer, does not count).
    pub fn owner_access(&self) -> Access {
        // The field alone: peers change `busy` beside it at any time.
        // SAFETY: the header is in the mapping (see `write_header`); the
        // field is read by a volatile read of its own four bytes.
        let bits = unsafe { std::ptr::addr_of!((*self.header_ptr()).access).read_volatile() };
        Access::from_bits(bits)
    }

    /// The header's `live` word.
    fn live(&self) -> &AtomicU64 {
        // SAFETY: the header is in the mapping, which lives as long as
        // `self`; `live` is 8-aligned (offset 48 of a page-aligned header)
        // and only ever accessed atomically, by every process mapping it.
        unsafe { AtomicU64::from_ptr(std::ptr::addr_of_mut!((*self.header_ptr()).live)) }
    }

    /// The header's `busy` word.
    fn busy(&self) -> &AtomicU64 {
        // SAFETY: as in `live` (`busy` is at offset 56).
        unsafe { AtomicU64::from_ptr(std::ptr::addr_of_mut!((*self.header_ptr()).busy)) }
    }

    /// The region's fence table, shared by its owner and every peer that
    /// maps it (`mem::fence`; all zero in a new file: never fenced).
    pub fn fences(&self) -> super::fence::FenceView<'_> {
        // SAFETY: the table lies in the header page (asserted at compile
        // time) of a page-aligned mapping living as long as `self`, and its
        // words are only ever accessed atomically, by every process mapping it.
        let words = unsafe {
            std::slice::from_raw_parts(
                self.map.as_mut_ptr().add(FENCE_OFFSET).cast::<AtomicU64>(),
                super::fence::FENCE_WORDS,
            )
        };
        super::fence::FenceView::new(words)
    }

    /// A peer's way in: counts a copy in progress and checks the owner
    /// still has the region registered; None (nothing may be copied) once
    /// it unregistered it. The copy ends when the guard drops
    /// (`mem::revoke`, the handshake loom models).
    pub fn enter(&self) -> Option<Entered<'_>> {
        super::revoke::enter(self.live(), self.busy())
    }

    /// The owner unregisters the region: no peer's copy starts after this
    /// call, and those in progress are waited for until `deadline`. On
    /// `Err(busy)` (copies still in progress) the region is live again.
    pub fn revoke(&self, deadline: Instant) -> std::result::Result<(), u32> {
        let mut pause = Duration::from_micros(1);
        super::revoke::revoke(self.live(), self.busy(), || {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
            true
        })
        .map_err(|busy| u32::try_from(busy).unwrap_or(u32::MAX))
    }

    /// Marks the region live again after a failed unregister (it stays
    /// registered).
    pub fn republish(&self) {
        self.live().store(1, Ordering::SeqCst);
    }

    /// Maps a peer's region file, only if it proves to be the region
    /// `expected` describes (see the module docs): the name kvring gives
    /// that owner, `O_NOFOLLOW`, a regular file of this user with mode 0600
    /// and the announced size, and a header naming the same pid, epoch,
    /// region and length.
    pub fn open_peer(path: &Path, expected: PeerRegion) -> Result<Self> {
        let refuse = |why: String| Error::Unsupported { what: format!("shm region {}: {why}", path.display()) };
        let name_ok = path.parent() == Some(Path::new(SHM_DIR))
            && path.file_name().and_then(|n| n.to_str()).is_some_and(|name| {
                name.strip_prefix(&name_prefix(expected.pid, expected.epoch))
                    .is_some_and(|seq| !seq.is_empty() && seq.bytes().all(|b| b.is_ascii_digit()))
            });
        if !name_ok {
            return Err(refuse(format!(
                "not the name kvring gives pid {} at epoch {:#x} (expected {SHM_DIR}/{}<n>)",
                expected.pid,
                expected.epoch,
                name_prefix(expected.pid, expected.epoch)
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| Error::io(format!("opening peer region {}", path.display()), e))?;
        let meta = file.metadata().map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        // SAFETY: geteuid has no preconditions and cannot fail.
        let uid = unsafe { libc::geteuid() };
        if !meta.file_type().is_file() {
            return Err(refuse("not a regular file".into()));
        }
        if meta.uid() != uid {
            return Err(refuse(format!("owned by uid {}, not this user ({uid})", meta.uid())));
        }
        if meta.mode() & 0o777 != SHM_MODE {
            return Err(refuse(format!("mode {:o}, not {SHM_MODE:o}", meta.mode() & 0o777)));
        }
        let total = expected.len.checked_add(SHM_HEADER_BYTES).ok_or_else(|| refuse("length overflows".into()))?;
        if meta.len() != total as u64 {
            return Err(refuse(format!("{} bytes, but a region of {} needs {total}", meta.len(), expected.len)));
        }
        let map = MmapOptions::new()
            .len(total)
            .populate()
            .map_raw(&file)
            .map_err(|e| Error::io(format!("mapping peer region {}", path.display()), e))?;
        let mapping = Self {
            map,
            path: path.to_path_buf(),
            owner: false,
            pinned: Default::default(),
            unregistering: Default::default(),
        };
        let header = mapping.read_header();
        if header.magic == HEADER_MAGIC && header.version != HEADER_VERSION {
            // Another kvring's layout: said by name, not as a failed proof.
            return Err(refuse(format!(
                "its header is version {}, and this kvring reads version {HEADER_VERSION} only (the peer runs \
                 another kvring)",
                header.version
            )));
        }
        let proven = header.magic == HEADER_MAGIC
            && header.version == HEADER_VERSION
            && header.pid == expected.pid
            && header.epoch == expected.epoch
            && header.region == expected.region.raw()
            && header.len == expected.len as u64;
        if !proven {
            return Err(refuse(format!(
                "its header (pid {}, epoch {:#x}, region {}, {} bytes) does not prove region {} of pid {} at epoch {:#x}",
                header.pid,
                header.epoch,
                RegionId::from_raw(header.region),
                header.len,
                expected.region,
                expected.pid,
                expected.epoch
            )));
        }
        Ok(mapping)
    }

    /// The region's first byte (after the header page; page aligned).
    pub fn as_ptr(&self) -> *mut u8 {
        // The mapping is header + region bytes long.
        self.map.as_mut_ptr().wrapping_add(SHM_HEADER_BYTES)
    }

    /// The region's length in bytes.
    pub fn len(&self) -> usize {
        self.map.len() - SHM_HEADER_BYTES
    }

    /// Always false: empty mappings are refused at creation.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The file behind the mapping.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Pins the mapping with `gpu`, so the GPU's copy engines reach it at
    /// full rate; unpinned when dropped. Called by whoever created or opened
    /// the mapping, before sharing it; a second call does nothing.
    pub fn pin(&self, gpu: &std::sync::Arc<dyn crate::gpu::Gpu>) -> Result<()> {
        if self.pinned.get().is_some() {
            return Ok(());
        }
        // SAFETY: the whole mapping stays mapped until this value drops,
        // which unpins it first.
        unsafe { gpu.host_register(self.map.as_ptr() as u64, self.map.len() as u64)? };
        let _ = self.pinned.set(gpu.clone());
        Ok(())
    }
}

impl Drop for ShmMapping {
    fn drop(&mut self) {
        if let Some(gpu) = self.pinned.get() {
            // Before the mapping goes (its fields drop after this body).
            let _ = gpu.host_unregister(self.map.as_ptr() as u64);
        }
        if self.owner {
            // Peers that already mapped it keep their mapping; new ones fail
            // to open it, which is right: the region is gone.
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Removes this user's kvring files in `/dev/shm` whose creating process
/// is gone. Returns how many were removed.
pub fn sweep_stale() -> usize {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else { return 0 };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let mut removed = 0;
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(SHM_PREFIX)) else { continue };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<libc::pid_t>().ok()) else { continue };
        // Never another user's file, nor anything but a plain file.
        let ours = entry.metadata().is_ok_and(|m| m.uid() == uid && m.file_type().is_file());
        if !ours || pid <= 0 {
            continue;
        }
        // SAFETY: kill with signal 0 only checks whether the pid exists.
        let signalled = unsafe { libc::kill(pid, 0) };
        let gone = signalled != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(mapping: &ShmMapping, epoch: u64, region: RegionId) -> PeerRegion {
        PeerRegion { pid: std::process::id(), epoch, region, len: mapping.len() }
    }

    #[test]
    fn owner_and_peer_see_the_same_bytes_and_the_file_goes_with_the_owner() {
        let owner = ShmMapping::create(8192, 0xabc).unwrap();
        owner.set_region(RegionId::new(3, 1), Access::REMOTE_READ);
        assert_eq!(owner.as_ptr() as usize % 4096, 0, "page aligned");
        let mode = std::fs::metadata(owner.path()).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600, "only the owner's user reads or writes it");
        let peer = ShmMapping::open_peer(owner.path(), claim(&owner, 0xabc, RegionId::new(3, 1))).unwrap();
        assert_eq!(peer.owner_access(), Access::REMOTE_READ, "the owner's rights, from its header");
        // SAFETY: both mappings are 8192 bytes long and alive.
        unsafe {
            owner.as_ptr().add(100).write(42);
            assert_eq!(peer.as_ptr().add(100).read(), 42);
        }
        let path = owner.path().to_path_buf();
        drop(owner);
        assert!(!path.exists());
        drop(peer);
    }

    #[test]
    fn a_file_that_is_not_the_announced_region_is_never_mapped() {
        let owner = ShmMapping::create(4096, 0x11).unwrap();
        let region = RegionId::new(1, 1);
        owner.set_region(region, Access::ALL);
        let good = claim(&owner, 0x11, region);
        let expect_refusal = |path: &Path, claim: PeerRegion, why: &str| {
            let error = ShmMapping::open_peer(path, claim).unwrap_err().to_string();
            assert!(error.contains(why), "{error} should say {why}");
        };
        // Another engine's region (another epoch or region), or a wrong size.
        expect_refusal(owner.path(), PeerRegion { epoch: 0x12, ..good }, "not the name kvring gives");
        expect_refusal(owner.path(), PeerRegion { region: RegionId::new(2, 1), ..good }, "does not prove region");
        expect_refusal(owner.path(), PeerRegion { len: 8192, ..good }, "needs 12288");
        // Another kvring's header layout: refused by its version.
        let current = owner.read_header();
        owner.write_header(&ShmHeader { version: HEADER_VERSION - 1, ..current });
        expect_refusal(owner.path(), good, &format!("its header is version {}", HEADER_VERSION - 1));
        owner.write_header(&current);
        // Names outside kvring's own.
        expect_refusal(Path::new("/etc/passwd"), good, "not the name kvring gives");
        expect_refusal(Path::new("/dev/shm/some-other-app"), good, "not the name kvring gives");

        // A file with the right name but not written by its owner.
        let forged = Path::new(SHM_DIR).join(format!("{}999999", name_prefix(std::process::id(), 0x11)));
        std::fs::write(&forged, vec![0u8; 4096 + SHM_HEADER_BYTES]).unwrap();
        std::fs::set_permissions(&forged, std::fs::Permissions::from_mode(0o600)).unwrap();
        expect_refusal(&forged, good, "does not prove region");
        // Too open a mode.
        std::fs::set_permissions(&forged, std::fs::Permissions::from_mode(0o644)).unwrap();
        expect_refusal(&forged, good, "mode 644");
        std::fs::remove_file(&forged).unwrap();
        // A symlink with the right name, pointing at the real region.
        let link = Path::new(SHM_DIR).join(format!("{}999998", name_prefix(std::process::id(), 0x11)));
        std::os::unix::fs::symlink(owner.path(), &link).unwrap();
        let error = ShmMapping::open_peer(&link, good).unwrap_err().to_string();
        std::fs::remove_file(&link).unwrap();
        assert!(error.contains("opening peer region"), "O_NOFOLLOW refuses the link: {error}");
        // Another user's file (root can make one; others skip this part).
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            let theirs = Path::new(SHM_DIR).join(format!("{}999997", name_prefix(std::process::id(), 0x11)));
            std::fs::write(&theirs, vec![0u8; 4096 + SHM_HEADER_BYTES]).unwrap();
            std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o600)).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), None).unwrap();
            let error = ShmMapping::open_peer(&theirs, good).unwrap_err().to_string();
            std::fs::remove_file(&theirs).unwrap();
            assert!(error.contains("owned by uid 65534"), "{error}");
        }
        assert!(ShmMapping::create(0, 1).is_err());
    }

    #[test]
    fn sweep_removes_files_of_dead_processes_only() {
        let dead_pid = {
            let mut child = std::process::Command::new("true").spawn().unwrap();
            let pid = child.id();
            child.wait().unwrap();
            pid
        };
        let stale = Path::new(SHM_DIR).join(format!("{SHM_PREFIX}{dead_pid}-0-0"));
        std::fs::write(&stale, b"x").unwrap();
        let live = ShmMapping::create(4096, 2).unwrap();
        assert!(sweep_stale() >= 1);
        assert!(!stale.exists());
        assert!(live.path().exists());
    }
}

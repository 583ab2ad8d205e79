//! A fence table (`mem::fence`) in a sealed memfd page: for a GPU region,
//! whose bytes have no file a same-host peer could map a table from, so
//! that a cuda_ipc peer's lane checks the very table the owner fences
//! (docs/ARCHITECTURE.md, "Fenced destinations").
//!
//! The owner creates the page ([`SharedFences::create`]) and hands its
//! descriptor to a proven peer over the GPU descriptor socket
//! (`transport::gpu_fds`); the peer maps it ([`SharedFences::open_peer`]).
//! The page is sealed against shrinking and growing before any peer sees
//! it (memfd_create(2), "File sealing": `F_SEAL_SHRINK` makes `ftruncate`
//! to a smaller size fail with `EPERM`), and the peer refuses a page that
//! lacks that seal or is too short: an owner that could shrink the file
//! under the peer's mapping would turn the peer's next table access into
//! `SIGBUS`. What either side writes into the words is outside input to
//! the other: `FenceView` reads every word as untrusted (no index past the
//! table, no arithmetic that can panic), so a scribbled table costs its
//! scribbler refusals or `RegionBusy`, never a write outside a region.

use super::fence::{FenceView, FENCE_WORDS};
use crate::sync::AtomicU64;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Bytes of the page: the table, rounded up to a page.
const TABLE_BYTES: usize = (FENCE_WORDS * 8).div_ceil(4096) * 4096;

/// A mapped fence table page (the owner's, or a peer's map of it).
#[derive(Debug)]
pub struct SharedFences {
    map: *mut u8,
    /// The owner's memfd, duplicated for each peer it is passed to; a
    /// peer closes its copy once mapped (a peer of a KV cache of many
    /// regions holds no descriptor per region).
    file: Option<OwnedFd>,
}

// SAFETY: the mapping is only ever accessed through atomics (`view`), by
// any thread of any process that maps it; it is unmapped once, on drop.
unsafe impl Send for SharedFences {}
// SAFETY: as above.
unsafe impl Sync for SharedFences {}

impl SharedFences {
    /// A new, empty (never fenced) table in a sealed memfd page.
    pub fn create() -> std::io::Result<Self> {
        // SAFETY: memfd_create with a NUL-terminated name; the descriptor
        // is owned at once below.
        let fd = unsafe { libc::memfd_create(c"kvring-fences".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let file = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain calls on a descriptor we own.
        let sized = unsafe { libc::ftruncate(file.as_raw_fd(), TABLE_BYTES as libc::off_t) };
        if sized != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Sealed before it is mapped or passed: nobody can shrink it under
        // a mapping (memfd_create(2), F_SEAL_SHRINK / F_SEAL_GROW; and
        // F_SEAL_SEAL so no seal is lifted or added later).
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fcntl(F_ADD_SEALS) on a descriptor we own.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Self::map(file)
    }

    /// Maps a table page a peer passed: refused (with the reason) unless it
    /// is a file of at least the table's size, sealed against shrinking.
    pub fn open_peer(file: OwnedFd) -> Result<Self, String> {
        // SAFETY: fcntl(F_GET_SEALS) on a descriptor we own; it only reads.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err("its fence table page is not sealed against shrinking (a shrunk page faults its reader)".into());
        }
        // SAFETY: an all-zero stat is a valid out-parameter for fstat.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat on a descriptor we own, into `stat`.
        if unsafe { libc::fstat(file.as_raw_fd(), &mut stat) } != 0 {
            return Err(format!("its fence table page: {}", std::io::Error::last_os_error()));
        }
        if stat.st_mode & libc::S_IFMT != libc::S_IFREG || (stat.st_size as u64) < TABLE_BYTES as u64 {
            return Err(format!("its fence table page is {} bytes, not a file of {TABLE_BYTES}", stat.st_size));
        }
        let mut page = Self::map(file).map_err(|e| format!("mapping its fence table page: {e}"))?;
        page.file = None; // the mapping stays (mmap(2)), the descriptor goes
        Ok(page)
    }

    fn map(file: OwnedFd) -> std::io::Result<Self> {
        // SAFETY: a fresh shared mapping of a file at least TABLE_BYTES
        // long (sized and sealed above, or checked sealed and long enough).
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                TABLE_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { map: map.cast(), file: Some(file) })
    }

    /// The table's view.
    pub fn view(&self) -> FenceView<'_> {
        // SAFETY: the mapping is TABLE_BYTES long (≥ FENCE_WORDS words),
        // page-aligned, lives as long as `self`, and its words are only
        // ever accessed atomically, by every process that maps it.
        let words = unsafe { std::slice::from_raw_parts(self.map.cast::<AtomicU64>(), FENCE_WORDS) };
        FenceView::new(words)
    }

    /// A descriptor of the page, to pass to a peer (closed once sent).
    pub fn share(&self) -> std::io::Result<OwnedFd> {
        match &self.file {
            Some(file) => file.try_clone(),
            None => Err(std::io::Error::other("a peer's map of a fence table page is not passed on")),
        }
    }
}

impl Drop for SharedFences {
    fn drop(&mut self) {
        // SAFETY: mapped in `map` with this length, unmapped once, here;
        // nothing borrows it past `self` (views borrow `self`, and every
        // pass held past a view keeps an Arc of `self`).
        unsafe { libc::munmap(self.map.cast(), TABLE_BYTES) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::fence::Span;

    #[test]
    fn a_peers_map_of_the_page_sees_the_owners_fences() {
        let owner = SharedFences::create().unwrap();
        let peer = SharedFences::open_peer(owner.share().unwrap()).unwrap();
        owner.view().fence(&[Span::range(0, 64)], 9, || true).unwrap();
        let pass = peer.view().enter().unwrap();
        assert!(!pass.admits(0, 8, 3));
        assert!(pass.admits(0, 8, 9));
    }

    #[test]
    fn a_table_full_of_noise_refuses_or_admits_and_never_panics() {
        let owner = SharedFences::create().unwrap();
        let peer = SharedFences::open_peer(owner.share().unwrap()).unwrap();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        for round in 0..64 {
            for word in peer.view().words() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let value = [x % 80, 0, u64::MAX, x][(x >> 60) as usize % 4];
                word.store(value, std::sync::atomic::Ordering::Relaxed);
            }
            // The writer: a pass or none, a yes or a no; never a panic.
            if let Some(pass) = peer.view().enter() {
                let _ = pass.admits(x % 4096, x % 4096 + 1 + round, (x >> 32) as u32);
                let _ = pass.admits(u64::MAX - 1, u64::MAX, u32::MAX);
            }
            // The owner: its fence enters, or gives up waiting for noise.
            let mut looks = 0;
            let fenced = owner.view().fence(&[Span::range(round, 64)], 1000 + round as u32, || {
                looks += 1;
                looks < 3
            });
            assert!(matches!(fenced, Ok(()) | Err(crate::mem::fence::FenceFailed::Busy(_))));
        }
    }

    #[test]
    fn an_unsealed_or_short_page_is_refused() {
        // SAFETY: memfd_create with a NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"kvring-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor nothing else owns.
        let file = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on a descriptor we own.
        assert_eq!(unsafe { libc::ftruncate(file.as_raw_fd(), TABLE_BYTES as libc::off_t) }, 0);
        let refused = SharedFences::open_peer(file).unwrap_err();
        assert!(refused.contains("not sealed"), "{refused}");

        // SAFETY: as above.
        let fd = unsafe { libc::memfd_create(c"kvring-test".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        // SAFETY: a fresh descriptor nothing else owns.
        let file = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: fcntl(F_ADD_SEALS) on a descriptor we own.
        assert_eq!(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) }, 0);
        let refused = SharedFences::open_peer(file).unwrap_err();
        assert!(refused.contains("0 bytes"), "{refused}");
    }

    #[test]
    fn the_owners_page_cannot_be_shrunk_under_a_peer() {
        let owner = SharedFences::create().unwrap();
        // SAFETY: ftruncate on a descriptor we own (the seal refuses it).
        assert_ne!(unsafe { libc::ftruncate(owner.share().unwrap().as_raw_fd(), 0) }, 0);
        assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EPERM));
    }
}

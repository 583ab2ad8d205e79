//! Shared-memory backing for regions: files in `/dev/shm`, mapped with memmap2.
//!
//! The owner creates the file, sizes it, allocates its pages with
//! `fallocate` and maps it with `MAP_POPULATE`, so neither the owner nor the
//! lane pays a page fault (~15 µs each here) on the data path. A same-host
//! peer maps the same file by path. The owner removes the file when the
//! mapping is dropped; files left by a crashed process are swept at the next
//! engine start ([`sweep_stale`]).

use crate::error::{Error, Result};
use memmap2::{MmapOptions, MmapRaw};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Where kvring puts its shared-memory files.
pub const SHM_DIR: &str = "/dev/shm";
/// Prefix of every kvring shared-memory file name.
pub const SHM_PREFIX: &str = "kvring-";

static NEXT_SHM_SEQ: AtomicU64 = AtomicU64::new(0);

/// A shared mapping of a `/dev/shm` file.
#[derive(Debug)]
pub struct ShmMapping {
    map: MmapRaw,
    path: PathBuf,
    /// The creator unlinks the file on drop; a peer's mapping does not.
    owner: bool,
}

impl ShmMapping {
    /// Creates a new file of `len` bytes (a multiple of the page size is
    /// not required; the mapping is page aligned), allocates and maps it.
    pub fn create(len: usize, epoch: u64) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid("region length", "must be greater than zero"));
        }
        let seq = NEXT_SHM_SEQ.fetch_add(1, Ordering::Relaxed);
        let path = Path::new(SHM_DIR).join(format!("{SHM_PREFIX}{}-{epoch:016x}-{seq}", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
        let mapping = Self::size_and_map(file, &path, len);
        if mapping.is_err() {
            let _ = std::fs::remove_file(&path);
        }
        mapping
    }

    fn size_and_map(file: File, path: &Path, len: usize) -> Result<Self> {
        file.set_len(len as u64).map_err(|e| Error::io(format!("sizing {}", path.display()), e))?;
        // SAFETY: fallocate on an fd we own, within the file's length.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return Err(Error::io(
                format!("allocating {len} bytes for {} (is /dev/shm big enough?)", path.display()),
                e,
            ));
        }
        let map = MmapOptions::new()
            .len(len)
            .populate()
            .map_raw(&file)
            .map_err(|e| Error::io(format!("mapping {}", path.display()), e))?;
        Ok(Self { map, path: path.to_path_buf(), owner: true })
    }

    /// Maps a peer's file by path, expecting `len` bytes.
    pub fn open(path: &Path, len: usize) -> Result<Self> {
        if !path.starts_with(SHM_DIR) {
            return Err(Error::invalid("shm path", format!("{} is not under {SHM_DIR}", path.display())));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::io(format!("opening peer region {}", path.display()), e))?;
        let actual = file.metadata().map_err(|e| Error::io(format!("reading size of {}", path.display()), e))?.len();
        if actual < len as u64 {
            return Err(Error::malformed(
                "segment descriptor",
                format!("{} has {actual} bytes but the peer advertised {len}", path.display()),
            ));
        }
        let map = MmapOptions::new()
            .len(len)
            .populate()
            .map_raw(&file)
            .map_err(|e| Error::io(format!("mapping peer region {}", path.display()), e))?;
        Ok(Self { map, path: path.to_path_buf(), owner: false })
    }

    /// Start of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Always false: empty mappings are refused at creation.
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// The file behind the mapping.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ShmMapping {
    fn drop(&mut self) {
        if self.owner {
            // Peers that already mapped it keep their mapping; new ones fail
            // to open it, which is right: the region is gone.
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Removes kvring files in `/dev/shm` whose creating process is gone.
/// Returns how many were removed.
pub fn sweep_stale() -> usize {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else { return 0 };
    let mut removed = 0;
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(SHM_PREFIX)) else { continue };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<libc::pid_t>().ok()) else { continue };
        // SAFETY: kill with signal 0 only checks whether the pid exists.
        let gone =
            unsafe { libc::kill(pid, 0) } != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_and_peer_see_the_same_bytes_and_the_file_goes_with_the_owner() {
        let owner = ShmMapping::create(8192, 0xabc).unwrap();
        assert_eq!(owner.as_ptr() as usize % 4096, 0, "page aligned");
        let peer = ShmMapping::open(owner.path(), 8192).unwrap();
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
    fn peer_refuses_a_shorter_file_and_paths_outside_dev_shm() {
        let owner = ShmMapping::create(4096, 1).unwrap();
        let err = ShmMapping::open(owner.path(), 8192).unwrap_err();
        assert!(err.to_string().contains("has 4096 bytes but the peer advertised 8192"), "{err}");
        let err = ShmMapping::open(Path::new("/etc/passwd"), 1).unwrap_err();
        assert!(err.to_string().contains("is not under /dev/shm"), "{err}");
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

//! What backs a region in GPU memory: the provider that classified it, what
//! same-host peers open it by, and the allocation when the engine made it.
//!
//! No host thread ever dereferences device memory: the few host-side reads
//! and writes kvring needs (a region's `write_at`, a checksum to verify a
//! transfer) go through the provider's copy engine and a host bounce
//! buffer, off the lanes.

use crate::error::{Error, Result};
use crate::gpu::{Copy, DevicePtr, Export, Gpu};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest a blocking copy through the provider may take before it is
/// reported as failed (its bounce buffer is then leaked, never reused while
/// the device may still write it).
pub const DEVICE_COPY_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes moved per blocking copy through a bounce buffer (a multiple of
/// the checksum's 32-byte block).
const BOUNCE_BYTES: usize = 4 << 20;

/// A new fence table page for a GPU region, or why none could be made.
fn shared_fences() -> std::result::Result<Arc<crate::mem::fence_file::SharedFences>, String> {
    crate::mem::fence_file::SharedFences::create().map(Arc::new).map_err(|e| format!("no fence table page: {e}"))
}

/// A GPU region's backing, shared by its registry entry and (for memory the
/// engine allocated) its [`Region`](crate::Region) handle.
pub struct DeviceBacking {
    /// The provider that classified (and, for owned memory, allocated) it.
    pub gpu: Arc<dyn Gpu>,
    /// Its device, as the provider numbers them.
    pub ordinal: u32,
    /// What a same-host peer opens it by, or why it cannot.
    pub export: std::result::Result<Export, String>,
    /// Memory the engine allocated: freed with the last holder.
    owned: Option<DevicePtr>,
    /// The region's fence table, in a page its cuda_ipc peers map (passed
    /// over the GPU descriptor socket); `Err` when no page could be made
    /// (writes over cuda_ipc are then refused, tcp's are checked on a heap
    /// table).
    pub fences: std::result::Result<Arc<crate::mem::fence_file::SharedFences>, String>,
}

impl std::fmt::Debug for DeviceBacking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBacking")
            .field("provider", &self.gpu.provider())
            .field("ordinal", &self.ordinal)
            .field("exported", &self.export.as_ref().map(|e| e.handles().len()))
            .field("owned", &self.owned)
            .finish()
    }
}

impl DeviceBacking {
    /// The backing of caller memory at `addr..addr + len` on `ordinal`,
    /// exported for peers (an export that fails leaves the region usable
    /// here and says why peers cannot open it).
    pub fn caller(gpu: Arc<dyn Gpu>, ordinal: u32, addr: u64, len: u64) -> Self {
        let export = gpu.export(addr, len).map_err(|e| e.to_string());
        Self { gpu, ordinal, export, owned: None, fences: shared_fences() }
    }

    /// Allocates `len` bytes on `ordinal`, exported; freed when dropped.
    pub fn allocate(gpu: Arc<dyn Gpu>, ordinal: u32, len: u64) -> Result<(Self, DevicePtr)> {
        let ptr = gpu.alloc(ordinal, len)?;
        let export = gpu.export(ptr.0, len).map_err(|e| e.to_string());
        Ok((Self { gpu, ordinal, export, owned: Some(ptr), fences: shared_fences() }, ptr))
    }

    /// True for memory the caller owns (not allocated by the engine).
    pub fn is_caller(&self) -> bool {
        self.owned.is_none()
    }

    /// Copies `bytes` to device address `dst`, waiting for the copy.
    pub fn write(&self, dst: u64, bytes: &[u8]) -> Result<()> {
        let mut done = 0;
        while done < bytes.len() {
            let n = (bytes.len() - done).min(BOUNCE_BYTES);
            let bounce = bytes[done..done + n].to_vec();
            let copy = Copy { src: bounce.as_ptr() as u64, dst: dst + done as u64, len: n as u64 };
            self.copy_blocking(copy, bounce)?;
            done += n;
        }
        Ok(())
    }

    /// Copies from device address `src` into `out`, waiting for the copy.
    pub fn read(&self, src: u64, out: &mut [u8]) -> Result<()> {
        self.read_chunks(src, out.len(), |offset, chunk| out[offset..offset + chunk.len()].copy_from_slice(chunk))
    }

    /// Reads `len` bytes at device address `src` in bounce-sized chunks,
    /// handing each (with its offset) to `take`.
    pub fn read_chunks(&self, src: u64, len: usize, mut take: impl FnMut(usize, &[u8])) -> Result<()> {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(BOUNCE_BYTES);
            let bounce = vec![0u8; n];
            let copy = Copy { src: src + done as u64, dst: bounce.as_ptr() as u64, len: n as u64 };
            let bounce = self.copy_blocking(copy, bounce)?;
            take(done, &bounce);
            done += n;
        }
        Ok(())
    }

    /// Runs one copy whose host side is `bounce` on a stream of its own and
    /// polls it to completion, handing the bounce buffer back. Past
    /// [`DEVICE_COPY_TIMEOUT`] the buffer is leaked, not freed: the device
    /// may still read or write it.
    fn copy_blocking(&self, copy: Copy, bounce: Vec<u8>) -> Result<Vec<u8>> {
        let stream = self.gpu.create_stream(self.ordinal)?;
        let event = match self.gpu.create_event(self.ordinal) {
            Ok(event) => event,
            Err(error) => {
                let _ = self.gpu.destroy_stream(stream);
                return Err(error);
            }
        };
        // One plain copy: `bounce` is pageable memory, which only the
        // driver's own copy path may touch (never the copy kernel).
        // SAFETY: the host side is `bounce`, which stays allocated and
        // untouched until the event completes (or forever, if it never
        // does); the device side is checked by the provider.
        let queued = unsafe { self.gpu.copy_one(stream, copy) }.and_then(|()| self.gpu.record(stream, event));
        let outcome = queued.and_then(|()| self.poll(event));
        let _ = self.gpu.destroy_event(event);
        let _ = self.gpu.destroy_stream(stream);
        match outcome {
            Ok(true) => Ok(bounce),
            Ok(false) => {
                std::mem::forget(bounce);
                Err(Error::Timeout { what: "the device copy to end", waited: DEVICE_COPY_TIMEOUT })
            }
            Err(error) => {
                std::mem::forget(bounce);
                Err(error)
            }
        }
    }

    /// Polls `event` until it completes (true) or the timeout passes
    /// (false), sleeping a little between looks.
    fn poll(&self, event: crate::gpu::Event) -> Result<bool> {
        let deadline = Instant::now() + DEVICE_COPY_TIMEOUT;
        let mut pause = Duration::from_micros(5);
        while Instant::now() < deadline {
            if self.gpu.query(event)? {
                return Ok(true);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
        Ok(false)
    }
}

impl Drop for DeviceBacking {
    fn drop(&mut self) {
        if let Some(ptr) = self.owned.take() {
            // The export goes first: its descriptors name the memory.
            self.export = Err("freed".into());
            // SAFETY: the last holder is gone: the registry entry (so no
            // lease, no batch in flight) and the region handle.
            if let Err(error) = unsafe { self.gpu.free(ptr) } {
                tracing::warn!(%error, "freeing a GPU region's memory failed");
            }
        }
    }
}

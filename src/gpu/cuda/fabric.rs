//! FABRIC handles (GPU-REVIEW #16): virtual-memory-API memory made with
//! `CU_MEM_HANDLE_TYPE_FABRIC` only, as PyTorch built for CUDA 12.3+ makes
//! its expandable segments on a host with IMEX channels, exports no POSIX
//! descriptor. Each of its physical allocations is exported instead as a
//! 64-byte `CUmemFabricHandle` (bytes, no descriptor), passed by the
//! exporter over its proven socket (`transport::gpu_fds`), and imported by
//! a peer granted the exporter's IMEX channel; elsewhere the driver
//! refuses the import with `CUDA_ERROR_NOT_PERMITTED`, which becomes a
//! typed [`Error::Unauthorized`] naming the channel as the reason.

use super::{check, cuda_error};
use crate::error::{Error, Result};
use crate::gpu::FABRIC_HANDLE_BYTES;
use cudarc::driver::sys;
use std::ffi::c_void;

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` in an allowed-types mask.
pub(super) const POSIX_FD_BIT: u64 = 0x1;
/// `CU_MEM_HANDLE_TYPE_FABRIC` in an allowed-types mask.
pub(super) const FABRIC_BIT: u64 = 0x8;

/// Where the driver puts the device files of the IMEX channels a process
/// may use (NVIDIA's IMEX guide: `/dev/nvidia-caps-imex-channels/channelN`).
const IMEX_CHANNELS: &str = "/dev/nvidia-caps-imex-channels";

/// The `CUmemFabricHandle` of the physical allocation mapped at `at`
/// [CUDA Driver API 6.14, cuMemExportToShareableHandle: for
/// `CU_MEM_HANDLE_TYPE_FABRIC` the shareable handle is a
/// `CUmemFabricHandle`, `unsigned char data[64]`].
pub(super) fn export_fabric(at: u64) -> Result<[u8; FABRIC_HANDLE_BYTES]> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: writes one handle; `at` is the start of a mapped allocation.
    let retained = unsafe { sys::cuMemRetainAllocationHandle(&mut handle, at as *mut c_void) };
    check(retained, "exporting device memory: not memory of the virtual memory API")?;
    let mut bytes = [0u8; FABRIC_HANDLE_BYTES];
    let kind = sys::CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_FABRIC;
    // SAFETY: for FABRIC the driver writes one CUmemFabricHandle (64 bytes)
    // at the pointer, which points at 64 bytes.
    let exported = unsafe { sys::cuMemExportToShareableHandle(bytes.as_mut_ptr().cast(), handle, kind, 0) };
    // SAFETY: one release per retain above.
    unsafe { sys::cuMemRelease(handle) };
    if exported == sys::CUresult::CUDA_ERROR_NOT_PERMITTED {
        return Err(cuda_error(format!(
            "exporting device memory at {at:#x} as a FABRIC handle (its allocation does not allow \
             POSIX_FILE_DESCRIPTOR handles) was refused (CUDA_ERROR_NOT_PERMITTED): this process is granted no IMEX \
             channel ({}); FABRIC handles need one",
            channels_here()
        )));
    }
    check(exported, "exporting device memory as a FABRIC handle")?;
    Ok(bytes)
}

/// Imports a peer's `CUmemFabricHandle`: the allocation's handle here.
/// `NOT_PERMITTED` is the driver's answer to an importer "not granted
/// access to the same IMEX channel as the exporter process" [CUDA Driver
/// API 6.14, cuMemImportFromShareableHandle], and is returned as
/// [`Error::Unauthorized`] saying so.
pub(super) fn import_fabric(bytes: &[u8; FABRIC_HANDLE_BYTES]) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut imported: sys::CUmemGenericAllocationHandle = 0;
    let kind = sys::CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_FABRIC;
    // The driver only reads the handle; a copy keeps the caller's bytes
    // out of reach of a `*mut` it might be handed.
    let mut handle = *bytes;
    // SAFETY: for FABRIC the driver reads one CUmemFabricHandle (64 bytes)
    // at the pointer and writes one allocation handle.
    let result =
        unsafe { sys::cuMemImportFromShareableHandle(&mut imported, handle.as_mut_ptr().cast::<c_void>(), kind) };
    if result == sys::CUresult::CUDA_ERROR_NOT_PERMITTED {
        return Err(Error::Unauthorized {
            reason: format!(
                "the driver refused the peer's FABRIC handle (CUDA_ERROR_NOT_PERMITTED): this process is not granted \
                 the exporter's IMEX channel (IMEX channel devices here: {}); run both processes on the same IMEX \
                 channel (NVIDIA_IMEX_CHANNELS, or the same /dev/nvidia-caps-imex-channels/channelN device), or have \
                 the exporter allocate with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR among its requestedHandleTypes",
                channels_here()
            ),
        });
    }
    check(result, "importing a peer's FABRIC handle")?;
    Ok(imported)
}

/// The IMEX channel devices present here (a container is given only the
/// channels it was granted), by name, or why none: listed, never opened.
fn channels_here() -> String {
    channels_in(std::path::Path::new(IMEX_CHANNELS))
}

/// [`channels_here`] in `dir`. A directory that exists but cannot be
/// listed (no permission in a container) is said so, not called absent.
fn channels_in(dir: &std::path::Path) -> String {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return format!("none: no {}", dir.display()),
        Err(e) => return format!("unknown: {} could not be listed ({e})", dir.display()),
    };
    let mut present: Vec<String> =
        entries.filter_map(|entry| entry.ok()).map(|entry| entry.file_name().to_string_lossy().into_owned()).collect();
    present.sort();
    match present.is_empty() {
        true => format!("none in {}", dir.display()),
        false => format!("{} in {}", present.join(", "), dir.display()),
    }
}

/// The handle type a run of allocations is shared by, from each one's
/// `CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES` mask (`None` where the
/// driver gives none): POSIX descriptors where every allocation allows
/// them, else FABRIC handles where every one allows those; otherwise an
/// error naming the types the first one lacking both has.
pub(super) fn run_kind(masks: &[(u64, Option<(u64, String)>)]) -> std::result::Result<crate::gpu::HandleKind, String> {
    let allows = |bit: u64| masks.iter().all(|(_, m)| m.as_ref().is_none_or(|(mask, _)| mask & bit != 0));
    if allows(POSIX_FD_BIT) {
        return Ok(crate::gpu::HandleKind::FileDescriptor);
    }
    if allows(FABRIC_BIT) {
        return Ok(crate::gpu::HandleKind::Fabric);
    }
    let lacking = masks.iter().find_map(|(at, m)| {
        m.as_ref().filter(|(mask, _)| mask & FABRIC_BIT == 0).map(|(_, names)| (*at, names.clone()))
    });
    let (at, names) = lacking.unwrap_or((masks.first().map_or(0, |m| m.0), "mixed".into()));
    Err(format!(
        "exporting device memory at {at:#x}: its allocation allows only {names} handles \
         (CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES), and cuda_ipc shares virtual-memory-API memory by \
         POSIX_FILE_DESCRIPTOR or FABRIC handles, one kind for a whole region: allocate it with \
         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (or FABRIC, on a host with IMEX channels) among its \
         requestedHandleTypes"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::HandleKind;

    fn mask(bits: u64) -> Option<(u64, String)> {
        Some((bits, format!("{bits:#x}")))
    }

    /// Review 8, probe 8: the channel devices are listed by name, never
    /// opened; an unlistable directory is not reported as absent.
    #[test]
    fn imex_channels_are_listed_by_name_and_an_unlistable_directory_is_not_called_absent() {
        let dir = std::env::temp_dir().join(format!("kvring-imex-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(channels_in(&dir), format!("none in {}", dir.display()));
        for name in ["channel3", "channel0"] {
            std::fs::write(dir.join(name), b"").unwrap();
        }
        assert_eq!(channels_in(&dir), format!("channel0, channel3 in {}", dir.display()));
        let file = dir.join("channel0");
        let unlistable = channels_in(&file);
        assert!(unlistable.starts_with("unknown:") && unlistable.contains("could not be listed"), "{unlistable}");
        std::fs::remove_dir_all(&dir).unwrap();
        let missing = channels_in(&dir);
        assert_eq!(missing, format!("none: no {}", dir.display()));
    }

    #[test]
    fn a_run_is_shared_by_descriptors_where_all_allow_them_else_by_fabric_handles() {
        let both = POSIX_FD_BIT | FABRIC_BIT;
        assert_eq!(run_kind(&[(0, mask(both)), (1, mask(POSIX_FD_BIT))]), Ok(HandleKind::FileDescriptor));
        assert_eq!(run_kind(&[(0, None)]), Ok(HandleKind::FileDescriptor), "no mask: try descriptors");
        assert_eq!(run_kind(&[(0, mask(both)), (1, mask(FABRIC_BIT))]), Ok(HandleKind::Fabric));
        let error = run_kind(&[(0, mask(FABRIC_BIT)), (0x20, mask(POSIX_FD_BIT))]).unwrap_err();
        assert!(error.contains("0x20") && error.contains("allows only 0x1 handles"), "{error}");
        let error = run_kind(&[(0x40, mask(0x2))]).unwrap_err();
        assert!(error.contains("0x40") && error.contains("POSIX_FILE_DESCRIPTOR"), "{error}");
    }
}

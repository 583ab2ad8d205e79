//! What loading the driver found: the error kept for later refusals, and
//! the check that `libcuda.so` is the driver's `libcuda.so.1`.

use cudarc::driver::sys;
use std::ffi::{c_void, CStr};
use std::sync::Mutex;

/// The last reason [`CudaGpu::load`] failed, kept for every later refusal.
pub(super) static LOAD_ERROR: Mutex<Option<String>> = Mutex::new(None);

/// Why this process has no CUDA provider, for refusals: the load's own
/// error (a present driver whose `cuInit` failed, quoted), else that no
/// driver was found.
pub(crate) fn unavailable() -> String {
    match LOAD_ERROR.lock().unwrap_or_else(|p| p.into_inner()).clone() {
        Some(error) => format!("the CUDA driver did not load: {error}"),
        None => "no CUDA driver found".into(),
    }
}

/// cudarc opens `libcuda.so` before `libcuda.so.1`: where the first is
/// another library than the driver's (the toolkit's stub, an older copy on
/// `LD_LIBRARY_PATH`), this process would run a second driver instance
/// beside the one PyTorch uses. Says so, rather than load it.
pub(super) fn library_mismatch() -> Option<String> {
    // Both handles stay open until both symbols are compared: a library
    // closed between the two opens may be mapped again elsewhere, and the
    // same file would then look like two.
    let open = |name: &CStr| {
        // SAFETY: dlopen of a library name; the handle is closed below.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        (!handle.is_null()).then_some(handle)
    };
    let entry = |handle: *mut c_void, name: &CStr| {
        // SAFETY: a symbol lookup in a live handle.
        let symbol = unsafe { libc::dlsym(handle, c"cuInit".as_ptr()) } as usize;
        // SAFETY: Dl_info is plain pointers, for which zero is valid.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: dladdr fills `info` with static strings of the loader.
        let path = match unsafe { libc::dladdr(symbol as *const c_void, &mut info) } != 0 && !info.dli_fname.is_null() {
            // SAFETY: a NUL-terminated string of the loader.
            true => unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned(),
            false => name.to_string_lossy().into_owned(),
        };
        (symbol, path)
    };
    let (driver, first) = (open(c"libcuda.so.1"), open(c"libcuda.so"));
    let mismatch = match (driver, first) {
        (Some(driver), Some(first)) => {
            let ((driver, driver_path), (first, first_path)) =
                (entry(driver, c"libcuda.so.1"), entry(first, c"libcuda.so"));
            (driver != first).then(|| {
                format!(
                    "libcuda.so on the library path ({first_path}) is not the driver's libcuda.so.1 ({driver_path}); \
                     the CUDA bindings load libcuda.so first, which would run a second driver beside the \
                     application's: take that directory (often the CUDA toolkit's stubs) off LD_LIBRARY_PATH"
                )
            })
        }
        _ => None,
    };
    for handle in [driver, first].into_iter().flatten() {
        // SAFETY: a handle opened above, closed once.
        unsafe { libc::dlclose(handle) };
    }
    mismatch
}

/// `device`'s UUID, where the driver tells it.
pub(super) fn uuid(device: sys::CUdevice) -> Option<[u8; 16]> {
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: writes one 16-byte UUID for a valid device.
    let asked = unsafe { sys::cuDeviceGetUuid(&mut uuid, device) };
    (asked == sys::CUresult::CUDA_SUCCESS).then(|| uuid.bytes.map(|b| b as u8))
}

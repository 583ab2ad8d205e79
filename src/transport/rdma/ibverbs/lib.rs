//! libibverbs loaded at run time: `dlopen("libibverbs.so.1")` once, then
//! every function kvring calls resolved with `dlsym` into one table. A host
//! without rdma-core still runs the binary (and the Python wheel): asking
//! for RDMA there is an error naming what is missing, never a failed load.
//!
//! The required functions are all in rdma-core 13's `IBVERBS_1.1` (the
//! oldest library kvring supports); a library lacking one is refused as
//! "too old or not libibverbs". Newer functions (`ibv_reg_mr_iova2`,
//! rdma-core 22; `ibv_reg_dmabuf_mr`, 34; `ibv_is_fork_initialized`, 35)
//! are optional and gate only the feature that needs them.

use super::ffi::*;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::OnceLock;

/// The soname production loads: the ABI-versioned name every rdma-core
/// package installs (`libibverbs1` on Debian, `libibverbs` on RHEL), found
/// through the dynamic loader's ordinary search (so `LD_LIBRARY_PATH`
/// substitutes a fake in CI).
pub const SONAME: &str = "libibverbs.so.1";

macro_rules! table {
    ($( $field:ident : $sym:literal => $ty:ty ),* $(,)?) => {
        /// The functions kvring calls, resolved from one loaded libibverbs.
        #[derive(Clone, Copy)]
        #[allow(clippy::type_complexity)]
        pub struct Lib {
            $( pub $field: $ty, )*
            /// `ibv_reg_mr_iova2` (rdma-core 22), if present.
            pub reg_mr_iova2: Option<unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, u64, c_uint) -> *mut ibv_mr>,
            /// `ibv_reg_dmabuf_mr` (rdma-core 34), if present.
            pub reg_dmabuf_mr: Option<unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr>,
            /// `ibv_is_fork_initialized` (rdma-core 35), if present.
            pub is_fork_initialized: Option<unsafe extern "C" fn() -> c_int>,
            /// `_ibv_query_gid_ex` (rdma-core 32; verbs.h's inline
            /// `ibv_query_gid_ex` calls it with the entry's size), if present:
            /// each GID's type from verbs rather than sysfs.
            pub query_gid_ex: Option<unsafe extern "C" fn(*mut ibv_context, u32, u32, *mut ibv_gid_entry, u32, usize) -> c_int>,
        }

        impl Lib {
            /// Resolves every required symbol from `handle`.
            ///
            /// # Safety
            ///
            /// `handle` is a live `dlopen` handle of a library that, if it
            /// exports these names, exports them with verbs.h's signatures.
            unsafe fn resolve(handle: *mut c_void) -> Result<Self, String> {
                Ok(Self {
                    $( $field: {
                        // SAFETY: our caller's contract: the symbol, if
                        // present, has this signature.
                        let f = unsafe { symbol(handle, $sym) }
                            .ok_or_else(|| format!("{SONAME} lacks {} (too old, or not libibverbs)", $sym))?;
                        // SAFETY: as above; a non-null code address.
                        unsafe { std::mem::transmute::<*mut c_void, $ty>(f) }
                    }, )*
                    // SAFETY: as above, for each optional symbol.
                    reg_mr_iova2: unsafe { symbol(handle, "ibv_reg_mr_iova2").map(|f| std::mem::transmute(f)) },
                    // SAFETY: as above.
                    reg_dmabuf_mr: unsafe { symbol(handle, "ibv_reg_dmabuf_mr").map(|f| std::mem::transmute(f)) },
                    // SAFETY: as above.
                    is_fork_initialized: unsafe {
                        symbol(handle, "ibv_is_fork_initialized").map(|f| std::mem::transmute(f))
                    },
                    // SAFETY: as above.
                    query_gid_ex: unsafe { symbol(handle, "_ibv_query_gid_ex").map(|f| std::mem::transmute(f)) },
                })
            }
        }
    };
}

table! {
    get_device_list: "ibv_get_device_list" => unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
    free_device_list: "ibv_free_device_list" => unsafe extern "C" fn(*mut *mut ibv_device),
    get_device_name: "ibv_get_device_name" => unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
    open_device: "ibv_open_device" => unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
    close_device: "ibv_close_device" => unsafe extern "C" fn(*mut ibv_context) -> c_int,
    query_device: "ibv_query_device" => unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int,
    query_port: "ibv_query_port" => unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int,
    query_gid: "ibv_query_gid" => unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int,
    alloc_pd: "ibv_alloc_pd" => unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
    dealloc_pd: "ibv_dealloc_pd" => unsafe extern "C" fn(*mut ibv_pd) -> c_int,
    reg_mr: "ibv_reg_mr" => unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    dereg_mr: "ibv_dereg_mr" => unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    create_comp_channel: "ibv_create_comp_channel" => unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel,
    destroy_comp_channel: "ibv_destroy_comp_channel" => unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int,
    create_cq: "ibv_create_cq" =>
        unsafe extern "C" fn(*mut ibv_context, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq,
    destroy_cq: "ibv_destroy_cq" => unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    get_cq_event: "ibv_get_cq_event" =>
        unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int,
    ack_cq_events: "ibv_ack_cq_events" => unsafe extern "C" fn(*mut ibv_cq, c_uint),
    create_srq: "ibv_create_srq" => unsafe extern "C" fn(*mut ibv_pd, *mut ibv_srq_init_attr) -> *mut ibv_srq,
    destroy_srq: "ibv_destroy_srq" => unsafe extern "C" fn(*mut ibv_srq) -> c_int,
    create_qp: "ibv_create_qp" => unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp,
    modify_qp: "ibv_modify_qp" => unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
    destroy_qp: "ibv_destroy_qp" => unsafe extern "C" fn(*mut ibv_qp) -> c_int,
    fork_init: "ibv_fork_init" => unsafe extern "C" fn() -> c_int,
    get_async_event: "ibv_get_async_event" => unsafe extern "C" fn(*mut ibv_context, *mut ibv_async_event) -> c_int,
    ack_async_event: "ibv_ack_async_event" => unsafe extern "C" fn(*mut ibv_async_event),
}

impl std::fmt::Debug for Lib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lib").field("soname", &SONAME).finish_non_exhaustive()
    }
}

/// `dlsym(handle, name)`, or `None` when absent.
///
/// # Safety
///
/// `handle` is a live `dlopen` handle.
unsafe fn symbol(handle: *mut c_void, name: &str) -> Option<*mut c_void> {
    let name = CString::new(name).ok()?;
    // SAFETY: a live handle (our caller's contract) and a NUL-terminated name.
    let found = unsafe { libc::dlsym(handle, name.as_ptr()) };
    (!found.is_null()).then_some(found)
}

/// The last `dlerror` text.
fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the
    // next dl* call on this thread, copied at once.
    let text = unsafe { libc::dlerror() };
    if text.is_null() {
        return "unknown error".into();
    }
    // SAFETY: as above.
    unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
}

/// Loads `soname` and resolves the table: the production path with
/// [`SONAME`]; tests name other files to see each refusal.
pub fn open(soname: &str) -> Result<Lib, String> {
    let name = CString::new(soname).map_err(|_| format!("library name {soname:?} has a NUL byte"))?;
    // SAFETY: dlopen with a NUL-terminated name; RTLD_NOW so a library whose
    // own dependencies are missing fails here, not inside a later verb. The
    // handle is never closed: the table points into it for the process's life.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(format!("{soname} not found ({}): install rdma-core (libibverbs1)", dlerror()));
    }
    // SAFETY: a live handle; a library exporting these names is libibverbs,
    // whose exported functions have verbs.h's signatures.
    unsafe { Lib::resolve(handle) }
}

/// The process's libibverbs, loaded on first use; the error says why there
/// is none (one line). Fork support is settled at load, before anything is
/// registered (finding 14).
pub fn lib() -> Result<&'static Lib, &'static str> {
    static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let lib = open(SONAME)?;
        fork_safety(&lib);
        Ok(lib)
    })
    .as_ref()
    .map_err(String::as_str)
}

/// Turns on libibverbs' fork protection unless the kernel makes it
/// unneeded: a child forked after registration (Python multiprocessing,
/// data loaders) would otherwise share pinned pages copy-on-write with the
/// parent. ibv_fork_init(3): must run before any registration; returns
/// EINVAL after. ibv_is_fork_initialized(3): IBV_FORK_UNNEEDED where the
/// kernel copies pinned pages on fork itself (Linux 5.13+).
fn fork_safety(lib: &Lib) {
    // SAFETY: both take no arguments and only read or set library state.
    let status = lib.is_fork_initialized.map(|f| unsafe { f() });
    if status == Some(IBV_FORK_UNNEEDED) {
        tracing::debug!("libibverbs: fork protection unneeded (the kernel copies pinned pages on fork)");
        return;
    }
    // SAFETY: as above; called once, before kvring registers anything.
    let rc = unsafe { (lib.fork_init)() };
    if rc != 0 {
        tracing::warn!(rc, "ibv_fork_init failed: do not fork after registering memory");
    } else {
        tracing::debug!("libibverbs: fork protection on (ibv_fork_init)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_and_one_without_the_symbols_are_refused_with_the_reason() {
        let missing = open("libibverbs-kvring-absent.so.1").unwrap_err();
        assert!(missing.contains("not found") && missing.contains("rdma-core"), "{missing}");
        // libc is loaded in every process and exports no verbs.
        let wrong = open("libc.so.6").unwrap_err();
        assert!(wrong.contains("lacks ibv_get_device_list"), "{wrong}");
        assert!(open("bad\0name").unwrap_err().contains("NUL"));
    }
}

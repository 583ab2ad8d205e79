//! The C ABI's transport choice: an engine's allow-list, and the transport
//! that carried a batch (split from `ffi.rs`; the same conventions).

use super::{
    guarded, null, KvringEngine, KvringSubmitter, KVRING_TRANSPORT_CMA, KVRING_TRANSPORT_CUDA_IPC,
    KVRING_TRANSPORT_NULL, KVRING_TRANSPORT_RDMA, KVRING_TRANSPORT_SHM, KVRING_TRANSPORT_TCP,
};
use crate::TransportKind;
use std::ffi::{c_char, c_int};

/// A transport's `KVRING_TRANSPORT_*` code.
pub(super) fn code(kind: TransportKind) -> c_int {
    match kind {
        TransportKind::Shm => KVRING_TRANSPORT_SHM,
        TransportKind::Tcp => KVRING_TRANSPORT_TCP,
        TransportKind::CudaIpc => KVRING_TRANSPORT_CUDA_IPC,
        TransportKind::Cma => KVRING_TRANSPORT_CMA,
        TransportKind::Rdma => KVRING_TRANSPORT_RDMA,
        TransportKind::Null => KVRING_TRANSPORT_NULL,
    }
}

/// As `kvring_engine_create_with_token`, limited to `transports`: the
/// transports this engine may reach peers by, comma-separated
/// (`"shm,tcp"`; one name: that one required; NULL or "": every one). A
/// peer only others reach is refused at `kvring_open_segment` with
/// `-UNSUPPORTED`, `kvring_last_error` naming what reaches it and why each
/// allowed transport does not.
///
/// # Safety
///
/// `name` and `listen` are NUL-terminated strings; `token` and
/// `transports` are each one or NULL; `out` is a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn kvring_engine_create_with_transports(
    name: *const c_char,
    listen: *const c_char,
    lanes: u32,
    token: *const c_char,
    transports: *const c_char,
    out: *mut *mut KvringEngine,
) -> c_int {
    guarded(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: per our contract.
        let builder = unsafe { super::base_builder(name, listen, lanes, token)? };
        // SAFETY: per our contract (checked for NULL first).
        let allowed =
            crate::config::parse_transports(unsafe { super::optional_text(transports, "transports")? }.unwrap_or(""))?;
        let builder = builder.transports(allowed);
        let engine = builder.build()?;
        // SAFETY: `out` is valid (checked non-null, per our contract).
        unsafe { *out = Box::into_raw(Box::new(KvringEngine(engine))) };
        Ok(0)
    })
}

/// The transport that carries a batch (`KVRING_TRANSPORT_*`), from its
/// submission until `kvring_wait` or `kvring_reap` consumes it (a reaped
/// `kvring_completion` carries it too); a negative code for an unknown or
/// consumed batch.
///
/// # Safety
///
/// `submitter` is live.
#[no_mangle]
pub unsafe extern "C" fn kvring_batch_transport(submitter: *mut KvringSubmitter, batch: u64) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let submitter = unsafe { submitter.as_ref() }.ok_or_else(|| null("submitter"))?;
        Ok(code(submitter.0.transport(crate::BatchId::from_raw(batch))?))
    })
}

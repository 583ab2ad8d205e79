//! A GPU region's entry in a segment descriptor: which of the owner's GPUs
//! holds it and what a same-host peer opens it by, checked on the way in.

use crate::error::{Error, Result};
use crate::gpu::{check_handles, HandleKind, IpcHandle, IPC_HANDLE_BYTES};
use crate::mem::MemoryKind;
use crate::proto;

/// Highest GPU number a descriptor may name.
pub const MAX_GPU_ORDINAL: u32 = 1023;
/// Longest export error a descriptor may carry.
pub const MAX_EXPORT_ERROR_BYTES: usize = 1024;

/// What a peer's descriptor says about how to open one of its regions.
pub type GpuExport = std::result::Result<Vec<IpcHandle>, String>;

/// The wire fields (`gpu`, `gpu_handles`, `gpu_export_error`) of a region.
pub fn to_proto(memory: MemoryKind, export: &GpuExport) -> (u32, Vec<proto::GpuHandle>, String) {
    let gpu = match memory {
        MemoryKind::Host => 0,
        MemoryKind::Gpu(n) => n + 1,
    };
    match export {
        Ok(handles) => (
            gpu,
            handles
                .iter()
                .map(|h| proto::GpuHandle {
                    kind: h.kind.to_wire(),
                    handle: h.bytes.to_vec(),
                    offset: h.offset,
                    len: h.len,
                })
                .collect(),
            String::new(),
        ),
        Err(reason) => (gpu, Vec::new(), reason.clone()),
    }
}

/// Checks a region's GPU fields from a peer: a host region carries none; a
/// GPU region is not shm-backed and carries well-formed handles that reach
/// all `len` bytes, or a short reason why it has none.
pub fn from_proto(region: &proto::RegionDescriptor, bad: impl Fn(String) -> Error) -> Result<(MemoryKind, GpuExport)> {
    let id = crate::region_id::RegionId::from_raw(region.id);
    if region.gpu == 0 {
        if !region.gpu_handles.is_empty() || !region.gpu_export_error.is_empty() {
            return Err(bad(format!("host region {id} carries GPU handles")));
        }
        return Ok((MemoryKind::Host, Ok(Vec::new())));
    }
    let ordinal = region.gpu - 1;
    if ordinal > MAX_GPU_ORDINAL {
        return Err(bad(format!("region {id} names GPU {ordinal} (at most {MAX_GPU_ORDINAL})")));
    }
    if !region.shm_path.is_empty() {
        return Err(bad(format!("GPU region {id} cannot be shm-backed")));
    }
    if region.gpu_export_error.len() > MAX_EXPORT_ERROR_BYTES {
        return Err(bad(format!("region {id}'s export error exceeds {MAX_EXPORT_ERROR_BYTES} bytes")));
    }
    if region.gpu_handles.is_empty() {
        let reason = if region.gpu_export_error.is_empty() {
            "its owner exported no handle".to_string()
        } else {
            region.gpu_export_error.clone()
        };
        return Ok((MemoryKind::Gpu(ordinal), Err(reason)));
    }
    let mut handles = Vec::with_capacity(region.gpu_handles.len().min(crate::gpu::MAX_EXPORT_PIECES));
    for h in &region.gpu_handles {
        let kind =
            HandleKind::from_wire(h.kind).ok_or_else(|| bad(format!("region {id}: GPU handle kind {}", h.kind)))?;
        let bytes: [u8; IPC_HANDLE_BYTES] = h.handle.as_slice().try_into().map_err(|_| {
            bad(format!("region {id}: a GPU handle of {} bytes (not {IPC_HANDLE_BYTES})", h.handle.len()))
        })?;
        handles.push(IpcHandle { kind, bytes, offset: h.offset, len: h.len });
        if handles.len() > crate::gpu::MAX_EXPORT_PIECES {
            break; // check_handles names the limit
        }
    }
    check_handles(&handles, region.len).map_err(|reason| bad(format!("region {id}'s GPU handles: {reason}")))?;
    Ok((MemoryKind::Gpu(ordinal), Ok(handles)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(gpu: u32, handles: Vec<proto::GpuHandle>) -> proto::RegionDescriptor {
        proto::RegionDescriptor { id: 1 << 16, len: 4096, gpu, gpu_handles: handles, ..Default::default() }
    }

    fn handle(kind: u32, bytes: usize, offset: u64, len: u64) -> proto::GpuHandle {
        proto::GpuHandle { kind, handle: vec![7; bytes], offset, len }
    }

    #[test]
    fn gpu_fields_round_trip_and_every_malformed_one_is_refused() {
        let bad = |reason: String| Error::malformed("segment descriptor", reason);
        let legacy = IpcHandle { kind: HandleKind::Legacy, bytes: [7; 64], offset: 0, len: 8192 };
        // Through the wire form of a region of `len` bytes and back.
        let round_trip = |memory, export: &std::result::Result<Vec<IpcHandle>, String>, len| {
            let (gpu, gpu_handles, gpu_export_error) = to_proto(memory, export);
            let wire = proto::RegionDescriptor { len, gpu, gpu_handles, gpu_export_error, ..Default::default() };
            from_proto(&wire, bad).unwrap()
        };
        assert_eq!(round_trip(MemoryKind::Gpu(2), &Ok(vec![legacy]), 4096), (MemoryKind::Gpu(2), Ok(vec![legacy])));
        let pooled = Err("pooled memory".to_string());
        assert_eq!(round_trip(MemoryKind::Gpu(0), &pooled, 1), (MemoryKind::Gpu(0), pooled.clone()));
        assert_eq!(from_proto(&region(0, vec![]), bad).unwrap(), (MemoryKind::Host, Ok(vec![])));

        let refused = |r: proto::RegionDescriptor| from_proto(&r, bad).unwrap_err().to_string();
        assert!(refused(region(0, vec![handle(1, 64, 0, 8192)])).contains("host region"));
        assert!(refused(region(MAX_GPU_ORDINAL + 2, vec![])).contains("names GPU"));
        assert!(refused(region(1, vec![handle(9, 64, 0, 8192)])).contains("handle kind 9"));
        assert!(refused(region(1, vec![handle(1, 63, 0, 8192)])).contains("63 bytes"));
        assert!(refused(region(1, vec![handle(1, 64, 0, 100)])).contains("reach 100 bytes"));
        assert!(refused(region(1, vec![handle(1, 64, 8192, 8192)])).contains("outside its allocation"));
        let mut shm = region(1, vec![handle(1, 64, 0, 8192)]);
        shm.shm_path = "/dev/shm/kvring-1-1-1".into();
        assert!(refused(shm).contains("cannot be shm-backed"));
        let mut long = region(1, vec![]);
        long.gpu_export_error = "x".repeat(MAX_EXPORT_ERROR_BYTES + 1);
        assert!(refused(long).contains("export error exceeds"));
        let many = vec![handle(2, 64, 0, 1); crate::gpu::MAX_EXPORT_PIECES + 5];
        assert!(refused(region(1, many)).contains("exceed the limit"));
    }
}

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

/// Why a kvring that predates FABRIC handles cannot open a FABRIC-only
/// region: what such a peer reads as the region's export error.
pub const FABRIC_FOR_OLDER_PEERS: &str =
    "FABRIC-only GPU memory: a kvring that takes FABRIC handles (handle kind 3, GPU \
     descriptor request KVF7) opens it over cuda_ipc; update this one";

/// The wire fields (`gpu`, `gpu_handles`, `gpu_export_error`,
/// `gpu_fabric_handles`) of a region. FABRIC handles go in a field of
/// their own, which a kvring predating them skips: it reads the region as
/// unopenable, with [`FABRIC_FOR_OLDER_PEERS`] as why.
pub fn to_proto(memory: MemoryKind, export: &GpuExport) -> (u32, Vec<proto::GpuHandle>, String, Vec<proto::GpuHandle>) {
    let gpu = match memory {
        MemoryKind::Host => 0,
        MemoryKind::Gpu(n) => n + 1,
    };
    let wire = |handles: &[IpcHandle]| -> Vec<proto::GpuHandle> {
        handles
            .iter()
            .map(|h| proto::GpuHandle {
                kind: h.kind.to_wire(),
                handle: h.bytes.to_vec(),
                offset: h.offset,
                len: h.len,
            })
            .collect()
    };
    match export {
        Ok(handles) if handles.first().is_some_and(|h| h.kind == HandleKind::Fabric) => {
            (gpu, Vec::new(), FABRIC_FOR_OLDER_PEERS.to_string(), wire(handles))
        }
        Ok(handles) => (gpu, wire(handles), String::new(), Vec::new()),
        Err(reason) => (gpu, Vec::new(), reason.clone(), Vec::new()),
    }
}

/// Checks a region's GPU fields from a peer: a host region carries none; a
/// GPU region is not shm-backed and carries well-formed handles that reach
/// all `len` bytes, or a short reason why it has none.
pub fn from_proto(region: &proto::RegionDescriptor, bad: impl Fn(String) -> Error) -> Result<(MemoryKind, GpuExport)> {
    let id = crate::region_id::RegionId::from_raw(region.id);
    if region.gpu == 0 {
        let handles = !region.gpu_handles.is_empty() || !region.gpu_fabric_handles.is_empty();
        if handles || !region.gpu_export_error.is_empty() {
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
    let fabric = !region.gpu_fabric_handles.is_empty();
    if fabric && !region.gpu_handles.is_empty() {
        return Err(bad(format!("region {id} carries both FABRIC and other GPU handles")));
    }
    let wire = if fabric { &region.gpu_fabric_handles } else { &region.gpu_handles };
    if wire.is_empty() {
        let reason = if region.gpu_export_error.is_empty() {
            "its owner exported no handle".to_string()
        } else {
            region.gpu_export_error.clone()
        };
        return Ok((MemoryKind::Gpu(ordinal), Err(reason)));
    }
    let mut handles = Vec::with_capacity(wire.len().min(crate::gpu::MAX_EXPORT_PIECES));
    for h in wire {
        let kind =
            HandleKind::from_wire(h.kind).ok_or_else(|| bad(format!("region {id}: GPU handle kind {}", h.kind)))?;
        if (kind == HandleKind::Fabric) != fabric {
            return Err(bad(format!("region {id}: a GPU handle of kind {} in the wrong field", h.kind)));
        }
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
        let wire = |memory, export: &std::result::Result<Vec<IpcHandle>, String>, len| {
            let (gpu, gpu_handles, gpu_export_error, gpu_fabric_handles) = to_proto(memory, export);
            proto::RegionDescriptor {
                len,
                gpu,
                gpu_handles,
                gpu_export_error,
                gpu_fabric_handles,
                ..Default::default()
            }
        };
        let round_trip = |memory, export: &std::result::Result<Vec<IpcHandle>, String>, len| {
            from_proto(&wire(memory, export, len), bad).unwrap()
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

    /// Review 8, probe 7: a FABRIC-only region's handles travel in a field
    /// of their own, so a kvring that predates handle kind 3 (which skips
    /// that field, as protobuf decoders skip unknown fields) reads the
    /// region as one it cannot open, saying why, and still decodes the
    /// descriptor; before, kind 3 among `gpu_handles` made every older peer
    /// refuse the whole descriptor (every region, every transport).
    #[test]
    fn a_fabric_region_reads_to_an_older_peer_as_unopenable_not_as_a_malformed_descriptor() {
        let bad = |reason: String| Error::malformed("segment descriptor", reason);
        let piece = IpcHandle { kind: HandleKind::Fabric, bytes: [7; 64], offset: 0, len: 4096 };
        let export = Ok(vec![piece, piece]);
        let (gpu, gpu_handles, gpu_export_error, gpu_fabric_handles) = to_proto(MemoryKind::Gpu(0), &export);
        let ours = proto::RegionDescriptor {
            len: 8192,
            gpu,
            gpu_handles,
            gpu_export_error,
            gpu_fabric_handles,
            ..Default::default()
        };
        assert_eq!(from_proto(&ours, bad).unwrap(), (MemoryKind::Gpu(0), export.clone()));
        // What an older kvring decodes: the same bytes less the field it
        // does not know.
        let older = proto::RegionDescriptor { gpu_fabric_handles: Vec::new(), ..ours.clone() };
        let (memory, reason) = from_proto(&older, bad).unwrap();
        assert_eq!((memory, reason.unwrap_err()), (MemoryKind::Gpu(0), FABRIC_FOR_OLDER_PEERS.to_string()));
        let refused = |r: proto::RegionDescriptor| from_proto(&r, bad).unwrap_err().to_string();
        // A FABRIC handle among the others, another kind among FABRIC ones,
        // both fields, or FABRIC handles on a host region: malformed.
        assert!(refused(region(1, vec![handle(3, 64, 0, 8192)])).contains("wrong field"));
        let mut mixed = region(1, vec![]);
        mixed.gpu_fabric_handles = vec![handle(2, 64, 0, 8192)];
        assert!(refused(mixed).contains("wrong field"));
        let mut both = region(1, vec![handle(2, 64, 0, 8192)]);
        both.gpu_fabric_handles = vec![handle(3, 64, 0, 8192)];
        assert!(refused(both).contains("both FABRIC and other"));
        let mut host = region(0, vec![]);
        host.gpu_fabric_handles = vec![handle(3, 64, 0, 8192)];
        assert!(refused(host).contains("host region"));
    }
}

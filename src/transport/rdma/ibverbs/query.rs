//! Devices as libibverbs reports them (finding 18: from `ibv_query_device`,
//! `ibv_query_port` and `ibv_query_gid`, not from a fixed sysfs path), so a
//! substitute library presents devices too. sysfs is read only for what
//! verbs do not say: the NUMA node, the PCI path and each GID's type, under
//! [`sysfs_root`].

use super::ffi::*;
use super::lib::Lib;
use super::{failed, mtu_bytes, Limits};
use crate::error::{Error, Result};
use crate::transport::rdma::devices::{natural, SYSFS_ROOT};
use crate::transport::rdma::verbs::{DeviceInfo, LinkLayer, PortInfo};
use std::ffi::CStr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Most GID entries read per port.
const MAX_GIDS: i32 = 256;

/// Where sysfs lists RDMA devices: `$KVRING_RDMA_SYSFS_ROOT` (a test tree
/// beside a fake libibverbs), read once, else [`SYSFS_ROOT`].
pub fn sysfs_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        std::env::var_os("KVRING_RDMA_SYSFS_ROOT").map(PathBuf::from).unwrap_or_else(|| SYSFS_ROOT.into())
    })
}

/// Zeroed port attributes (plain C data).
pub(super) fn zeroed_port() -> ibv_port_attr {
    // SAFETY: ibv_port_attr is integers only; all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

/// The listed devices' names and pointers; the list is freed by the caller.
///
/// # Safety
///
/// `list` came from `ibv_get_device_list` with `count` entries.
unsafe fn names(lib: &Lib, list: *mut *mut ibv_device, count: i32) -> Vec<(String, *mut ibv_device)> {
    (0..count.max(0) as usize)
        .filter_map(|i| {
            // SAFETY: `list` holds `count` valid device pointers.
            let device = unsafe { *list.add(i) };
            // SAFETY: `device` is a listed device.
            let name = unsafe { (lib.get_device_name)(device) };
            // SAFETY: a NUL-terminated name owned by the list, copied now.
            (!name.is_null()).then(|| (unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned(), device))
        })
        .collect()
}

/// Opens `device` by name, with its limits.
pub(super) fn open(lib: &Lib, device: &str) -> Result<(*mut ibv_context, Limits)> {
    let mut count = 0;
    // SAFETY: `count` is a valid out-pointer; the list is freed below.
    let list = unsafe { (lib.get_device_list)(&mut count) };
    if list.is_null() {
        return Err(Error::Device { device: device.into(), reason: "no RDMA devices on this host".into() });
    }
    // SAFETY: as documented for `names`.
    let found = unsafe { names(lib, list, count) }.into_iter().find(|(name, _)| name == device);
    // SAFETY: a listed device, opened before the list is freed
    // (ibv_get_device_list(3) NOTES).
    let context = found.map(|(_, d)| unsafe { (lib.open_device)(d) });
    // SAFETY: freed once, after the open.
    unsafe { (lib.free_device_list)(list) };
    let context = match context {
        None => return Err(Error::Device { device: device.into(), reason: "no such RDMA device".into() }),
        Some(c) if c.is_null() => return Err(failed(device, "opening")),
        Some(c) => c,
    };
    // SAFETY: zeroed attributes are a valid out-parameter; `context` is live.
    let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { (lib.query_device)(context, &mut attr) };
    if rc != 0 {
        // SAFETY: closing the context just opened, once.
        unsafe { (lib.close_device)(context) };
        return Err(Error::Device { device: device.into(), reason: format!("ibv_query_device failed ({rc})") });
    }
    // ibv_get_async_event(3)'s example: the async descriptor made
    // non-blocking, so events are taken without waiting.
    // SAFETY: `context` is live; fcntl on its own descriptor, flags only.
    unsafe {
        let fd = (*context).async_fd;
        libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK);
    }
    let clamp = |v: i32| v.clamp(0, i32::from(u8::MAX)) as u8;
    Ok((
        context,
        Limits {
            max_qp_wr: attr.max_qp_wr.max(1) as u32,
            max_cqe: attr.max_cqe.max(1) as u32,
            max_qp_rd_atom: clamp(attr.max_qp_rd_atom),
            max_qp_init_rd_atom: clamp(attr.max_qp_init_rd_atom),
        },
    ))
}

/// Every device libibverbs lists, with its ports and GIDs.
pub(super) fn devices(lib: &Lib) -> Result<Vec<DeviceInfo>> {
    let mut count = 0;
    // SAFETY: as in `open`.
    let list = unsafe { (lib.get_device_list)(&mut count) };
    if list.is_null() {
        return Ok(Vec::new());
    }
    // SAFETY: as documented for `names`.
    let listed = unsafe { names(lib, list, count) };
    // SAFETY: freed once; only names are kept.
    unsafe { (lib.free_device_list)(list) };
    let mut devices = Vec::new();
    for (name, _) in listed {
        let (context, _) = match open(lib, &name) {
            Ok(opened) => opened,
            Err(error) => {
                tracing::warn!(device = %name, %error, "listed but not usable");
                continue;
            }
        };
        // SAFETY: a live context, closed below.
        let ports = unsafe { ports(lib, context, &name) };
        // SAFETY: closed once.
        unsafe { (lib.close_device)(context) };
        let dir = sysfs_root().join(&name);
        let numa_node = std::fs::read_to_string(dir.join("device/numa_node"))
            .ok()
            .and_then(|n| n.trim().parse::<i64>().ok())
            .filter(|&n| n >= 0)
            .map(|n| n as u32);
        let pci_path = std::fs::canonicalize(dir.join("device")).ok();
        devices.push(DeviceInfo { name, numa_node, pci_path, ports });
    }
    devices.sort_by(|a, b| natural(&a.name).cmp(&natural(&b.name)));
    Ok(devices)
}

/// Each port of `context`.
///
/// # Safety
///
/// `context` is live.
unsafe fn ports(lib: &Lib, context: *mut ibv_context, name: &str) -> Vec<PortInfo> {
    // SAFETY: zeroed attributes are a valid out-parameter.
    let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `context` is live (our caller's contract).
    if unsafe { (lib.query_device)(context, &mut attr) } != 0 {
        return Vec::new();
    }
    let mut ports = Vec::new();
    for port in 1..=attr.phys_port_cnt {
        let mut p = zeroed_port();
        // SAFETY: `context` is live; `p` is as large as verbs.h's struct.
        if unsafe { (lib.query_port)(context, port, &mut p) } != 0 {
            continue;
        }
        let types = sysfs_root().join(name).join(format!("ports/{port}/gid_attrs/types"));
        let gids = (0..p.gid_tbl_len.clamp(0, MAX_GIDS))
            .filter_map(|index| {
                let mut gid = ibv_gid::default();
                // SAFETY: `context` is live; `gid` is our out-parameter.
                let rc = unsafe { (lib.query_gid)(context, port, index, &mut gid) };
                // The type from verbs where the library has
                // `_ibv_query_gid_ex` (ibv_query_gid_ex(3): `gid_type`), else
                // from sysfs (older rdma-core).
                // SAFETY: `context` is live (our caller's contract).
                let v2 = unsafe { gid_type(lib, context, port, index) }
                    .map(|t| t == IBV_GID_TYPE_ROCE_V2)
                    .unwrap_or_else(|| {
                        std::fs::read_to_string(types.join(index.to_string()))
                            .is_ok_and(|t| t.trim().eq_ignore_ascii_case("RoCE v2"))
                    });
                (rc == 0 && gid.raw != [0; 16]).then_some((index as u8, gid.raw, v2))
            })
            .collect();
        let link_layer = match p.link_layer {
            IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
            IBV_LINK_LAYER_INFINIBAND => LinkLayer::InfiniBand,
            _ => LinkLayer::Unspecified,
        };
        ports.push(PortInfo {
            port,
            active: p.state == IBV_PORT_ACTIVE,
            mtu: mtu_bytes(p.active_mtu),
            lid: p.lid,
            gids,
            link_layer,
        });
    }
    ports
}

/// The type of GID `index` of `port` by `_ibv_query_gid_ex`, when the
/// library has it and the entry is valid (ENODATA: an empty entry).
///
/// # Safety
///
/// `context` is live.
pub(super) unsafe fn gid_type(lib: &Lib, context: *mut ibv_context, port: u8, index: i32) -> Option<u32> {
    let query = lib.query_gid_ex?;
    let mut entry = ibv_gid_entry::default();
    // SAFETY: `context` is live (our caller's contract); `entry` is ours and
    // its size is passed as verbs.h's inline wrapper does.
    let rc = unsafe {
        query(context, u32::from(port), index.max(0) as u32, &mut entry, 0, std::mem::size_of::<ibv_gid_entry>())
    };
    (rc == 0).then_some(entry.gid_type)
}

//! Which NIC each GPU's memory would go over, and why, from sysfs alone
//! (no CUDA driver needed): the NVIDIA display and 3D controllers of
//! `<sys>/bus/pci/devices`, the RDMA devices with an active port of
//! `<sys>/class/infiniband`, and [`nearest`](super::topology::nearest)
//! between their real PCI paths and NUMA nodes (the engine's own choice:
//! same PCIe switch, else the same host bridge, else the same NUMA node,
//! else every NIC). For `kvring info` and `kvring bench`; tested on fake
//! sysfs trees (`KVRING_SYSFS_ROOT`).

use super::devices::read_sysfs;
use super::topology::nearest;
use std::path::{Path, PathBuf};

/// Where the kernel's sysfs is: `$KVRING_SYSFS_ROOT` (a test tree), else
/// `/sys`.
pub fn sysfs_root() -> PathBuf {
    std::env::var_os("KVRING_SYSFS_ROOT").map_or_else(|| PathBuf::from("/sys"), PathBuf::from)
}

/// One GPU as sysfs shows it.
struct PciGpu {
    bus: String,
    path: Option<PathBuf>,
    numa: Option<u32>,
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|t| t.trim().to_string())
}

/// NVIDIA display and 3D controllers under `devices`, by bus address.
fn gpus(devices: &Path) -> Vec<PciGpu> {
    let Ok(entries) = std::fs::read_dir(devices) else { return Vec::new() };
    let mut found: Vec<PciGpu> = entries
        .flatten()
        .filter(|d| read(&d.path().join("vendor")).as_deref() == Some("0x10de"))
        .filter(|d| read(&d.path().join("class")).is_some_and(|c| c.starts_with("0x0300") || c.starts_with("0x0302")))
        .map(|d| PciGpu {
            bus: d.file_name().to_string_lossy().into_owned(),
            path: std::fs::canonicalize(d.path()).ok(),
            // -1: no NUMA information.
            numa: read(&d.path().join("numa_node")).and_then(|n| n.parse::<u32>().ok()),
        })
        .collect();
    found.sort_by(|a, b| a.bus.cmp(&b.bus));
    found
}

/// One line per GPU under `sys` (`GPU 0000:1b:00.0 (numa 0) -> mlx5_0
/// (same PCIe switch)`), or why there is nothing to choose: no GPU, no NIC
/// with an active port (each named plainly).
pub fn choices(sys: &Path) -> Result<Vec<String>, String> {
    let pci = sys.join("bus/pci/devices");
    let ib = match std::env::var_os("KVRING_RDMA_SYSFS_ROOT") {
        Some(root) => PathBuf::from(root),
        None => sys.join("class/infiniband"),
    };
    let gpus = gpus(&pci);
    let listed = read_sysfs(&ib);
    let nics: Vec<_> = listed.iter().filter(|d| d.ports.iter().any(|p| p.active)).collect();
    let buses = || gpus.iter().map(|g| g.bus.as_str()).collect::<Vec<_>>().join(", ");
    match (gpus.is_empty(), nics.is_empty()) {
        (true, true) => {
            return Err(format!(
                "no NVIDIA GPU under {} and no RDMA device with an active port under {}",
                pci.display(),
                ib.display()
            ))
        }
        (true, false) => {
            let names: Vec<&str> = nics.iter().map(|n| n.name.as_str()).collect();
            return Err(format!(
                "no NVIDIA GPU under {} (NICs {} carry host memory only)",
                pci.display(),
                names.join(", ")
            ));
        }
        (false, true) => {
            let down: Vec<&str> = listed.iter().map(|n| n.name.as_str()).collect();
            let listed =
                if down.is_empty() { String::new() } else { format!(" (listed, none active: {})", down.join(", ")) };
            return Err(format!(
                "no RDMA device with an active port under {}{listed}: GPU {} would move over tcp (staged) only",
                ib.display(),
                buses()
            ));
        }
        (false, false) => {}
    }
    let places: Vec<_> = nics.iter().map(|n| (n.pci_path.as_deref(), n.numa_node)).collect();
    Ok(gpus
        .iter()
        .map(|gpu| {
            let (mask, nearness) = nearest(gpu.path.as_deref(), gpu.numa, &places);
            let names: Vec<&str> =
                nics.iter().enumerate().filter(|(i, _)| mask & (1 << i) != 0).map(|(_, n)| n.name.as_str()).collect();
            let numa = gpu.numa.map_or("numa ?".to_string(), |n| format!("numa {n}"));
            format!("GPU {} ({numa}) -> {} ({})", gpu.bus, names.join(", "), nearness.describe())
        })
        .collect())
}

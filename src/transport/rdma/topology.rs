//! Which NICs are nearest a GPU, from where both sit in the PCI tree: a
//! pure function over sysfs paths (the real path of
//! `/sys/bus/pci/devices/<bdf>` for the GPU, of
//! `/sys/class/infiniband/<dev>/device` for each NIC) and NUMA nodes, so it
//! is tested on synthetic topologies.
//!
//! A real path reads `/sys/devices/pci0000:17/0000:17:00.0/0000:18:00.0/
//! 0000:19:01.0/0000:1b:00.0`: the host bridge (`pci0000:17`), then every
//! PCI bridge down to the device. Two devices that share a bridge below
//! the host bridge (a root port, and the PCIe switch under it) reach each
//! other without crossing the CPU: what GPUDirect RDMA runs fastest over
//! (`nvidia-smi topo`'s PIX and PXB). Then, in order: the same host bridge
//! (PHB), the same NUMA node (NODE), anything else (SYS).

use std::path::Path;

/// How near a NIC is to a GPU, nearest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Nearness {
    /// Under one PCIe switch (or root port): no CPU in between.
    Switch,
    /// Under the same host bridge.
    HostBridge,
    /// On the same NUMA node.
    Numa,
    /// Nothing known in common.
    Far,
}

impl Nearness {
    /// How `kvring info` says it.
    pub fn describe(self) -> &'static str {
        match self {
            Nearness::Switch => "same PCIe switch",
            Nearness::HostBridge => "same host bridge",
            Nearness::Numa => "same NUMA node",
            Nearness::Far => "no nearer NIC known",
        }
    }
}

/// Where a device sits: its host bridge, and the PCI devices from the
/// root port down to itself.
fn chain(path: &Path) -> Option<(String, Vec<String>)> {
    let mut parts = path.iter().filter_map(|p| p.to_str());
    let root = parts.find(|p| p.starts_with("pci") && p.contains(':'))?.to_string();
    let devices: Vec<String> = parts.take_while(|p| is_bdf(p)).map(str::to_string).collect();
    (!devices.is_empty()).then_some((root, devices))
}

/// `0000:17:00.0`: domain, bus, device and function.
fn is_bdf(name: &str) -> bool {
    let bytes = name.as_bytes();
    bytes.len() == 12
        && bytes[4] == b':'
        && bytes[7] == b':'
        && bytes[10] == b'.'
        && bytes.iter().enumerate().all(|(i, b)| matches!(i, 4 | 7 | 10) || b.is_ascii_hexdigit())
}

/// How near the NIC at `nic` (on NUMA node `nic_numa`) is to the GPU at
/// `gpu` (on `gpu_numa`).
pub fn nearness(gpu: Option<&Path>, gpu_numa: Option<u32>, nic: Option<&Path>, nic_numa: Option<u32>) -> Nearness {
    if let (Some((gpu_root, gpu_chain)), Some((nic_root, nic_chain))) = (gpu.and_then(chain), nic.and_then(chain)) {
        if gpu_root == nic_root {
            // Bridges above each device (the device itself excluded).
            let above = |chain: &[String]| chain.len() - 1;
            let shared = gpu_chain[..above(&gpu_chain)]
                .iter()
                .zip(&nic_chain[..above(&nic_chain)])
                .take_while(|(a, b)| a == b)
                .count();
            return if shared > 0 { Nearness::Switch } else { Nearness::HostBridge };
        }
    }
    match (gpu_numa, nic_numa) {
        (Some(a), Some(b)) if a == b => Nearness::Numa,
        _ => Nearness::Far,
    }
}

/// The NICs nearest the GPU, as a mask (bit n: NIC n of `nics`, each its
/// PCI path and NUMA node), and how near they are. With nothing known
/// ([`Nearness::Far`] for all), every NIC.
pub fn nearest(gpu: Option<&Path>, gpu_numa: Option<u32>, nics: &[(Option<&Path>, Option<u32>)]) -> (u32, Nearness) {
    let each: Vec<Nearness> = nics.iter().map(|(path, numa)| nearness(gpu, gpu_numa, *path, *numa)).collect();
    let best = each.iter().copied().min().unwrap_or(Nearness::Far);
    let mask = each.iter().enumerate().filter(|(i, n)| **n == best && *i < 32).fold(0u32, |m, (i, _)| m | 1 << i);
    (mask, best)
}

/// Where the GPU at PCI address `bus` (`0000:3b:00.0`) sits in the PCI
/// tree: the real path of its sysfs entry, if this host shows it.
pub fn gpu_pci_path(bus: &str) -> Option<std::path::PathBuf> {
    std::fs::canonicalize(format!("/sys/bus/pci/devices/{}", sysfs_bus_id(bus))).ok()
}

/// A PCI address as sysfs names it: lower case, a 4-digit domain (drivers
/// also print `00000000:3B:00.0`).
fn sysfs_bus_id(bus: &str) -> String {
    let bus = bus.trim().to_ascii_lowercase();
    match bus.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => format!("{}:{rest}", &domain[domain.len() - 4..]),
        _ => bus,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn at(path: &str) -> PathBuf {
        PathBuf::from(path)
    }

    /// Two sockets; on socket 0 a root port with a PCIe switch holding
    /// GPU 0 and mlx5_0, another root port with mlx5_1 straight under it;
    /// on socket 1 a switch holding GPU 1 and mlx5_2 (a DGX-like layout).
    fn machine() -> (Vec<PathBuf>, Vec<(PathBuf, u32)>) {
        let sw0 = "/sys/devices/pci0000:17/0000:17:00.0/0000:18:00.0";
        let sw1 = "/sys/devices/pci0000:b0/0000:b0:00.0/0000:b1:00.0";
        let gpus =
            vec![at(&format!("{sw0}/0000:19:01.0/0000:1b:00.0")), at(&format!("{sw1}/0000:b2:01.0/0000:b3:00.0"))];
        let nics = vec![
            (at(&format!("{sw0}/0000:19:02.0/0000:1c:00.0")), 0),
            (at("/sys/devices/pci0000:17/0000:17:02.0/0000:30:00.0"), 0),
            (at(&format!("{sw1}/0000:b2:02.0/0000:b4:00.0")), 1),
        ];
        (gpus, nics)
    }

    #[test]
    fn the_nic_under_the_gpus_switch_comes_first_then_the_host_bridge_then_numa() {
        let (gpus, nics) = machine();
        let listed: Vec<_> = nics.iter().map(|(p, n)| (Some(p.as_path()), Some(*n))).collect();
        assert_eq!(nearest(Some(&gpus[0]), Some(0), &listed), (0b001, Nearness::Switch));
        assert_eq!(nearest(Some(&gpus[1]), Some(1), &listed), (0b100, Nearness::Switch));
        let each: Vec<_> = listed.iter().map(|(p, n)| nearness(Some(&gpus[0]), Some(0), *p, *n)).collect();
        assert_eq!(each, [Nearness::Switch, Nearness::HostBridge, Nearness::Far]);
        // Without the switch's NIC: the one on the same host bridge.
        assert_eq!(nearest(Some(&gpus[0]), Some(0), &listed[1..]), (0b01, Nearness::HostBridge));
        // Paths unknown (a VM, a simulated device): NUMA decides.
        let numa_only = [(None, Some(1)), (None, Some(0)), (None, Some(0))];
        assert_eq!(nearest(None, Some(0), &numa_only), (0b110, Nearness::Numa));
        // Nothing known: every NIC.
        assert_eq!(nearest(None, None, &[(None, None), (None, None)]), (0b11, Nearness::Far));
        assert_eq!(nearest(None, None, &[]), (0, Nearness::Far));
    }

    #[test]
    fn paths_that_are_not_pci_trees_teach_nothing() {
        assert!(chain(Path::new("/sys/devices/virtual/net/lo")).is_none());
        assert!(chain(Path::new("/sys/devices/pci0000:00")).is_none(), "a host bridge alone");
        assert!(is_bdf("0000:3b:00.0") && !is_bdf("0000:3b:00") && !is_bdf("pci0000:3b"));
        let gpu = at("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0");
        let same_port_fn = at("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.1");
        assert_eq!(nearness(Some(&gpu), None, Some(&same_port_fn), None), Nearness::Switch);
        let other_port = at("/sys/devices/pci0000:00/0000:00:02.0/0000:02:00.0");
        assert_eq!(nearness(Some(&gpu), None, Some(&other_port), None), Nearness::HostBridge);
        assert_eq!(Nearness::Switch.describe(), "same PCIe switch");
        assert_eq!(sysfs_bus_id("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(sysfs_bus_id("0000:3b:00.0"), "0000:3b:00.0");
    }
}

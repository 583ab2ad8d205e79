//! RDMA devices as the kernel lists them (`/sys/class/infiniband`), the GID
//! and MTU to use on a port, and where lanes go: on cores of their NIC's
//! NUMA node, one poller per NIC queue pair. Pure functions over data, so
//! they are tested on synthetic topologies and synthetic sysfs trees.

use super::verbs::{DeviceInfo, LinkLayer, PortInfo};
use std::net::Ipv6Addr;
use std::path::Path;

/// Where the kernel lists RDMA devices.
pub const SYSFS_ROOT: &str = "/sys/class/infiniband";

/// Reads every device under `root` (normally [`SYSFS_ROOT`]); empty when
/// the directory does not exist.
pub fn read_sysfs(root: &Path) -> Vec<DeviceInfo> {
    let Ok(entries) = std::fs::read_dir(root) else { return Vec::new() };
    let mut devices: Vec<DeviceInfo> = entries
        .flatten()
        .map(|entry| {
            let dir = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            // -1 means "no NUMA information".
            let numa_node = read_trimmed(&dir.join("device/numa_node")).and_then(|n| n.parse::<i64>().ok());
            let numa_node = numa_node.filter(|&n| n >= 0).map(|n| n as u32);
            let mut ports: Vec<PortInfo> = std::fs::read_dir(dir.join("ports"))
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|p| p.file_name().to_str()?.parse::<u8>().ok().map(|n| (n, p.path())))
                .map(|(port, path)| read_port(port, &path))
                .collect();
            ports.sort_by_key(|p| p.port);
            let pci_path = std::fs::canonicalize(dir.join("device")).ok();
            DeviceInfo { name, numa_node, pci_path, ports }
        })
        .collect();
    devices.sort_by(|a, b| a.name.cmp(&b.name));
    devices
}

fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

fn read_port(port: u8, dir: &Path) -> PortInfo {
    // "4: ACTIVE"
    let active = read_trimmed(&dir.join("state")).is_some_and(|s| s.ends_with("ACTIVE"));
    let lid = read_trimmed(&dir.join("lid"))
        .and_then(|s| u16::from_str_radix(s.trim_start_matches("0x"), 16).ok())
        .unwrap_or(0);
    let mut gids = Vec::new();
    let mut netdev_mtu = None;
    for index in 0..=u8::MAX {
        let Some(text) = read_trimmed(&dir.join(format!("gids/{index}"))) else { break };
        let Ok(address) = text.parse::<Ipv6Addr>() else { continue };
        if address.is_unspecified() {
            continue;
        }
        let kind = read_trimmed(&dir.join(format!("gid_attrs/types/{index}"))).unwrap_or_default();
        gids.push((index, address.octets(), kind.eq_ignore_ascii_case("RoCE v2")));
        if netdev_mtu.is_none() {
            netdev_mtu = read_trimmed(&dir.join(format!("gid_attrs/ndevs/{index}")))
                .and_then(|ndev| read_trimmed(&Path::new("/sys/class/net").join(ndev).join("mtu")))
                .and_then(|mtu| mtu.parse::<u32>().ok());
        }
    }
    let link_layer = match read_trimmed(&dir.join("link_layer")).as_deref() {
        Some("Ethernet") => LinkLayer::Ethernet,
        Some("InfiniBand") => LinkLayer::InfiniBand,
        _ => LinkLayer::Unspecified,
    };
    PortInfo { port, active, mtu: path_mtu(netdev_mtu), lid, gids, link_layer }
}

/// The largest InfiniBand path MTU (256..=4096) that fits the Ethernet MTU
/// (RoCE); 4096 when unknown (InfiniBand).
pub fn path_mtu(netdev_mtu: Option<u32>) -> u32 {
    let Some(mtu) = netdev_mtu else { return 4096 };
    [4096, 2048, 1024, 512, 256].into_iter().find(|&m| m <= mtu).unwrap_or(256)
}

/// The GID index to use on `port`: RoCE v2 with an IPv4-mapped address
/// first (routable, what RoCE deployments use), then any RoCE v2, then the
/// first GID (InfiniBand, RoCE v1).
pub fn pick_gid(port: &PortInfo) -> Option<u8> {
    let mapped = |gid: &[u8; 16]| Ipv6Addr::from(*gid).to_ipv4_mapped().is_some();
    port.gids
        .iter()
        .find(|(_, gid, v2)| *v2 && mapped(gid))
        .or_else(|| port.gids.iter().find(|(_, _, v2)| *v2))
        .or_else(|| port.gids.first())
        .map(|(index, _, _)| *index)
}

/// The GID index a node uses on `device`'s `port`: `configured` when the
/// port has a GID there (a non-empty entry of its table), else an error
/// naming the indices it has; unconfigured, [`pick_gid`]'s choice. A RoCE
/// port without any GID (no address on its netdev) is refused: no RoCE
/// connection could leave it. InfiniBand always routes by LID too, so an
/// IB port with none uses index 0.
pub fn gid_index(device: &str, port: &PortInfo, configured: Option<u8>) -> crate::error::Result<u8> {
    use crate::error::Error;
    let listed = || {
        let indices: Vec<String> = port
            .gids
            .iter()
            .map(|(i, gid, v2)| {
                let kind = if *v2 { "RoCE v2" } else { "v1/IB" };
                format!("{i} ({} {kind})", Ipv6Addr::from(*gid))
            })
            .collect();
        if indices.is_empty() {
            "none".to_string()
        } else {
            indices.join(", ")
        }
    };
    match (configured, pick_gid(port)) {
        (Some(index), _) if port.gids.iter().any(|(i, ..)| *i == index) => Ok(index),
        (Some(index), _) => Err(Error::Device {
            device: device.into(),
            reason: format!("GID index {index} is out of range on port {}: its GIDs are {}", port.port, listed()),
        }),
        (None, Some(index)) => Ok(index),
        (None, None) if port.link_layer == LinkLayer::Ethernet => Err(Error::Device {
            device: device.into(),
            reason: format!("port {} has no GID (RoCE needs an IP address on its network interface)", port.port),
        }),
        (None, None) => Ok(0),
    }
}

/// The devices an engine opens, with the port each uses: those `wanted`
/// (by name, each with an active port, or the error says which and why),
/// else every device with an active port in natural name order, all of the
/// first one's link layer (an InfiniBand NIC cannot reach a RoCE one, so a
/// host with both uses one kind and logs the others). At most `max`.
pub fn choose(
    listed: &[DeviceInfo],
    wanted: &[String],
    max: usize,
) -> crate::error::Result<Vec<(DeviceInfo, PortInfo)>> {
    use crate::error::Error;
    let mut chosen = Vec::new();
    if !wanted.is_empty() {
        for name in wanted {
            let device = listed.iter().find(|d| &d.name == name).ok_or_else(|| Error::Device {
                device: name.clone(),
                reason: format!(
                    "no such RDMA device (listed: {})",
                    if listed.is_empty() { "none".into() } else { names(listed) }
                ),
            })?;
            let port = device
                .ports
                .iter()
                .find(|p| p.active)
                .ok_or_else(|| Error::Device { device: name.clone(), reason: "no active port".into() })?;
            chosen.push((device.clone(), port.clone()));
        }
        if chosen.len() > max {
            return Err(Error::Device { device: wanted.join(","), reason: format!("at most {max} RDMA devices") });
        }
        return Ok(chosen);
    }
    let mut sorted: Vec<&DeviceInfo> = listed.iter().collect();
    sorted.sort_by(|a, b| natural(&a.name).cmp(&natural(&b.name)));
    let mut layer = None;
    for device in sorted {
        let Some(port) = device.ports.iter().find(|p| p.active) else { continue };
        if *layer.get_or_insert(port.link_layer) != port.link_layer {
            tracing::info!(device = %device.name, link_layer = %port.link_layer, "skipped: another link layer than the first NIC's");
            continue;
        }
        if chosen.len() < max {
            chosen.push((device.clone(), port.clone()));
        }
    }
    if chosen.is_empty() {
        return Err(Error::Device {
            device: "any".into(),
            reason: if listed.is_empty() {
                "no RDMA device with an active port (none listed)".into()
            } else {
                format!("no RDMA device with an active port (listed: {})", names(listed))
            },
        });
    }
    Ok(chosen)
}

fn names(listed: &[DeviceInfo]) -> String {
    listed.iter().map(|d| d.name.as_str()).collect::<Vec<_>>().join(", ")
}

/// A name's sort key with its trailing number as a number, so `mlx5_2`
/// sorts before `mlx5_10`.
pub fn natural(name: &str) -> (&str, u64) {
    let digits = name.len() - name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let (stem, number) = name.split_at(name.len() - digits);
    (stem, number.parse().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::rdma::sim::SimVerbs;

    #[test]
    fn gids_prefer_routable_roce_v2_and_mtu_fits_the_netdev() {
        let mut port = SimVerbs::device("mlx5_0", Some(0)).ports.remove(0);
        assert_eq!(pick_gid(&port), Some(1), "the IPv4-mapped RoCE v2 GID");
        port.gids.retain(|g| !g.2);
        assert_eq!(pick_gid(&port), Some(0), "no v2: the first GID");
        port.gids.clear();
        assert_eq!(pick_gid(&port), None);
        assert_eq!(path_mtu(Some(9000)), 4096);
        assert_eq!(path_mtu(Some(1500)), 1024);
        assert_eq!(path_mtu(Some(100)), 256);
        assert_eq!(path_mtu(None), 4096);
    }

    #[test]
    fn a_configured_gid_index_must_name_a_gid_and_a_roce_port_without_any_is_refused() {
        let mut port = SimVerbs::device("mlx5_0", Some(0)).ports.remove(0);
        port.link_layer = LinkLayer::Ethernet;
        assert_eq!(gid_index("mlx5_0", &port, None).unwrap(), 1, "the default: IPv4-mapped RoCE v2");
        assert_eq!(gid_index("mlx5_0", &port, Some(0)).unwrap(), 0, "a configured index the port has");
        let error = gid_index("mlx5_0", &port, Some(7)).unwrap_err().to_string();
        assert!(error.contains("mlx5_0") && error.contains("GID index 7 is out of range on port 1"), "{error}");
        assert!(error.contains("1 (::ffff:"), "the valid indices are listed: {error}");
        port.gids.clear();
        let error = gid_index("mlx5_0", &port, None).unwrap_err().to_string();
        assert!(error.contains("no GID") && error.contains("IP address"), "{error}");
        port.link_layer = LinkLayer::InfiniBand;
        assert_eq!(gid_index("mlx5_0", &port, None).unwrap(), 0, "InfiniBand routes by LID");
    }

    #[test]
    fn devices_are_chosen_by_name_active_port_and_link_layer_in_natural_order() {
        let dev = |name: &str, active: bool, layer: LinkLayer| {
            let mut d = SimVerbs::device(name, None);
            d.ports[0].active = active;
            d.ports[0].link_layer = layer;
            d
        };
        let listed = vec![
            dev("mlx5_10", true, LinkLayer::Ethernet),
            dev("mlx5_2", true, LinkLayer::Ethernet),
            dev("mlx5_1", false, LinkLayer::Ethernet),
            dev("mlx5_3", true, LinkLayer::InfiniBand),
        ];
        let all: Vec<String> = choose(&listed, &[], 8).unwrap().into_iter().map(|(d, _)| d.name).collect();
        assert_eq!(all, ["mlx5_2", "mlx5_10"], "natural order, active ports, one link layer");
        assert_eq!(choose(&listed, &[], 1).unwrap().len(), 1);
        let named = choose(&listed, &["mlx5_3".to_string()], 8).unwrap();
        assert_eq!((named[0].0.name.as_str(), named[0].1.link_layer), ("mlx5_3", LinkLayer::InfiniBand));
        let missing = choose(&listed, &["mlx5_9".to_string()], 8).unwrap_err().to_string();
        assert!(missing.contains("mlx5_9") && missing.contains("no such RDMA device"), "{missing}");
        let down = choose(&listed, &["mlx5_1".to_string()], 8).unwrap_err().to_string();
        assert!(down.contains("mlx5_1") && down.contains("no active port"), "{down}");
        assert!(choose(&[], &[], 8).unwrap_err().to_string().contains("none listed"));
        assert!(choose(&listed[2..3], &[], 8).unwrap_err().to_string().contains("active port (listed: mlx5_1)"));
    }

    #[test]
    fn a_synthetic_sysfs_tree_reads_as_devices() {
        let root = std::env::temp_dir().join(format!("kvring-sysfs-{}", std::process::id()));
        let port = root.join("mlx5_0/ports/1");
        std::fs::create_dir_all(port.join("gids")).unwrap();
        std::fs::create_dir_all(port.join("gid_attrs/types")).unwrap();
        std::fs::create_dir_all(root.join("mlx5_0/device")).unwrap();
        std::fs::create_dir_all(root.join("mlx5_1/ports")).unwrap();
        std::fs::write(root.join("mlx5_0/device/numa_node"), "1\n").unwrap();
        std::fs::write(port.join("state"), "4: ACTIVE\n").unwrap();
        std::fs::write(port.join("lid"), "0x0\n").unwrap();
        std::fs::write(port.join("gids/0"), "fe80:0000:0000:0000:0000:0000:0000:0001\n").unwrap();
        std::fs::write(port.join("gids/1"), "0000:0000:0000:0000:0000:ffff:0a00:0001\n").unwrap();
        std::fs::write(port.join("gids/2"), "0000:0000:0000:0000:0000:0000:0000:0000\n").unwrap();
        std::fs::write(port.join("gid_attrs/types/0"), "IB/RoCE v1\n").unwrap();
        std::fs::write(port.join("gid_attrs/types/1"), "RoCE v2\n").unwrap();
        let devices = read_sysfs(&root);
        let _ = std::fs::remove_dir_all(&root);
        assert_eq!(devices.len(), 2);
        let dev = &devices[0];
        assert_eq!((dev.name.as_str(), dev.numa_node), ("mlx5_0", Some(1)));
        assert!(dev.ports[0].active);
        assert_eq!(dev.ports[0].gids.len(), 2, "the zero GID is skipped");
        assert_eq!(pick_gid(&dev.ports[0]), Some(1));
        assert_eq!((devices[1].numa_node, devices[1].ports.len()), (None, 0));
        assert!(read_sysfs(Path::new("/nonexistent/infiniband")).is_empty());
    }
}

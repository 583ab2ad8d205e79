//! Which cores lanes may run on.
//!
//! The cores a machine offers this process: the online CPUs, within the
//! cgroup's cpuset when there is one. Not the calling thread's affinity
//! mask: an application that pinned the thread creating the engine (or a
//! bench that pinned itself beside an earlier engine's lane) would
//! otherwise have every lane pinned onto that one core, beside it.

use std::path::Path;

/// Parses a kernel CPU list (`0-3,8,10-11`); `None` when it is not one.
pub fn parse_cpu_list(text: &str) -> Option<Vec<usize>> {
    let mut cores = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((first, last)) => {
                let (first, last): (usize, usize) = (first.parse().ok()?, last.parse().ok()?);
                if last < first || last - first > 4096 {
                    return None;
                }
                cores.extend(first..=last);
            }
            None => cores.push(part.parse().ok()?),
        }
    }
    cores.sort_unstable();
    cores.dedup();
    Some(cores)
}

fn read_list(path: &str) -> Option<Vec<usize>> {
    std::fs::read_to_string(Path::new(path)).ok().and_then(|text| parse_cpu_list(&text)).filter(|c| !c.is_empty())
}

/// The cores of NUMA node `node` (from sysfs), if it has a CPU list.
pub fn node_cores(node: u32) -> Option<Vec<usize>> {
    read_list(&format!("/sys/devices/system/node/node{node}/cpulist"))
}

/// Cores for lanes that drive a device on NUMA node `node` (a GPU, a NIC):
/// the usable cores of that node, the node's first left to the
/// application's threads when it has more; `None` when the node is unknown
/// or none of its cores is usable here (the caller places lanes as usual).
pub fn near_node(
    node: Option<u32>,
    usable: &[usize],
    cores_of: impl Fn(u32) -> Option<Vec<usize>>,
) -> Option<Vec<usize>> {
    let local: Vec<usize> = cores_of(node?)?.into_iter().filter(|c| usable.contains(c)).collect();
    match local.len() {
        0 => None,
        1 => Some(local),
        _ => Some(local[1..].to_vec()),
    }
}

/// Where lanes that drive GPUs should run, by the GPUs' NUMA nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuPlacement {
    /// On this node's cores.
    Node(u32),
    /// The GPU named by `gpu_device` has no known node (or does not exist).
    NamedUnknown(u32),
    /// The GPUs sit on several nodes, or some node is unknown: no GPU is
    /// "the" GPU, so lanes are placed as usual (name one with `gpu_device`).
    Ambiguous,
    /// No GPU.
    NoGpu,
}

/// The node for lanes, given the GPU named by `gpu_device` (the override)
/// and every GPU as (ordinal, NUMA node): the named GPU's node; with none
/// named, the node of every GPU when they all sit on one known node (one
/// GPU, or all on one socket), which is unambiguous.
pub fn gpu_placement(named: Option<u32>, gpus: &[(u32, Option<u32>)]) -> GpuPlacement {
    if let Some(ordinal) = named {
        return match gpus.iter().find(|(o, _)| *o == ordinal) {
            Some(&(_, Some(node))) => GpuPlacement::Node(node),
            _ => GpuPlacement::NamedUnknown(ordinal),
        };
    }
    let Some(&(_, first)) = gpus.first() else { return GpuPlacement::NoGpu };
    match first {
        Some(node) if gpus.iter().all(|&(_, n)| n == Some(node)) => GpuPlacement::Node(node),
        _ => GpuPlacement::Ambiguous,
    }
}

/// NVIDIA GPUs' NUMA nodes as sysfs lists them (display and 3D controllers
/// of vendor 0x10de), without loading the driver; CUDA's ordinals are not
/// sysfs's order, so only "all on one node" can be read from this.
pub fn sysfs_gpu_nodes() -> Vec<Option<u32>> {
    let Ok(devices) = std::fs::read_dir("/sys/bus/pci/devices") else { return Vec::new() };
    let read = |path: std::path::PathBuf| std::fs::read_to_string(path).map(|t| t.trim().to_string()).ok();
    devices
        .flatten()
        .filter(|d| read(d.path().join("vendor")).as_deref() == Some("0x10de"))
        .filter(|d| read(d.path().join("class")).is_some_and(|c| c.starts_with("0x0300") || c.starts_with("0x0302")))
        .map(|d| {
            read(d.path().join("numa_node")).and_then(|n| n.parse::<i64>().ok()).and_then(|n| u32::try_from(n).ok())
        })
        .collect()
}

/// The cores this process may use: online CPUs within the cgroup's cpuset;
/// where neither can be read, the calling thread's affinity.
pub fn usable_cores() -> Vec<usize> {
    let online = read_list("/sys/devices/system/cpu/online");
    let cpuset = read_list("/sys/fs/cgroup/cpuset.cpus.effective");
    match (online, cpuset) {
        (Some(online), Some(cpuset)) => {
            let both: Vec<usize> = online.iter().copied().filter(|c| cpuset.contains(c)).collect();
            if both.is_empty() {
                online
            } else {
                both
            }
        }
        (Some(cores), None) | (None, Some(cores)) => cores,
        (None, None) => core_affinity::get_core_ids().unwrap_or_default().into_iter().map(|c| c.id).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_garbage_is_refused() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list("3,1-2,2"), Some(vec![1, 2, 3]));
        assert_eq!(parse_cpu_list(""), Some(vec![]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("a-b"), None);
        assert_eq!(parse_cpu_list("0-999999"), None);
    }

    #[test]
    fn lanes_for_a_device_go_to_its_node_and_fall_back_when_they_cannot() {
        // Two nodes of four cores; this process may use 1..=6.
        let topology = |node: u32| match node {
            0 => Some(vec![0, 1, 2, 3]),
            1 => Some(vec![4, 5, 6, 7]),
            _ => None,
        };
        let usable = [1, 2, 3, 4, 5, 6];
        // Node 1's usable cores, its first left to the application.
        assert_eq!(near_node(Some(1), &usable, topology), Some(vec![5, 6]));
        assert_eq!(near_node(Some(0), &usable, topology), Some(vec![2, 3]));
        // A node with a single usable core keeps it.
        assert_eq!(near_node(Some(1), &[4], topology), Some(vec![4]));
        // Unknown node, or nothing usable there: no preference.
        assert_eq!(near_node(None, &usable, topology), None);
        assert_eq!(near_node(Some(7), &usable, topology), None);
        assert_eq!(near_node(Some(1), &[0, 1], topology), None);
    }

    #[test]
    fn lanes_follow_the_gpus_node_when_it_is_unambiguous_and_the_named_gpu_always() {
        use GpuPlacement::*;
        // One GPU, or every GPU on one node: that node, nobody naming it.
        assert_eq!(gpu_placement(None, &[(0, Some(1))]), Node(1));
        assert_eq!(gpu_placement(None, &[(0, Some(0)), (1, Some(0)), (2, Some(0))]), Node(0));
        // GPUs on two nodes, or a node unknown: no guess.
        assert_eq!(gpu_placement(None, &[(0, Some(0)), (1, Some(1))]), Ambiguous);
        assert_eq!(gpu_placement(None, &[(0, Some(0)), (1, None)]), Ambiguous);
        assert_eq!(gpu_placement(None, &[(0, None)]), Ambiguous);
        assert_eq!(gpu_placement(None, &[]), NoGpu);
        // `gpu_device` overrides: its node, whatever the others.
        assert_eq!(gpu_placement(Some(1), &[(0, Some(0)), (1, Some(1))]), Node(1));
        assert_eq!(gpu_placement(Some(0), &[(0, Some(0)), (1, Some(1))]), Node(0));
        assert_eq!(gpu_placement(Some(1), &[(0, Some(0)), (1, None)]), NamedUnknown(1));
        assert_eq!(gpu_placement(Some(5), &[(0, Some(0))]), NamedUnknown(5));
        // Then the node's cores, as for a NIC: eight GPUs on node 1 of two.
        let topology = |node: u32| Some(if node == 0 { vec![0, 1, 2, 3] } else { vec![4, 5, 6, 7] });
        let on_one: Vec<(u32, Option<u32>)> = (0..8).map(|g| (g, Some(1))).collect();
        let GpuPlacement::Node(node) = gpu_placement(None, &on_one) else { panic!("one node") };
        assert_eq!(near_node(Some(node), &[0, 1, 2, 3, 4, 5, 6, 7], topology), Some(vec![5, 6, 7]));
    }

    #[test]
    fn pinning_the_calling_thread_does_not_shrink_the_usable_cores() {
        let before = usable_cores();
        assert!(!before.is_empty());
        let first = core_affinity::CoreId { id: before[0] };
        std::thread::spawn(move || {
            core_affinity::set_for_current(first);
            assert_eq!(usable_cores(), before);
        })
        .join()
        .unwrap();
    }
}

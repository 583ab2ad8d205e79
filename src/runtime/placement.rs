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

//! `kvring info` and `kvring bench` say which NIC each GPU's memory would
//! go over and why, from sysfs alone, read here from fake sysfs trees
//! (`KVRING_SYSFS_ROOT`): the NIC under the GPU's PCIe switch, else the one
//! on its host bridge, else its NUMA node's; no GPU or no NIC said plainly.

mod common;

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A fake `/sys` under a fresh temporary directory.
struct FakeSys(PathBuf);

impl FakeSys {
    fn new(label: &str) -> Self {
        let root = std::env::temp_dir().join(format!("kvring-gpu-nics-{label}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("bus/pci/devices")).unwrap();
        std::fs::create_dir_all(root.join("class/infiniband")).unwrap();
        FakeSys(root)
    }

    /// A PCI function at `tree` (below `devices/`), on `numa`.
    fn device(&self, tree: &str, numa: i32) -> PathBuf {
        let dir = self.0.join("devices").join(tree);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("numa_node"), format!("{numa}\n")).unwrap();
        dir
    }

    /// An NVIDIA 3D controller at `tree`, linked from bus/pci/devices as
    /// the kernel does.
    fn gpu(&self, tree: &str, numa: i32) {
        let dir = self.device(tree, numa);
        std::fs::write(dir.join("vendor"), "0x10de\n").unwrap();
        std::fs::write(dir.join("class"), "0x030200\n").unwrap();
        let bus = Path::new(tree).file_name().unwrap();
        symlink(&dir, self.0.join("bus/pci/devices").join(bus)).unwrap();
    }

    /// An RDMA device `name` at `tree` with port 1 in `state`.
    fn nic(&self, name: &str, tree: &str, numa: i32, state: &str) {
        let dir = self.device(tree, numa);
        let ib = self.0.join("class/infiniband").join(name);
        std::fs::create_dir_all(ib.join("ports/1")).unwrap();
        std::fs::write(ib.join("ports/1/state"), format!("{state}\n")).unwrap();
        symlink(&dir, ib.join("device")).unwrap();
    }

    /// Another PCI function that is not a GPU (an NVIDIA audio device).
    fn other(&self, tree: &str) {
        let dir = self.device(tree, 0);
        std::fs::write(dir.join("vendor"), "0x10de\n").unwrap();
        std::fs::write(dir.join("class"), "0x040300\n").unwrap();
        symlink(&dir, self.0.join("bus/pci/devices").join(Path::new(tree).file_name().unwrap())).unwrap();
    }

    fn line(&self, args: &[&str], prefix: &str) -> String {
        let out = Command::new(common::kvring_bin())
            .args(args)
            .env("KVRING_SYSFS_ROOT", &self.0)
            .env_remove("KVRING_RDMA_SYSFS_ROOT")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
        text.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix} line: {text}")).to_string()
    }
}

impl Drop for FakeSys {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const SW0: &str = "pci0000:17/0000:17:00.0/0000:18:00.0";
const SW1: &str = "pci0000:b0/0000:b0:00.0/0000:b1:00.0";

/// Two sockets: a switch on each holding a GPU; mlx5_0 under socket 0's
/// switch, mlx5_1 on socket 0's host bridge on another root port, mlx5_2
/// on socket 1 outside its switch, mlx5_3 down.
fn two_sockets() -> FakeSys {
    let sys = FakeSys::new("two");
    sys.gpu(&format!("{SW0}/0000:19:01.0/0000:1b:00.0"), 0);
    sys.gpu(&format!("{SW1}/0000:b2:01.0/0000:b3:00.0"), 1);
    sys.other(&format!("{SW0}/0000:19:01.0/0000:1b:00.1"));
    sys.nic("mlx5_0", &format!("{SW0}/0000:19:02.0/0000:1c:00.0"), 0, "4: ACTIVE");
    sys.nic("mlx5_1", "pci0000:17/0000:17:02.0/0000:30:00.0", 0, "4: ACTIVE");
    sys.nic("mlx5_2", "pci0000:c0/0000:c0:01.0/0000:c1:00.0", 1, "4: ACTIVE");
    sys.nic("mlx5_3", &format!("{SW1}/0000:b2:02.0/0000:b4:00.0"), 1, "1: DOWN");
    sys
}

#[test]
fn each_gpu_gets_the_nic_under_its_switch_else_its_numa_nodes_and_the_bench_says_so_too() {
    let sys = two_sockets();
    let info = sys.line(&["info"], "gpu nics:");
    assert!(info.contains("GPU 0000:1b:00.0 (numa 0) -> mlx5_0 (same PCIe switch)"), "{info}");
    // mlx5_3 shares GPU 1's switch but is down: the NUMA node decides.
    assert!(info.contains("GPU 0000:b3:00.0 (numa 1) -> mlx5_2 (same NUMA node)"), "{info}");
    assert!(!info.contains("1b:00.1"), "an audio function is not a GPU: {info}");
    let bench = sys.line(
        &[
            "bench",
            "--transport",
            "null",
            "--total",
            "4KiB",
            "--block-size",
            "4KiB",
            "--op",
            "write",
            "--region-size",
            "64KiB",
            "--latency-samples",
            "0",
        ],
        "gpu nics:",
    );
    assert!(bench.contains("GPU 0000:1b:00.0 (numa 0) -> mlx5_0 (same PCIe switch)"), "{bench}");

    // Without mlx5_0: the NIC on GPU 0's host bridge.
    std::fs::remove_dir_all(sys.0.join("class/infiniband/mlx5_0")).unwrap();
    let info = sys.line(&["info"], "gpu nics:");
    assert!(info.contains("GPU 0000:1b:00.0 (numa 0) -> mlx5_1 (same host bridge)"), "{info}");
}

#[test]
fn no_gpu_or_no_nic_is_said_plainly() {
    let sys = FakeSys::new("none");
    let line = sys.line(&["info"], "gpu nics:");
    assert!(
        line.contains("none: no NVIDIA GPU under") && line.contains("and no RDMA device with an active port"),
        "{line}"
    );
    sys.nic("mlx5_0", "pci0000:17/0000:17:02.0/0000:30:00.0", 0, "1: DOWN");
    sys.gpu("pci0000:17/0000:17:01.0/0000:20:00.0", -1);
    let line = sys.line(&["info"], "gpu nics:");
    assert!(line.contains("no RDMA device with an active port under"), "{line}");
    assert!(
        line.contains("(listed, none active: mlx5_0)") && line.contains("GPU 0000:20:00.0 would move over tcp"),
        "{line}"
    );
    let nic_only = FakeSys::new("nic-only");
    nic_only.nic("mlx5_0", "pci0000:17/0000:17:02.0/0000:30:00.0", 0, "4: ACTIVE");
    let line = nic_only.line(&["info"], "gpu nics:");
    assert!(
        line.contains("none: no NVIDIA GPU under") && line.contains("NICs mlx5_0 carry host memory only"),
        "{line}"
    );
}

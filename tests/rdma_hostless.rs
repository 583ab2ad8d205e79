//! A host without libibverbs: the binary (this file) and the Python module
//! (tests/python/test_rdma.py) load and run over tcp, and asking for RDMA
//! is refused in one line naming why. The library is taken away in a
//! private mount namespace (`unshare -m`, then /dev/null bound over every
//! libibverbs.so.1 the loader knows, and LD_LIBRARY_PATH pointing nowhere),
//! so the same `dlopen` production uses finds nothing it can load. Needs
//! root for the namespace, as CI has; elsewhere each test says why it
//! skipped.

use std::process::{Command, Output};

/// Runs `kvring args...` where libibverbs cannot be loaded; `None` (with
/// the reason printed) where no mount namespace can be made.
fn without_libibverbs(args: &[&str]) -> Option<Output> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: hiding libibverbs needs a mount namespace (root; CI runs as root)");
        return None;
    }
    let script = r#"set -e
for lib in $(ldconfig -p | awk '/libibverbs\.so\.1 /{print $NF}'); do
    mount --bind /dev/null "$(readlink -f "$lib")"
done
export LD_LIBRARY_PATH=/nonexistent-kvring-libs
exec "$@""#;
    let output = Command::new("unshare")
        .args(["-m", "sh", "-c", script, "sh", env!("CARGO_BIN_EXE_kvring")])
        .args(args)
        .env_remove("FAKE_IBVERBS_DEVICES")
        .output()
        .expect("unshare (util-linux) runs");
    Some(output)
}

fn text(output: &Output) -> (String, String) {
    (String::from_utf8_lossy(&output.stdout).into_owned(), String::from_utf8_lossy(&output.stderr).into_owned())
}

#[test]
fn info_says_in_one_line_that_libibverbs_is_missing() {
    let Some(output) = without_libibverbs(&["info"]) else { return };
    let (out, err) = text(&output);
    assert!(output.status.success(), "{out}{err}");
    let rdma: Vec<&str> = out.lines().filter(|l| l.starts_with("rdma:")).collect();
    assert_eq!(rdma.len(), 1, "{out}");
    assert!(rdma[0].contains("libibverbs not found") && rdma[0].contains("install rdma-core"), "{}", rdma[0]);
}

#[test]
fn bench_runs_over_tcp_and_refuses_rdma_in_one_line() {
    let Some(output) = without_libibverbs(&["bench", "--transport", "rdma"]) else { return };
    let (out, err) = text(&output);
    assert!(!output.status.success(), "{out}{err}");
    let said = format!("{out}{err}");
    assert_eq!(said.trim_end().lines().count(), 1, "{said}");
    assert!(said.contains("--transport rdma") && said.contains("libibverbs not found"), "{said}");

    let args = ["bench", "--transport", "tcp", "--total", "1MiB", "--block-size", "64KiB", "--latency-samples", "0"];
    let Some(output) = without_libibverbs(&args) else { return };
    let (out, err) = text(&output);
    assert!(output.status.success(), "{out}{err}");
    assert!(out.lines().filter(|l| l.contains(" verified")).count() >= 1, "every case verified: {out}");
}

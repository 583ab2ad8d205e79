//! Arrival tags from C: `tests/c/arrivals.c` is compiled with the system C
//! compiler against `include/kvring.h`, linked to the cdylib this build
//! made, and run: a tagged layer push, a wait for its bytes with a
//! deadline, another engine's bytes not counted for the granted sender,
//! and bad input refused with its code.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn a_c_program_pushes_a_tagged_layer_and_waits_for_it_to_land() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let deps = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    assert!(deps.join("libkvring.so").exists(), "the cdylib is built beside the tests in {}", deps.display());
    let out = std::env::temp_dir().join(format!("kvring-c-arrivals-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O2", "-I"])
        .arg(root.join("include"))
        .arg(root.join("tests/c/arrivals.c"))
        .arg("-L")
        .arg(&deps)
        .arg("-lkvring")
        .arg(format!("-Wl,-rpath,{}", deps.display()))
        .arg("-o")
        .arg(&out)
        .status()
        .expect("a C compiler");
    assert!(status.success(), "{cc} failed");
    let output = Command::new(&out).output().unwrap();
    let _ = std::fs::remove_file(&out);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(stdout.trim(), "arrivals ok");
}

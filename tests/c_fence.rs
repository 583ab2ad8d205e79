//! Fenced destinations from C: `tests/c/fence.c` is compiled with the
//! system C compiler against `include/kvring.h`, linked to the cdylib this
//! build made, and run: a range fenced and granted, a push under the grant,
//! the range fenced again, a stale push refused `-FENCED` with nothing
//! landed, the new grant landing, and bad input refused with its code.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn a_c_program_fences_a_range_and_a_stale_push_is_refused() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let deps = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    assert!(deps.join("libkvring.so").exists(), "the cdylib is built beside the tests in {}", deps.display());
    let out = std::env::temp_dir().join(format!("kvring-c-fence-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O2", "-I"])
        .arg(root.join("include"))
        .arg(root.join("tests/c/fence.c"))
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
    assert_eq!(stdout.trim(), "fence ok");
}

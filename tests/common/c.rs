//! C programs of tests/c/, compiled with the system C compiler against
//! `include/kvring.h` and linked to the cdylib this build made (beside the
//! test's executable), for the C ABI's tests.

use std::path::PathBuf;
use std::process::Command;

/// Compiles `tests/c/<source>` into a fresh executable in the temp dir
/// (named for `source` and this process), or panics saying why.
pub fn compile(source: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let deps = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    assert!(deps.join("libkvring.so").exists(), "the cdylib is built beside the tests in {}", deps.display());
    let stem = source.trim_end_matches(".c");
    let out = std::env::temp_dir().join(format!("kvring-c-{stem}-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O2", "-I"])
        .arg(root.join("include"))
        .arg(root.join("tests/c").join(source))
        .arg("-L")
        .arg(&deps)
        .arg("-lkvring")
        .arg(format!("-Wl,-rpath,{}", deps.display()))
        .arg("-o")
        .arg(&out)
        .status()
        .expect("a C compiler");
    assert!(status.success(), "{cc} failed on tests/c/{source}");
    out
}

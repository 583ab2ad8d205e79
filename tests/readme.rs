//! The README as a new user meets it: its Rust quick start is the example
//! that runs against a real `kvring serve`, and its sample output has the
//! shape of what `kvring bench` prints. (The Python quick start is run by
//! `tests/python/test_readme.py`.)

#[path = "common/child.rs"]
mod child;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap()
}

/// The first fenced block opening with `fence` after `heading`.
fn block_after(text: &str, heading: &str, fence: &str) -> String {
    let from = text.find(heading).unwrap_or_else(|| panic!("the README has no {heading:?}"));
    let rest = &text[from..];
    let start = rest.find(fence).unwrap_or_else(|| panic!("no {fence} block after {heading:?}")) + fence.len() + 1;
    let end = rest[start..].find("\n```").expect("the block ends") + start;
    rest[start..end].to_string()
}

/// A line's shape: numbers (with a size unit or not) become `N`, runs of
/// spaces one space.
fn shape(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.trim().chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            while chars.peek().is_some_and(|c| c.is_ascii_alphanumeric() || *c == '.') {
                chars.next();
            }
            out.push('N');
        } else if c == ' ' {
            while chars.peek() == Some(&' ') {
                chars.next();
            }
            out.push(' ');
        } else {
            out.push(c);
        }
    }
    // Column padding inside parentheses varies with the number's width.
    out.replace("( ", "(")
}

/// `target/<profile>/examples/<name>`, built by `cargo test` with the tests.
fn example(name: &str) -> PathBuf {
    let deps = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    deps.parent().unwrap().join("examples").join(name)
}

/// A `kvring serve` child and its control address.
fn serve() -> (child::Reaped, String) {
    let (child, line) = child::serve(&["--region-size", "16MiB", "--parent-watch"]);
    (child, child::field(&line, "listen=").to_string())
}

#[test]
fn the_rust_quick_start_is_the_example_and_runs_against_kvring_serve() {
    let text = readme();
    let shown = block_after(&text, "## Quick start: Rust", "```rust");
    let source = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/quickstart.rs")).unwrap();
    assert_eq!(shown.trim(), source.trim(), "the README shows examples/quickstart.rs as it is");
    assert!(text.contains("cargo run --release --example quickstart"));

    let (mut target, addr) = serve();
    let binary = example("quickstart");
    assert!(binary.exists(), "{} was not built (cargo test builds examples)", binary.display());
    let started = Instant::now();
    let run = Command::new(&binary).arg(&addr).output().unwrap();
    let _ = target.kill();
    let _ = target.wait();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}{}", String::from_utf8_lossy(&run.stderr));
    assert_eq!(stdout.lines().filter(|l| l.starts_with("4096 bytes moved over shm")).count(), 2, "{stdout}");
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn the_sample_output_has_the_shape_of_what_the_bench_prints() {
    let text = readme();
    let opening = "```\n$ cargo run --release -- bench\n";
    let start = text.find(opening).expect("the README shows a bench run") + opening.len();
    let sample = &text[start..start + text[start..].find("\n```").expect("the block ends")];
    let sample_shapes: Vec<String> = sample.lines().map(shape).collect();
    let run = Command::new(env!("CARGO_BIN_EXE_kvring"))
        .args(["bench", "--total", "16MiB", "--region-size", "16MiB"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}{}", String::from_utf8_lossy(&run.stderr));
    let printed: Vec<String> = stdout.lines().filter(|l| !l.trim().is_empty()).map(shape).collect();
    assert_eq!(printed.len(), sample_shapes.len(), "printed:\n{stdout}\nsample:\n{sample}");
    for (printed, shown) in printed.iter().zip(&sample_shapes) {
        assert_eq!(printed, shown, "printed:\n{stdout}\nsample:\n{sample}");
    }
}

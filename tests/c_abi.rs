//! The C ABI from C: `tests/c/two_process.c` is compiled with the system C
//! compiler against `include/kvring.h`, linked to the cdylib this build
//! made, and run as two processes that move and verify blocks; the
//! initiator's log callback counts kvring's events.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};

fn compile() -> PathBuf {
    common::c::compile("two_process.c")
}

#[test]
fn a_c_program_moves_and_verifies_blocks_between_two_processes() {
    let program = compile();
    let mut target = Command::new(&program).arg("target").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(target.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let addr = first.split_whitespace().find_map(|f| f.strip_prefix("addr=")).expect("address line").to_string();

    // The initiator's log callback gets kvring's default (info and above).
    let output = Command::new(&program).args(["initiator", &addr]).env_remove("RUST_LOG").output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "initiator: {stdout}{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("read back equal, bad input refused"), "{stdout}");
    let logged = stdout.split(", ").find_map(|part| part.strip_suffix(" events logged\n")).expect("a count of events");
    assert!(logged.parse::<u32>().unwrap() >= 2, "{stdout}");

    // The target checks its own memory: the pushed pattern is there.
    let mut stdin = target.stdin.take().unwrap();
    writeln!(stdin, "check 7 {}", 16 * 64 * 1024).unwrap();
    assert_eq!(lines.next().unwrap().unwrap(), "ok");
    writeln!(stdin, "check 8 4096").unwrap();
    assert!(lines.next().unwrap().unwrap().starts_with("mismatch"), "a wrong seed is caught");
    drop(stdin);
    assert!(target.wait().unwrap().success());
    let _ = std::fs::remove_file(program);
}

#[test]
fn the_checked_in_header_declares_every_exported_function() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // Every file of the C ABI: src/ffi.rs and its submodules.
    let mut source = std::fs::read_to_string(root.join("src/ffi.rs")).unwrap();
    for entry in std::fs::read_dir(root.join("src/ffi")).unwrap() {
        source.push_str(&std::fs::read_to_string(entry.unwrap().path()).unwrap());
    }
    let header = std::fs::read_to_string(root.join("include/kvring.h")).unwrap();
    let exported: Vec<&str> = source
        .lines()
        .filter_map(|line| line.trim().split("extern \"C\" fn ").nth(1))
        .filter_map(|rest| rest.split('(').next())
        .collect();
    assert!(exported.len() >= 15, "{exported:?}");
    for name in exported {
        assert!(
            header.contains(&format!("{name}(")),
            "{name} is missing from include/kvring.h: regenerate it with cbindgen"
        );
    }
}

#[test]
fn a_c_program_sets_every_key_by_name_and_bad_ones_are_refused() {
    let program = common::c::compile("config.c");
    let output = Command::new(&program).env_remove("KVRING_NAME").output().unwrap();
    let _ = std::fs::remove_file(&program);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(stdout.trim(), "config ok");
}

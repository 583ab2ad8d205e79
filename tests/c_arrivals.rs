//! Arrival tags from C: `tests/c/arrivals.c` is compiled with the system C
//! compiler against `include/kvring.h`, linked to the cdylib this build
//! made, and run: a tagged layer push, a wait for its bytes with a
//! deadline, another engine's bytes not counted for the granted sender,
//! and bad input refused with its code.

mod common;

use std::process::Command;

#[test]
fn a_c_program_pushes_a_tagged_layer_and_waits_for_it_to_land() {
    let out = common::c::compile("arrivals.c");
    let output = Command::new(&out).output().unwrap();
    let _ = std::fs::remove_file(&out);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(stdout.trim(), "arrivals ok");
}

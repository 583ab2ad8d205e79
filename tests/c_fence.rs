//! Fenced destinations from C: `tests/c/fence.c` is compiled with the
//! system C compiler against `include/kvring.h`, linked to the cdylib this
//! build made, and run: a range fenced and granted, a push under the grant,
//! the range fenced again, a stale push refused `-FENCED` with nothing
//! landed, the new grant landing, and bad input refused with its code.

mod common;

use std::process::Command;

#[test]
fn a_c_program_fences_a_range_and_a_stale_push_is_refused() {
    let out = common::c::compile("fence.c");
    let output = Command::new(&out).output().unwrap();
    let _ = std::fs::remove_file(&out);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(stdout.trim(), "fence ok");
}

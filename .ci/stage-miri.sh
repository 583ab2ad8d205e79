#!/usr/bin/env bash
# Miri over kvring's pure-Rust parts: the rings, the status table, arrivals,
# the registry, descriptor and frame decoding, the notification queue.
# Tests that make syscalls Miri cannot run are left out where they are
# written, each with `#[cfg_attr(miri, ignore = "why")]`.
# Fails loudly when Miri cannot be installed: a stage that silently passed
# without running would prove nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

run() {
    echo "+ $*" >&2
    "$@"
}

if ! run rustup component add --toolchain nightly miri rust-src; then
    echo "stage-miri: FAILED: could not install Miri (rustup component add --toolchain nightly miri rust-src)" >&2
    exit 1
fi
run cargo +nightly miri --version

# Strict provenance: every pointer in these modules comes from a real
# allocation, never from an integer.
# Isolation off: a few of these tests read /proc (the host id) and make
# shared memory, which isolated Miri refuses.
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-strict-provenance -Zmiri-disable-isolation}"
echo "MIRIFLAGS=$MIRIFLAGS" >&2
run cargo +nightly miri test --lib -- \
    ring:: \
    runtime::status:: \
    arrival:: \
    mem::registry:: \
    segment::descriptor:: \
    transport::tcp::frame:: \
    control::frame:: \
    notify:: \
    desc::
echo "stage-miri: passed" >&2

#!/usr/bin/env bash
# The real verbs provider (IbVerbs, libibverbs loaded at run time) against
# the fake libibverbs of tests/fakes/ibverbs: checks kvring's verbs.h
# declarations against the installed headers, builds the fake as
# libibverbs.so.1, then runs the RDMA tests with it on LD_LIBRARY_PATH, the
# same run-time loading production uses. Also checks that the kvring
# binary links no libibverbs and refuses --transport rdma in one line
# without it.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
step() { printf '\n== %s\n' "$*"; }

if [ ! -e /usr/include/infiniband/verbs.h ] || ! command -v cc >/dev/null 2>&1; then
    step "installing libibverbs-dev and a C compiler (for the layout check only)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs-dev gcc libc6-dev
fi

step "verbs.h layout: tests/fakes/ibverbs/layout.c against layout.expected (the Rust side checks the same file)"
if [ "$(uname -m)" = x86_64 ]; then
    out="$(mktemp -d)"
    cc -o "$out/layout" tests/fakes/ibverbs/layout.c
    "$out/layout" | diff -u tests/fakes/ibverbs/layout.expected -
    rm -rf "$out"
else
    echo "layout.expected is for x86_64; skipped on $(uname -m)"
fi

step "build the fake libibverbs (tests/fakes/ibverbs) as libibverbs.so.1"
fake_target="$PWD/target/fakeverbs"
(cd tests/fakes/ibverbs && CARGO_TARGET_DIR="$fake_target" cargo build --release)
mkdir -p "$fake_target/lib"
cp "$fake_target/release/libibverbs.so" "$fake_target/lib/libibverbs.so.1"

step "kvring links no libibverbs"
cargo build --release --bin kvring
if ldd target/release/kvring | grep -i ibverbs; then
    echo "target/release/kvring links libibverbs: it must be loaded at run time" >&2
    exit 1
fi

step "without the fake: --transport rdma is refused in one line"
set +e
refusal="$(env -u LD_LIBRARY_PATH target/release/kvring bench --transport rdma 2>&1)"
rc=$?
set -e
echo "$refusal"
if [ "$rc" = 0 ] || [ "$(printf '%s\n' "$refusal" | wc -l)" != 1 ]; then
    echo "expected one line and a failure" >&2
    exit 1
fi

export LD_LIBRARY_PATH="$fake_target/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FAKE_IBVERBS_FABRIC="ci-$$"
export FAKE_IBVERBS_QUIET=1
export FAKE_IBVERBS_REQUIRED=1
export FAKE_IBVERBS_DEVICES="fakeroce0:eth:4096:active,fakeroce1:eth:1024:active,fakeib0:ib:4096:active,fakedown0:eth:4096:down"
trap 'rm -f /dev/shm/kvring-fakeverbs-$(id -u)-$FAKE_IBVERBS_FABRIC' EXIT

step "the real provider over the fake: tests/rdma_ibverbs*.rs, kvring info on a sysfs tree, and the provider's unit tests"
cargo test --test rdma_ibverbs --test rdma_ibverbs_faults --test rdma_ibverbs_port --test rdma_ibverbs_gid
cargo test --lib transport::rdma

step "the simulated provider's engine suite (tests/rdma.rs) again on the real provider over the fake (skips print their reason)"
RDMA_TEST_PROVIDER=ibverbs cargo test --test rdma -- --nocapture 2>&1 | tee /tmp/kvring-fakeverbs-rdma.txt
grep -E '^test result: ok\. 8 passed' /tmp/kvring-fakeverbs-rdma.txt >/dev/null

step "a host without libibverbs (a private mount namespace hides it): info, bench over tcp, rdma refused"
env -u LD_LIBRARY_PATH cargo test --test rdma_hostless

step "kvring info and kvring bench --transport rdma through IbVerbs on the fake (two processes)"
FAKE_IBVERBS_DEVICES="fakeroce0:eth:4096:active" target/release/kvring info | grep '^rdma:.*fakeroce0.*active Ethernet'
FAKE_IBVERBS_DEVICES="fakeroce0:eth:4096:active" \
    target/release/kvring bench --transport rdma --total 8MiB --block-size 4KiB,64KiB,1MiB | tee /tmp/kvring-fakeverbs-bench.txt
if [ "$(grep -c ' verified' /tmp/kvring-fakeverbs-bench.txt)" != 6 ]; then
    echo "expected 6 verified cases (write and read at 3 sizes)" >&2
    exit 1
fi
echo "stage-fakeverbs: ok"

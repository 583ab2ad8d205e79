#!/usr/bin/env bash
# End-to-end checksums over rdma (tests/rdma_checksum.rs) on the real verbs
# provider (IbVerbs) against the fake libibverbs of tests/fakes/ibverbs, as
# .ci/stage-fakeverbs.sh runs the other RDMA suites; the simulator's run of
# the same file is part of the main test run. Then `kvring bench --checksum`
# over rdma through the fake, a smoke check that every case is verified.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
step() { printf '\n== %s\n' "$*"; }

step "build the fake libibverbs (tests/fakes/ibverbs) as libibverbs.so.1"
fake_target="$PWD/target/fakeverbs"
(cd tests/fakes/ibverbs && CARGO_TARGET_DIR="$fake_target" cargo build --release)
mkdir -p "$fake_target/lib"
cp "$fake_target/release/libibverbs.so" "$fake_target/lib/libibverbs.so.1"

step "build the fake libcuda (tests/fakes/cuda) as libcuda.so.1 (the GPU refusal runs on the CUDA provider)"
bash .ci/build-fakecuda.sh

export LD_LIBRARY_PATH="$fake_target/lib:$PWD/target/fakecuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FAKECUDA_REQUIRED=1
export FAKE_IBVERBS_FABRIC="rdma-checksum-$$"
export FAKE_IBVERBS_QUIET=1
export FAKE_IBVERBS_REQUIRED=1
export FAKE_IBVERBS_DEVICES="fakeroce0:eth:4096:active"
trap 'rm -f /dev/shm/kvring-fakeverbs-$(id -u)-$FAKE_IBVERBS_FABRIC' EXIT

step "tests/rdma_checksum.rs on IbVerbs over the fake"
RDMA_TEST_PROVIDER=ibverbs cargo test --test rdma_checksum -- --nocapture 2>&1 | tee /tmp/kvring-rdma-checksum.txt
grep -E '^test result: ok\. 5 passed' /tmp/kvring-rdma-checksum.txt >/dev/null
if grep -q '^skipped' /tmp/kvring-rdma-checksum.txt; then
    echo "a test of tests/rdma_checksum.rs skipped on the fakes" >&2
    exit 1
fi

step "kvring bench --checksum --transport rdma through IbVerbs on the fake"
cargo build --release --bin kvring
target/release/kvring bench --checksum --transport rdma --op both --block-size 64KiB,1MiB --total 64MiB \
    --json | tee /tmp/kvring-rdma-checksum-bench.json
if [ "$(grep -c '"verified": *true' /tmp/kvring-rdma-checksum-bench.json)" != 4 ]; then
    echo "expected 4 verified cases (write and read at 2 sizes)" >&2
    exit 1
fi
echo "stage-rdma-checksum: ok"

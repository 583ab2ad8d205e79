#!/usr/bin/env bash
# Fenced destinations over rdma (tests/fence_rdma.rs) on the real verbs
# provider (IbVerbs) against the fake libibverbs of tests/fakes/ibverbs,
# as .ci/stage-fakeverbs.sh runs the other RDMA suites; the simulator's run
# of the same file is part of the main test run.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
step() { printf '\n== %s\n' "$*"; }

step "build the fake libibverbs (tests/fakes/ibverbs) as libibverbs.so.1"
fake_target="$PWD/target/fakeverbs"
(cd tests/fakes/ibverbs && CARGO_TARGET_DIR="$fake_target" cargo build --release)
mkdir -p "$fake_target/lib"
cp "$fake_target/release/libibverbs.so" "$fake_target/lib/libibverbs.so.1"

export LD_LIBRARY_PATH="$fake_target/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FAKE_IBVERBS_FABRIC="fence-$$"
export FAKE_IBVERBS_QUIET=1
export FAKE_IBVERBS_REQUIRED=1
export FAKE_IBVERBS_DEVICES="fakeroce0:eth:4096:active"
# The fake's late landings (tests/fakes/ibverbs/src/delay.rs): the tests
# create and remove this file to delay their WRITEs' placement.
export FAKE_IBVERBS_DELAY_FILE="${TMPDIR:-/tmp}/kvring-fake-delay-$$"
trap 'rm -f /dev/shm/kvring-fakeverbs-$(id -u)-$FAKE_IBVERBS_FABRIC "$FAKE_IBVERBS_DELAY_FILE"' EXIT

step "tests/fence_rdma.rs on IbVerbs over the fake (stalls and late landings by FAKE_IBVERBS_DELAY_FILE)"
RDMA_TEST_PROVIDER=ibverbs cargo test --test fence_rdma -- --nocapture 2>&1 | tee /tmp/kvring-fence-rdma.txt
grep -E '^test result: ok\. 10 passed' /tmp/kvring-fence-rdma.txt >/dev/null

step "tests/rdma_fake_delay.rs: the fake's late landings keep its documented rules"
cargo test --test rdma_fake_delay

step "tests/review8_rdma_fence.rs (the hostile review's probes) on IbVerbs over the fake"
RDMA_TEST_PROVIDER=ibverbs cargo test --features testing --test review8_rdma_fence
echo "stage-fence-rdma: ok"

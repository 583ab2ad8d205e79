#!/usr/bin/env bash
# GPU memory over RDMA on the real providers: the real verbs provider
# (IbVerbs) over the fake libibverbs of tests/fakes/ibverbs and the CUDA
# provider over the fake libcuda of tests/fakes/cuda, both loaded at run
# time through LD_LIBRARY_PATH as production loads the real libraries.
# Device memory is registered with the NIC through the dma-buf the fake
# libcuda exports (cuMemGetHandleForAddressRange), whose pages the fake
# libibverbs maps (ibv_reg_dmabuf_mr): all the two fakes share.
# Runs tests/rdma_gpu.rs with RDMA_TEST_PROVIDER=ibverbs (what only the
# simulator can do is skipped with the reason printed) and the fakes'
# dma-buf rules (tests/rdma_fake_dmabuf.rs). Exits non-zero on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
step() { printf '\n== %s\n' "$*"; }
run() {
    echo "+ $*"
    "$@"
}

step "build the fake libibverbs (tests/fakes/ibverbs) as libibverbs.so.1"
verbs_target="$PWD/target/fakeverbs"
(cd tests/fakes/ibverbs && CARGO_TARGET_DIR="$verbs_target" run cargo build --release)
mkdir -p "$verbs_target/lib"
cp "$verbs_target/release/libibverbs.so" "$verbs_target/lib/libibverbs.so.1"

step "build the fake libcuda (tests/fakes/cuda) as libcuda.so.1"
bash .ci/build-fakecuda.sh

export LD_LIBRARY_PATH="$verbs_target/lib:$PWD/target/fakecuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FAKE_IBVERBS_FABRIC="gpu-ci-$$"
export FAKE_IBVERBS_QUIET=1
export FAKE_IBVERBS_REQUIRED=1
export FAKECUDA_REQUIRED=1
export FAKE_IBVERBS_DEVICES="fakeroce0:eth:4096:active,fakeroce1:eth:4096:active,fakenosrq0:eth:4096:active:nosrq"
trap 'rm -f /dev/shm/kvring-fakeverbs-$(id -u)-$FAKE_IBVERBS_FABRIC' EXIT

step "the fakes' dma-buf rules (tests/rdma_fake_dmabuf.rs)"
run cargo test --test rdma_fake_dmabuf

step "tests/rdma_gpu.rs on IbVerbs + CudaGpu over the fakes (skips print their reason)"
log="$(mktemp)"
echo "+ RDMA_TEST_PROVIDER=ibverbs cargo test --test rdma_gpu -- --nocapture"
RDMA_TEST_PROVIDER=ibverbs cargo test --test rdma_gpu -- --nocapture 2>&1 | tee "$log"
expected="$(grep -c '#\[test\]' tests/rdma_gpu.rs)"
if ! grep -E "^test result: ok\. $expected passed" "$log" >/dev/null; then
    echo "expected every one of the $expected tests of tests/rdma_gpu.rs to pass" >&2
    exit 1
fi
echo "skipped parts on the real providers: $(grep -c '^skipped on the real provider' "$log" || true)"
rm -f "$log"
echo "stage-fakerdmagpu: ok"

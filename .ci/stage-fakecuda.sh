#!/usr/bin/env bash
# The CUDA provider on the fake CUDA driver (tests/fakes/cuda): builds the
# fake as libcuda.so (and libcuda.so.1) in target/fakecuda, then runs the
# GPU suites with TEST_GPU_PROVIDER=cuda and that directory first on
# LD_LIBRARY_PATH, so kvring loads it through cudarc's production path, and
# the GPU check script on it. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

run() {
    echo "+ $*"
    "$@"
}

lib=target/fakecuda
bash .ci/build-fakecuda.sh "$lib"
# A second build lacking cuGetProcAddress_v2 (a symbol kvring resolves):
# missing symbols must be errors, and a libcuda.so that is not libcuda.so.1
# refused.
bash .ci/build-fakecuda.sh target/fakecuda-noproc --features no-proc-address
export FAKECUDA_NOPROC_DIR="$PWD/target/fakecuda-noproc"
export LD_LIBRARY_PATH="$PWD/$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FAKECUDA_REQUIRED=1

# tests/gpu.rs on the CUDA provider (the main run covers the simulated one);
# the fake's own findings; the lib's GPU tests.
run env TEST_GPU_PROVIDER=cuda cargo test --test gpu
run cargo test --test gpu_fake
# Hostile review 8: a FABRIC-handle exporter's bad bytes on the CUDA provider
# (this process on IMEX channel 3, so it can make FABRIC-only memory).
run env FAKECUDA_IMEX_CHANNEL=3 cargo test --test review8_fabric
run env TEST_GPU_PROVIDER=cuda cargo test --lib gpu
# Fenced destinations in GPU memory on the driver: cuda_ipc in one process
# and across processes (the table page crossing the GPU descriptor socket),
# staged tcp, a scribbled table (the main run covers the simulated GPU).
run env TEST_GPU_PROVIDER=cuda cargo test --test fence_gpu
# GPU memory over staged tcp on the driver (the main run covers the
# simulated one): counters, a refused copy call and a slow copy engine
# through the fake's controls, in a child process per test.
run env TEST_GPU_PROVIDER=cuda cargo test --test gpu_tcp

# The whole GPU check on the fake: exits 0 with the batched method taken.
run bash benches/gpu_check.sh --fake

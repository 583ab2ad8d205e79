#!/usr/bin/env bash
# Fenced destinations in GPU memory (tests/fence_gpu.rs) on the CUDA
# provider over the fake CUDA driver (tests/fakes/cuda), as
# .ci/stage-fakecuda.sh builds it: cuda_ipc in one process and across
# processes (the table page crossing the GPU descriptor socket), staged tcp,
# a scribbled table. The main test run covers the same file on the
# simulated GPU. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

run() {
    echo "+ $*"
    "$@"
}

lib=target/fakecuda
run cargo build --release --manifest-path tests/fakes/cuda/Cargo.toml --target-dir target/fakecuda-build
mkdir -p "$lib"
cp target/fakecuda-build/release/libcuda.so "$lib/libcuda.so"
ln -sf libcuda.so "$lib/libcuda.so.1"
export LD_LIBRARY_PATH="$PWD/$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FAKECUDA_REQUIRED=1
run env TEST_GPU_PROVIDER=cuda cargo test --test fence_gpu

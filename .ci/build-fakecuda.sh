#!/usr/bin/env bash
# Builds the fake CUDA driver (tests/fakes/cuda) as DIR/libcuda.so, linked
# as DIR/libcuda.so.1: what every stage that runs kvring's CUDA provider on
# the fake puts first on LD_LIBRARY_PATH. DIR defaults to target/fakecuda;
# further arguments go to `cargo build` (e.g. `--features no-proc-address`),
# built in DIR-build so two variants do not overwrite each other.
#
#   bash .ci/build-fakecuda.sh                      # target/fakecuda
#   bash .ci/build-fakecuda.sh target/fakecuda-noproc --features no-proc-address
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-target/fakecuda}
[ $# -gt 0 ] && shift
echo "+ cargo build --release --manifest-path tests/fakes/cuda/Cargo.toml --target-dir $dir-build $*"
cargo build --release --manifest-path tests/fakes/cuda/Cargo.toml --target-dir "$dir-build" "$@"
mkdir -p "$dir"
cp "$dir-build/release/libcuda.so" "$dir/libcuda.so"
ln -sf libcuda.so "$dir/libcuda.so.1"

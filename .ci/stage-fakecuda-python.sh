#!/usr/bin/env bash
# The Python GPU suite (tests/python/test_gpu.py) on the CUDA provider over
# the fake CUDA driver (tests/fakes/cuda, docs/FAKECUDA.md; issue 28): the
# main Python run covers kvring's simulated GPU. With TEST_GPU_PROVIDER=cuda
# the suite's engines and peers use gpu="cuda", and the device memory they
# register is allocated through libcuda with ctypes as a PyTorch application
# holds it (conftest.py's device_buffer), from the same libcuda.so.1 kvring
# loads: the fake, first on LD_LIBRARY_PATH.
#
# Uses target/pyenv when present (.ci/test builds it), else makes it;
# installs kvring from CI_WHEEL_KVRING (.ci/test's wheel) or this checkout.
# Fails on any failure or skip.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=.ci/venv.sh
source .ci/venv.sh

run() {
    echo "+ $*"
    "$@"
}

lib=target/fakecuda
bash .ci/build-fakecuda.sh "$lib"

venv=target/pyenv
if [ ! -x "$venv/bin/python" ]; then
    echo "+ make_venv $venv"
    make_venv "$venv"
fi
run "$venv/bin/pip" install -q pytest numpy
run "$venv/bin/pip" install -q --no-deps --force-reinstall "${CI_WHEEL_KVRING:-.}"

log=$(mktemp)
trap 'rm -f "$log"' EXIT
echo "+ (cd tests/python && TEST_GPU_PROVIDER=cuda LD_LIBRARY_PATH=$lib python -m pytest -q -rs test_gpu.py)"
(cd tests/python && TEST_GPU_PROVIDER=cuda LD_LIBRARY_PATH="$PWD/../../$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "../../$venv/bin/python" -m pytest -q -rs -p no:cacheprovider test_gpu.py) 2>&1 | tee "$log"
if grep -q "skipped" "$log"; then
    echo "stage-fakecuda-python: a test skipped on the CUDA provider" >&2
    exit 1
fi

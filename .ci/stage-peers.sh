#!/usr/bin/env bash
# Peers' own tests as referees of kvring's drop-ins: NIXL's Python tests
# (tests/peers/nixl/upstream, unchanged) run on NIXL 1.5.1 itself and on
# kvring.nixl in the same Python; the stage fails if kvring.nixl fails any
# test NIXL passes here, or passes fewer (tests/peers/nixl/run.py).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=.ci/venv.sh
source .ci/venv.sh
step() { printf '\n=== %s\n' "$*"; }

venv=${KVRING_PYENV:-target/pyenv}
step "python venv $venv with kvring built (pip install .[test])"
make_venv "$venv"
# Always from this tree: the Python layer under test is what pip copies
# (maturin's cargo build in target/ is incremental after .ci/test's).
echo "+ $venv/bin/pip install -q .[test]"
if [ -n "${CI_WHEEL_KVRING:-}" ]; then
    "$venv/bin/pip" install -q --no-deps --force-reinstall "$CI_WHEEL_KVRING"
else
    "$venv/bin/pip" install -q ".[test]"
fi

# NIXL itself (its _api needs numpy; --no-deps keeps its pins out, as
# .ci/test does), pytest-timeout (NIXL's tests mark per-test limits), and
# torch (NIXL's test_nixl_api imports it; the registry's build runs on CPU).
step "NIXL 1.5.1, torch and pytest-timeout"
echo "+ $venv/bin/pip install -q --no-deps nixl-cu13==1.5.1 nixl==1.5.1"
"$venv/bin/pip" install -q --no-deps nixl-cu13==1.5.1 nixl==1.5.1
echo "+ $venv/bin/pip install -q torch pytest-timeout"
"$venv/bin/pip" install -q torch pytest-timeout

step "NIXL's own Python tests on NIXL 1.5.1 and on kvring.nixl"
echo "+ $venv/bin/python tests/peers/nixl/run.py"
"$venv/bin/python" tests/peers/nixl/run.py

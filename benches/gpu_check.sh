#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the GPU tests on the CUDA driver, then
# the GPU bench's figures against issue 15's targets (one host, cuda_ipc)
# and issue 18's (staged tcp, device to device against host-memory tcp of
# the same blocks), as one table, then the GPU review's nine-step
# first-run checklist (benches/gpu_checklist.py: torch tensors, two
# processes, failure paths), where torch with CUDA is installed.
#
#   bash benches/gpu_check.sh            # builds with cargo, then runs
#   KVRING_BIN=path/kvring KVRING_GPU_TEST_BIN=path/gpu-<hash> bash benches/gpu_check.sh
#                                        # prebuilt binaries (no Rust on the GPU machine)
#
# The prebuilt test binary is the one `cargo test --release --test gpu
# --no-run` names; both load libcuda at run time, so a build from a machine
# without CUDA runs here. Exit status: 0 when every test passed and every
# target was met. GPU_CHECK_SIM=1 runs the whole script on the
# simulated GPU with small totals (a dry run of the script itself; its
# figures mean nothing for the targets).
#
#   bash benches/gpu_check.sh --fake     # the CUDA provider on the fake CUDA
#                                        # driver (tests/fakes/cuda), small totals
#
# --fake builds the fake driver, puts it first on LD_LIBRARY_PATH and runs
# everything on the CUDA provider through it: the whole check on a machine
# with no GPU. Its figures mean nothing (host memcpy behind a fake) and are
# labelled so; it exits 0 when every test passed, every case verified and
# the batched copy method was taken.
set -uo pipefail
cd "$(dirname "$0")/.."

fake=0
if [ "${1:-}" = "--fake" ]; then
    fake=1
    bash .ci/build-fakecuda.sh || exit 1
    export LD_LIBRARY_PATH="$PWD/target/fakecuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export FAKECUDA_REQUIRED=1
fi

kvring="${KVRING_BIN:-}"
tests="${KVRING_GPU_TEST_BIN:-}"
# kvring reads every KVRING_* variable as a setting and refuses unknown
# ones: these two are this script's, not kvring's.
unset KVRING_BIN KVRING_GPU_TEST_BIN
# The fake's figures mean nothing, so --fake builds the (faster) dev profile.
profile=(--release) dir=release
if [ "$fake" = 1 ]; then
    profile=() dir=debug
fi
if [ -z "$kvring" ] || [ -z "$tests" ]; then
    cargo build "${profile[@]}" --bin kvring || exit 1
    kvring=target/$dir/kvring
    tests=$(cargo test "${profile[@]}" --test gpu --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "gpu" and m.get("executable"):
        print(m["executable"])')
fi

echo "== this machine"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
"$kvring" info | grep -A8 -i '^gpus' || true

provider=cuda small=4GiB large=8GiB
if [ "${GPU_CHECK_SIM:-0}" = 1 ]; then
    provider=sim small=64MiB large=64MiB
fi
if [ "$fake" = 1 ]; then
    small=16MiB large=32MiB
    echo "== the FAKE CUDA driver (tests/fakes/cuda): every figure below is meaningless"
fi

failed=0
echo
echo "== tests/gpu.rs on the $provider provider (TEST_GPU_PROVIDER=$provider)"
if ! TEST_GPU_PROVIDER=$provider "$tests" --test-threads=1; then
    failed=1
fi

echo
echo "== bench (same-run baselines on the same GPU)"
out=$(mktemp)
run() { "$kvring" bench --json --gpu "$provider" --latency-samples 5000 "$@" | tee -a "$out"; }
run --memory gpu --block-size 4KiB --batch 4096 --total "$small" || failed=1
run --memory gpu --block-size 64KiB,1MiB --batch 64 --total "$large" || failed=1
run --memory gpu,host --block-size 64KiB,1MiB --batch 64 --total "$large" || failed=1
run --memory gpu --transport tcp --block-size 4KiB,64KiB,1MiB --batch 64 --total "$small" || failed=1

echo
FAKE="$fake" python3 - "$out" <<'EOF' || failed=1
import json, os, sys
cases = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
def find(memory, op, block, batch=None, transport="cuda_ipc"):
    for c in cases:
        if (c["memory"] == memory and c["op"] == op and c["block_bytes"] == block and batch in (None, c["batch"])
                and c["transport"] == transport):
            return c
    return None
rows, ok = [], True
def target(name, value, want, better):
    global ok
    met = value is not None and (value >= want if better == "min" else value <= want)
    ok &= met
    shown = "missing" if value is None else f"{value:.2f}"
    rows.append(f"{'met ' if met else 'MISS'}  {name:64} {shown:>10}  (target {'>=' if better == 'min' else '<='} {want})")
d2d = ["gpu:0", "gpu:0"]
for op in ["write", "read"]:
    c = find(d2d, op, 4096, 4096)
    target(f"{op} 4KiB x4096 D2D: x the one-call-per-block baseline", c and c["ratio_per_call"], 100, "min")
    target(f"{op} 4KiB x4096 D2D: share of one large copy", c and c["ratio_one_copy"], 0.30, "min")
    target(f"{op} 4KiB single-block round trip p50 (us)", c and c["p50_us"], 15, "max")
    for block in [65536, 1 << 20]:
        c = find(d2d, op, block)
        target(f"{op} {block >> 10}KiB D2D: share of one large copy", c and c["ratio_one_copy"], 0.80, "min")
        c = find(["gpu:0", "host"], op, block)
        target(f"{op} {block >> 10}KiB GPU<->host shm: share of the pinned copy", c and c["ratio_one_copy"], 0.80, "min")
    for block in [4096, 65536, 1 << 20]:
        c = find(d2d, op, block, 64, "tcp")
        target(f"{op} {block >> 10}KiB x64 D2D staged tcp: share of host-memory tcp", c and c["ratio_host_tcp"], 0.80, "min")
bad = [c for c in cases if not c["verified"]]
print("== targets (issues 15 and 18)")
print("\n".join(rows))
taken = {m: sum(c.get("chunks", {}).get(m, 0) for c in cases) for m in ["batched", "kernel", "per_copy"]}
methods = sorted({c["copy_method"] for c in cases if "copy_method" in c})
print(f"{len(cases)} cases, {len(bad)} not verified; driver's best method: {methods}; "
      f"chunks taken: {taken}")
if os.environ.get("FAKE") == "1":
    # The fake's figures are host memcpy: the targets cannot be met or
    # missed there. What must hold: every case verified, batched taken.
    print("(fake driver: the targets above are MEANINGLESS; checked: every case verified, batched copies taken)")
    sys.exit(0 if not bad and taken["batched"] > 0 and "batched" in methods else 1)
sys.exit(0 if ok and not bad else 1)
EOF
rm -f "$out"

if [ "$fake" = 0 ] && [ "${GPU_CHECK_SIM:-0}" != 1 ]; then
    echo
    echo "== the GPU review's first-run checklist (benches/gpu_checklist.py)"
    if python3 -c 'import torch, kvring; assert torch.cuda.is_available()' 2>/dev/null; then
        GPU_CHECK_KVRING="$kvring" python3 benches/gpu_checklist.py || failed=1
    else
        echo "NOT RUN: it needs torch with CUDA and kvring's module (pip install .)"
    fi
fi
exit "$failed"

#!/usr/bin/env bash
# On a host with an RDMA NIC: what kvring sees (devices, ports, link layers,
# GIDs, limits), the real provider's tests on the NIC, a two-process
# transfer through `kvring bench --transport rdma` (every case verified),
# GPU memory over RDMA where a GPU is present, and perftest's ib_write_bw
# in the same run as the baseline where perftest is installed.
#
#   bash benches/rdma_check.sh                 # every active device
#   RDMA_DEVICE=mlx5_0 bash benches/rdma_check.sh
#   KVRING_BIN=path/kvring bash benches/rdma_check.sh   # prebuilt binary
#
# kvring loads libibverbs at run time, so a binary built on a machine
# without rdma-core runs here. Exit status: 0 when every step passed.
# RDMA_CHECK_FAKE=1 runs the script on the fake libibverbs of
# tests/fakes/ibverbs (a dry run of the script: its figures mean nothing).
set -uo pipefail
cd "$(dirname "$0")/.."

kvring="${KVRING_BIN:-}"
device="${RDMA_DEVICE:-}"
# kvring reads every KVRING_* variable as a setting and refuses unknown
# ones: this one is the script's.
unset KVRING_BIN
failed=0
step() { printf '\n== %s\n' "$*"; }
fail() { echo "FAILED: $*" >&2; failed=1; }

if [ "${RDMA_CHECK_FAKE:-0}" = 1 ]; then
    step "dry run on the fake libibverbs"
    (cd tests/fakes/ibverbs && CARGO_TARGET_DIR="$PWD/../../../target/fakeverbs" cargo build --release) || exit 1
    mkdir -p target/fakeverbs/lib && cp target/fakeverbs/release/libibverbs.so target/fakeverbs/lib/libibverbs.so.1
    export LD_LIBRARY_PATH="$PWD/target/fakeverbs/lib" FAKE_IBVERBS_QUIET=1 FAKE_IBVERBS_FABRIC="check-$$"
fi
if [ -z "$kvring" ]; then
    cargo build --release --bin kvring || exit 1
    kvring=target/release/kvring
fi
# Both the bench and the `kvring serve` it starts read the setting.
[ -n "$device" ] && export KVRING_RDMA_DEVICES="$device"

step "the fabric as verbs report it"
if command -v ibv_devinfo >/dev/null 2>&1; then
    ibv_devinfo -v | grep -E 'hca_id|state|link_layer|active_mtu|max_qp_rd_atom|max_qp_init_rd_atom|max_qp_wr|max_cqe|max_srq_wr|GID\[' || true
else
    echo "(no ibv_devinfo: apt-get install ibverbs-utils)"
fi
echo "ulimit -l: $(ulimit -l)  kernel: $(uname -r)"
"$kvring" info | grep '^rdma:' || fail "kvring info has no rdma line"
"$kvring" info | grep -q '^rdma:.*active' || fail "kvring sees no device with an active port"

step "the real provider's tests (IbVerbs on this host's libibverbs)"
if [ "${RDMA_CHECK_FAKE:-0}" = 1 ]; then
    FAKE_IBVERBS_REQUIRED=1 \
    FAKE_IBVERBS_DEVICES="fakeroce0:eth:4096:active,fakeroce1:eth:1024:active,fakeib0:ib:4096:active,fakedown0:eth:4096:down" \
        cargo test --release --test rdma_ibverbs || fail "rdma_ibverbs tests"
else
    echo "(tests/rdma_ibverbs.rs names the fake's devices; the engine suite below and the bench are the NIC check)"
fi

step "the engine suite (tests/rdma.rs) on this host's NICs"
if [ "${RDMA_CHECK_FAKE:-0}" = 1 ]; then
    names="fakeroce0,fakeroce1"
    export FAKE_IBVERBS_DEVICES="fakeroce0:eth:4096:active,fakeroce1:eth:4096:active"
else
    names="${device:-$("$kvring" info | grep '^rdma:' | grep -oE '[A-Za-z0-9_]+ \(numa [^;]*; port [0-9]+ active' |
        cut -d' ' -f1 | paste -sd, -)}"
fi
echo "devices: $names"
RDMA_TEST_PROVIDER=ibverbs RDMA_TEST_DEVICES="$names" cargo test --release --test rdma -- --nocapture ||
    fail "tests/rdma.rs on the real provider"

step "two processes: kvring bench --transport rdma (host memory)"
out="$(mktemp)"
"$kvring" bench --transport rdma --block-size 4KiB,64KiB,1MiB --total 256MiB | tee "$out" || fail "bench"
verified=$(grep -c ' verified' "$out")
[ "$verified" = 6 ] || fail "expected 6 verified cases, got $verified"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    step "GPU memory over RDMA (GPUDirect: dma-buf or peer memory)"
    "$kvring" bench --transport rdma --memory gpu,gpu --block-size 64KiB,1MiB --total 256MiB |
        tee "$out" || fail "GPU bench"
else
    echo "(no GPU: GPUDirect not checked)"
fi

if command -v ib_write_bw >/dev/null 2>&1 && [ "${RDMA_CHECK_FAKE:-0}" != 1 ]; then
    step "baseline in the same run: ib_write_bw 1 MiB on one host (loopback)"
    dev_flag=()
    [ -n "$device" ] && dev_flag=(-d "$device")
    ib_write_bw "${dev_flag[@]}" -s 1048576 -n 2000 -F >/dev/null 2>&1 &
    server=$!
    sleep 1
    ib_write_bw "${dev_flag[@]}" -s 1048576 -n 2000 -F localhost | tee "$out" || fail "ib_write_bw"
    wait "$server"
    echo "ratio: kvring's write 1MiB GB/s above against ib_write_bw's BW average (MB/s / 1000) just printed"
else
    echo "(no perftest: apt-get install perftest for the ib_write_bw baseline)"
fi
rm -f "$out"
exit "$failed"

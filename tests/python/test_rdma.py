"""RDMA from Python: ``kvring.Engine``'s rdma settings, Mooncake's
``device_name`` (kvring.mooncake) and ``UCX_NET_DEVICES`` (kvring.nixl)
naming the NICs, each used or refused by name, never replaced by another
NIC or by tcp (issue 32); and the module on a host without libibverbs.

The real verbs provider runs against the fake libibverbs
(tests/fakes/ibverbs, built here with cargo when it is not built yet), in
child processes whose LD_LIBRARY_PATH points at it: the same
``dlopen("libibverbs.so.1")`` production uses. The host without libibverbs
is a private mount namespace where every libibverbs.so.1 reads as empty
(root only, as CI runs)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvring.mooncake import _device_names
from kvring.nixl._bindings import ucx_rdma

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FAKE_LIB = os.path.join(ROOT, "target", "fakeverbs", "lib")


@pytest.fixture(scope="module")
def fake_verbs():
    """Environment for a child process on the fake libibverbs, two RoCE
    NICs, its own fabric file."""
    lib = os.path.join(FAKE_LIB, "libibverbs.so.1")
    if not os.path.exists(lib):
        target = os.path.join(ROOT, "target", "fakeverbs")
        subprocess.run(
            ["cargo", "build", "--release", "-q"],
            cwd=os.path.join(ROOT, "tests", "fakes", "ibverbs"),
            env={**os.environ, "CARGO_TARGET_DIR": target},
            check=True,
        )
        os.makedirs(FAKE_LIB, exist_ok=True)
        subprocess.run(["cp", os.path.join(target, "release", "libibverbs.so"), lib], check=True)
    fabric = f"pytest-{os.getpid()}"
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": FAKE_LIB,
        "FAKE_IBVERBS_FABRIC": fabric,
        "FAKE_IBVERBS_QUIET": "1",
        "FAKE_IBVERBS_DEVICES": "fakeroce0:eth:4096:active,fakeroce1:eth:1024:active",
    }
    env.pop("UCX_NET_DEVICES", None)
    yield env
    try:
        os.unlink(f"/dev/shm/kvring-fakeverbs-{os.getuid()}-{fabric}")
    except FileNotFoundError:
        pass


def child(code, env):
    """Runs ``code`` in a fresh interpreter with ``env``; its last stdout
    line, parsed as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_ucx_net_devices_name_the_rdma_nics_and_nothing_else():
    assert ucx_rdma("mlx5_0:1,mlx5_3:1") == {"rdma": "on", "rdma_devices": ["mlx5_0", "mlx5_3"]}
    assert ucx_rdma("mlx5_0:1,eth0") == {"rdma": "on", "rdma_devices": ["mlx5_0"]}
    assert ucx_rdma("eth0,eth1") == {"rdma": "off"}, "UCX's tcp only: no NIC by RDMA"
    assert ucx_rdma("all") == {} and ucx_rdma(" ") == {}


def test_mooncake_device_name_is_a_comma_separated_list_of_hcas():
    assert _device_names("mlx5_0,mlx5_1") == ["mlx5_0", "mlx5_1"]
    assert _device_names(" mlx5_2:1 , ") == ["mlx5_2"]
    assert _device_names("") == [] and _device_names(None) == []
    assert _device_names(["mlx5_0"]) is None


MOONCAKE = """
    import json, logging, numpy as np
    from kvring.mooncake import TransferEngine
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("kvring.mooncake").addHandler(handler)
    out = {}
    a, b = TransferEngine(), TransferEngine()
    out["init"] = [a.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "fakeroce0"),
                   b.initialize("127.0.0.1:0", "P2PHANDSHAKE", "rdma", "fakeroce0:1")]
    if out["init"] == [0, 0]:
        session = f"127.0.0.1:{b.get_rpc_port()}"
        local, remote = a.allocate_managed_buffer(1 << 20), b.allocate_managed_buffer(1 << 20)
        data = bytes(np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8))
        a.write_bytes_to_buffer(local, data, len(data))
        out["write"] = a.transfer_sync_write(session, local, remote, 1 << 20)
        out["same"] = b.read_bytes_from_buffer(remote, 1 << 20) == data
    records.clear()
    out["missing"] = TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_9")
    out["log"] = " ".join(records)
    print(json.dumps(out))
"""


def test_mooncake_rdma_moves_over_the_named_nic_and_refuses_one_that_does_not_exist(fake_verbs):
    out = child(MOONCAKE, fake_verbs)
    assert out["init"] == [0, 0], out
    assert out["write"] == 0 and out["same"], out
    assert out["missing"] < 0, "a NIC that does not exist is refused, not replaced"
    assert "mlx5_9" in out["log"] and "no such RDMA device" in out["log"], out["log"]


NIXL = """
    import json, os
    from kvring.nixl import nixl_agent
    out = {}
    os.environ["UCX_NET_DEVICES"] = "mlx5_9:1"
    try:
        nixl_agent("missing")
        out["missing"] = "made"
    except Exception as error:
        out["missing"] = str(error)
    os.environ["UCX_NET_DEVICES"] = "fakeroce1:1"
    agent = nixl_agent("named")
    out["named"] = agent.name if hasattr(agent, "name") else "made"
    print(json.dumps(out))
"""


def test_nixl_honours_ucx_net_devices_or_says_why_not(fake_verbs):
    out = child(NIXL, fake_verbs)
    assert "mlx5_9" in out["missing"] and "no such RDMA device" in out["missing"], out
    assert out["named"], out


HOSTLESS = """
    import json, numpy as np, kvring
    from kvring.mooncake import TransferEngine
    out = {"transports": kvring.transports()}
    with kvring.Engine() as a, kvring.Engine() as b:
        local = np.arange(1 << 16, dtype=np.uint8)
        remote = np.zeros(1 << 16, dtype=np.uint8)
        lr, rr = a.register(local), b.register(remote)
        out["via"] = a.open_segment(b.control_addr, "tcp")
        out["moved"] = a.write(b.control_addr, [(lr, 0, rr, 0, 1 << 16)])
        out["same"] = bool((local == remote).all())
    try:
        kvring.Engine(rdma="on")
        out["rdma"] = "made"
    except kvring.KvringError as error:
        out["rdma"] = str(error)
    out["mooncake"] = TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "")
    print(json.dumps(out))
"""

MASK = r"""set -e
for lib in $(ldconfig -p | awk '/libibverbs\.so\.1 /{print $NF}'); do
    mount --bind /dev/null "$(readlink -f "$lib")"
done
exec "$@"
"""


def test_the_module_imports_and_moves_over_tcp_on_a_host_without_libibverbs():
    if os.geteuid() != 0:
        pytest.skip("hiding libibverbs needs a mount namespace (root; CI runs as root)")
    env = {**os.environ, "LD_LIBRARY_PATH": "/nonexistent-kvring-libs"}
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", MASK, "sh", sys.executable, "-c", textwrap.dedent(HOSTLESS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["via"] == "tcp" and out["moved"] == 1 << 16 and out["same"], out
    assert "libibverbs" in out["rdma"] and "not found" in out["rdma"], out
    assert out["mooncake"] < 0, "protocol rdma is refused, not tcp in its place"

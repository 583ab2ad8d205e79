"""kvring.mooncake: an unmodified Mooncake-style script, and the int
convention for bad input."""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from kvring.mooncake import TransferEngine, TransferNotify, TransferOpcode

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_a_script_written_for_mooncake_runs_unmodified_across_two_processes(protocol):
    script = os.path.join(HERE, "mooncake_script.py")
    server = subprocess.Popen([sys.executable, script, "server", protocol], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        session_id, server_ptr = server.stdout.readline().split()
        client = subprocess.run(
            [sys.executable, script, "client", protocol, session_id, server_ptr], capture_output=True, text=True, timeout=120
        )
        assert client.returncode == 0, client.stderr
        sent_sum = int(client.stdout.split()[-1])
        server.stdin.write("done\n")
        server.stdin.flush()
        # Every byte the client wrote is in the server's buffer.
        assert int(server.stdout.readline()) == sent_sum
        server.stdin.write("exit\n")
        server.stdin.flush()
        assert server.wait(timeout=30) == 0
    finally:
        server.kill()


@pytest.fixture
def pair():
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1:0", "P2PHANDSHAKE", "tcp", "") == 0
    yield a, b
    a.close()
    b.close()


def test_notifications_travel_after_the_transfer(pair):
    a, b = pair
    remote = b.allocate_managed_buffer(4096)
    local = a.allocate_managed_buffer(4096)
    assert a.write_bytes_to_buffer(local, b"kv-ready", 8) == 0
    session = f"127.0.0.1:{b.get_rpc_port()}"
    assert a.transfer_sync(session, local, remote, 8, TransferOpcode.Write, TransferNotify("req-7", "done")) == 0
    assert b.read_bytes_from_buffer(remote, 8) == b"kv-ready"
    for _ in range(1000):
        got = b.get_notifies()
        if got:
            break
    assert [(n.name, n.msg) for n in got] == [("req-7", "done")]


def test_bad_input_is_a_negative_code_and_a_logged_reason(pair, caplog):
    a, b = pair
    session = f"127.0.0.1:{b.get_rpc_port()}"
    remote = b.allocate_managed_buffer(65536)
    local = a.allocate_managed_buffer(65536)
    caplog.set_level(logging.ERROR, logger="kvring.mooncake")

    # Unknown protocols, and rdma on a host with no RDMA device (or no
    # libibverbs), never fall back.
    for protocol, why in [("carrier-pigeon", "unknown protocol"), ("rdma", "rdma device")]:
        fresh = TransferEngine()
        assert fresh.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") < 0
        assert why in caplog.text
    assert TransferEngine().initialize("127.0.0.1", "redis://127.0.0.1:1", "tcp", "") < 0
    # A length past a registered region, on either side.
    assert a.transfer_sync_write(session, local, remote, 65537) < 0
    assert a.transfer_sync_write(session, local + 65000, remote, 4096) < 0
    # An unregistered address; an unknown segment.
    stray = np.zeros(4096, dtype=np.uint8)
    assert a.transfer_sync_write(session, stray.ctypes.data, remote, 4096) < 0
    assert a.transfer_sync_write("127.0.0.1:1", local, remote, 4096) < 0
    assert a.batch_transfer_async_write("127.0.0.1:1", [local], [remote], [16]) == 0
    # Mismatched batch lists.
    assert a.batch_transfer_sync_write(session, [local, local], [remote], [16]) < 0
    # A freed buffer.
    assert a.free_managed_buffer(local, 65536) == 0
    assert a.transfer_sync_write(session, local, remote, 4096) < 0
    assert a.free_managed_buffer(local, 65536) < 0
    assert a.read_bytes_from_buffer(local, 16) == b""
    # Unknown batch ids.
    assert a.transfer_check_status(12345) == -1
    assert a.get_batch_transfer_status([12345]) == -1
    assert "lies in no registered region" in caplog.text
    # A closed engine.
    a.close()
    assert a.allocate_managed_buffer(4096) == 0
    assert "shut down" in caplog.text


def test_a_forked_child_gets_negative_codes(pair):
    a, b = pair
    local = a.allocate_managed_buffer(4096)
    session = f"127.0.0.1:{b.get_rpc_port()}"
    pid = os.fork()
    if pid == 0:
        code = a.transfer_sync_write(session, local, b.get_first_buffer_address(session) or 1, 16)
        os._exit(0 if code < 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd(tmp_path):
    """A real etcd on free loopback ports (skipped where none is installed)."""
    import json
    import shutil
    import time
    import urllib.request

    if shutil.which("etcd") is None:
        pytest.skip("no etcd on PATH (apt-get install etcd-server; .ci/run does)")
    client, peer = _free_port(), _free_port()
    proc = subprocess.Popen(
        ["etcd", "--name", "py", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"py=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 20
    while True:
        try:
            body = json.dumps({"key": "L3JlYWR5"}).encode()
            urllib.request.urlopen(f"http://127.0.0.1:{client}/v3/kv/range", body, timeout=1)
            break
        except OSError:
            assert time.time() < deadline, "etcd did not come up"
            time.sleep(0.05)
    yield f"127.0.0.1:{client}"
    proc.kill()
    proc.wait()


def _found_by_name_through(metadata_server):
    names = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize(names[0], metadata_server, "tcp", "") == 0
    assert b.initialize(names[1], metadata_server, "tcp", "") == 0
    remote = b.allocate_managed_buffer(65536)
    local = a.allocate_managed_buffer(65536)
    assert a.write_bytes_to_buffer(local, b"through metadata", 16) == 0
    assert a.get_first_buffer_address(names[1]) == remote
    assert a.transfer_sync_write(names[1], local, remote, 16) == 0
    assert b.read_bytes_from_buffer(remote, 16) == b"through metadata"
    a.close()
    b.close()


@pytest.mark.parametrize("scheme", ["etcd://", ""])
def test_segments_are_found_by_name_through_etcd(etcd, scheme):
    _found_by_name_through(scheme + etcd)


@pytest.fixture
def redis():
    """A real redis-server on a free loopback port (skipped where none is installed)."""
    import shutil
    import socket
    import time

    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server on PATH (apt-get install redis-server; .ci/run does)")
    port = _free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.time() < deadline, "redis did not come up"
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def test_segments_are_found_by_name_through_redis(redis):
    _found_by_name_through(redis)


def _plain_metadata_server(port):
    """Mooncake's HTTP metadata protocol, from the standard library."""
    import http.server
    import threading
    import urllib.parse

    store = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def _key(self):
            url = urllib.parse.urlparse(self.path)
            return url.path == "/metadata" and urllib.parse.parse_qs(url.query).get("key", [None])[0]

        def _answer(self, status, body):
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            key = self._key()
            self._answer(200, store[key]) if key in store else self._answer(404, b"metadata not found")

        def do_PUT(self):
            store[self._key()] = self.rfile.read(int(self.headers["Content-Length"]))
            self._answer(200, b"metadata updated")

        def do_DELETE(self):
            self._answer(200, b"metadata deleted") if store.pop(self._key(), None) else self._answer(404, b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.shutdown


def _mooncake_metadata_server(port):
    """Mooncake's own server, from its PyPI package, in this process."""
    import time
    import urllib.error
    import urllib.request

    try:
        from mooncake.http_metadata_server import KVBootstrapServer
    except ImportError as error:
        pytest.skip(f"Mooncake's package is not installed ({error}): pip install mooncake-transfer-engine-non-cuda")
    server = KVBootstrapServer(port, "127.0.0.1")
    server.run()
    deadline = time.time() + 20
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metadata?key=ready", timeout=1)
        except urllib.error.HTTPError:
            break  # 404: it answers
        except OSError:
            assert time.time() < deadline, "Mooncake's metadata server did not come up"
            time.sleep(0.05)
    return server.close


@pytest.mark.parametrize("server", [_plain_metadata_server, _mooncake_metadata_server])
def test_segments_are_found_by_name_through_the_http_metadata_server(server):
    port = _free_port()
    stop = server(port)
    try:
        _found_by_name_through(f"http://127.0.0.1:{port}/metadata")
    finally:
        stop()


def test_an_unknown_metadata_scheme_is_refused_with_what_kvring_speaks(caplog):
    with caplog.at_level(logging.ERROR, logger="kvring.mooncake"):
        assert TransferEngine().initialize("127.0.0.1", "zk://x:1", "tcp", "") < 0
    assert "P2PHANDSHAKE, etcd://, redis:// and http://" in caplog.text


# Every method of Mooncake's current binding (mooncake-integration/
# transfer_engine/transfer_engine_py.cpp): 34.
MOONCAKE_METHODS = """
initialize initialize_ext get_rpc_port allocate_managed_buffer free_managed_buffer transfer_sync_write
transfer_sync_read batch_transfer_sync_write batch_transfer_sync_read batch_transfer_async_write
batch_transfer_async_read transfer_sync batch_transfer_sync batch_transfer_async transfer_write_on_cuda
transfer_read_on_cuda batch_transfer_write_on_cuda batch_transfer_read_on_cuda get_batch_transfer_status
transfer_submit_write transfer_check_status write_bytes_to_buffer read_bytes_from_buffer register_memory
unregister_memory batch_register_memory batch_unregister_memory get_local_topology get_first_buffer_address
warmup_efa_segment get_notifies send_probe get_engine get_engine_ptr
""".split()


def test_every_method_of_mooncakes_binding_is_there():
    assert len(MOONCAKE_METHODS) == 34
    missing = [m for m in MOONCAKE_METHODS if not callable(getattr(TransferEngine, m, None))]
    assert missing == []


def test_opcode_batches_probes_and_the_rest_of_the_api(pair, caplog):
    import json

    a, b = pair
    session = f"127.0.0.1:{b.get_rpc_port()}"
    remote = b.allocate_managed_buffer(1 << 16)
    local = a.allocate_managed_buffer(1 << 16)
    assert a.write_bytes_to_buffer(local, b"A" * 4096 + b"B" * 4096, 8192) == 0

    # One batch each way, the opcode as an argument; a notification after it.
    notify = TransferNotify("req-9", "in place")
    assert a.batch_transfer_sync(session, [local, local + 4096], [remote, remote + 8192], [4096, 4096], TransferOpcode.Write, notify) == 0
    assert b.read_bytes_from_buffer(remote, 4096) == b"A" * 4096
    assert b.read_bytes_from_buffer(remote + 8192, 4096) == b"B" * 4096
    got = []
    for _ in range(1000):
        got += b.get_notifies()
        if got:
            break
    assert [(n.name, n.msg) for n in got] == [("req-9", "in place")]
    batch = a.batch_transfer_async(session, [local + 16384], [remote + 8192], [4096], TransferOpcode.Read)
    assert batch > 0 and a.get_batch_transfer_status([batch]) == 0
    assert a.read_bytes_from_buffer(local + 16384, 4096) == b"B" * 4096
    assert a.batch_transfer_sync(session, [local], [remote], [16], 1) == 0  # a plain int opcode too

    # A probe answers for a live peer and fails for a dead one.
    assert a.send_probe(session) == 0
    caplog.set_level(logging.ERROR, logger="kvring.mooncake")
    assert a.send_probe("127.0.0.1:1") == -1
    assert a.warmup_efa_segment(session) == 0
    assert a.warmup_efa_segment("127.0.0.1:1") == -1

    topology = json.loads(a.get_local_topology())
    assert "cpu:0" in topology and all(v == [[], []] for v in topology.values())
    import kvring

    assert isinstance(a.get_engine(), kvring.Engine)
    assert a.get_engine_ptr() == 0 and "no Mooncake C++ TransferEngine" in caplog.text

    # initialize_ext: the metadata type apart.
    c = TransferEngine()
    assert c.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "etcd") == 0
    assert c.transfer_sync_write(session, c.allocate_managed_buffer(4096), remote, 16) == 0
    c.close()
    assert TransferEngine().initialize_ext("127.0.0.1", "127.0.0.1:1", "tcp", "", "zookeeper") == -1
    assert "kvring speaks etcd, redis and http" in caplog.text


def test_failed_async_submits_return_mooncakes_sentinel_zero(pair):
    a, b = pair
    local = a.allocate_managed_buffer(4096)
    remote = b.allocate_managed_buffer(4096)
    session = f"127.0.0.1:{b.get_rpc_port()}"
    # A batch id is unsigned: -1 read as one passes `batch_id != 0` checks.
    assert a.transfer_submit_write("127.0.0.1:1", local, remote, 16) == 0
    assert a.transfer_submit_write(session, local, remote, 1 << 20) == 0  # past the region
    assert a.batch_transfer_async("127.0.0.1:1", [local], [remote], [16], TransferOpcode.Write) == 0
    assert a.batch_transfer_async(session, [local], [remote], [16], 7) == 0  # no such opcode
    assert a.transfer_check_status(0) == -1
    ok = a.transfer_submit_write(session, local, remote, 16)
    assert ok > 0
    for _ in range(100000):
        status = a.transfer_check_status(ok)
        if status != 0:
            break
    assert status == 1


def test_wrong_types_return_mooncakes_error_values_and_never_raise(pair, caplog):
    a, b = pair
    session = f"127.0.0.1:{b.get_rpc_port()}"
    local = a.allocate_managed_buffer(4096)
    remote = b.allocate_managed_buffer(4096)
    caplog.set_level(logging.ERROR, logger="kvring.mooncake")
    assert a.transfer_sync_write(12345, local, remote, 16) == -1
    assert a.transfer_sync_write(session, "not an address", remote, 16) == -1
    assert a.transfer_sync_read(session, local, remote, -5) == -1
    assert a.batch_transfer_sync_write(session, "abc", [remote], [16]) == -1
    assert a.batch_transfer_sync(session, [local], [remote], [16], "write") == -1
    assert a.transfer_sync(session, local, remote, 16, TransferOpcode.Write, notify="not a notify") == -1
    assert a.batch_transfer_async_write(session, [local], None, [16]) == 0
    assert a.transfer_submit_write(session, local, remote, "16") == 0
    assert a.register_memory("x", 5) == -1
    assert a.unregister_memory(None) == -1
    assert a.batch_register_memory(None, None) == -1
    assert a.get_batch_transfer_status(None) == -1
    assert a.transfer_check_status("batch") == -1
    assert a.get_first_buffer_address(42) == 0
    assert a.send_probe(None) == -1
    assert a.read_bytes_from_buffer("x", 4) == b""
    assert TransferEngine().initialize(None, "P2PHANDSHAKE", "tcp", "") == -1
    assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "efa", "") == -1
    assert "not a kvring transport" in caplog.text
    assert "TypeError" in caplog.text  # the reason is logged
    # The engine still works after all of it.
    assert a.transfer_sync_write(session, local, remote, 16) == 0

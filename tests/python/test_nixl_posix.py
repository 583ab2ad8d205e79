"""kvring.nixl's POSIX backend: host memory to and from files, as NIXL's
POSIX plugin (NIXL 1.5.1's outcomes, checked beside it: see
docs/NIXL.md), through NIXL's Python agent and its C++-style bindings;
and NIXL's errors for bad input."""

import os
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

import kvring
from kvring.nixl import _bindings as b
from kvring.nixl import nixl_agent, nixl_agent_config, nixlInvalidParamError, nixlNotFoundError, nixlNotSupportedError
from kvring.nixl._errors import nixlBackendError

SIZE = 64 * 1024
HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.join(HERE, "..", "peers", "nixl", "shim")


def _wait(agent, handle, limit_s=10.0):
    """Polls to the end; the states seen, in order (bounded)."""
    deadline = time.monotonic() + limit_s
    seen = [agent.check_xfer_state(handle)]
    while seen[-1] == "PROC":
        assert time.monotonic() < deadline, "POSIX transfer did not end"
        seen.append(agent.check_xfer_state(handle))
    return seen


@pytest.fixture
def setup(tmp_path):
    """An agent with the POSIX backend, 64 KiB of registered memory and an
    open file of 128 KiB whose first 96 KiB are registered."""
    agent = nixl_agent("posix-test", nixl_agent_config(backends=["POSIX"], capture_telemetry=True))
    mem = np.zeros(SIZE, dtype=np.uint8)
    path = tmp_path / "kv.bin"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 2 * SIZE)
    agent.register_memory([(mem.ctypes.data, SIZE, 0, "")], "DRAM")
    agent.register_memory([(0, SIZE + SIZE // 2, fd, str(path))], "FILE")
    yield agent, mem, fd, path
    agent._close()
    os.close(fd)


def test_write_puts_memory_at_the_file_offsets_and_read_brings_it_back(setup):
    agent, mem, fd, _path = setup
    mem[:] = np.arange(SIZE, dtype=np.uint64).astype(np.uint8) ^ 0x5A
    base = mem.ctypes.data
    # Three pieces of memory to three places in the file (out of order).
    local = [(base, 4096, 0), (base + 4096, 8192, 0), (base + 12288, 100, 0)]
    remote = [(40960, 4096, fd), (0, 8192, fd), (8192, 100, fd)]
    handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "FILE"), "posix-test")
    assert agent.query_xfer_backend(handle) == "POSIX"
    assert agent.transfer(handle) == "PROC"
    assert _wait(agent, handle)[-1] == "DONE"
    assert os.pread(fd, 4096, 40960) == mem[:4096].tobytes()
    assert os.pread(fd, 8192, 0) == mem[4096:12288].tobytes()
    assert os.pread(fd, 100, 8192) == mem[12288:12388].tobytes()
    assert os.pread(fd, 4096, 12288) == bytes(4096)  # nothing else written
    telemetry = agent.get_xfer_telemetry(handle)
    assert (telemetry.totalBytes, telemetry.descCount) == (4096 + 8192 + 100, 3)
    written = mem.copy()

    # READ: the same pairs the other way, into cleared memory.
    mem[:] = 0
    back = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "FILE"), "posix-test")
    assert agent.transfer(back) == "PROC"
    assert _wait(agent, back)[-1] == "DONE"
    assert (mem[:12388] == written[:12388]).all()
    assert not mem[12388:].any()  # nothing outside the descriptors
    # A request posts again once DONE (NIXL's reposting).
    mem[:100] = 7
    assert agent.transfer(back) == "PROC" and _wait(agent, back)[-1] == "DONE"
    assert (mem[:100] == written[:100]).all()
    agent.release_xfer_handle(handle)
    agent.release_xfer_handle(back)


def test_prepped_lists_with_indices(setup):
    agent, mem, fd, _path = setup
    base = mem.ctypes.data
    mem[:8192] = 3
    mem[8192:16384] = 4
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base, 8192, 0), (base + 8192, 8192, 0)], "DRAM")
    files = agent.prep_xfer_dlist("posix-test", [(0, 8192, fd), (16384, 8192, fd), (32768, 8192, fd)], "FILE")
    handle = agent.make_prepped_xfer("WRITE", local, [1, 0], files, [2, 0])
    assert agent.transfer(handle) == "PROC" and _wait(agent, handle)[-1] == "DONE"
    assert os.pread(fd, 8192, 32768) == bytes([4]) * 8192
    assert os.pread(fd, 8192, 0) == bytes([3]) * 8192
    assert os.pread(fd, 8192, 16384) == bytes(8192)
    with pytest.raises(kvring.InvalidArgumentError, match="remote index 3 is past its list of 3"):
        agent.make_prepped_xfer("WRITE", local, [0], files, [3])
    with pytest.raises(nixlNotFoundError, match="own files"):
        agent.prep_xfer_dlist("someone-else", [(0, 8192, fd)], "FILE")


def test_the_bindings_as_nixl_gives_them(tmp_path):
    """getPluginParams, createBackend, registerMem, queryMem and the
    request calls of NIXL's C++ agent, with NIXL 1.5.1's values."""
    agent = b.nixlAgent("posix-core", b.nixlAgentConfig())
    params, mems = agent.getPluginParams("POSIX")
    assert params == {"use_aio": "false", "use_uring": "false", "use_posix_aio": "false", "ios_pool_size": "65536", "kernel_queue_size": "256"}
    assert mems == [b.DRAM_SEG, b.FILE_SEG]
    backend = agent.createBackend("POSIX", params)
    assert agent.getBackendParams(backend)[1] == [b.FILE_SEG, b.DRAM_SEG]
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 4096)
    missing = tmp_path / "missing.bin"
    fd = os.open(path, os.O_RDWR)
    try:
        mem = np.full(4096, 9, dtype=np.uint8)
        assert agent.registerMem(b.nixlRegDList(b.DRAM_SEG, [(mem.ctypes.data, 4096, 0, "")]), [backend]) == b.NIXL_SUCCESS
        assert agent.registerMem(b.nixlRegDList(b.FILE_SEG, [(0, 4096, fd, str(path))]), [backend]) == b.NIXL_SUCCESS
        info = agent.queryMem(b.nixlRegDList(b.FILE_SEG, [(0, 0, 0, str(path)), (0, 0, 0, str(missing))]), backend)
        st = os.stat(path)
        assert info == [{"size": "4096", "mode": str(st.st_mode), "mtime": str(int(st.st_mtime))}, None]
        assert stat.S_ISREG(int(info[0]["mode"]))
        assert agent.queryMem(b.nixlRegDList(b.FILE_SEG), backend) == []
        req = agent.createXferReq(
            b.NIXL_WRITE, b.nixlXferDList(b.DRAM_SEG, [(mem.ctypes.data, 4096, 0)]), b.nixlXferDList(b.FILE_SEG, [(0, 4096, fd)]), "posix-core"
        )
        assert agent.postXferReq(req) == b.NIXL_IN_PROG
        status, polls = b.NIXL_IN_PROG, 0
        while status == b.NIXL_IN_PROG:
            polls += 1
            assert polls < 1_000_000, "never ended"
            status = agent.getXferStatus(req)
        assert status == b.NIXL_SUCCESS
        assert path.read_bytes() == bytes([9]) * 4096
        assert agent.releaseXferReq(req) == b.NIXL_SUCCESS
    finally:
        agent._api()._close()
        os.close(fd)


def test_bad_input_gets_nixl_errors(setup, tmp_path):
    agent, mem, fd, path = setup
    base = mem.ctypes.data

    def make(local, remote, agent_name="posix-test", notif=b""):
        return agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "FILE"), agent_name, notif)

    # Each outcome is NIXL 1.5.1's for the same call (docs/NIXL.md).
    with pytest.raises(nixlNotFoundError, match="not inside a FILE registration"):
        make([(base, 16, 0)], [(0, 16, 999)])  # an fd never registered
    with pytest.raises(nixlNotFoundError, match=r"\[98304, 98320\) of fd"):
        make([(base, 16, 0)], [(SIZE + SIZE // 2, 16, fd)])  # past the registered range
    with pytest.raises(nixlNotFoundError, match=r"\[98300, 98316\)"):
        make([(base, 16, 0)], [(SIZE + SIZE // 2 - 4, 16, fd)])  # straddling its end
    with pytest.raises(nixlNotFoundError, match="not inside registered DRAM"):
        make([(base + SIZE - 8, 16, 0)], [(0, 16, fd)])
    with pytest.raises(nixlInvalidParamError, match="lengths must match"):
        make([(base, 16, 0)], [(0, 8, fd)])
    with pytest.raises(nixlBackendError, match="no notifications"):
        make([(base, 16, 0)], [(0, 16, fd)], notif=b"done")
    with pytest.raises(nixlNotFoundError, match="to the agent itself"):
        make([(base, 16, 0)], [(0, 16, fd)], agent_name="elsewhere")
    with pytest.raises(nixlInvalidParamError, match="fd is not open"):
        agent.register_memory([(0, 16, 987654, "")], "FILE")
    with pytest.raises(nixlInvalidParamError, match="is not registered with the POSIX backend"):
        agent.deregister_memory(agent.get_reg_descs([(0, 16, fd, "")], "FILE"))
    other = nixl_agent("posix-ucx", nixl_agent_config(backends=["UCX"]))
    try:
        with pytest.raises(nixlNotSupportedError, match="answers no memory queries"):
            other.query_memory([(0, 0, 0, str(path))], "UCX", "FILE")
        with pytest.raises(nixlNotFoundError, match=r'create_backend\("POSIX"\) first'):
            other.register_memory([(0, 16, fd, "")], "FILE")
        with pytest.raises(nixlInvalidParamError, match="ios_pool_size='many'"):
            other.create_backend("POSIX", {"ios_pool_size": "many"})
    finally:
        other._close()

    # A READ past the end of the file ends ERR with NIXL's backend error,
    # and the memory past what the file held is left as it was.
    os.ftruncate(fd, 10)
    mem[:] = 1
    short = agent.initialize_xfer("READ", agent.get_xfer_descs([(base, 64, 0)], "DRAM"), agent.get_xfer_descs([(0, 64, fd)], "FILE"), "posix-test")
    assert agent.transfer(short) == "PROC"
    assert _wait(agent, short)[-1] == "ERR"
    assert isinstance(short.error, nixlBackendError) and "ends at 10, 54 bytes short" in str(short.error)
    assert not mem[:10].any() and (mem[10:] == 1).all()
    core = agent.agent  # the bindings raise where the agent says ERR, as NIXL's
    reqh = core.createXferReq(
        b.NIXL_READ, b.nixlXferDList(b.DRAM_SEG, [(base, 64, 0)]), b.nixlXferDList(b.FILE_SEG, [(0, 64, fd)]), "posix-test"
    )
    assert core.postXferReq(reqh) == b.NIXL_IN_PROG
    with pytest.raises(nixlBackendError, match="bytes short"):
        for _ in range(1_000_000):
            core.getXferStatus(reqh)

    # Memory deregistered after the request was made: the posting is
    # refused, nothing is read into it.
    handle = agent.initialize_xfer("READ", agent.get_xfer_descs([(base, 8, 0)], "DRAM"), agent.get_xfer_descs([(0, 8, fd)], "FILE"), "posix-test")
    agent.deregister_memory(agent.get_reg_descs([(base, SIZE, 0, "")], "DRAM"))
    mem[:] = 2
    assert agent.transfer(handle) == "ERR"
    assert isinstance(handle.error, nixlNotFoundError) and "deregistered since" in str(handle.error)
    assert (mem == 2).all()


def _script(tmp_path, side):
    """nixl_posix_script.py's output on NIXL itself or on kvring.nixl."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(([SHIM] if side == "kvring" else []) + paths))
    folder = tmp_path / side
    folder.mkdir()
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "nixl_posix_script.py")], cwd=folder, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def test_the_same_posix_script_gives_the_same_outcomes_on_nixl_itself(tmp_path):
    """Every outcome above is NIXL 1.5.1's: a script written for NIXL's
    bindings prints the same lines on both (where NIXL installs: CI
    installs it, .ci/test)."""
    probe = subprocess.run([sys.executable, "-c", "import nixl._bindings"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("NIXL is not installed (pip install --no-deps nixl-cu13 nixl): the cross-check needs it")
    kvring_lines = _script(tmp_path, "kvring")
    assert kvring_lines == _script(tmp_path, "nixl")
    assert "write: posted IN_PROG, ended SUCCESS" in kvring_lines and "read back: True" in kvring_lines
    assert kvring_lines[-1] == "done"


def test_file_lists_keep_their_type_through_serialization():
    from kvring.nixl import _descs

    reg = b.nixlRegDList(b.FILE_SEG, [(0, 4096, 5, "/tmp/a"), (4096, 10, 6, "")])
    back = _descs.deserialize(_descs.serialize(reg))
    assert back == reg and back.getType() == "FILE" and list(back)[0] == (0, 4096, 5, "/tmp/a")
    xfer = b.nixlXferDList(b.FILE_SEG, [(8, 8, 5)])
    assert _descs.deserialize(_descs.serialize(xfer)).getType() == "FILE"
    forged = bytearray(_descs.serialize(xfer))
    forged[9] = 3  # the memory type byte: no type 3
    with pytest.raises(kvring.InvalidArgumentError, match="bad header"):
        _descs.deserialize(bytes(forged))


def test_deregistering_memory_waits_for_the_reads_into_it(tmp_path):
    """A READ in flight when its memory is deregistered has ended by the
    time deregister_memory returns: no file byte lands in memory after it
    was handed back."""
    agent = nixl_agent("posix-dereg", nixl_agent_config(backends=["POSIX"]))
    size = 32 << 20
    path = tmp_path / "big.bin"
    path.write_bytes(bytes([6]) * size)
    fd = os.open(path, os.O_RDONLY)
    try:
        mem = np.zeros(size, dtype=np.uint8)
        agent.register_memory([(mem.ctypes.data, size, 0, "")], "DRAM")
        agent.register_memory([(0, size, fd, str(path))], "FILE")
        pieces = 64
        piece = size // pieces
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs([(mem.ctypes.data + i * piece, piece, 0) for i in range(pieces)], "DRAM"),
            agent.get_xfer_descs([(i * piece, piece, fd) for i in range(pieces)], "FILE"),
            "posix-dereg",
        )
        assert agent.transfer(handle) == "PROC"
        agent.deregister_memory(agent.get_reg_descs([(mem.ctypes.data, size, 0, "")], "DRAM"))
        assert agent.check_xfer_state(handle) == "DONE"
        assert (mem == 6).all()
        # And it cannot be posted again into the memory handed back.
        assert agent.transfer(handle) == "ERR" and isinstance(handle.error, nixlNotFoundError)
        agent.release_xfer_handle(handle)
    finally:
        agent._close()
        os.close(fd)

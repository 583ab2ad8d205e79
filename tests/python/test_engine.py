"""kvring.Engine between two processes, and its errors."""

import os

import numpy as np
import pytest

import kvring
from conftest import digest, pattern

BLOCK = 16 << 10
SPREAD = [i * 3 * BLOCK for i in range(16)]  # scattered remote offsets


@pytest.fixture
def engine():
    with kvring.Engine() as e:
        yield e


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_push_then_pull_between_processes_moves_exact_bytes(engine, spawn, transport):
    peer = spawn("peer.py", *(["--managed"] if transport == "shm" else []))
    name, remote = peer.info["addr"], peer.info["region"]
    assert engine.open_segment(name, transport) == transport

    local = pattern(1 << 20, 7)
    region = engine.register(local)
    blocks = [(region, i * BLOCK, remote, offset, BLOCK) for i, offset in enumerate(SPREAD)]
    assert engine.write(name, blocks) == len(SPREAD) * BLOCK
    for i, offset in enumerate(SPREAD):
        assert peer.ask(f"digest {offset} {BLOCK}") == digest(local[i * BLOCK : (i + 1) * BLOCK])

    # Pull the peer's new contents back into a fresh buffer.
    assert peer.ask("fill 11") == "ok"
    theirs = pattern(peer.info["size"], 11)
    back = np.zeros(1 << 20, dtype=np.uint8)
    back_region = engine.register(back)
    assert engine.read(name, [(back_region, i * BLOCK, remote, off, BLOCK) for i, off in enumerate(SPREAD)]) > 0
    for i, offset in enumerate(SPREAD):
        assert digest(back[i * BLOCK : (i + 1) * BLOCK]) == digest(theirs[offset : offset + BLOCK])

    # By address, asynchronously, as Mooncake names memory.
    base = peer.info["buffer"]
    batch = engine.submit(name, "read", [back.ctypes.data], [base + 4096], [8192])
    assert engine.wait(batch, 10.0) == 8192
    assert digest(back[:8192]) == digest(theirs[4096 : 4096 + 8192])
    # `wait` consumed it: reaping it again reports that, not a second result.
    consumed = engine.reap([batch])[batch]
    assert isinstance(consumed, (kvring.StaleBatchError, kvring.UnknownBatchError)), consumed


def test_async_batches_are_reaped_and_notifications_arrive(engine, spawn):
    peer = spawn("peer.py")
    name, base = peer.info["addr"], peer.info["buffer"]
    engine.open_segment(name)
    local = pattern(1 << 16, 3)
    engine.register(local)
    batches = [engine.submit(name, "write", [local.ctypes.data + i * 4096], [base + i * 4096], [4096]) for i in range(8)]
    ended = {}
    while len(ended) < len(batches):
        ended.update(engine.reap([b for b in batches if b not in ended]))
    assert all(moved == 4096 for moved in ended.values()), ended
    assert peer.ask(f"digest 0 {8 * 4096}") == digest(local[: 8 * 4096])
    engine.notify(name, "layer 3 done")
    got = []
    for _ in range(200):
        got += peer.ask("notifies")
        if got:
            break
    assert [m for _, m in got] == ["layer 3 done"]


def test_kv_blocks_are_pushed_into_a_peer_layout(engine, spawn):
    dims = [2, 8, 64, 2, 4, 0]  # mla: 2 layers, 8 blocks, latent 64 x 2 bytes, 4 tokens per block
    block = 64 * 2 * 4
    peer = spawn("peer.py", "--kv", "mla:" + ",".join(map(str, dims)))
    cache = pattern(2 * 8 * block, 5)
    region = engine.register(cache)
    engine.set_kv_layout("mla", dims, region)
    name = peer.info["addr"]
    assert engine.push_blocks(name, [0, 1], [5, 6]) == 2 * 2 * block
    for layer in range(2):
        for src, dst in [(0, 5), (1, 6)]:
            mine = cache[(layer * 8 + src) * block : (layer * 8 + src + 1) * block]
            assert peer.ask(f"digest {(layer * 8 + dst) * block} {block}") == digest(mine)
    assert engine.push_layer(name, 1, [2], [0]) == block
    # Pull the peer's blocks 5 and 6 (what we pushed) back into our 3 and 4.
    assert engine.pull_blocks(name, [5, 6], [3, 4]) == 2 * 2 * block
    for layer in range(2):
        for src, dst in [(0, 3), (1, 4)]:
            at = lambda b: slice((layer * 8 + b) * block, (layer * 8 + b + 1) * block)  # noqa: E731
            assert digest(cache[at(dst)]) == digest(pattern(2 * 8 * block, 5)[at(src)])
    assert kvring.check_pd_topo((1, 2, 0, 1), (1, 1, 0, 0), "push", "mla")[0] == "heterogeneous"
    verdict, reason = kvring.check_pd_topo((1, 2, 0, 1), (1, 1, 0, 0), "pull", "mha")
    assert verdict == "invalid_remote" and reason


def test_bad_arguments_raise_their_own_exceptions(engine, spawn):
    peer = spawn("peer.py")
    name, remote, base = peer.info["addr"], peer.info["region"], peer.info["buffer"]
    local = np.zeros(1 << 16, dtype=np.uint8)
    region = engine.register(local)

    # Wrong types.
    with pytest.raises(kvring.InvalidArgumentError, match="buffer protocol"):
        engine.register("not memory")
    with pytest.raises(TypeError):
        engine.write(name, [("a", 0, remote, 0, 10)])
    with pytest.raises(ValueError, match="op must be"):
        engine.transfer(name, "copy", [(region, 0, remote, 0, 10)])
    # A non-contiguous numpy array.
    with pytest.raises(kvring.InvalidArgumentError, match="not contiguous"):
        engine.register(np.zeros((64, 64), dtype=np.uint8)[:, ::2])
    # An unregistered address, and a length past a registered region.
    stray = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(kvring.InvalidArgumentError, match="no registered region"):
        engine.transfer_addrs(name, "write", [stray.ctypes.data], [base], [4096])
    with pytest.raises(kvring.InvalidArgumentError, match="no registered region"):
        engine.transfer_addrs(name, "write", [local.ctypes.data], [base], [(1 << 16) + 1])
    with pytest.raises(kvring.OutOfBoundsError):
        engine.write(name, [(region, 0, remote, peer.info["size"] - 10, 4096)])
    with pytest.raises(kvring.InvalidArgumentError, match="no region of"):
        engine.transfer_addrs(name, "write", [local.ctypes.data], [base + peer.info["size"]], [16])
    # A freed buffer.
    freed_region, freed = engine.alloc(1 << 16)
    engine.unregister(freed_region)
    with pytest.raises(kvring.InvalidArgumentError, match="no registered region"):
        engine.transfer_addrs(name, "write", [freed], [base], [4096])
    with pytest.raises(kvring.InvalidArgumentError):
        engine.write_bytes(freed, b"x")
    # An unknown segment.
    with pytest.raises(kvring.KvringError, match="127.0.0.1:1"):
        engine.open_segment("127.0.0.1:1", timeout=1.0)
    with pytest.raises(kvring.UnsupportedError):
        engine.open_segment(name, "carrier-pigeon")
    # A batch whose own deadline passes ends with the bytes it moved.
    with pytest.raises(kvring.TransferTimeoutError, match="deadline passed"):
        engine.write(name, [(region, 0, remote, 0, 65536)] * 64, timeout=1e-6)  # zeros: nothing changes
    # The peer's bytes are untouched by all of the above.
    assert peer.ask(f"digest 0 {peer.info['size']}") == digest(np.zeros(peer.info["size"], dtype=np.uint8))


def test_a_closed_engine_refuses_everything():
    engine = kvring.Engine()
    region, _ = engine.alloc(4096)
    engine.close()
    assert engine.closed
    with pytest.raises(kvring.EngineClosedError):
        engine.alloc(4096)
    with pytest.raises(kvring.EngineClosedError):
        engine.transfer("127.0.0.1:1", "write", [(region, 0, region, 0, 1)])


def test_a_forked_child_gets_fork_error_not_a_hang():
    engine = kvring.Engine()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            engine.alloc(4096)
            outcome = b"no error"
        except kvring.ForkError as error:
            outcome = b"ForkError: " + str(error).encode()
        except BaseException as error:  # noqa: BLE001 (report anything else to the parent)
            outcome = repr(error).encode()
        os.write(write_end, outcome)
        os._exit(0)
    os.close(write_end)
    outcome = os.read(read_end, 4096).decode()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert outcome.startswith("ForkError") and "fork" in outcome, outcome
    # The parent's engine is unaffected.
    assert engine.alloc(4096)[1] > 0
    engine.close()


def _task_state(pid, task):
    """One thread's state letter from /proc (`T`: stopped by a signal)."""
    try:
        with open(f"/proc/{pid}/task/{task}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # a thread that ended meanwhile
        return "T"


def test_a_wait_releases_the_gil_so_other_threads_run(engine, spawn):
    import signal
    import threading
    import time

    peer = spawn("peer.py")
    name, base = peer.info["addr"], peer.info["buffer"]
    engine.open_segment(name, "tcp")
    local = np.zeros(1 << 20, dtype=np.uint8)
    engine.register(local)
    os.kill(peer.proc.pid, signal.SIGSTOP)  # a frozen peer: the batch stays in flight
    # SIGSTOP lands on each of the peer's threads on its way back to user
    # space: wait until all of them are stopped, or a lane still running
    # could take the batch in before it froze.
    frozen_by = time.monotonic() + 5.0
    while not all(_task_state(peer.proc.pid, task) == "T" for task in os.listdir(f"/proc/{peer.proc.pid}/task")):
        assert time.monotonic() < frozen_by, "the peer did not stop within 5 s of SIGSTOP"
        time.sleep(0.001)
    try:
        batch = engine.submit(name, "write", [local.ctypes.data], [base], [1 << 20], timeout=5.0)
        outcome = []

        def waiter():
            try:
                engine.wait(batch, 0.5)
            except Exception as error:  # the assertion below names anything but a timeout
                outcome.append(error)
            else:
                outcome.append("wait() returned: the batch completed with its peer stopped")

        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.05)  # the waiter is inside wait() now
        spins, started = 0, time.perf_counter()
        while thread.is_alive():
            spins += 1
            assert not engine.closed  # no lock held by the wait blocks this
        elapsed = time.perf_counter() - started
        assert outcome and "still complete" in str(outcome[0]), outcome
        # This thread ran all along: far more than one pass per GIL switch interval.
        assert elapsed > 0.3 and spins > 10_000, (elapsed, spins)
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    assert engine.wait(batch, 10.0) == 1 << 20


def test_a_token_is_proven_both_ways_and_never_optional_on_one_side(monkeypatch):
    """Engines with the same token move bytes; a tokenless engine is refused
    by a tokened one and the reverse; KVRING_TOKEN gives the token too."""
    with kvring.Engine(token="py-token") as target, kvring.Engine(token=b"py-token") as good:
        buf, _ = target.alloc(1 << 16)
        good.open_segment(target.control_addr, "tcp")
        local = good.register(pattern(1 << 16, 3))
        assert good.write(target.control_addr, [(local, 0, buf, 0, 1 << 16)]) == 1 << 16
        with kvring.Engine() as stranger:
            with pytest.raises(kvring.UnauthorizedError, match="requires a token"):
                stranger.open_segment(target.control_addr, "tcp")
            with pytest.raises(kvring.UnauthorizedError, match="runs without a token"):
                good.open_segment(stranger.control_addr, "tcp")
        monkeypatch.setenv("KVRING_TOKEN", "py-token")
        with kvring.Engine() as from_env:
            assert from_env.open_segment(target.control_addr, "tcp") == "tcp"

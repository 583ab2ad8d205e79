"""Engine.open_segments: a TP group's peers opened in one call, each with
its own result; a silent rank's typed error is returned beside the others."""

import socket

import pytest

import kvring

RANKS = 8
BLOCK = 4096


@pytest.fixture
def targets():
    engines = [kvring.Engine(name=f"rank-{i}") for i in range(RANKS)]
    regions = [e.alloc(BLOCK) for e in engines]
    yield engines, regions
    for e in engines:
        e.close()


def test_eight_ranks_open_in_one_call_and_a_silent_one_times_out(targets):
    engines, regions = targets
    # Accepted by the kernel's backlog, never answered: only the deadline
    # ends its handshake.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    names = [e.control_addr for e in engines]
    names.insert(5, "127.0.0.1:%d" % silent.getsockname()[1])
    with kvring.Engine(name="initiator") as initiator:
        results = initiator.open_segments(names, "tcp", timeout=0.5)
        assert len(results) == RANKS + 1
        assert isinstance(results.pop(5), kvring.TransferTimeoutError)
        assert results == ["tcp"] * RANKS
        local, addr = initiator.alloc(BLOCK)
        initiator.write_bytes(addr, bytes(range(256)) * (BLOCK // 256))
        for name, e, (remote, remote_addr) in zip(names[:5] + names[6:], engines, regions):
            assert initiator.write(name, [(local, 0, remote, 0, BLOCK)]) == BLOCK
            assert e.read_bytes(remote_addr, BLOCK) == bytes(range(256)) * (BLOCK // 256)
    silent.close()

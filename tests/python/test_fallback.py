"""No silent fallback, from Python: an engine's allow-list refuses a peer
that only other transports reach, with the reason; every batch says which
transport carried it; a link that is not the order's first choice is
logged once."""

import ctypes
import logging
import time

import pytest

import kvring
from kvring.errors import UnsupportedError

LEN = 8192


def records_matching(caplog, text, deadline=5.0):
    """Captured records containing `text`, waited for (kvring logs from a
    thread of its own)."""
    end = time.monotonic() + deadline
    while True:
        found = [r for r in caplog.records if text in r.getMessage()]
        if found or time.monotonic() > end:
            return found
        time.sleep(0.01)


def caller_memory_target(name):
    """An engine whose only region is a buffer it owns (no peer maps it):
    cma reaches it on this host, not shm."""
    engine = kvring.Engine(name=name)
    memory = bytearray(LEN)
    region = engine.register(memory)
    addr = ctypes.addressof((ctypes.c_char * LEN).from_buffer(memory))
    return engine, memory, region, addr


def test_an_allow_list_refuses_a_peer_only_other_transports_reach_with_the_reason():
    target, _memory, _region, _addr = caller_memory_target("py-cma-target")
    with target, kvring.Engine(name="py-only-shm", transports=["shm"]) as initiator:
        with pytest.raises(UnsupportedError) as refused:
            initiator.open_segment(target.control_addr)
        message = str(refused.value)
        assert "no allowed transport reaches py-cma-target: allowed shm" in message
        assert "reachable by cma, tcp" in message and "none of its regions is shm-backed" in message
        # Asked for by name, outside the list: refused too.
        with pytest.raises(UnsupportedError, match="not in this engine's transports"):
            initiator.open_segment(target.control_addr, "cma")


def test_a_bad_transport_name_is_refused_at_start():
    with pytest.raises(kvring.KvringError, match="this build has"):
        kvring.Engine(transports=["shm", "verbs"])


def test_every_batch_reports_its_transport_and_a_fallback_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="kvring")
    target, memory, _region, remote = caller_memory_target("py-fallback-target")
    with target, kvring.Engine(name="py-any") as initiator:
        # The line is rate-limited to one a second per process (a peer must
        # not flood the log), and an earlier test in this process may have
        # spent this second's: wait one period so this open's line passes.
        time.sleep(1.05)
        # No shm region on the peer: cma, and one line saying why.
        assert initiator.open_segment(target.control_addr) == "cma"
        logged = records_matching(caplog, "link is not the transport order's first choice")
        assert logged, [r.getMessage() for r in caplog.records]
        line = logged[0].getMessage()
        assert "transport=cma" in line and "none of its regions is shm-backed" in line, line
        _local, local = initiator.alloc(LEN)
        initiator.write_bytes(local, bytes(range(256)) * (LEN // 256))
        batch = initiator.submit(target.control_addr, "write", [local], [remote], [LEN])
        assert initiator.batch_transport(batch) == "cma"
        assert initiator.wait(batch, with_transport=True) == (LEN, "cma")
        batch = initiator.submit(target.control_addr, "write", [local], [remote], [LEN])
        ended = {}
        end = time.monotonic() + 10
        while batch not in ended and time.monotonic() < end:
            ended = initiator.reap([batch], with_transport=True)
        assert ended == {batch: (LEN, "cma")}
    assert bytes(memory) == bytes(range(256)) * (LEN // 256)


def test_the_allow_list_comes_from_kvring_transports(monkeypatch):
    monkeypatch.setenv("KVRING_TRANSPORTS", "tcp")
    target = kvring.Engine(name="py-env-target")
    target.alloc(LEN)
    with target, kvring.Engine(name="py-env-tcp") as initiator:
        # shm would be the first choice; the list says tcp.
        assert initiator.open_segment(target.control_addr) == "tcp"

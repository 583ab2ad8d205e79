"""Hostile review 3 (docs/SECURITY.md's promise, attacked through the
Python binding): `close()` must stop the engine before it returns, even
while another thread's `open_segment` waits on a silent peer outside the
engine's lock. Otherwise the engine keeps serving peers after `close()`
has released the buffers it held (`Engine._held`), and a peer's write
lands in memory its owner no longer registers."""

import socket
import threading
import time

import numpy as np
import pytest

import kvring

BLOCK = 4096


def test_close_during_an_open_of_a_silent_peer_stops_serving_peers():
    # Accepted by the kernel's backlog, never answered: only the open's
    # own deadline ends its handshake.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    silent.settimeout(30)
    addr = "127.0.0.1:%d" % silent.getsockname()[1]
    victim = kvring.Engine(name="review3-victim")
    owned = np.zeros(BLOCK, dtype=np.uint8)
    region = victim.register(owned)
    ended = []

    def open_silent():
        try:
            victim.open_segment(addr, "tcp", timeout=5.0)
        except kvring.KvringError as error:
            ended.append(error)

    opener = threading.Thread(target=open_silent)
    opener.start()
    conn, _ = silent.accept()  # the opener now waits on the silent peer
    victim_addr = victim.control_addr
    victim.close()
    assert victim.closed
    # The owner takes its memory back once close() returned; a peer that
    # still reaches the engine writes into it.
    with kvring.Engine(name="review3-attacker") as attacker:
        local, local_addr = attacker.alloc(BLOCK)
        attacker.write_bytes(local_addr, b"\xab" * BLOCK)
        with pytest.raises(kvring.KvringError):
            attacker.open_segment(victim_addr, "tcp", timeout=2.0)
            attacker.write(victim_addr, [(local, 0, region, 0, BLOCK)], timeout=2.0)
    assert not owned.any(), "a peer wrote into a closed engine's released buffer"
    opener.join(30)
    assert not opener.is_alive()
    assert len(ended) == 1, "the open ends in a typed error (its timeout, or the engine's shutdown)"
    conn.close()
    silent.close()


def test_push_targets_refuses_a_tp_size_beyond_any_cluster():
    # A tp size is a caller's number; the answer has an entry per
    # destination rank. Unchecked, 2**32 - 1 asked for a 16 GiB list after
    # minutes of work (shown at 2**24, which returned 16 M ranks).
    huge = 1 << 24
    with pytest.raises((ValueError, kvring.KvringError)):
        kvring.push_targets(0, 1, huge)
    with pytest.raises(kvring.KvringError):
        kvring.push_targets(0, 1, huge, kv_heads=huge)
    assert kvring.push_targets(0, 1, 4) == [0, 1, 2, 3]
    assert kvring.push_targets(0, 1, 4, kv_heads=8) == [0, 1, 2, 3]


def test_close_ends_an_arrival_wait_on_another_thread_with_engine_closed():
    # close() waits for the calls running outside the engine's lock; a
    # wait for bytes that will never land ends at close with the engine's
    # typed error, not at its own (long) timeout.
    engine = kvring.Engine(name="review3-waiter")
    region, _ = engine.alloc(BLOCK)
    tag = kvring.arrival_tag(7, 0)
    engine.grant_arrival(tag, [(region, 0, BLOCK)])
    ended = []

    def wait():
        try:
            engine.wait_landed(tag, BLOCK, timeout=20.0)
        except kvring.KvringError as error:
            ended.append(error)

    waiter = threading.Thread(target=wait)
    waiter.start()
    # Most often the wait is under way by now; either order must end in
    # EngineClosedError (a wait begun after close raises it at once).
    time.sleep(0.2)
    engine.close()
    waiter.join(60)
    assert not waiter.is_alive()
    assert len(ended) == 1 and isinstance(ended[0], kvring.EngineClosedError), ended

"""Cancelling a batch from Python: the chunks that have not left are
withdrawn, the batch ends only once what was on its way has drained (never
while a peer may still read or write its memory), it ends with
``CancelledError``, and nothing it withdrew lands afterwards."""

import hashlib
import os
import signal
import time

import numpy as np
import pytest

import kvring

BLOCK = 1 << 20
BLOCKS = 128


@pytest.fixture
def engine():
    with kvring.Engine() as e:
        yield e


def _stopped(pid):
    """Every thread of `pid` stopped by SIGSTOP (state letter `T`)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] != "T":
                    return False
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return True


def _freeze(pid):
    os.kill(pid, signal.SIGSTOP)
    frozen_by = time.monotonic() + 5.0
    while not _stopped(pid):
        assert time.monotonic() < frozen_by, "the peer did not stop within 5 s of SIGSTOP"
        time.sleep(0.001)


def test_a_cancelled_batch_withdraws_what_has_not_left_and_ends_once_the_rest_drained(engine, spawn):
    peer = spawn("peer.py", "--size", str(BLOCK * BLOCKS))
    name, base = peer.info["addr"], peer.info["buffer"]
    engine.open_segment(name, "tcp")
    local = np.full(BLOCK * BLOCKS, 7, dtype=np.uint8)
    engine.register(local)
    _freeze(peer.proc.pid)  # a peer that reads nothing: most blocks cannot be posted
    try:
        batch = engine.submit(
            name,
            "write",
            [local.ctypes.data + i * BLOCK for i in range(BLOCKS)],
            [base + i * BLOCK for i in range(BLOCKS)],
            [BLOCK] * BLOCKS,
            timeout=30.0,
        )
        time.sleep(0.05)  # the lane has posted what the socket takes
        engine.cancel(batch)
        # What was posted cannot drain while the peer is stopped: the batch
        # must not end yet, or its memory would be handed back while the
        # peer may still read it.
        with pytest.raises(kvring.TransferTimeoutError):
            engine.wait(batch, 0.3)
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    # Once the peer reads again, what was on its way drains and the batch
    # ends cancelled: the chunks that had not left were withdrawn.
    with pytest.raises(kvring.CancelledError, match="cancelled after"):
        engine.wait(batch, 10.0)
    # The last block never left (128 MiB do not fit in loopback's socket
    # buffers): it never lands, now or later.
    time.sleep(0.1)
    zeros = hashlib.sha256(bytes(BLOCK)).hexdigest()
    assert peer.ask(f"digest {(BLOCKS - 1) * BLOCK} {BLOCK}") == zeros, "a withdrawn block landed after the cancel"


def test_cancelling_an_ended_or_unknown_batch_is_a_clear_error(engine, spawn):
    peer = spawn("peer.py")
    name, base = peer.info["addr"], peer.info["buffer"]
    local = np.ones(4096, dtype=np.uint8)
    engine.register(local)
    batch = engine.submit(name, "write", [local.ctypes.data], [base], [4096])
    assert engine.wait(batch, 10.0) == 4096
    with pytest.raises(kvring.StaleBatchError):
        engine.cancel(batch)
    with pytest.raises(kvring.UnknownBatchError):
        engine.cancel(0xDEAD0000BEEF)

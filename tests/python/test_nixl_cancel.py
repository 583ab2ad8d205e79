"""kvring.nixl's ``release_xfer_handle`` on a transfer still in flight
cancels it, as NIXL documents for releasing an in-flight handle: it
returns once what had left has drained (never while a peer may still
write the handle's memory), bounded by the agent's timeout with
``TransferTimeoutError`` past it, and the memory is then free to reuse:
nothing of the transfer lands afterwards. The peer is a real process
(nixl_cancel_peer.py)."""

import os
import signal
import socket
import time

import numpy as np
import pytest

import kvring
from kvring.nixl import nixl_agent, nixl_agent_config
from test_cancel import _freeze

IP = "127.0.0.1"
SIZE = 256 << 20
BLOCKS = 4096
STEP = SIZE // BLOCKS
SENTINEL = 0xA5
# How long a late write is given to land before the sentinel is checked.
SETTLE_S = 0.2


def _free_port():
    with socket.socket() as s:
        s.bind((IP, 0))
        return s.getsockname()[1]


def _read_all(spawn, name):
    """A peer holding SIZE bytes of 7s, an agent here that has loaded its
    metadata, and a READ of all of it into a zeroed buffer here, in 4,096
    blocks, not yet posted."""
    port = _free_port()
    peer = spawn("nixl_cancel_peer.py", name, str(port), str(SIZE))
    agent = nixl_agent(f"{name}-reader", nixl_agent_config(True, True, 0))
    local = np.zeros(SIZE, dtype=np.uint8)
    registered = agent.register_memory([(local.ctypes.data, SIZE, 0, "")], "DRAM")
    agent.fetch_remote_metadata(name, IP, port)
    deadline = time.monotonic() + 10.0
    while not agent.check_remote_metadata(name):
        assert time.monotonic() < deadline, "the peer's metadata never arrived"
        time.sleep(0.001)
    remote = peer.info["addr"]
    handle = agent.initialize_xfer(
        "READ",
        agent.get_xfer_descs([(local.ctypes.data + i * STEP, STEP, 0) for i in range(BLOCKS)], "DRAM"),
        agent.get_xfer_descs([(remote + i * STEP, STEP, 0) for i in range(BLOCKS)], "DRAM"),
        name,
    )
    return peer, agent, local, registered, handle


def _nothing_lands_after(agent, local, registered, handle):
    """The handle is gone, the memory unregisters at once (no lease left),
    and a sentinel written over it stays intact."""
    with pytest.raises(kvring.InvalidArgumentError, match="released"):
        agent.check_xfer_state(handle)
    agent.deregister_memory(registered)
    local[:] = SENTINEL
    time.sleep(SETTLE_S)
    late = np.flatnonzero(local != SENTINEL)
    assert late.size == 0, f"{late.size} bytes landed after release, the first at {late[0]}"


def test_releasing_an_in_flight_read_cancels_it_and_nothing_lands_after(spawn):
    peer, agent, local, registered, handle = _read_all(spawn, "cancel-peer")
    assert agent.transfer(handle) == "PROC"
    agent.release_xfer_handle(handle)
    # Released mid-flight: cancelled, not waited for (256 MiB do not
    # arrive in the time one call takes).
    arrived = int((local.reshape(BLOCKS, STEP) == 7).all(axis=1).sum())
    assert arrived < BLOCKS, "every block arrived: the release waited for the transfer instead of cancelling it"
    assert isinstance(handle.error, kvring.CancelledError), handle.error
    _nothing_lands_after(agent, local, registered, handle)
    agent._close()


def test_a_release_whose_cancel_cannot_settle_is_a_timeout_and_keeps_the_handle(spawn, monkeypatch):
    # Over tcp a stopped peer answers nothing: what was asked of it cannot
    # drain, so the release cannot safely return.
    monkeypatch.setenv("KVRING_TRANSPORTS", "tcp")
    peer, agent, local, registered, handle = _read_all(spawn, "stopped-peer")
    _freeze(peer.proc.pid)
    try:
        assert agent.transfer(handle) == "PROC"
        time.sleep(0.05)  # the lane has sent what the socket takes
        agent._timeout = 0.3  # the agent's deadline, short for the test
        with pytest.raises(kvring.TransferTimeoutError, match="did not drain"):
            agent.release_xfer_handle(handle)
        # Still held: in flight, cancelled, its memory not yet reusable.
        assert agent.check_xfer_state(handle) == "PROC"
        with pytest.raises(kvring.RegionBusyError):
            agent.deregister_memory(registered)
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    agent._timeout = 10.0
    agent.release_xfer_handle(handle)
    # A READ's requests are small: all may have left before the cancel,
    # and then it ends done (nothing withdrawn), its replies landed.
    assert handle.error is None or isinstance(handle.error, kvring.CancelledError), handle.error
    _nothing_lands_after(agent, local, registered, handle)
    agent._close()

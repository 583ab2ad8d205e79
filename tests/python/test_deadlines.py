"""A call that waits on a dead peer holds up no other call on the same
engine past its own deadline (docs/DEADLINES.md, finding F5): an open of a
silent peer runs outside the engine's lock, so a transfer on another
thread completes while that open still waits."""

import socket
import threading

import kvring

BLOCK = 4096


def test_a_write_is_not_held_behind_an_open_of_a_silent_peer():
    # Accepted by the kernel's backlog, never answered: only the open's
    # own deadline ends its handshake.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    silent.settimeout(30)
    addr = "127.0.0.1:%d" % silent.getsockname()[1]
    with kvring.Engine(name="deadline-target") as target, kvring.Engine(name="deadline-initiator") as initiator:
        remote, _ = target.alloc(BLOCK)
        local, _ = initiator.alloc(BLOCK)
        initiator.open_segment(target.control_addr, "tcp")
        timed_out = []

        def open_silent():
            try:
                initiator.open_segment(addr, "tcp", timeout=5.0)
            except kvring.TransferTimeoutError as error:
                timed_out.append(error)

        opener = threading.Thread(target=open_silent)
        opener.start()
        # Its connect is in: the opener now waits on the silent peer.
        conn, _ = silent.accept()
        assert initiator.write(target.control_addr, [(local, 0, remote, 0, BLOCK)]) == BLOCK
        # The opener had not given up when the write returned: its socket
        # is still open (an end of stream here would mean the write
        # waited for the open's deadline).
        conn.setblocking(False)
        while True:
            try:
                chunk = conn.recv(65536)
            except BlockingIOError:
                break
            assert chunk, "the write waited behind the open of a silent peer"
        opener.join(30)
        assert not opener.is_alive()
        assert len(timed_out) == 1, "the silent peer's open ends in its typed timeout"
        conn.close()
    silent.close()

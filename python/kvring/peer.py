"""A peer to try kvring against, shipped with the module.

``python -m kvring.peer`` runs a target engine in this process: it
allocates one region of shared memory, prints ``kvring peer at ADDR`` and
serves until interrupted (Ctrl-C). Another engine opens ``ADDR``.

``kvring.peer.start()`` does the same in a child process and hands back its
address, for scripts and notebooks::

    with kvring.peer.start() as decode:
        engine.write(decode, blocks)
"""

import argparse
import select
import subprocess
import sys

import kvring

READY = "kvring peer at "


def serve(region_bytes=64 << 20, listen="127.0.0.1:0", token=None):
    """Serves one shared-memory region until stdin closes or Ctrl-C."""
    engine = kvring.Engine(name="peer", listen=listen, token=token)
    engine.alloc(region_bytes)
    print(READY + engine.control_addr, flush=True)
    try:
        # A child of ``start`` ends with its parent: its stdin closes then.
        sys.stdin.read()
    except KeyboardInterrupt:
        pass
    engine.close()


class Peer(str):
    """The address of a peer running in a child process (a ``str``, so it
    goes wherever a segment name does); stops the child on ``stop`` or at
    the end of a ``with`` block."""

    def __new__(cls, addr, process):
        peer = super().__new__(cls, addr)
        peer._process = process
        return peer

    def stop(self, timeout=5.0):
        """Stops the child and waits for it (bounded)."""
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start(region_bytes=64 << 20, token=None, timeout=30.0):
    """Starts ``python -m kvring.peer`` in a child process; returns its
    address once it serves (a ``Peer``)."""
    command = [sys.executable, "-m", "kvring.peer", "--region-bytes", str(region_bytes)]
    if token is not None:
        command += ["--token", token]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline() if ready else ""
    if not line.startswith(READY):
        process.kill()
        process.wait()
        why = f"it printed {line!r}" if ready else f"nothing within {timeout} s"
        raise kvring.KvringError(f"the peer did not start ({why})")
    return Peer(line[len(READY):].strip(), process)


def main():
    parser = argparse.ArgumentParser(prog="python -m kvring.peer", description=__doc__.splitlines()[0])
    parser.add_argument("--region-bytes", type=int, default=64 << 20, help="size of the served region")
    parser.add_argument("--listen", default="127.0.0.1:0", help="control address (host:port)")
    parser.add_argument("--token", default=None, help="the cluster's pre-shared token")
    args = parser.parse_args()
    serve(args.region_bytes, args.listen, args.token)


if __name__ == "__main__":
    main()

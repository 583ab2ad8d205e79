"""A second process for the Python suites: a kvring engine holding one
buffer, answering commands on stdin, one per line, with one JSON line each.

    python peer.py [--managed] [--size N] [--kv ATTENTION:D1,D2,...]

Prints {"addr", "buffer", "region", "size"} once ready. Commands:
fill SEED | digest OFFSET LEN | notifies | exit.
"""

import argparse
import hashlib
import json

import numpy as np

import kvring
from peer_commands import answer_commands


def pattern(size, seed):
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--managed", action="store_true", help="shared memory from alloc (reachable over shm)")
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument("--kv", default=None)
    args = parser.parse_args()

    engine = kvring.Engine()
    if args.managed:
        region, addr = engine.alloc(args.size)
        view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * args.size).from_address(addr))
    else:
        view = np.zeros(args.size, dtype=np.uint8)
        region = engine.register(view)
        addr = view.ctypes.data
    if args.kv:
        attention, dims = args.kv.split(":")
        engine.set_kv_layout(attention, [int(d) for d in dims.split(",")], region)
    print(json.dumps({"addr": engine.control_addr, "buffer": addr, "region": region, "size": args.size}), flush=True)

    def fill(seed):
        view[:] = pattern(args.size, int(seed))
        return "ok"

    def digest(offset, length):
        offset, length = int(offset), int(length)
        return hashlib.sha256(view[offset : offset + length].tobytes()).hexdigest()

    def notifies():
        return [[sender, message.decode()] for sender, message in engine.notifications()]

    answer_commands({"fill": fill, "digest": digest, "notifies": notifies})
    engine.close()


if __name__ == "__main__":
    main()

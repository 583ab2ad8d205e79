"""A second process for the Python suites: a kvring engine holding one
buffer, answering commands on stdin, one per line, with one JSON line each.

    python peer.py [--managed] [--size N] [--kv ATTENTION:D1,D2,...]

Prints {"addr", "buffer", "region", "size"} once ready. Commands:
fill SEED | digest OFFSET LEN | notifies | exit.
"""

import argparse
import hashlib
import json
import sys

import numpy as np

import kvring


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
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "fill":
            view[:] = pattern(args.size, int(rest[0]))
            reply = "ok"
        elif command == "digest":
            offset, length = int(rest[0]), int(rest[1])
            reply = hashlib.sha256(view[offset : offset + length].tobytes()).hexdigest()
        elif command == "notifies":
            reply = [[sender, message.decode()] for sender, message in engine.notifications()]
        elif command == "exit":
            break
        else:
            reply = f"unknown command {command!r}"
        print(json.dumps(reply), flush=True)
    engine.close()


if __name__ == "__main__":
    main()

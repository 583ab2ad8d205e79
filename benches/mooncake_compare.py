"""One script written against Mooncake's Python API, run on Mooncake's own
TransferEngine (its "tcp" protocol) and on kvring.mooncake, on this host, in
the same run.

Both ends register plain mmap'd buffers: memory neither engine allocated,
as an inference engine's KV cache is (private anonymous memory, what
malloc, numpy and PyTorch's CPU allocator hand out for large buffers;
`--shared` maps MAP_SHARED instead, Python's mmap default). Mooncake moves it over loopback tcp;
kvring.mooncake, given the same "tcp", takes its same-host order and moves
it by cross-memory attach. For each block size and op the client moves
batches of 64 blocks with batch_transfer_sync_write / _read and reports
GB/s; the engines alternate round by round and each reports its median
round. Every WRITE is verified on the server (a digest of its buffer).

    python benches/mooncake_compare.py                  # both engines, 3 rounds
    python benches/mooncake_compare.py --rounds 1 --total 64   # quicker

Needs `pip install mooncake-transfer-engine-non-cuda` beside kvring; without
it, it says so and exits 0 after measuring kvring alone.
"""

import argparse
import hashlib
import json
import mmap
import os
import statistics
import subprocess
import sys
import time

SIZE = 64 << 20
BATCH = 64


def engine_class(which):
    if which == "mooncake":
        from mooncake.engine import TransferEngine
    else:
        from kvring.mooncake import TransferEngine
    return TransferEngine


def mapped(size):
    """A plain anonymous mapping and its address (pages touched)."""
    import ctypes

    shared = os.environ.get("MOONCAKE_COMPARE_SHARED") == "1"
    buf = mmap.mmap(-1, size, flags=mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE)
    buf.write(b"\0" * size)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return buf, addr


def start(which):
    engine = engine_class(which)()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError(f"{which}: initialize failed")
    return engine


def server(which):
    engine = start(which)
    buf, addr = mapped(SIZE)
    if engine.register_memory(addr, SIZE) != 0:
        raise RuntimeError(f"{which}: register_memory failed")
    print(f"127.0.0.1:{engine.get_rpc_port()}", addr, flush=True)
    for line in sys.stdin:
        covered = int(line)
        if covered == 0:
            break
        print(hashlib.blake2b(buf[:covered]).hexdigest(), flush=True)


def client(which, session, remote, block, total, op):
    engine = start(which)
    buf, addr = mapped(SIZE)
    if engine.register_memory(addr, SIZE) != 0:
        raise RuntimeError(f"{which}: register_memory failed")
    pattern = os.urandom(1 << 20)
    for at in range(0, SIZE, len(pattern)):
        buf[at : at + len(pattern)] = pattern
    slots = SIZE // block
    lengths = [block] * BATCH
    move = engine.batch_transfer_sync_write if op == "write" else engine.batch_transfer_sync_read

    def batch(first):
        offsets = [((first + i) % slots) * block for i in range(BATCH)]
        code = move(session, [addr + o for o in offsets], [remote + o for o in offsets], lengths)
        if code != 0:
            raise RuntimeError(f"{which}: {op} of {BATCH} x {block} returned {code}")

    batch(0)  # opens the segment, outside the clock
    batches = max(1, total // (block * BATCH))
    started = time.perf_counter()
    for n in range(batches):
        batch(n * BATCH)
    seconds = time.perf_counter() - started
    covered = min(SIZE, batches * BATCH * block)
    digest = hashlib.blake2b(buf[:covered]).hexdigest() if op == "write" else ""
    print(json.dumps({"gbps": batches * BATCH * block / seconds / 1e9, "covered": covered, "digest": digest}), flush=True)


def measure(python, which, block, total, op):
    """One case: a server and a client process; GB/s, and whether the
    server holds what a WRITE sent."""
    here = os.path.abspath(__file__)
    srv = subprocess.Popen([python, here, "server", which], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        session, remote = srv.stdout.readline().split()
        args = [python, here, "client", which, session, remote, str(block), str(total), op]
        done = subprocess.run(args, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{which} client failed: {done.stderr[-2000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        verified = True
        if op == "write":
            srv.stdin.write(f"{result['covered']}\n")
            srv.stdin.flush()
            verified = srv.stdout.readline().strip() == result["digest"]
        srv.stdin.write("0\n")
        srv.stdin.flush()
        srv.wait(timeout=60)
        return result["gbps"], verified
    finally:
        srv.kill()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-sizes", default="4096,65536,1048576")
    parser.add_argument("--ops", default="write,read")
    parser.add_argument("--total", type=int, default=512, help="MiB per case and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--python", default=sys.executable, help="an interpreter with both packages")
    parser.add_argument("--shared", action="store_true", help="MAP_SHARED buffers instead of private ones")
    args = parser.parse_args()
    # The children map their buffers as the parent was told to.
    os.environ["MOONCAKE_COMPARE_SHARED"] = "1" if args.shared else "0"
    engines = ["kvring", "mooncake"]
    probe = subprocess.run([args.python, "-c", "import mooncake.engine"], capture_output=True, text=True)
    if probe.returncode != 0:
        print("Mooncake's package is not installed (pip install mooncake-transfer-engine-non-cuda): kvring only")
        engines = ["kvring"]
    blocks = [int(b) for b in args.block_sizes.split(",")]
    ops = args.ops.split(",")
    results = {}
    for round_ in range(args.rounds):
        order = engines if round_ % 2 == 0 else engines[::-1]
        for op in ops:
            for block in blocks:
                for which in order:
                    gbps, verified = measure(args.python, which, block, args.total << 20, op)
                    if not verified:
                        raise SystemExit(f"{which} {op} {block}: the server's buffer differs from what was sent")
                    results.setdefault((op, block, which), []).append(gbps)
    kind = "MAP_SHARED" if args.shared else "MAP_PRIVATE"
    print(f"Mooncake API, same host, {kind} mmap'd buffers, batches of {BATCH}, {args.total} MiB per case, "
          f"{args.rounds} rounds (median); protocol \"tcp\" on both")
    for op in ops:
        for block in blocks:
            kv = statistics.median(results[(op, block, "kvring")])
            line = f"{op:5} {block >> 10:5} KiB  kvring.mooncake {kv:6.2f} GB/s"
            if "mooncake" in engines:
                mc = statistics.median(results[(op, block, "mooncake")])
                line += f"  Mooncake {mc:6.2f} GB/s  ({kv / mc:5.1f}x)"
            print(line, flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "server":
        server(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "client":
        client(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7])
    else:
        main()

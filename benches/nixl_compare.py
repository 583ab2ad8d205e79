"""One script written against NIXL's Python agent API, run on NIXL (its UCX
backend) and on kvring.nixl, on this host, in the same run.

The two ends are two processes exchanging metadata through the agents'
listeners, as NIXL's examples do, and both register plain numpy memory
(64 MiB each): memory neither engine allocated, as an inference engine's
KV cache is. NIXL moves it with UCX (shared memory / cma on one host);
kvring.nixl with its same-host order (cross-memory attach for such memory).
The only line that differs between the two is the import (``ENGINE``).

For each op (READ, then WRITE) and block size, the initiator prepares the
whole buffer's blocks once on both sides (``prep_xfer_dlist``) and then, as
vLLM's NixlConnector does per request, makes a transfer of 64 block indices
(``make_prepped_xfer``), posts it, polls ``check_xfer_state`` until DONE
and releases it, moving on through the buffer (so the blocks are not the
same cache-warm ones every time), for ``--total`` MiB, and reports GB/s.
Then one 4 KiB block, its handle reused, posted and polled ``--singles``
times, for p50 / p99. Every READ is checked against the target's pattern;
every WRITE by the target, which digests its buffer when told. Engines
alternate round by round; each figure is the median round.

    python benches/nixl_compare.py                       # both, 3 rounds
    python benches/nixl_compare.py --rounds 1 --total 64 # quicker

Needs `pip install --no-deps nixl-cu13 nixl` beside kvring (NIXL's `_api`
needs numpy, not torch); without NIXL it says so and measures kvring alone.
NIXL 1.5.1's processes crash at exit after finishing; their results are
taken from what they printed before.
"""

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

ENGINE = os.environ.get("NIXL_COMPARE_ENGINE", "kvring")
if ENGINE == "nixl":
    from nixl._api import nixl_agent, nixl_agent_config
else:
    from kvring.nixl import nixl_agent, nixl_agent_config

IP = "127.0.0.1"
SIZE = 64 << 20
BATCH = 64
BLOCK_SIZES = (4096, 65536, 1 << 20)


def wait_done(agent, handle):
    state = agent.transfer(handle)
    while state != "DONE":
        if state == "ERR":
            raise RuntimeError("transfer failed")
        state = agent.check_xfer_state(handle)


def target(port):
    agent = nixl_agent("target", nixl_agent_config(True, True, port))
    buffer = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8)
    reg = agent.register_memory([(buffer.ctypes.data, SIZE, 0, "")], "DRAM")
    print("ready", flush=True)
    while not agent.check_remote_metadata("initiator"):
        time.sleep(0.001)
    agent.send_notif("initiator", agent.get_serialized_descs(reg.trim()))
    while True:
        notifs = agent.get_new_notifs().get("initiator", [])
        for message in notifs:
            if message == b"exit":
                agent.deregister_memory(reg)
                print("done", flush=True)
                return
            if message.startswith(b"digest "):
                length = int(message.split()[1])
                digest = hashlib.blake2b(buffer[:length].tobytes()).hexdigest()
                agent.send_notif("initiator", b"digest " + digest.encode())
        if not notifs:
            time.sleep(0.0005)


def next_notif(agent, prefix):
    while True:
        for message in agent.get_new_notifs().get("target", []):
            if message.startswith(prefix):
                return message


def initiator(port, total, singles):
    agent = nixl_agent("initiator", nixl_agent_config(True, True, 0))
    source = np.random.default_rng(8).integers(0, 256, SIZE, dtype=np.uint8)
    sink = np.zeros(SIZE, dtype=np.uint8)
    sink.fill(1)  # fault its pages in now, not inside the first READ
    regs = [agent.register_memory([(a.ctypes.data, SIZE, 0, "")], "DRAM") for a in (source, sink)]
    agent.fetch_remote_metadata("target", IP, port)
    agent.send_local_metadata(IP, port)
    remote = agent.deserialize_descs(next_notif(agent, b""))
    while not agent.check_remote_metadata("target"):
        time.sleep(0.001)
    base = remote[0][0]
    expected = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8)
    results = {}
    for op in ("READ", "WRITE"):
        local_buf = sink if op == "READ" else source
        for block in BLOCK_SIZES:
            count = SIZE // block
            local = agent.prep_xfer_dlist("", [(local_buf.ctypes.data + i * block, block, 0) for i in range(count)], "DRAM")
            far = agent.prep_xfer_dlist("target", [(base + i * block, block, 0) for i in range(count)], "DRAM")
            windows = [list(range(w * BATCH, (w + 1) * BATCH)) for w in range(count // BATCH)]
            handle = agent.make_prepped_xfer(op, local, windows[0], far, windows[0])
            wait_done(agent, handle)  # first posting: connections
            agent.release_xfer_handle(handle)
            batches = max(1, (total << 20) // (block * BATCH))
            started = time.perf_counter()
            for n in range(batches):
                indices = windows[n % len(windows)]
                handle = agent.make_prepped_xfer(op, local, indices, far, indices)
                wait_done(agent, handle)
                agent.release_xfer_handle(handle)
            seconds = time.perf_counter() - started
            covered = min(SIZE, batches * BATCH * block)
            if op == "READ":
                verified = bool(np.array_equal(sink[:covered], expected[:covered]))
            else:
                agent.send_notif("target", f"digest {covered}".encode())
                theirs = next_notif(agent, b"digest ").split()[1].decode()
                verified = theirs == hashlib.blake2b(source[:covered].tobytes()).hexdigest()
            results[f"{op} {block}"] = {"gbps": batches * BATCH * block / seconds / 1e9, "verified": verified}
            agent.release_dlist_handle(local)
            agent.release_dlist_handle(far)
    for op in ("READ", "WRITE"):
        local_buf = sink if op == "READ" else source
        local = agent.prep_xfer_dlist("", [(local_buf.ctypes.data, 4096, 0)], "DRAM")
        far = agent.prep_xfer_dlist("target", [(base, 4096, 0)], "DRAM")
        handle = agent.make_prepped_xfer(op, local, [0], far, [0])
        for _ in range(100):
            wait_done(agent, handle)
        times = []
        for _ in range(singles):
            started = time.perf_counter_ns()
            wait_done(agent, handle)
            times.append(time.perf_counter_ns() - started)
        times.sort()
        results[f"{op} single"] = {"p50_us": times[len(times) // 2] / 1e3, "p99_us": times[len(times) * 99 // 100] / 1e3}
        agent.release_xfer_handle(handle)
    agent.send_notif("target", b"exit")
    print(json.dumps(results), flush=True)
    agent.remove_remote_agent("target")
    for reg in regs:
        agent.deregister_memory(reg)


def free_port():
    with socket.socket() as s:
        s.bind((IP, 0))
        return s.getsockname()[1]


def measure(python, engine, total, singles):
    """One pair of processes on ``engine``; the initiator's results."""
    env = dict(os.environ, NIXL_COMPARE_ENGINE=engine)
    here, port = os.path.abspath(__file__), str(free_port())
    srv = subprocess.Popen([python, here, "target", port], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        for line in srv.stdout:  # NIXL logs to stdout before it
            if line.strip() == "ready":
                break
        else:
            raise RuntimeError(f"{engine}: the target did not start")
        done = subprocess.run(
            [python, here, "initiator", port, str(total), str(singles)], capture_output=True, text=True, timeout=600, env=env
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if not lines:
            raise RuntimeError(f"{engine} initiator failed ({done.returncode}): {done.stderr[-2000:]}")
        srv.wait(timeout=60)
        return json.loads(lines[-1])
    finally:
        srv.kill()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total", type=int, default=256, help="MiB per case and round")
    parser.add_argument("--singles", type=int, default=5000, help="single 4 KiB transfers per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--python", default=sys.executable, help="an interpreter with both packages")
    args = parser.parse_args()
    engines = ["kvring", "nixl"]
    probe = subprocess.run([args.python, "-c", "import nixl._api"], capture_output=True, text=True)
    if probe.returncode != 0:
        print("NIXL is not installed (pip install --no-deps nixl-cu13 nixl): kvring only")
        engines = ["kvring"]
    runs = {engine: [] for engine in engines}
    for round_ in range(args.rounds):
        for engine in engines if round_ % 2 == 0 else engines[::-1]:
            result = measure(args.python, engine, args.total, args.singles)
            bad = [case for case, r in result.items() if r.get("verified") is False]
            if bad:
                raise SystemExit(f"{engine}: {', '.join(bad)}: the bytes moved are not the bytes sent")
            runs[engine].append(result)
    print(f"NIXL's API, same host, plain numpy memory, batches of {BATCH}, {args.total} MiB per case, "
          f"{args.singles} single transfers, {args.rounds} rounds (median), every batch verified")
    for case in [f"{op} {b}" for op in ("READ", "WRITE") for b in BLOCK_SIZES]:
        kv = statistics.median(r[case]["gbps"] for r in runs["kvring"])
        line = f"{case.split()[0]:5} {int(case.split()[1]) >> 10:5} KiB x {BATCH}  kvring.nixl {kv:6.2f} GB/s"
        if "nixl" in runs:
            nx = statistics.median(r[case]["gbps"] for r in runs["nixl"])
            line += f"  NIXL (UCX) {nx:6.2f} GB/s  ({kv / nx:4.1f}x)"
        print(line, flush=True)
    for op in ("READ", "WRITE"):
        case = f"{op} single"
        kv50 = statistics.median(r[case]["p50_us"] for r in runs["kvring"])
        kv99 = statistics.median(r[case]["p99_us"] for r in runs["kvring"])
        line = f"{op:5}     4 KiB x 1   kvring.nixl p50 {kv50:6.2f} us p99 {kv99:6.2f} us"
        if "nixl" in runs:
            nx50 = statistics.median(r[case]["p50_us"] for r in runs["nixl"])
            nx99 = statistics.median(r[case]["p99_us"] for r in runs["nixl"])
            line += f"  NIXL (UCX) p50 {nx50:6.2f} us p99 {nx99:6.2f} us"
        print(line, flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "target":
        target(int(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "initiator":
        initiator(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()

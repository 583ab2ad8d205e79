"""Python overhead: kvring.mooncake and kvring.nixl against the Rust API,
same case, same run.

    python benches/python_overhead.py [--layer mooncake|nixl] [--protocol shm|tcp] [--rounds N] [--quick]

With ``--layer nixl`` the peer is a kvring.nixl agent holding plain numpy
memory (what NIXL's users register; on one host it moves by cross-memory
attach), and the same prepped transfer (64 x 64 KiB, or one 4 KiB block) is
posted and polled through ``nixl_agent.transfer`` / ``check_xfer_state``,
and posted and waited for in Rust (``rust_loop_xfer``), alternating.

A peer process serves a shared-memory buffer. This process moves the same
batches two ways over the same engine and segment, alternating batch by
batch (each timed alone; a round reports medians):
through ``kvring.mooncake.TransferEngine`` (Python lists of addresses, the
call, the GIL released inside) and through the Rust API alone (the same
address translation, submit and wait, looped in Rust: ``rust_loop``).

Cases: ``batch_transfer_sync_write`` of 64 x 64 KiB (throughput, target
>= 95% of Rust), and ``transfer_sync_write`` of one 4 KiB block (p50,
target <= Rust's p50 + 5 us).
"""

import argparse
import statistics
import subprocess
import sys
import time

from kvring.mooncake import TransferEngine

BLOCK, BLOCKS = 64 << 10, 64


def serve(protocol):
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0
    addr = engine.allocate_managed_buffer(BLOCK * BLOCKS)
    print(f"127.0.0.1:{engine.get_rpc_port()} {addr}", flush=True)
    sys.stdin.readline()


def serve_nixl():
    import numpy as np

    from kvring.nixl import nixl_agent

    agent = nixl_agent("overhead-target")
    buffer = np.zeros(BLOCK * BLOCKS, dtype=np.uint8)
    agent.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM")
    print(agent.get_agent_metadata().hex(), buffer.ctypes.data, flush=True)
    sys.stdin.readline()


def nixl_round(agent, native_post_loop, batch, single, batches, singles):
    """One round: (python times, rust times) for the batch and the single."""
    def post(handle):
        state = agent.transfer(handle)
        while state != "DONE":
            assert state != "ERR", handle.error
            state = agent.check_xfer_state(handle)

    out = []
    for handle, count in ((batch, batches), (single, singles)):
        py_times, rust_times = [], []
        for _ in range(count):
            t = time.perf_counter_ns()
            post(handle)
            py_times.append(time.perf_counter_ns() - t)
            rust_times += native_post_loop(handle, 1)
        out.append((py_times, rust_times))
    return out


def main_nixl(args, batches, singles, rounds):
    import numpy as np

    from kvring import _native
    from kvring.nixl import nixl_agent

    peer = subprocess.Popen([sys.executable, __file__, "--serve", "nixl"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        metadata, remote = peer.stdout.readline().split()
        remote = int(remote)
        agent = nixl_agent("overhead-initiator")
        local = np.ones(BLOCK * BLOCKS, dtype=np.uint8)
        agent.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
        name = agent.add_remote_agent(bytes.fromhex(metadata))
        mine = agent.prep_xfer_dlist("", [(local.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)] + [(local.ctypes.data, 4096, 0)], "DRAM")
        theirs = agent.prep_xfer_dlist(name, [(remote + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)] + [(remote, 4096, 0)], "DRAM")
        batch = agent.make_prepped_xfer("WRITE", mine, list(range(BLOCKS)), theirs, list(range(BLOCKS)))
        single = agent.make_prepped_xfer("WRITE", mine, [BLOCKS], theirs, [BLOCKS])
        native = agent._native

        def rust(handle, iterations):
            return _native.rust_loop_xfer(native, handle.xfer(), iterations)

        for _ in range(20):  # warm up both paths
            nixl_round(agent, rust, batch, single, 1, 1)
        ratios, extra = [], []
        for round_ in range(rounds):
            (bp, br), (sp, sr) = nixl_round(agent, rust, batch, single, batches, singles)
            py_rate = BLOCK * BLOCKS / (statistics.median(bp) / 1e9)
            rust_rate = BLOCK * BLOCKS / (statistics.median(br) / 1e9)
            ratios.append(py_rate / rust_rate)
            extra.append((statistics.median(sp) - statistics.median(sr)) / 1e3)
            print(
                f"round {round_}: 64x64KiB nixl {py_rate / 1e9:.2f} GB/s, rust {rust_rate / 1e9:.2f} GB/s "
                f"({100 * ratios[-1]:.1f}%); 4KiB p50 nixl {statistics.median(sp) / 1e3:.2f} us, "
                f"rust {statistics.median(sr) / 1e3:.2f} us",
                flush=True,
            )
        print(f"\nlayer nixl (cma, numpy memory), {rounds} rounds, each path timed in the same round:")
        print(f"  transfer + check_xfer_state 64 x 64 KiB: nixl/rust median {100 * statistics.median(ratios):.1f}% "
              f"(min {100 * min(ratios):.1f}%, max {100 * max(ratios):.1f}%)")
        print(f"  one 4 KiB block: nixl adds {statistics.median(extra):.2f} us to Rust's p50 (median of rounds)")
        agent._close()
    finally:
        peer.stdin.write("exit\n")
        peer.stdin.flush()
        peer.wait(timeout=10)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layer", default="mooncake", choices=["mooncake", "nixl"])
    parser.add_argument("--protocol", default="shm", choices=["shm", "tcp"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few iterations")
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "nixl":
        return serve_nixl()
    if args.serve:
        return serve(args.serve)

    batches, singles, rounds = (20, 200, 2) if args.quick else (300, 3000, args.rounds)
    if args.layer == "nixl":
        return main_nixl(args, batches, singles, rounds)
    peer = subprocess.Popen([sys.executable, __file__, "--serve", args.protocol], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        session, remote = peer.stdout.readline().split()
        remote = int(remote)
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", args.protocol, "") == 0
        local = engine.allocate_managed_buffer(BLOCK * BLOCKS)
        locals_ = [local + i * BLOCK for i in range(BLOCKS)]
        remotes = [remote + i * BLOCK for i in range(BLOCKS)]
        lengths = [BLOCK] * BLOCKS
        native = engine._engine._native
        if args.protocol == "tcp":
            # kvring.mooncake's "tcp" takes shm on one host; measure tcp itself.
            engine._engine.open_segment(session, "tcp")
        total = BLOCK * BLOCKS
        # Warm up both paths (connection, page faults).
        for _ in range(5):
            assert engine.batch_transfer_sync_write(session, locals_, remotes, lengths) == 0
        native.rust_loop(session, "write", locals_, remotes, lengths, 5)

        ratios, py_rates, rust_rates = [], [], []
        py_p50s, rust_p50s = [], []
        for round_ in range(rounds):
            # Batch by batch, alternating the two paths, so both see the
            # same machine; medians, since these VMs stall at random.
            py_times, rust_times = [], []
            for _ in range(batches):
                t = time.perf_counter_ns()
                assert engine.batch_transfer_sync_write(session, locals_, remotes, lengths) == 0
                py_times.append(time.perf_counter_ns() - t)
                rust_times += native.rust_loop(session, "write", locals_, remotes, lengths, 1)
            py_rate = total / (statistics.median(py_times) / 1e9)
            rust_rate = total / (statistics.median(rust_times) / 1e9)
            py_rates.append(py_rate)
            rust_rates.append(rust_rate)
            ratios.append(py_rate / rust_rate)

            py_single, rust_single = [], []
            for _ in range(singles):
                t = time.perf_counter_ns()
                assert engine.transfer_sync_write(session, local, remote, 4096) == 0
                py_single.append(time.perf_counter_ns() - t)
                rust_single += native.rust_loop(session, "write", [local], [remote], [4096], 1)
            py_p50s.append(statistics.median(py_single) / 1e3)
            rust_p50s.append(statistics.median(rust_single) / 1e3)
            print(
                f"round {round_}: 64x64KiB python {py_rate / 1e9:.2f} GB/s, rust {rust_rate / 1e9:.2f} GB/s "
                f"({100 * ratios[-1]:.1f}%); 4KiB p50 python {py_p50s[-1]:.2f} us, rust {rust_p50s[-1]:.2f} us",
                flush=True,
            )
        print(f"\nprotocol {args.protocol}, {rounds} rounds, each path timed in the same round:")
        print(
            f"  batch_transfer_sync_write 64 x 64 KiB: python/rust median {100 * statistics.median(ratios):.1f}% "
            f"(min {100 * min(ratios):.1f}%, max {100 * max(ratios):.1f}%); "
            f"median {statistics.median(py_rates) / 1e9:.2f} vs {statistics.median(rust_rates) / 1e9:.2f} GB/s"
        )
        extra = [p - r for p, r in zip(py_p50s, rust_p50s)]
        print(
            f"  transfer_sync_write 4 KiB p50: python {statistics.median(py_p50s):.2f} us, rust {statistics.median(rust_p50s):.2f} us, "
            f"python adds {statistics.median(extra):.2f} us (median of rounds)"
        )
        engine.close()
    finally:
        peer.stdin.write("exit\n")
        peer.stdin.flush()
        peer.wait(timeout=10)


if __name__ == "__main__":
    main()

"""The time a vLLM decode waits for KV, kvring.nixl beside NIXL itself.

Two prefill/decode pairs of vLLM servers with NixlConnector (CPU KV,
``--enforce-eager``, one core per server, the tiny Llama of
tests/vllm/make_model.py) run at once: one pair with ``nixl`` resolving to
kvring.nixl (tests/vllm/shims/nixl on PYTHONPATH), one with NIXL's own
wheel (UCX). Requests alternate between the pairs, prompt by prompt, round
by round (interleaved, so drift of the shared machine hits both alike).
Per request, on the decode:

- ``xfer``: vLLM's own metric ``vllm:nixl_xfer_time_seconds`` (the
  transfer's post-to-done time as the connector polled it), the increase of
  its sum over the request;
- ``decode``: the decode request's latency with ``max_tokens=1`` as the
  client sees it: the wait for KV (handshake on the first request, then the
  transfer) plus one forward pass of the tokens not loaded, the same on
  both sides.

Medians per prompt length, and kvring / NIXL as a ratio.

    target/vllmenv/bin/python benches/vllm_kv_wait.py --rounds 20
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "vllm"))

from pd_check import Ports, ensure_models  # noqa: E402
from vllm_servers import Server, complete, prompts_of, stop_all  # noqa: E402

XFER_SUM = "vllm:nixl_xfer_time_seconds_sum"


def one(prefill, decode, prompt):
    """One request through the pair: (xfer s, decode latency s) or None."""
    first = complete(prefill.url, prompt, 1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    params = first.get("kv_transfer_params")
    if not params:
        print(f"  prefill failed: {first!r}", flush=True)
        return None
    before = decode.metric(XFER_SUM)
    got = complete(decode.url, prompt, 1, kv_transfer_params=params)
    if "error" in got:
        print(f"  decode failed: {got!r}", flush=True)
        return None
    # The stats reach /metrics on the engine's logging interval: wait for
    # the sum to move (bounded), so each request is charged its own transfer.
    end = time.monotonic() + 15
    after = decode.metric(XFER_SUM)
    while after == before and time.monotonic() < end:
        time.sleep(0.25)
        after = decode.metric(XFER_SUM)
    return after - before, got["elapsed_s"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--lengths", default="64,200")
    parser.add_argument("--workdir", default=os.path.join(HERE, "..", "target", "vllm-check"))
    parser.add_argument("--port-base", type=int, default=int(os.environ.get("KVRING_VLLM_PORT_BASE", "28100")) + 50)
    args = parser.parse_args()
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    models = ensure_models(workdir, sys.executable)
    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = prompts_of(lengths)
    ports = Ports(args.port_base)
    pairs = {}
    for impl in ("kvring", "native"):
        mk = lambda role, core: Server(f"bench-{impl}-{role}", models["model-a"], ports.take(), core=core,  # noqa: E731
                                       logdir=workdir, connector="nixl", side_port=ports.take(), impl=impl)
        pairs[impl] = (mk("prefill", 0), mk("decode", 1))
    servers = [s for pair in pairs.values() for s in pair]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        # One request each first: the handshake, charged to no figure.
        for impl, (p, d) in pairs.items():
            if one(p, d, prompts[0]) is None:
                raise RuntimeError(f"{impl}: the warm-up request failed")
        samples = {(impl, n): [] for impl in pairs for n in lengths}
        for r in range(args.rounds):
            for n, prompt in zip(lengths, prompts):
                order = ("kvring", "native") if r % 2 == 0 else ("native", "kvring")
                for impl in order:
                    got = one(*pairs[impl], prompt)
                    if got is not None:
                        samples[(impl, n)].append(got)
        print(f"\nvLLM NixlConnector, CPU KV, {args.rounds} rounds interleaved; medians per request "
              "(xfer: vllm:nixl_xfer_time_seconds; decode: decode latency with max_tokens=1)")
        print(f"{'tokens':>6} {'kvring xfer ms':>15} {'NIXL xfer ms':>13} {'ratio':>6} "
              f"{'kvring decode ms':>17} {'NIXL decode ms':>15} {'ratio':>6}  n")
        for n in lengths:
            k, x = samples[("kvring", n)], samples[("native", n)]
            if not k or not x:
                print(f"{n:>6} (no samples: kvring {len(k)}, NIXL {len(x)})")
                continue
            kx, nx = statistics.median(s[0] for s in k) * 1e3, statistics.median(s[0] for s in x) * 1e3
            kd, nd = statistics.median(s[1] for s in k) * 1e3, statistics.median(s[1] for s in x) * 1e3
            print(f"{n:>6} {kx:>15.3f} {nx:>13.3f} {kx / nx if nx else float('nan'):>6.2f} "
                  f"{kd:>17.2f} {nd:>15.2f} {kd / nd:>6.2f}  {len(k)}/{len(x)}")
    finally:
        stop_all(servers)


if __name__ == "__main__":
    main()

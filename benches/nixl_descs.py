"""``get_xfer_descs`` on vLLM's list: kvring.nixl beside NIXL, same run.

vLLM's NixlConnector builds a transfer list of every block of every layer
on each handshake (``get_xfer_descs(blocks_data, "DRAM")``, a list of
``(addr, len, dev_id)`` tuples: 65,536 of them for the check's model), and
its side channel waits on it. This times that call on both agents in one
process, interleaved round by round (the engine that goes first
alternates), for a list of tuples and for an N x 3 numpy array, and
prints the median of each with the ratio kvring / NIXL (below 1: kvring
is faster).

    python benches/nixl_descs.py                 # 65,536 descriptors, 21 rounds
    python benches/nixl_descs.py --descs 262144 --rounds 9

Needs `pip install --no-deps nixl-cu13 nixl` beside kvring (NIXL's `_api`
needs numpy, not torch); without NIXL it says so and times kvring alone.
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("KVRING_LOG", "error")

from kvring.nixl import nixl_agent as kvring_agent  # noqa: E402
from kvring.nixl import nixl_agent_config as kvring_config  # noqa: E402

try:
    from nixl._api import nixl_agent as nixl_agent_cls
    from nixl._api import nixl_agent_config as nixl_config
except ImportError as error:  # NIXL not installed: kvring alone
    nixl_agent_cls = None
    print(f"NIXL not importable ({error}): timing kvring.nixl alone", file=sys.stderr)

BLOCK = 4096
BASE = 0x7F00_0000_0000


def rows(count):
    """vLLM's shape: one (addr, len, dev_id) tuple per block per layer."""
    return [(BASE + i * BLOCK, BLOCK, 0) for i in range(count)]


def timed(agent, descs):
    started = time.perf_counter()
    out = agent.get_xfer_descs(descs, "DRAM")
    elapsed = time.perf_counter() - started
    if out is None or out.descCount() != len(descs):
        raise SystemExit(f"{type(agent).__module__}: get_xfer_descs gave {out!r}")
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--descs", type=int, default=65536, help="descriptors in the list (vLLM's check: 65,536)")
    parser.add_argument("--rounds", type=int, default=21, help="interleaved rounds (the median is reported)")
    args = parser.parse_args()
    agents = {"kvring": kvring_agent("descs-kvring", kvring_config(backends=[]))}
    if nixl_agent_cls is not None:
        agents["nixl"] = nixl_agent_cls("descs-nixl", nixl_config(backends=[]))
    inputs = {"tuples": rows(args.descs)}
    inputs["numpy"] = np.array(inputs["tuples"], dtype=np.uint64)
    times = {(engine, form): [] for engine in agents for form in inputs}
    names = list(agents)
    for round_ in range(args.rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        for form, descs in inputs.items():
            for engine in order:
                times[(engine, form)].append(timed(agents[engine], descs))
    for form in inputs:
        result = {"call": "get_xfer_descs", "input": form, "descs": args.descs, "rounds": args.rounds}
        for engine in names:
            result[f"{engine}_ms"] = round(statistics.median(times[(engine, form)]) * 1e3, 2)
        if "nixl" in agents:
            result["ratio_kvring_to_nixl"] = round(result["kvring_ms"] / result["nixl_ms"], 2)
        print(json.dumps(result))


if __name__ == "__main__":
    main()

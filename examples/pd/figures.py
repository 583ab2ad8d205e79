"""Time to first token, split: prefill compute, transfer exposed after the
last layer (what layer-wise push did not hide), decode's first step.

Layer-wise push (``push``) beside pushing the whole cache after the last
layer (``whole``), in the same run, rounds interleaved, one request at a
time so that nothing else queues in front of it. Every request's tokens are
also checked against transformers' generate.

Columns (medians, ms): compute = prefill's forward, first token included;
exposed = how long after that the last layer landed at decode (0 when it
landed before); decode = the rest of the time to first token: the first
token's message and decode's first step; TTFT = from prefill's start to the
end of decode's first step; landed-end = last layer landed minus compute
end, unclamped (negative: hidden with that much to spare). Times are
CLOCK_MONOTONIC, shared by the processes of one host.
"""

import statistics

import run

KIND = "llama-fig"


def split(timing):
    compute = timing["compute_end"] - timing["compute_start"]
    margin = timing["landed"] - timing["compute_end"]  # < 0: the last layer landed before prefill ended
    exposed = max(0.0, margin)
    ttft = timing["decode_end"] - timing["compute_start"]
    return compute, exposed, ttft - compute - exposed, ttft, margin


def main(args):
    referee, tally = run.Referee(), run.Tally()
    rounds, length = args.rounds, args.prompt
    modes = ("push", "whole")
    clusters = {mode: run.Cluster(KIND, mode, blocks=2 * (length // 16 + 2)) for mode in modes}
    rows = {mode: [] for mode in modes}
    try:
        for i in range(rounds):
            request = run.make_requests(KIND, 1, lengths=[length], new=2, first_id=i, seed=100 + i)
            for mode in modes if i % 2 == 0 else reversed(modes):
                results = clusters[mode].run(request)
                run.compare(tally, referee, KIND, mode, request, results)
                got = results[0].get(i) or results[0].get(str(i))
                if got and not got["error"] and i > 0:  # round 0 warms up
                    rows[mode].append(split(got["timing"]))
    finally:
        for cluster in clusters.values():
            cluster.stop()
    print(f"\nmodel {KIND}, prompt {length} tokens, {rounds - 1} measured rounds (medians, ms):")
    print(f"{'mode':8} {'compute':>9} {'exposed':>9} {'decode':>9} {'TTFT':>9} {'landed-end':>11}")
    med = {}
    for mode in modes:
        cols = list(zip(*rows[mode])) if rows[mode] else [[0.0]] * 5
        med[mode] = [statistics.median(c) * 1e3 for c in cols]
        print(f"{mode:8} " + " ".join(f"{v:9.2f}" for v in med[mode][:4]) + f" {med[mode][4]:11.2f}")
    if med["whole"][1] > 0:
        print(f"exposed transfer, layer-wise / whole-cache: {100 * med['push'][1] / med['whole'][1]:.1f}%")
    print(f"{tally.passed} passed, {tally.failed} failed")
    return 1 if tally.failed else 0

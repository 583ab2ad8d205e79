#!/usr/bin/env python3
"""How fast a soak recovers when its target is killed (-9) and restarted.

Issue 32's target: a soak whose target is killed and restarted on the same
port 8 times in 40 s recovers each time within 100 ms of the new target
listening, worst case, and verifies every batch it reported done.

This harness starts `kvring serve`, runs `kvring bench --duration 40s
--json` against it (tcp, 8 blocks of 4 KiB per batch), and kills and
restarts the target 8 times. It notes the wall-clock moment each new target
printed its listening line (it prints it after binding), and puts beside it
the soak's first `recovered` event after that moment (the soak stamps its
events with `unix_ms`). It prints, per restart, listen -> recovered in ms
(negative when the soak's retry got in before this harness read the line),
the worst case, the failures the soak counted, and whether the soak's final
check of everything it reported done passed.

    cargo build --release --bin kvring
    python3 benches/soak_recovery.py [--kvring target/release/kvring]
"""

import argparse
import json
import socket
import subprocess
import sys
import time

RESTARTS = 8
DURATION_S = 40
TARGET_MS = 100


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(kvring, listen):
    """Starts a target; returns it and the moment it said it listens."""
    target = subprocess.Popen(
        [kvring, "serve", "--name", "decode-0", "--listen", listen, "--region-size", "1MiB", "--parent-watch"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = target.stdout.readline()
    if listen not in line:
        sys.exit(f"kvring serve did not say it listens on {listen}: {line!r}")
    return target, time.time() * 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kvring", default="target/release/kvring")
    args = parser.parse_args()
    listen = f"127.0.0.1:{free_port()}"
    target, _ = serve(args.kvring, listen)
    soak = subprocess.Popen(
        [args.kvring, "bench", "--peer", listen, "--transport", "tcp", "--duration", f"{DURATION_S}s", "--json"]
        + ["--batch", "8", "--block-size", "4KiB", "--region-size", "1MiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    kill_ms, ready_ms = [], []
    gap = DURATION_S / (RESTARTS + 1)
    for _ in range(RESTARTS):
        time.sleep(gap)
        kill_ms.append(time.time() * 1000)
        target.kill()
        target.wait()
        target, ready = serve(args.kvring, listen)
        ready_ms.append(ready)
    events = [json.loads(line) for line in soak.communicate()[0].splitlines() if line.startswith("{")]
    target.kill()
    target.wait()
    recovered = [e["unix_ms"] for e in events if e["event"] == "recovered"]
    summary = next(e for e in events if e["event"] == "summary")
    latencies = []
    for i, (killed, ready) in enumerate(zip(kill_ms, ready_ms)):
        # This restart's recovery: the first after its kill, before the next.
        next_kill = kill_ms[i + 1] if i + 1 < len(kill_ms) else float("inf")
        after = [r for r in recovered if killed < r < next_kill]
        latencies.append(after[0] - ready if after else None)
    shown = ["missed" if x is None else f"{x:.0f}" for x in latencies]
    print(f"restarts: {RESTARTS} in {DURATION_S} s; listen -> recovered per restart (ms): {', '.join(shown)}")
    measured = [x for x in latencies if x is not None]
    worst = max(measured) if measured else float("nan")
    print(f"worst: {worst:.0f} ms (target <= {TARGET_MS} ms); recoveries {len(recovered)}")
    print(
        f"batches done {summary['batches_done']}, failures {summary['failures']}, "
        f"verified {summary['verified_bytes']} bytes on the target: {summary['verified']}"
    )
    ok = len(measured) == RESTARTS and worst <= TARGET_MS and summary["verified"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

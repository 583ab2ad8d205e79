"""vLLM's own KV connectors on kvring, judged by tokens.

Starts vLLM servers (``python -m vllm.entrypoints.openai.api_server``) on
127.0.0.1, one core each, on a tiny Llama built here (``make_model.py``), and
does what vLLM's toy proxy does: prefill with ``max_tokens=1`` and
``do_remote_decode``, then decode with the ``kv_transfer_params`` prefill
returned. Decode's tokens must equal a single vLLM instance's for every
prompt; a prefill serving other weights of the same shape must change them
(the negative control: it proves decode used the moved KV, not its own
recompute). Then the bad input: a prefill that restarted, a request aborted
while its KV is pending, a side channel that does not answer; each must end
in a clear failure (``kv_load_failure_policy`` "fail": an error response)
and leave the server serving, never a hang.

The drop-ins are switched in as a user would: ``shims/nixl`` (``nixl._api``
and ``nixl._bindings`` are kvring.nixl) or ``shims/mooncake``
(``mooncake.engine`` is kvring.mooncake) on PYTHONPATH.

    python tests/vllm/pd_check.py --connectors nixl,mooncake

Ends with ``N passed, N failed``; exits 1 on any failure.
"""

import argparse
import json
import os
import socket
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_servers import (  # noqa: E402
    HERE,
    Server,
    complete,
    disagg_mooncake,
    disagg_nixl,
    dump_stacks,
    prompts_of,
    stop_all,
)

PROMPT_LENGTHS = (40, 75, 100, 150, 220)  # tokens; blocks are 32 (CPU attention wants a multiple of 32)
MAX_TOKENS = 12


class Tally:
    """Counts checks and prints each as it is decided."""

    def __init__(self):
        self.passed = 0
        self.failed = 0

    def check(self, name, ok, detail=""):
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        print(f"{'PASS' if ok else 'FAIL'} {name}{(': ' + detail) if detail else ''}", flush=True)
        return ok


def ensure_models(workdir, python):
    import subprocess

    models = {}
    # The same relative name in two folders: vLLM's NIXL compatibility hash
    # covers the model's name, so the negative control's other weights must
    # be served under the name decode knows (each server runs in its folder).
    for name, seed in (("model-a", 1), ("model-b", 2)):
        path = os.path.join(workdir, name, "tiny")
        if not os.path.exists(os.path.join(path, "model.safetensors")):
            subprocess.run([python, os.path.join(HERE, "make_model.py"), path, "--seed", str(seed)], check=True)
        models[name] = path
    return models


def reference(models, workdir, ports, prompts):
    """The single instance's tokens: no connector, the same flags otherwise."""
    server = Server("single", models["model-a"], ports.take(), core=0, logdir=workdir)
    try:
        server.start()
        server.wait_ready()
        return [complete(server.url, p, MAX_TOKENS)["text"] for p in prompts]
    finally:
        server.stop()


class Ports:
    """Consecutive ports from a base, so parallel runs can be kept apart."""

    def __init__(self, base):
        self.next = base

    def take(self):
        self.next += 1
        return self.next - 1


def blackhole():
    """A TCP listener that accepts and never answers: a side channel that
    does not answer (the kernel completes the handshake, nobody replies)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


def run_connector(kind, models, workdir, ports, prompts, ref, tally, bad_input, impl="kvring", b_core=0):
    """Prefill A (same weights), prefill B (other weights), decode: tokens,
    the negative control, then the bad input."""
    common = dict(logdir=workdir, connector=kind, impl=impl)
    pa = Server(f"{kind}-prefill-a", models["model-a"], ports.take(), core=0, side_port=ports.take(), **common)
    pb = Server(f"{kind}-prefill-b", models["model-b"], ports.take(), core=b_core, side_port=ports.take(), **common)
    dec = Server(f"{kind}-decode", models["model-a"], ports.take(), core=1, side_port=ports.take(), **common)
    servers = [pa, pb, dec]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        disagg = disagg_mooncake if kind == "mooncake" else disagg_nixl
        # One request per prefill first, counted by no check: the first
        # request to a prefill makes decode's handshake with it, and vLLM
        # gives that handshake a fixed 5 s receive timeout, which a 2-core
        # host under load can miss (then the next request handshakes again).
        for prefill in (pa, pb):
            warm = disagg(prefill, dec, prompts[0], 1)
            print(f"warm-up {prefill.name} -> {dec.name}: {warm.get('error') or 'ok'}", flush=True)
            stalled(warm, servers, f"warm-up {prefill.name}")
        for i, (prompt, want) in enumerate(zip(prompts, ref)):
            got = disagg(pa, dec, prompt, MAX_TOKENS)
            stalled(got, servers, f"prompt {i}")
            tally.check(f"{kind}: prompt {i} ({PROMPT_LENGTHS[i]} tokens) equals a single instance",
                        got.get("text") == want, f"got {got.get('text')!r}, want {want!r}")
        for i, (prompt, want) in enumerate(zip(prompts, ref)):
            got = disagg(pb, dec, prompt, MAX_TOKENS)
            stalled(got, servers, f"negative control {i}")
            tally.check(f"{kind}: negative control, prompt {i}: prefill with other weights changes the tokens",
                        "text" in got and got["text"] != want, f"got {got!r}")
        if bad_input and kind == "nixl":
            nixl_bad_input(pa, dec, models, prompts, ref, tally)
    finally:
        stop_all(servers)


def stalled(got, servers, what):
    """A client timeout is a stall: print what every server was doing."""
    if got.get("error") == "client timeout":
        dump_stacks(servers, f"{what}: client timeout")


def healthy_after(dec, prefill, models, prompt, want, tally, what):
    got = disagg_nixl(prefill, dec, prompt, MAX_TOKENS)
    tally.check(f"nixl: after {what}, decode still serves equal tokens", got.get("text") == want, f"got {got!r}")


def nixl_bad_input(pa, dec, models, prompts, ref, tally):
    """Each case: an error response (policy "fail") within a deadline, then
    the decode serves a normal request with equal tokens."""
    prompt, want = prompts[2], ref[2]

    # A side channel that does not answer: decode's handshake must time out.
    hole = blackhole()
    try:
        params = disagg_nixl(pa, dec, prompt, MAX_TOKENS, only_prefill=True)
        params = dict(params, remote_port=hole.getsockname()[1], remote_engine_id=str(uuid.uuid4()))
        mark = dec.log_mark()
        start = time.monotonic()
        got = complete(dec.url, prompt, MAX_TOKENS, kv_transfer_params=params, timeout=120)
        waited = time.monotonic() - start
        tally.check("nixl: a side channel that does not answer gives an error, not a hang",
                    "error" in got, f"after {waited:.1f} s: {got!r}")
        logged = [l for l in dec.log_since(mark).splitlines() if "due to KV load failure" in l]
        tally.check("nixl: vLLM's kv_load_failure_policy saw the failed handshake", bool(logged),
                    logged[0].split("] ", 1)[-1] if logged else "no 'KV load failure' line in decode's log")
    finally:
        hole.close()
    healthy_after(dec, pa, models, prompt, want, tally, "an unanswered handshake")

    # A request aborted while its KV is pending: the client goes away while
    # decode waits on a side channel that does not answer.
    hole = blackhole()
    try:
        params = disagg_nixl(pa, dec, prompt, MAX_TOKENS, only_prefill=True)
        params = dict(params, remote_port=hole.getsockname()[1], remote_engine_id=str(uuid.uuid4()))
        got = complete(dec.url, prompt, MAX_TOKENS, kv_transfer_params=params, timeout=1.5)
        tally.check("nixl: the aborted request had not finished when the client left",
                    got.get("error") == "client timeout", f"{got!r}")
        idle = dec.wait_idle(deadline_s=60)
        tally.check("nixl: decode drops the aborted request (no request left running)", idle, dec.running_line())
    finally:
        hole.close()
    healthy_after(dec, pa, models, prompt, want, tally, "an aborted request")

    # A prefill that restarted: its blocks and its engine id are gone.
    params = disagg_nixl(pa, dec, prompt, MAX_TOKENS, only_prefill=True)
    pa.restart()
    mark = dec.log_mark()
    start = time.monotonic()
    got = complete(dec.url, prompt, MAX_TOKENS, kv_transfer_params=params, timeout=120)
    waited = time.monotonic() - start
    tally.check("nixl: decode asking a restarted prefill for its blocks gets an error, not a hang",
                "error" in got, f"after {waited:.1f} s: {got!r}")
    # vLLM's scheduler logs each request its kv_load_failure_policy fails.
    logged = [l for l in dec.log_since(mark).splitlines() if "due to KV load failure" in l]
    tally.check("nixl: vLLM's kv_load_failure_policy saw the failed load", bool(logged),
                logged[0].split("] ", 1)[-1] if logged else "no 'KV load failure' line in decode's log")
    healthy_after(dec, pa, models, prompt, want, tally, "a prefill restart")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=os.path.join(HERE, "..", "..", "target", "vllm-check"))
    parser.add_argument("--connectors", default="nixl,mooncake")
    parser.add_argument("--port-base", type=int, default=int(os.environ.get("VLLM_CHECK_PORT_BASE", "28100")))
    parser.add_argument("--no-bad-input", action="store_true")
    parser.add_argument("--prefill-b-core", type=int, default=0,
                        help="prefill B's core (decode has core 1): 1 reproduces the stall of docs/VLLM.md")
    parser.add_argument("--impl", choices=("kvring", "native"), default="kvring",
                        help="native: the installed nixl / mooncake packages instead of kvring's shims (a baseline)")
    args = parser.parse_args()
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    started = time.monotonic()
    tally = Tally()
    models = ensure_models(workdir, sys.executable)
    prompts = prompts_of(PROMPT_LENGTHS)
    ports = Ports(args.port_base)
    ref = reference(models, workdir, ports, prompts)
    print("single instance:", json.dumps(ref), flush=True)
    tally.check("single instance answered every prompt", all(isinstance(t, str) and t for t in ref))
    tally.check("the prompts' outputs differ from each other", len(set(ref)) == len(ref), json.dumps(ref))
    for kind in args.connectors.split(","):
        try:
            run_connector(kind, models, workdir, ports, prompts, ref, tally, not args.no_bad_input, args.impl,
                          args.prefill_b_core)
        except Exception as error:  # a server that did not start fails the check, with its log
            tally.check(f"{kind}: servers started and answered", False, f"{type(error).__name__}: {error}")
    print(f"took {time.monotonic() - started:.0f} s", flush=True)
    print(f"{tally.passed} passed, {tally.failed} failed", flush=True)
    sys.exit(1 if tally.failed else 0)


if __name__ == "__main__":
    main()

"""A small disaggregated engine on kvring, checked against transformers.

    python examples/pd/run.py --check      # every mode, both models; exit 0 only if every token matches
    python examples/pd/run.py --figures    # TTFT split, layer-wise push beside whole-cache push

This process is the router: it computes the expected tokens with
transformers' own ``generate`` (the referee), starts prefill and decode
processes (``worker.py``), hands them requests and compares what decode
returns. The KV cache moves between the workers through kvring only.
"""

import argparse
import multiprocessing
import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import model as pdmodel  # noqa: E402
import netns  # noqa: E402
import worker  # noqa: E402

NEW_TOKENS = 8
PROMPT_LENGTHS = [5, 16, 17, 40, 63, 100]
BLOCKS = 96
START_S = 300.0  # a worker must answer within this (startup imports torch: slow on a loaded machine)


class WorkerDied(Exception):
    pass


def receive(conn, what, timeout=START_S):
    if not conn.poll(timeout):
        raise WorkerDied(f"{what}: no answer within {timeout} s")
    try:
        message = conn.recv()
    except EOFError:
        raise WorkerDied(f"{what}: the process ended") from None
    if "crash" in message:
        raise WorkerDied(f"{what} crashed:\n{message['crash']}")
    return message


class Cluster:
    """Prefill at ``src_tp`` ranks and decode at ``dst_tp`` ranks, one
    process each, wired through kvring."""

    def __init__(self, kind, mode, src_tp=1, dst_tp=1, blocks=BLOCKS, prefill_listen=None, transport=None, hosts=None):
        """``hosts``: a ``netns.TwoHosts``: prefill runs in its namespace
        ``a`` and decode in ``b``, each listening on its veth address."""
        self.transport, self.hosts = transport, hosts
        self.kind, self.mode, self.src_tp, self.dst_tp, self.blocks = kind, mode, src_tp, dst_tp, blocks
        self.ctx = multiprocessing.get_context("spawn")
        self.prefill_listen = prefill_listen
        self.kv_heads = pdmodel.kv_heads(kind)
        self.decodes = [self.spawn(worker.decode_main, rank, dst_tp) for rank in range(dst_tp)]
        self.prefills = [self.spawn(worker.prefill_main, rank, src_tp) for rank in range(src_tp)]
        self.decode_addrs = [receive(c, f"decode {r}")["address"] for r, (_, c) in enumerate(self.decodes)]
        self.prefill_addrs = [receive(c, f"prefill {r}")["address"] for r, (_, c) in enumerate(self.prefills)]
        for rank in range(src_tp):
            self.wire_prefill(rank)
        for rank, (_, conn) in enumerate(self.decodes):
            sources = worker.sources_of(rank, src_tp, dst_tp, self.kv_heads)
            source = sources[0]
            wiring = {"source": self.peer_name("prefill", source, self.prefill_addrs),
                      "sources": [self.peer_name("prefill", s, self.prefill_addrs) for s in sources]}
            if self.kv_heads is not None and dst_tp == 2:  # the other decode rank, which holds the other heads
                wiring["peer"] = self.decode_addrs[1 - rank]
            conn.send(wiring)
            if mode == "pull":
                conn.send({"metadata": [self.prefill_addrs[s] for s in sources]})
        self.transports = set()
        for what, group in (("prefill", self.prefills), ("decode", self.decodes)):
            for rank, (_, conn) in enumerate(group):
                self.transports.update(receive(conn, f"{what} {rank} wiring").get("transports", {}).values())

    def spawn(self, main, rank, tp):
        here, there = self.ctx.Pipe()
        prefill = main is worker.prefill_main
        other_tp = self.dst_tp if prefill else self.src_tp
        args = (there, self.kind, self.mode, rank, tp if prefill else other_tp, other_tp if prefill else tp, self.blocks)
        place = self.hosts.place("prefill" if prefill else "decode") if self.hosts is not None else None
        listen = f"{place[1]}:0" if place is not None else None
        if prefill:
            args = args + (self.prefill_listen or listen, self.transport)
        else:
            args = args + (self.transport, listen)
        if place is not None:  # the worker enters its namespace first thing
            main, args = netns.hosted, (place, main) + args
        process = self.ctx.Process(target=main, args=args, daemon=True)
        process.start()
        return process, here

    def peer_name(self, role, rank, addrs):
        return f"{role}-{rank}" if self.mode == "pull" else addrs[rank]

    def wire_prefill(self, rank):
        conn = self.prefills[rank][1]
        targets = worker.push_targets(rank, self.src_tp, self.dst_tp, self.kv_heads)
        conn.send({"decoders": {d: self.peer_name("decode", d, self.decode_addrs) for d in targets}})
        if self.mode == "pull":
            conn.send({"metadata": [self.decode_addrs[d] for d in targets]})

    def restart_prefill(self, rank):
        """A fresh prefill process in place of a dead one (same listen
        address when one was given: decode sees a restarted peer)."""
        process, conn = self.prefills[rank]
        process.join(5)
        self.prefills[rank] = self.spawn(worker.prefill_main, rank, self.src_tp)
        self.prefill_addrs[rank] = receive(self.prefills[rank][1], f"prefill {rank}")["address"]
        self.wire_prefill(rank)
        receive(self.prefills[rank][1], f"prefill {rank} wiring")
        for d, (_, dconn) in enumerate(self.decodes):
            if d % self.src_tp == rank:
                dconn.send({"source": self.peer_name("prefill", rank, self.prefill_addrs)})

    def run(self, requests, timeout=START_S):
        """Sends ``requests`` to every rank; returns each decode rank's
        results {req: {"tokens", "error", "timing"}}."""
        for process, conn in self.prefills:
            if process.is_alive():
                conn.send({"requests": requests})
        for _, conn in self.decodes:
            conn.send({"requests": requests})
        return [receive(conn, f"decode {r}", timeout)["results"] for r, (_, conn) in enumerate(self.decodes)]

    def run_reuse(self, a, b, a2, timeout=START_S):
        """The block-reuse fault case (decode's ``reuse``)."""
        self.prefills[0][1].send({"requests": [a, b, a2]})
        self.decodes[0][1].send({"reuse": {"a": a, "b": b, "a2": a2}})
        return receive(self.decodes[0][1], "decode 0", timeout)["results"]

    def stop(self):
        for process, conn in self.prefills + self.decodes:
            if process.is_alive():
                try:
                    conn.send({"stop": True})
                except (BrokenPipeError, OSError):
                    pass
        for process, _ in self.prefills + self.decodes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()


class Referee:
    """Expected tokens per (model, prompt), from transformers' generate."""

    def __init__(self):
        self.models, self.cache = {}, {}

    def expected(self, kind, prompt, new):
        key = (kind, tuple(prompt), new)
        if key not in self.cache:
            if kind not in self.models:
                self.models[kind] = pdmodel.build(kind)
            self.cache[key] = pdmodel.reference(self.models[kind], prompt, new)
        return self.cache[key]


class Tally:
    def __init__(self):
        self.passed, self.failed = 0, 0

    def check(self, label, ok, detail=""):
        if ok:
            self.passed += 1
            print(f"ok    {label}")
        else:
            self.failed += 1
            print(f"FAIL  {label}: {detail}")
        sys.stdout.flush()


def compare(tally, referee, kind, label, requests, results):
    """Each decode rank's tokens of each request against the referee."""
    for rank, per_rank in enumerate(results):
        for request in requests:
            rid = request["req"]
            name = f"{kind} {label} decode rank {rank} request {rid} ({len(request['prompt'])}-token prompt)"
            got = per_rank.get(rid) or per_rank.get(str(rid))
            want = referee.expected(kind, request["prompt"], request["new"])
            if got is None:
                tally.check(name, False, "no result")
            elif got["error"]:
                tally.check(name, False, f"failed: {got['error']}")
            elif got["tokens"] != want:
                at = next((i for i, (a, b) in enumerate(zip(got["tokens"], want)) if a != b), min(len(got["tokens"]), len(want)))
                tally.check(name, False, f"first differing position {at}: got {got['tokens']}, expected {want}")
            else:
                tally.check(name, True)


def make_requests(kind, count, lengths=PROMPT_LENGTHS, new=NEW_TOKENS, first_id=0, seed=7):
    prompts = pdmodel.prompts(count, lengths, seed=seed)
    return [{"req": first_id + i, "prompt": p, "new": new} for i, p in enumerate(prompts)]


def run_mode(tally, referee, kind, mode, src_tp=1, dst_tp=1, transport=None, hosts=None):
    """``hosts``: prefill and decode in two network namespaces (``netns``),
    the transport left to kvring's order; asserts it took tcp."""
    label = f"{mode} tp {src_tp}->{dst_tp}" + (" across two network namespaces" if hosts else "")
    requests = make_requests(kind, len(PROMPT_LENGTHS))
    cluster = None
    try:
        cluster = Cluster(kind, mode, src_tp, dst_tp, transport=transport, hosts=hosts)
        if cluster.transports:
            label += " over " + ",".join(sorted(cluster.transports))
        if hosts is not None:
            tally.check(f"{kind} {label}: kvring's order took tcp to every decode rank (prefill {hosts.a_ip}, "
                        f"decode {hosts.b_ip})", cluster.transports == {"tcp"}, f"took {sorted(cluster.transports)}")
        results = cluster.run(requests)
        compare(tally, referee, kind, label, requests, results)
        # A second round reuses the blocks the first one freed.
        again = make_requests(kind, 3, lengths=[33, 7, 64], first_id=100, seed=11)
        more = cluster.run(again)
        compare(tally, referee, kind, label + " (blocks reused)", again, more)
        if hosts is not None:
            # Tagged bytes are counted by decode's engine as its tcp (or
            # RDMA) receiver writes them; a write over cma or shm is never
            # seen there (kvring refuses to tag it).
            untagged = [rid for per_rank in results + more for rid, r in per_rank.items() if not r.get("tagged")]
            tally.check(f"{kind} {label}: every request's layers landed as tagged bytes decode's engine counted "
                        f"on arrival", not untagged, f"requests {untagged} were not")
        if pdmodel.kv_heads(kind) is not None and src_tp != dst_tp:
            swapped_heads(tally, referee, kind, label, cluster)
    except WorkerDied as error:
        tally.check(f"{kind} {label}", False, str(error))
    finally:
        if cluster is not None:
            cluster.stop()


def across_hosts(tally, referee, kinds):
    """Prefill in one network namespace, decode in another, joined by a
    veth pair: KV over tcp between two hosts (docs/PD.md). Skipped, saying
    why, without root or ``ip``; under CI that is a failure."""
    why, hosts = netns.unavailable(), None
    if why is None:
        try:
            hosts = netns.TwoHosts().__enter__()
        except RuntimeError as error:  # root, but no permission for namespaces (a container)
            why = str(error)
    if hosts is None:
        if os.environ.get("CI"):
            tally.check("push across two network namespaces", False, f"CI must run this mode: {why}")
        else:
            print(f"SKIPPED push across two network namespaces over tcp: {why}")
        return
    try:
        for kind in kinds:
            run_mode(tally, referee, kind, "push", hosts=hosts)
        # The control: two processes inside one of the namespaces, which
        # kvring's order joins by cma; so the tcp asserted above is the
        # namespace boundary's doing, and the assertion can fail.
        try:
            took = netns.one_namespace_transport(hosts)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
            took = f"error: {error}"
        tally.check(f"control: two processes in one of those namespaces: kvring's order took {took} (a same-host "
                    f"transport, not tcp)", took in ("cma", "shm"), took)
    finally:
        hosts.__exit__()


def swapped_heads(tally, referee, kind, label, cluster):
    """The negative control of heterogeneous TP for Llama: prefill stores
    the two halves of the KV heads in each other's place (at tp 2 each rank
    stores the other's half; at tp 1 the halves swapped), so each half
    lands where the other belongs. Every decode rank's tokens must differ
    from generate's: the check sees where the heads landed, not only that
    bytes arrived."""
    requests = make_requests(kind, 2, lengths=[40, 63], first_id=500, seed=17)
    for request in requests:
        request["swap_heads"] = True
    for rank, per_rank in enumerate(cluster.run(requests)):
        for request in requests:
            got = per_rank.get(request["req"])
            want = referee.expected(kind, request["prompt"], request["new"])
            tally.check(f"{kind} {label} negative control: KV head halves swapped, decode rank {rank} request "
                        f"{request['req']} tokens differ", got is not None and not got["error"] and got["tokens"] != want,
                        repr(got))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fault_kill(tally, referee, kind):
    """Prefill killed (SIGKILL) after pushing layer 1 of a request: decode's
    request fails with kvring's error naming the peer, never wrong tokens;
    a new prefill on the same address serves the next requests."""
    addr = f"127.0.0.1:{free_port()}"
    cluster = None
    try:
        cluster = Cluster(kind, "push", prefill_listen=addr, transport="tcp")
        request = make_requests(kind, 1, lengths=[60], first_id=200)[0]
        request.update(die_after_layer=1, push_delay_s=0.05)
        got = cluster.run([request])[0]
        got = got.get(200) or got.get("200")
        error = (got or {}).get("error") or ""
        tally.check(f"{kind} fault: prefill killed mid-push fails the request with kvring's error naming {addr}",
                    addr in error and "Error" in error and not got["tokens"][1:], repr(got))
        print(f"      decode said: {error}")
        cluster.restart_prefill(0)
        after = make_requests(kind, 2, lengths=[30, 50], first_id=210, seed=13)
        compare(tally, referee, kind, "push after prefill restarted", after, cluster.run(after))
    except WorkerDied as error:
        tally.check(f"{kind} fault: prefill killed mid-push", False, str(error))
    finally:
        if cluster is not None:
            cluster.stop()


def fault_reuse(tally, referee, kind):
    """Decode gives up request A while its push is in flight and reuses A's
    blocks for B: no write of A may land in B's blocks. B's tokens and a
    fresh run of A's prompt are checked."""
    cluster = None
    try:
        cluster = Cluster(kind, "push", transport="tcp")
        prompts = pdmodel.prompts(2, [90, 70], seed=21)
        a = {"req": 300, "prompt": prompts[0], "new": NEW_TOKENS, "push_delay_s": 0.05}
        b = {"req": 301, "prompt": prompts[1], "new": NEW_TOKENS}
        a2 = {"req": 302, "prompt": prompts[0], "new": NEW_TOKENS}
        got = cluster.run_reuse(a, b, a2)
        if "error" in got:
            tally.check(f"{kind} fault: block reuse", False, got["error"])
            return
        ga, gb = got[300], got[301]
        layers = pdmodel.build(kind).config.num_hidden_layers
        in_flight = 0 < len(ga["landed_before_abort"]) < layers
        shared = sorted(set(ga["blocks"]) & set(gb["blocks"]))
        tally.check(f"{kind} fault: request A given up mid-push ({len(ga['landed_before_abort'])} of {layers} layers landed), "
                    f"B reuses its blocks {shared}", ga["aborted"] and in_flight and bool(shared), repr(ga))
        compare(tally, referee, kind, "push, blocks reused mid-push", [b, a2], [got])
    except WorkerDied as error:
        tally.check(f"{kind} fault: block reuse", False, str(error))
    finally:
        if cluster is not None:
            cluster.stop()


def negative_control(tally, referee, kind):
    """The check can fail: a layer that prefill never moved, read by a
    decode that does not wait for it, leaves decode reading stale blocks,
    and the tokens differ. And decode's wait is what prevents it: waiting
    for the layer's tagged bytes, the same request fails (no tokens) at
    its deadline instead."""
    cluster = None
    try:
        cluster = Cluster(kind, "push", transport="tcp")
        requests = make_requests(kind, 2, lengths=[40, 63], first_id=400, seed=5)
        cluster.run(requests)  # fills the blocks with these requests' KV
        stale = make_requests(kind, 2, lengths=[40, 63], first_id=410, seed=6)
        for request in stale:
            request.update(skip_layer=1, trust_layer=1)
        got = cluster.run(stale)[0]
        for request in stale:
            r = got.get(request["req"])
            want = referee.expected(kind, request["prompt"], request["new"])
            tally.check(f"{kind} negative control: layer 1 not moved for request {request['req']} is caught",
                        r is not None and not r["error"] and r["tokens"] != want, repr(r))
        waited = make_requests(kind, 1, lengths=[40], first_id=420, seed=7)[0]
        waited.update(skip_layer=1, wait_s=2.0)
        r = cluster.run([waited])[0].get(waited["req"])
        tally.check(f"{kind} negative control: decode waiting for layer 1's tagged bytes fails request "
                    f"{waited['req']} at its deadline, with no token past the first",
                    r is not None and bool(r["error"]) and not r["tokens"][1:], repr(r))
    except WorkerDied as error:
        tally.check(f"{kind} negative control", False, str(error))
    finally:
        if cluster is not None:
            cluster.stop()


def check(args):
    import kvring

    tally, referee = Tally(), Referee()
    kinds = args.models.split(",")
    if args.only_netns:
        across_hosts(tally, referee, kinds)
        print(f"{tally.passed} passed, {tally.failed} failed")
        return 1 if tally.failed else 0
    for kind in kinds if not args.only_tp else []:
        for mode in args.modes.split(","):
            run_mode(tally, referee, kind, mode)
    if "push" in args.modes.split(",") and not args.only_tp:
        # The default above is kvring's order: cma for the model's own
        # memory (cuda_ipc for a GPU's); shm pools are host memory.
        for transport in ("tcp", "shm") if pdmodel.device().type == "cpu" else ("tcp",):
            run_mode(tally, referee, kinds[0], "push", transport=transport)
    if "mla" in kinds and not args.skip_tp:
        run_mode(tally, referee, "mla", "push", 2, 1, transport="tcp")
        run_mode(tally, referee, "mla", "push", 1, 2, transport="tcp")
    if "llama" in kinds and not args.skip_tp:
        for src_tp, dst_tp in ((2, 1), (1, 2)):
            verdict, reason = kvring.check_pd_topo((1, src_tp, 0, 0), (1, dst_tp, 0, 0), "push", "mha")
            tally.check(f"llama tp {src_tp}->{dst_tp}: kvring's KV layer routes a head-split cache across tp sizes",
                        verdict == "heterogeneous", f"{verdict}: {reason}")
            run_mode(tally, referee, "llama", "push", src_tp, dst_tp, transport="tcp")
        if "pull" in args.modes.split(","):
            # vLLM's NIXL connector, prefill at tp 2: decode (tp 1) READs
            # each prefill rank's half of the heads into its place.
            run_mode(tally, referee, "llama", "pull", 2, 1)
    if not args.skip_netns and not args.only_tp:
        across_hosts(tally, referee, kinds)
    if not args.skip_faults and not args.only_tp:
        negative_control(tally, referee, kinds[0])
        fault_kill(tally, referee, kinds[0])
        fault_reuse(tally, referee, kinds[0])
    print(f"{tally.passed} passed, {tally.failed} failed")
    return 1 if tally.failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="run every mode and compare every token")
    parser.add_argument("--figures", action="store_true", help="TTFT split, layer-wise vs whole-cache push")
    parser.add_argument("--models", default="llama,mla")
    parser.add_argument("--modes", default="push,pull,mooncake")
    parser.add_argument("--skip-tp", action="store_true")
    parser.add_argument("--skip-faults", action="store_true")
    parser.add_argument("--only-tp", action="store_true",
                        help="only the heterogeneous-TP cases (of --models), no other mode nor fault case")
    parser.add_argument("--skip-netns", action="store_true", help="not the two-network-namespace mode")
    parser.add_argument("--only-netns", action="store_true",
                        help="only push across two network namespaces (of --models), and its control")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the models and the pools live (cuda: not yet run on a GPU, docs/PD.md)")
    parser.add_argument("--rounds", type=int, default=11, help="--figures: rounds per mode (the first warms up)")
    parser.add_argument("--prompt", type=int, default=512, help="--figures: prompt tokens")
    args = parser.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: --device cuda needs one (torch.cuda.is_available() is False)", file=sys.stderr)
            return 2
    os.environ["PD_DEVICE"] = args.device  # the workers (spawned) inherit it
    pdmodel.deterministic()
    if args.figures:
        import figures

        return figures.main(args)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())

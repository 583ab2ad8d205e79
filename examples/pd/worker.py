"""The prefill and decode processes.

Each runs the transformers model over its own paged pools (``model.py``),
registered with kvring once, and talks to its peers through kvring: block
tables and "layer landed" messages are kvring notifications, KV moves as
kvring batches. The orchestrator (``run.py``) only hands out requests and
collects tokens, over a pipe, as a router does.

Modes (how the KV of a request gets from prefill to decode):

- ``push``: prefill pushes each layer's blocks (``Engine.push_layer_tagged``:
  kvring's KV layer turns block ids into coalesced descriptors, each write
  tagged with the request's slot and the layer) as soon as the model wrote
  that layer, from a pusher thread, while the main thread computes the
  next layer. Decode granted each layer's tag the blocks it gave the
  request (``Engine.grant_arrival``) and waits per layer inside its first
  forward until that layer's bytes are in place (``Engine.wait_landed``):
  no notification per layer. Over a link whose target cannot count tags
  (shm, cma: the initiator copies into the target's memory itself) the
  push is ``Engine.push_layer`` and a notification says the layer landed.
- ``whole``: the baseline for the figures: every layer pushed once, after
  the last layer (``Engine.push_blocks``).
- ``pull``: vLLM's NIXL connector: prefill tells decode its block ids,
  decode READs them through ``kvring.nixl`` with a notification back, and
  prefill frees its blocks when that notification arrives.
- ``mooncake``: LMDeploy's / SGLang's Mooncake backends: decode sends its
  pool addresses and block table; prefill writes each layer with
  ``kvring.mooncake.TransferEngine.batch_transfer_sync`` and a
  ``TransferNotify`` (sent after the bytes are in place).

Heterogeneous TP (``push`` over tcp): for MLA each decode rank is served
whole by one prefill rank; for Llama each rank holds a share of the KV
heads and prefill pushes each decode rank the heads they share
(``Engine.push_layer_heads_tagged``); a decode rank at TP 2 gathers its
peer's half through kvring into mirror blocks before decoding (docs/PD.md).
"""

import json
import os
import queue
import signal
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import model as pdmodel  # noqa: E402
from model import BlockAllocator, PagedCache, PoolSpec  # noqa: E402

WAIT_S = 20.0  # every wait on a peer has this deadline
PROBE_S = 0.5  # how often a waiting decode checks that its prefill is there
# The transports whose target counts arrival tags (kvring counts them as
# the bytes land: tcp frames, RDMA immediates); on shm and cma the
# initiator writes the target's memory itself, so nothing there sees them.
TAGGED_TRANSPORTS = ("tcp", "rdma")
MAX_SLOT = (1 << 20) - 1  # kvring.arrival_tag's request slots: 1 ..= 2**20 - 1


def push_targets(src_rank, src_tp, dst_tp, kv_heads=None):
    """The decode ranks a prefill rank pushes to, by kvring's KV layer
    (``kvring.push_targets``): for MLA (``kv_heads`` None) destination
    ``d`` is served by source ``d % src_tp``; for Llama (KV heads split
    across ranks) every destination holding a head the source holds."""
    import kvring

    return kvring.push_targets(src_rank, src_tp, dst_tp, kv_heads)


def sources_of(dst_rank, src_tp, dst_tp, kv_heads=None):
    """The prefill ranks that push into decode rank ``dst_rank``."""
    return [s for s in range(src_tp) if dst_rank in push_targets(s, src_tp, dst_tp, kv_heads)]


def tp_heads(spec, tp, rank, swapped=False):
    """The model's KV heads rank ``rank`` of ``tp`` stores, in pool order
    (all of them at tp 1). ``swapped``: the negative control, a rank that
    stores the other half of the heads in place of its own (at tp 1, the
    two halves in swapped order), so every head it moves is misplaced."""
    total = spec.kv_heads_total
    if not swapped:
        return slice(rank * total // tp, (rank + 1) * total // tp) if tp > 1 else None
    half = total // 2
    order = list(range(half, total)) + list(range(half))
    return order[rank * total // tp:(rank + 1) * total // tp]


class Channel:
    """Messages (JSON) between the two sides, over kvring's notifications
    in the mode's own API."""

    def __init__(self, mode, endpoint, name):
        self.mode, self.endpoint, self.name = mode, endpoint, name

    def send(self, peer, message):
        """Sends ``message``; a peer that restarted since we opened it is
        reopened once (kvring evicts a stale handle and the next call to
        that name opens it afresh)."""
        from kvring import PeerRestartedError

        try:
            self._send(peer, json.dumps(message))
        except PeerRestartedError:
            self._send(peer, json.dumps(message))

    def probe(self, peer):
        """Raises kvring's error if ``peer`` cannot be reached."""
        self._send(peer, "probe")

    def _send(self, peer, data):
        if self.mode == "pull":
            self.endpoint.send_notif(peer, data)
        elif self.mode == "mooncake":
            # Mooncake's notifications are "sender\0message" on the wire.
            self.endpoint.get_engine().notify(peer, f"{self.name}\0{data}".encode())
        else:
            self.endpoint.notify(peer, data)

    def recv(self):
        if self.mode == "pull":
            raw = [m for messages in self.endpoint.get_new_notifs().values() for m in messages]
        elif self.mode == "mooncake":
            raw = [n.msg for n in self.endpoint.get_notifies()]
        else:
            raw = [m for _, m in self.endpoint.notifications()]
        out = []
        for message in raw:
            text = message.decode() if isinstance(message, bytes) else message
            if text.startswith("{"):
                out.append(json.loads(text))
        return out


def make_endpoint(mode, name, spec, listen=None, transport=None):
    """The mode's engine object and the pools, registered once; returns
    (endpoint, address for peers, pools). The pools are memory this process
    allocated itself (``torch.zeros``: kvring reaches it by cma on one host,
    or tcp), or with ``transport="shm"`` kvring's shared memory
    (``Engine.alloc``) seen as a tensor."""
    import ctypes

    import kvring

    if transport == "shm" and pdmodel.device().type != "cpu":
        raise ValueError("shm pools are kvring's shared host memory: CPU tensors only")
    pools = spec.allocate() if transport != "shm" else None

    if mode == "pull":
        from kvring.nixl import nixl_agent, nixl_agent_config

        agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        memory, dev = nixl_memory(pools)
        agent.register_memory([(pools.data_ptr(), pools.nbytes, dev, "")], memory)
        return agent, agent.get_agent_metadata(), pools
    if mode == "mooncake":
        from kvring.mooncake import TransferEngine

        engine = TransferEngine()
        if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("mooncake initialize failed")
        if engine.register_memory(pools.data_ptr(), pools.nbytes) != 0:
            raise RuntimeError("mooncake register_memory failed")
        return engine, f"127.0.0.1:{engine.get_rpc_port()}", pools
    engine = kvring.Engine(name=name, listen=listen or "127.0.0.1:0")
    if transport == "shm":
        nbytes = 4 * int(torch.Size(spec.shape).numel())
        region, addr = engine.alloc(nbytes)
        memory = (ctypes.c_char * nbytes).from_address(addr)
        pools = torch.frombuffer(memory, dtype=torch.float32).view(spec.shape)
    else:
        region = engine.register(pools)
    return (engine, region), engine.control_addr, pools


def nixl_memory(pools):
    """NIXL's memory type and device id of the pools ("VRAM" on a GPU)."""
    return ("VRAM", pools.get_device()) if pools.is_cuda else ("DRAM", 0)


def written():
    """On a GPU, an event after the work queued so far (a layer's write
    into the pool is queued, not done, when the model returns from it):
    the pusher waits for it before kvring reads the pool. None on the CPU."""
    if pdmodel.device().type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def block_descs(spec, base, blocks, layers=None):
    """(address, length) of every (layer, kind, block), layer-major."""
    out = []
    for layer in range(spec.layers) if layers is None else layers:
        for kind in range(spec.kinds):
            for block in blocks:
                out.append((base + spec.block_offset(layer, kind, block), spec.block_bytes))
    return out


# Prefill ---------------------------------------------------------------------


def prefill_main(conn, kind, mode, rank, src_tp, dst_tp, blocks, listen=None, transport=None):
    try:
        Prefill(conn, kind, mode, rank, src_tp, dst_tp, blocks, listen, transport).run()
    except BaseException:
        conn.send({"crash": traceback.format_exc()})
        raise


class Prefill:
    def __init__(self, conn, kind, mode, rank, src_tp, dst_tp, blocks, listen=None, transport=None):
        self.conn, self.mode, self.rank = conn, mode, rank
        self.model = pdmodel.build(kind)
        self.kv_heads = pdmodel.kv_heads(kind)
        self.src_tp, self.dst_tp = src_tp, dst_tp
        # Llama across tp sizes: this rank stores its share of the heads,
        # and pushes each decode rank the heads they share.
        self.split = self.kv_heads is not None and src_tp != dst_tp
        self.spec = PoolSpec(self.model, blocks, tp=src_tp if self.kv_heads is not None else 1)
        self.allocator = BlockAllocator(blocks)
        self.name = f"prefill-{rank}"
        endpoint, address, self.pools = make_endpoint(mode, self.name, self.spec, listen, transport)
        if mode in ("push", "whole"):
            self.engine, region = endpoint
            attention, dims = self.spec.layout()
            self.engine.set_kv_layout(attention, dims, region)
            self.channel = Channel(mode, self.engine, self.name)
        else:
            self.engine = endpoint
            self.channel = Channel(mode, endpoint, self.name)
        self.targets = push_targets(rank, src_tp, dst_tp, self.kv_heads)
        conn.send({"address": address})
        self.decoders = conn.recv()["decoders"]  # rank -> address (or nixl name)
        used = {}
        if mode == "pull":
            for metadata in conn.recv()["metadata"]:
                self.engine.add_remote_agent(metadata)
        elif mode in ("push", "whole"):
            for rank_, peer in self.decoders.items():
                used[rank_] = self.engine.open_segment(peer, transport)  # None: kvring's order
        # Links whose target counts arrival tags: the layer-wise push is
        # tagged there, and needs no "landed" notification.
        self.tagged = {peer for rank_, peer in self.decoders.items() if used.get(rank_) in TAGGED_TRANSPORTS}
        conn.send({"ready": True, "transports": used})
        self.work = queue.Queue()
        self.pusher = threading.Thread(target=self.push_loop, daemon=True)
        self.pusher.start()
        self.tables = {}  # request -> {decode rank: message}
        self.aborted = set()
        self.requests = {}
        self.held = {}  # request -> our blocks, freed once the push (or pull) ended

    def run(self):
        pending = []
        while True:
            if self.conn.poll():
                message = self.conn.recv()
                if "stop" in message:
                    self.work.put(None)
                    self.pusher.join(WAIT_S)
                    return
                pending.extend(message["requests"])
            for message in self.channel.recv():
                if "table" in message:
                    self.tables.setdefault(message["req"], {})[message["rank"]] = message
                elif "pulled" in message:
                    self.allocator.give_back(self.held.pop(message["pulled"]))
                elif "abort" in message:
                    # Decode gave up the request: no push of it may start
                    # from now on, and decode hears back once none is in
                    # flight (the pusher handles items in order).
                    self.aborted.add(message["abort"])
                    pending = [r for r in pending if r["req"] != message["abort"]]
                    self.work.put(("abort", message["abort"], None, None, {message["rank"]: None}))
            for request in list(pending):
                tables = self.tables.get(request["req"], {})
                if all(t in tables for t in self.targets):
                    pending.remove(request)
                    self.prefill(request, self.tables.pop(request["req"], {}))
            time.sleep(0.0002)

    def prefill(self, request, tables):
        rid, prompt = request["req"], request["prompt"]
        self.requests[rid] = request
        ours = self.allocator.take(len(prompt))
        self.held[rid] = ours
        layered = self.mode in ("push", "mooncake")

        def after_write(layer):
            if layered:
                self.work.put(("layer", rid, layer, ours, tables, written()))

        heads = None
        if self.kv_heads is not None and (self.src_tp > 1 or request.get("swap_heads")):
            heads = tp_heads(self.spec, self.src_tp, self.rank, swapped=bool(request.get("swap_heads")))
        cache = PagedCache(self.spec, self.pools, ours, heads=heads, after_write=after_write)
        start = time.monotonic()
        with torch.no_grad():
            # logits_to_keep=1: the LM head on the last position only, as
            # generate and serving engines do.
            input_ids = torch.tensor([prompt], device=self.pools.device)
            logits = pdmodel.forward(self.model, cache, input_ids=input_ids, logits_to_keep=1).logits
        first = int(logits[0, -1].argmax())
        end = time.monotonic()
        timing = {"compute_start": start, "compute_end": end}
        for rank in self.targets:
            # "tagged": this request's layers come tagged (decode waits for
            # their bytes), not each with a "landed" notification.
            tagged = self.mode == "push" and self.decoders[rank] in self.tagged
            self.channel.send(self.decoders[rank], {"first": rid, "token": first, "tagged": tagged, **timing})
        if self.mode == "whole":
            self.work.put(("whole", rid, None, ours, tables))
        elif self.mode == "pull":
            for rank in self.targets:
                self.channel.send(self.decoders[rank], {"ready": rid, "blocks": ours, "base": self.pools.data_ptr(),
                                                        "source": self.name})
        if self.mode != "pull":
            self.work.put(("free", rid, None, ours, tables))

    def push_loop(self):
        """The pusher thread: moves each item as it comes, in order."""
        while True:
            item = self.work.get()
            if item is None:
                return
            what, rid, layer, ours, tables, *event = item
            if what == "free":
                self.allocator.give_back(self.held.pop(rid))
                continue
            if what == "abort":
                for rank in tables:
                    self.channel.send(self.decoders[rank], {"aborted": rid})
                continue
            if rid in self.aborted:
                continue
            if event and event[0] is not None:
                event[0].synchronize()  # the layer's K/V are in the pool (GPU)
            request = self.requests[rid]
            time.sleep(request.get("push_delay_s", 0.0))  # a slow link, for the fault cases
            for rank, table in tables.items():
                peer = self.decoders[rank]
                try:
                    if what == "whole":
                        self.engine.push_blocks(peer, ours, table["blocks"][: len(ours)], timeout=WAIT_S)
                        layers = list(range(self.spec.layers))
                    elif self.mode == "push" and request.get("skip_layer") == layer:
                        # The negative control: move nothing (and, where
                        # layers are announced, say it landed).
                        layers = [] if peer in self.tagged else [layer]
                    elif self.mode == "push" and self.split:
                        # kvring's head-sliced plan: the heads this rank
                        # shares with decode rank `rank`, at their place in
                        # its blocks (tagged: tcp only).
                        theirs = table["blocks"][: len(ours)]
                        self.engine.push_layer_heads_tagged(
                            peer, layer, table["slot"], ours, theirs, self.spec.heads(),
                            (self.src_tp, self.rank), (self.dst_tp, rank), timeout=WAIT_S,
                        )
                        layers = []
                    elif self.mode == "push" and peer in self.tagged:
                        theirs = table["blocks"][: len(ours)]
                        self.engine.push_layer_tagged(peer, layer, table["slot"], ours, theirs, timeout=WAIT_S)
                        layers = []  # decode waits for the bytes themselves
                    elif self.mode == "push":
                        self.engine.push_layer(peer, layer, ours, table["blocks"][: len(ours)], timeout=WAIT_S)
                        layers = [layer]
                    else:
                        self.mooncake_layer(peer, layer, ours, table)
                        continue  # its TransferNotify says it landed
                    if layers:
                        self.channel.send(peer, {"landed": rid, "layers": layers, "t": time.monotonic()})
                    if layer is not None and request.get("die_after_layer") == layer:
                        os.kill(os.getpid(), signal.SIGKILL)  # the fault case: killed mid-push
                except Exception as error:  # the request fails; the message names why
                    self.channel.send(peer, {"failed": rid, "error": f"{type(error).__name__}: {error}"})

    def mooncake_layer(self, peer, layer, ours, table):
        from kvring.mooncake import TransferNotify, TransferOpcode

        local = block_descs(self.spec, self.pools.data_ptr(), ours, [layer])
        remote = block_descs(self.spec, table["base"], table["blocks"][: len(ours)], [layer])
        message = json.dumps({"landed": table["req"], "layers": [layer], "t": time.monotonic()})
        code = self.engine.batch_transfer_sync(
            peer, [a for a, _ in local], [a for a, _ in remote], [n for _, n in local],
            TransferOpcode.Write, TransferNotify(self.name, message),
        )
        if code != 0:
            raise RuntimeError(f"batch_transfer_sync to {peer} returned {code} (the reason is on the kvring.mooncake logger)")


# Decode ----------------------------------------------------------------------


def decode_main(conn, kind, mode, rank, src_tp, dst_tp, blocks, transport=None, listen=None):
    try:
        Decode(conn, kind, mode, rank, src_tp, dst_tp, blocks, transport, listen).run()
    except BaseException:
        conn.send({"crash": traceback.format_exc()})
        raise


class RequestFailed(Exception):
    pass


class Decode:
    def __init__(self, conn, kind, mode, rank, src_tp, dst_tp, blocks, transport=None, listen=None):
        self.conn, self.mode, self.rank = conn, mode, rank
        self.model = pdmodel.build(kind)
        kv_heads = pdmodel.kv_heads(kind)
        # Llama at decode tp 2: this rank receives its half of the heads
        # from prefill into blocks [0, blocks); its peer decode rank's half
        # of the same request lands in our "mirror" blocks [blocks, 2 *
        # blocks) (the peer pushes it through kvring once its own half has
        # landed), and this rank decodes over both halves.
        self.mirror = kv_heads is not None and dst_tp > 1
        if self.mirror and dst_tp != 2:
            raise NotImplementedError("this example assembles a head-split decode cache at tp 2 only")
        self.blocks = blocks
        self.spec = PoolSpec(self.model, 2 * blocks if self.mirror else blocks, tp=dst_tp if kv_heads else 1)
        self.allocator = BlockAllocator(blocks)
        self.name = f"decode-{rank}"
        endpoint, address, self.pools = make_endpoint(mode, self.name, self.spec, listen, transport)
        if mode in ("push", "whole"):
            self.engine, self.region = endpoint
            attention, dims = self.spec.layout()
            self.engine.set_kv_layout(attention, dims, self.region)
        else:
            self.engine = endpoint
        self.channel = Channel(mode, self.engine, self.name)
        self.next_slot = 0  # the request slot of the next request's arrival tags
        conn.send({"address": address})
        wiring = conn.recv()
        self.source = wiring["source"]  # our (first) prefill rank's address (or nixl name)
        self.sources = wiring.get("sources", [self.source])  # every prefill rank pushing to us
        self.peer = wiring.get("peer")  # the other decode rank (mirror)
        self.peer_tables, self.mirrored = {}, set()
        if mode == "pull":
            for metadata in conn.recv()["metadata"]:  # every prefill rank we read from
                self.engine.add_remote_agent(metadata)
            self.prepare_pull(kv_heads, src_tp, dst_tp)
        conn.send({"ready": True})
        self.state = {}
        self.acks = set()

    def prepare_pull(self, kv_heads, src_tp, dst_tp):
        """The NIXL descriptor lists of our blocks, prepared once, as vLLM's
        connector does: one per prefill rank we read from. Each prefill
        rank's pools hold its share of the KV heads (Llama at prefill tp 2
        here: one head of two); vLLM's connector computes, itself, where a
        share goes in the reader's blocks (kvring's KV layer plans
        different tp sizes for push only: ``check_pd_topo`` says so), and
        so does this: with head-major blocks ("HND") rank ``s``'s heads are
        one run per block, at ``s`` times its block's bytes into ours.
        ``self.theirs`` is the shape of a prefill rank's pools."""
        spec = self.spec
        self.theirs = spec
        if kv_heads is not None and src_tp != dst_tp:
            if dst_tp != 1:
                raise NotImplementedError("this example pulls across tp sizes into decode tp 1 only")
            self.theirs = PoolSpec(self.model, self.blocks, tp=src_tp)
        memory, dev = nixl_memory(self.pools)  # prefill's pools are on the same kind of device
        base = self.pools.data_ptr()
        self.local_lists = {}
        for index, source in enumerate(self.sources):
            # The rank's heads (at decode tp 1 the sources are every prefill
            # rank, in rank order): whole blocks when it holds them all.
            at = index * self.theirs.block_bytes if self.theirs is not spec else 0
            descs = [(base + spec.block_offset(layer, kind, block) + at, self.theirs.block_bytes, dev)
                     for layer in range(spec.layers) for kind in range(spec.kinds) for block in range(spec.blocks)]
            self.local_lists[source] = self.engine.prep_xfer_dlist("NIXL_INIT_AGENT", descs, memory)
        self.remote_lists = {}  # prepared once each prefill rank's base address is known

    def run(self):
        while True:
            message = self.conn.recv()
            if "stop" in message:
                return
            if "source" in message:  # prefill restarted
                self.source = message["source"]
                self.sources = [self.source]
                continue
            if "reuse" in message:
                try:
                    self.conn.send({"results": self.reuse(message["reuse"])})
                except RequestFailed as error:
                    self.conn.send({"results": {"error": str(error)}})
                continue
            self.conn.send({"results": self.serve(message["requests"])})

    def admit(self, request):
        """Blocks for the prompt and the new tokens; the table to prefill."""
        rid = request["req"]
        ours = self.allocator.take(len(request["prompt"]) + request["new"])
        self.state[rid] = st = {
            "request": request, "blocks": ours, "landed": set(), "tokens": [], "failed": None,
            "first": None, "pos": len(request["prompt"]), "cache": None, "timing": {}, "tags": {},
        }
        table = {"table": True, "req": rid, "rank": self.rank, "blocks": ours, "base": self.pools.data_ptr()}
        if self.mode == "push":
            table["slot"] = self.grant(st)
        for source in self.sources:
            self.channel.send(source, table)
        if self.mirror:  # where the peer's half of this request goes: our blocks + self.blocks
            self.channel.send(self.peer, {"mirror_table": rid, "blocks": ours})
        return st

    def grant(self, st):
        """A request slot for ``st``, and each layer's tag granted the
        blocks of that layer the prompt's KV lands in (every kind): only
        bytes landing inside them count, each once, so a layer has landed
        when its count reaches their size."""
        import kvring

        self.next_slot = self.next_slot % MAX_SLOT + 1
        spec, pushed = self.spec, st["blocks"][: -(-len(st["request"]["prompt"]) // pdmodel.BLOCK_TOKENS)]
        for layer in range(spec.layers):
            tag = kvring.arrival_tag(self.next_slot, layer)
            ranges = [(self.region, spec.block_offset(layer, kind, block), spec.block_bytes)
                      for kind in range(spec.kinds) for block in pushed]
            self.engine.forget_arrival(tag)  # a slot used before: its count starts again
            self.engine.grant_arrival(tag, ranges)
            st["tags"][layer] = (tag, len(ranges) * spec.block_bytes)
        return self.next_slot

    def poll_landed(self, st):
        """Marks the layers whose tagged bytes have all landed."""
        if not st.get("tagged"):
            return
        for layer, (tag, size) in st["tags"].items():
            if layer not in st["landed"] and self.engine.landed(tag) >= size:
                self.layer_landed(st, layer)

    def layer_landed(self, st, layer):
        st["landed"].add(layer)
        if len(st["landed"]) == self.spec.layers:
            st["timing"]["landed"] = time.monotonic()

    def serve(self, requests):
        """Runs ``requests`` together: blocks for each, tables to prefill,
        then round-robin decode steps as each one's first token arrives."""
        results = {}
        for request in requests:
            try:
                self.admit(request)
            except Exception as error:  # prefill unreachable: kvring's error names it
                st = self.state.pop(request["req"], None)
                if st is not None:
                    self.allocator.give_back(st["blocks"])
                results[request["req"]] = {"tokens": [], "error": f"{type(error).__name__}: {error}", "timing": {}}
        while len(results) < len(requests):
            self.pump()
            progressed = False
            for rid, st in list(self.state.items()):
                if st["failed"] is not None:
                    results[rid] = self.finish(rid, error=st["failed"])
                elif st["first"] is not None and self.assembled(rid, st):
                    try:
                        self.step(rid, st)
                    except RequestFailed as error:
                        results[rid] = self.finish(rid, error=str(error))
                        continue
                    progressed = True
                    if len(st["tokens"]) == st["request"]["new"]:
                        results[rid] = self.finish(rid)
            if not progressed:
                for rid, st in list(self.state.items()):
                    try:
                        self.check_alive(st)
                    except RequestFailed as error:
                        results[rid] = self.finish(rid, error=str(error))
                time.sleep(0.0002)
        return results

    def check_alive(self, st):
        """While waiting on prefill: its error if the request failed there,
        a probe of prefill every ``PROBE_S`` (kvring's error, naming the
        peer, if it is gone), and the deadline."""
        now = time.monotonic()
        st.setdefault("since", now)
        if st["failed"] is not None:
            raise RequestFailed(st["failed"])
        if now - st.setdefault("probed", now) > PROBE_S:
            st["probed"] = now
            for source in self.sources:
                try:
                    self.channel.probe(source)
                except Exception as error:
                    raise RequestFailed(f"prefill {source} is gone: {type(error).__name__}: {error}") from None
        limit = st["request"].get("wait_s", WAIT_S)
        if now - st["since"] > limit:
            raise RequestFailed(f"nothing from prefill {self.source} within {limit} s")

    def reuse(self, spec):
        """The block-reuse fault case: request ``a``'s push is in flight
        when decode gives it up; its blocks go to ``b`` only once prefill
        says no push of ``a`` is in flight. ``a2`` is ``a`` again, fresh."""
        a, b, a2 = spec["a"], spec["b"], spec["a2"]
        st = self.admit(a)
        while not st["landed"]:  # a layer landed: the push is under way
            self.pump()
            self.check_alive(st)
            time.sleep(0.0002)
        landed_before = sorted(st["landed"])
        self.channel.send(self.source, {"abort": a["req"], "rank": self.rank})
        fenced_st = self.state.pop(a["req"])
        self.forget(fenced_st)
        fenced = fenced_st["blocks"]
        since = time.monotonic()
        while a["req"] not in self.acks:
            self.pump()
            if time.monotonic() - since > WAIT_S:
                raise RequestFailed(f"prefill {self.source} never confirmed the abort of request {a['req']}")
            time.sleep(0.0002)
        self.allocator.give_back(fenced)
        results = self.serve([b, a2])
        results[a["req"]] = {"tokens": [], "error": None, "aborted": True, "blocks": fenced,
                             "landed_before_abort": landed_before, "timing": {}}
        return results

    def forget(self, st):
        """Frees the request's arrival tags (a bounded table on the engine)."""
        for tag, _ in st.get("tags", {}).values():
            self.engine.forget_arrival(tag)

    def finish(self, rid, error=None):
        st = self.state.pop(rid)
        self.forget(st)
        self.mirrored.discard(rid)
        self.peer_tables.pop(rid, None)
        self.allocator.give_back(st["blocks"])
        # "tagged": its layers came as tagged bytes that this engine counted
        # as they landed (tcp, rdma), not announced by a notification.
        return {"tokens": st["tokens"], "error": error, "timing": st["timing"], "blocks": st["blocks"],
                "tagged": bool(st.get("tagged"))}

    def pump(self):
        """Takes every message that arrived and applies it, and marks the
        layers whose tagged bytes have landed."""
        for st in self.state.values():
            self.poll_landed(st)
        if self.mirror:
            for rid, st in self.state.items():
                self.push_mirror(rid, st)
        for message in self.channel.recv():
            if "aborted" in message:
                self.acks.add(message["aborted"])
                continue
            if "mirror_table" in message:
                self.peer_tables[message["mirror_table"]] = message["blocks"]
                continue
            if "mirrored" in message:
                self.mirrored.add(message["mirrored"])
                continue
            rid = next(message[k] for k in ("landed", "first", "failed", "ready", "req") if k in message)
            st = self.state.get(rid)
            if st is None:
                continue  # a request already ended (failed) here
            if "landed" in message:
                for layer in message["layers"]:
                    self.layer_landed(st, layer)
            elif "first" in message and st["first"] is None:  # (at prefill tp 2, each rank sends it)
                st["first"] = message["token"]
                st["tagged"] = message.get("tagged", False)
                st["tokens"].append(message["token"])
                st["timing"].update(
                    compute_start=message["compute_start"], compute_end=message["compute_end"]
                )
            elif "failed" in message:
                st["failed"] = f"prefill {self.source}: {message['error']}"
            elif "ready" in message:
                self.pull(rid, st, message["source"], message["blocks"], message["base"])

    def assembled(self, rid, st):
        """Whether the request's cache is whole here: always, except at
        decode tp 2 (Llama), where our half must have gone to the peer and
        the peer's half come to us."""
        return not self.mirror or (st.get("mirror_sent") and rid in self.mirrored)

    def push_mirror(self, rid, st):
        """Decode tp 2: once every layer of our half of ``rid`` landed (and
        the peer said where its copy goes), pushes our blocks of every layer
        into the peer's mirror blocks through kvring (whole blocks: both
        ranks hold one half), then tells it."""
        if st.get("mirror_sent") or rid not in self.peer_tables or len(st["landed"]) < self.spec.layers:
            return
        prompt_blocks = -(-len(st["request"]["prompt"]) // pdmodel.BLOCK_TOKENS)
        ours = st["blocks"][:prompt_blocks]
        theirs = [b + self.blocks for b in self.peer_tables.pop(rid)[:prompt_blocks]]
        try:
            self.engine.push_blocks(self.peer, ours, theirs, timeout=WAIT_S)
            self.channel.send(self.peer, {"mirrored": rid})
        except Exception as error:  # the request fails here; the peer's fails at its deadline
            st["failed"] = f"gathering heads to decode {self.peer}: {type(error).__name__}: {error}"
        st["mirror_sent"] = True

    def pull(self, rid, st, source, theirs, base):
        """vLLM's NIXL connector: READ prefill rank ``source``'s blocks of
        every layer into ours (its share of the heads into their place),
        then tell it (the transfer's notification). The request's cache is
        whole once every source's READ is done."""
        spec = self.spec
        memory, dev = nixl_memory(self.pools)
        if source not in self.remote_lists:  # prepared once, as vLLM's connector does
            self.remote_lists[source] = self.engine.prep_xfer_dlist(
                source, [(a, n, dev) for a, n in block_descs(self.theirs, base, range(spec.blocks))], memory
            )

        def indices(blocks):
            return [(layer * spec.kinds + k) * spec.blocks + b for layer in range(spec.layers)
                    for k in range(spec.kinds) for b in blocks]

        handle = self.engine.make_prepped_xfer(
            "READ", self.local_lists[source], indices(st["blocks"][: len(theirs)]), self.remote_lists[source],
            indices(theirs),
            json.dumps({"pulled": rid}).encode(),
        )
        state = self.engine.transfer(handle)
        deadline = time.monotonic() + WAIT_S
        while state == "PROC" and time.monotonic() < deadline:
            state = self.engine.check_xfer_state(handle)
        if state != "DONE":
            st["failed"] = f"nixl READ from {source} ended {state}: {getattr(handle, 'error', None)}"
        else:
            st.setdefault("pulled", set()).add(source)
            if st["pulled"] >= set(self.sources):
                st["landed"].update(range(spec.layers))
                st["timing"]["landed"] = time.monotonic()
        self.engine.release_xfer_handle(handle)

    def wait_layer(self, rid, st, layer):
        """Inside the first decode step: returns once ``layer`` landed: its
        tagged bytes all in place (``wait_landed``, in slices of
        ``PROBE_S`` so that prefill's liveness and messages are checked
        between them), or a "landed" notification over shm and cma."""
        import kvring

        st.pop("since", None)
        if st["request"].get("trust_layer") == layer:
            return  # the negative control: read the layer without waiting for it
        tag, size = st["tags"][layer] if st.get("tagged") else (None, 0)
        while layer not in st["landed"]:
            self.check_alive(st)
            self.pump()
            if tag is None:
                time.sleep(0.0001)
                continue
            try:
                self.engine.wait_landed(tag, size, timeout=PROBE_S)
            except kvring.TransferTimeoutError:
                continue
            self.layer_landed(st, layer)

    def step(self, rid, st):
        """One decode step of one request, its cache read from our pools."""
        if st["cache"] is None:
            parts = None
            if self.mirror:  # heads in model order: ours at offset 0, the peer's in the mirror blocks
                half = self.spec.kv_heads
                parts = [(slice(h * half, (h + 1) * half), 0 if h == self.rank else self.blocks) for h in range(2)]
            st["cache"] = PagedCache(
                self.spec, self.pools, st["blocks"], length=st["pos"], parts=parts,
                before_read=lambda layer: self.wait_layer(rid, st, layer) if layer not in st["landed"] else None,
            )
        first_step = len(st["tokens"]) == 1
        start = time.monotonic()
        with torch.no_grad():
            logits = pdmodel.forward(
                self.model, st["cache"], input_ids=torch.tensor([[st["tokens"][-1]]], device=self.pools.device),
                position_ids=torch.tensor([[st["pos"]]], device=self.pools.device),
            ).logits
        st["tokens"].append(int(logits[0, -1].argmax()))
        st["pos"] += 1
        if first_step:
            st["timing"].update(decode_start=start, decode_end=time.monotonic())

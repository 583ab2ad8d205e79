"""kvring: KV-cache block transfer between prefill and decode engines.

``kvring.Engine`` is the native Python API (mirrors the Rust engine);
``kvring.mooncake.TransferEngine`` is a drop-in for Mooncake's Python
``TransferEngine``; ``kvring.lmdeploy`` holds an LMDeploy migration backend.
Every transfer and wait releases the GIL.

kvring's log events (an engine started or stopped, a peer restarted, a
refusal, a lost metadata store) go to Python's ``logging``, under the
logger ``kvring`` (``kvring.engine.lifecycle`` and so on: the Rust module
path). They arrive from a thread of kvring's own, shortly after the fact.
``RUST_LOG`` narrows what is sent (default: debug and above).
"""

import atexit
import logging
import os
import ctypes

from . import _native
from ._buffers import address_of
from .errors import *  # noqa: F401,F403  (one class per error kind)
from .errors import InvalidArgumentError, KvringError

__all__ = ["Engine", "arrival_tag", "check_pd_topo", "push_targets", "transports", "KvringError"]


_LEVELS = {"ERROR": logging.ERROR, "WARN": logging.WARNING, "INFO": logging.INFO, "DEBUG": logging.DEBUG, "TRACE": 5}


def _forward_log(level, target, message):
    """Hands one of kvring's events to ``logging`` (kvring's log thread)."""
    level = _LEVELS.get(level, logging.INFO)
    name = target.replace("::", ".") if target.startswith("kvring") else "kvring"
    logger = logging.getLogger(name)
    if logger.isEnabledFor(level):
        logger.log(level, message, extra={"kvring_target": target})


try:
    _native.set_log_callback(_forward_log)
    # Stop forwarding before the interpreter goes away.
    atexit.register(_native.set_log_callback, None)
except RuntimeError as _error:  # another tracing subscriber in this process
    logging.getLogger("kvring").debug("kvring's events do not reach logging: %s", _error)


def transports():
    """The transports a Python engine can use in this build."""
    return list(_native.transports())


def check_pd_topo(local, remote, mode="push", attention="mha"):
    """Whether two ranks, each (dp_size, tp_size, dp_rank, tp_rank), can
    exchange KV blocks. Returns (verdict, reason): verdict is
    "homogeneous", "heterogeneous", "invalid_local" or "invalid_remote"."""
    return _native.check_pd_topo(tuple(local), tuple(remote), mode, attention)


def push_targets(src_rank, src_tp, dst_tp, kv_heads=None):
    """The decode ranks (of ``dst_tp``) that prefill rank ``src_rank`` (of
    ``src_tp``) pushes to. With ``kv_heads`` (an MHA/GQA cache split by KV
    head): the ranks holding a head it holds, each head written by exactly
    one source (``kv::head_push_targets``; a head count that does not
    split over a tp size raises ``InvalidArgumentError``). Without (MLA,
    the same cache on every rank): destination ``d`` is served by source
    ``d % src_tp`` (``kv::push_targets``)."""
    return list(_native.push_targets(src_rank, src_tp, dst_tp, kv_heads))


def arrival_tag(slot, layer):
    """The arrival tag of request slot ``slot``'s ``layer``: ``slot << 12 |
    layer`` (slot 1 to 2**20 - 1, layer below 4096); anything else raises
    ``InvalidArgumentError``."""
    return _native.arrival_tag(slot, layer)


class Engine:
    """A kvring engine: registered memory, peers opened by ``host:port`` (or
    by name with etcd metadata), batches of block copies.

    Blocks are either (local region, local offset, remote region, remote
    offset, length) tuples, or addresses (``transfer_addrs``), as Mooncake
    names memory.
    """

    def __init__(
        self,
        name=None,
        listen="127.0.0.1:0",
        lanes=1,
        metadata=None,
        serve_tcp=True,
        token=None,
        gpu=None,
        rdma=None,
        rdma_devices=None,
        rdma_gid_index=None,
        transports=None,
        pin_host_memory=None,
        checksum=None,
    ):
        """``token``: the cluster's pre-shared token (str or bytes), proven in
        every handshake and data connection and never sent; when None, the
        ``KVRING_TOKEN`` environment variable, if set. Without a token,
        anyone who reaches the engine's ports can read and write its
        registered memory.

        ``gpu``: the GPU provider. None (or ``KVRING_GPU`` unset): the CUDA
        driver where one is installed, loaded at the first registration;
        "cuda": the driver now, or an error; "sim": kvring's simulated GPUs
        (two), whose memory no host thread can touch, for tests and for
        trying the GPU path anywhere (``sim_device_buffer``). When None, the
        ``KVRING_GPU`` environment variable, if set.

        ``rdma``: "auto" (default: RDMA where libibverbs lists a device with
        an active port), "on" (or an error saying why not) or "off";
        ``rdma_devices``: the NICs to use by name (a list, or a
        comma-separated str), each used or refused by name, never replaced
        by another; ``rdma_gid_index``: the RoCE GID index of every port
        (None: RoCE v2 with an IPv4-mapped address first). When None, the
        ``KVRING_RDMA``, ``KVRING_RDMA_DEVICES`` and
        ``KVRING_RDMA_GID_INDEX`` environment variables, if set.


        ``transports``: the transports this engine may reach peers by, a
        list such as ``["shm", "tcp"]`` (one entry: that one required);
        a peer only others reach is refused at ``open_segment`` with
        ``UnsupportedError`` naming what reaches it and why each allowed one does
        not. When None, ``KVRING_TRANSPORTS`` (comma-separated), if set;
        else every transport.

        ``pin_host_memory``: pin registered host memory for GPU copies
        (``cuMemHostRegister``; off by default, since pinning behind an
        application's back breaks its own later ``cudaHostRegister``);
        memory its owner pinned (``tensor.pin_memory()``) is used as it is.
        When None, ``KVRING_PIN_HOST_MEMORY`` ("on"/"off"), if set."""
        if token is None:
            token = os.environ.get("KVRING_TOKEN") or None
        if isinstance(token, str):
            token = token.encode()
        if gpu is None:
            gpu = os.environ.get("KVRING_GPU") or None
        if rdma is None:
            rdma = os.environ.get("KVRING_RDMA") or None
        if rdma_devices is None:
            rdma_devices = os.environ.get("KVRING_RDMA_DEVICES") or None
        if isinstance(rdma_devices, str):
            rdma_devices = [d.strip() for d in rdma_devices.split(",") if d.strip()]
        if rdma_gid_index is None and os.environ.get("KVRING_RDMA_GID_INDEX"):
            try:
                rdma_gid_index = int(os.environ["KVRING_RDMA_GID_INDEX"])
            except ValueError:
                raise InvalidArgumentError(
                    f"KVRING_RDMA_GID_INDEX={os.environ['KVRING_RDMA_GID_INDEX']!r} is not a whole number"
                ) from None
        if transports is None and os.environ.get("KVRING_TRANSPORTS"):
            transports = [t.strip() for t in os.environ["KVRING_TRANSPORTS"].split(",") if t.strip()]
        if isinstance(transports, str):
            transports = [transports]
        if pin_host_memory is None:
            pin_host_memory = os.environ.get("KVRING_PIN_HOST_MEMORY", "off").strip().lower() in ("on", "true", "1")
        if checksum is None:
            checksum = os.environ.get("KVRING_CHECKSUM", "off").strip().lower() in ("on", "true", "1")
        self._native = _native.Engine(
            name=name,
            listen=listen,
            lanes=lanes,
            metadata=metadata,
            serve_tcp=serve_tcp,
            token=token,
            gpu=gpu,
            rdma=rdma,
            rdma_devices=rdma_devices,
            rdma_gid_index=rdma_gid_index,
            transports=None if transports is None else list(transports),
            pin_host_memory=bool(pin_host_memory),
            checksum=bool(checksum),
        )
        # Region id -> what keeps a registered buffer object alive and pinned.
        self._held = {}

    @property
    def name(self):
        """The engine's name."""
        return self._native.name

    @property
    def control_addr(self):
        """``host:port`` peers open this engine by."""
        return self._native.control_addr

    @property
    def port(self):
        """The control port (Mooncake's RPC port)."""
        return int(self._native.control_addr.rsplit(":", 1)[1])

    @property
    def closed(self):
        """True once closed."""
        return self._native.closed

    # Memory ------------------------------------------------------------

    def register(self, memory, length=None, location=None):
        """Registers memory in place (no copy) and returns the region id:
        an int address with ``length``, a contiguous writable buffer object
        (host memory), or a contiguous GPU array (``__cuda_array_interface__``
        or DLPack: a CUDA tensor, no import of torch needed). Where it lives
        is found out: an address is classified by the GPU provider (host
        memory, or the GPU holding it, as Mooncake does), a DLPack tensor
        says its device. ``location`` ("host", "gpu:N"; default: found
        out) overrides, and is checked."""
        addr, length, keep, found = address_of(memory, length)
        region = self._native.register(addr, length, location if location is not None else found)
        if keep is not None:
            self._held[region] = keep
        return region

    def region_memory(self, region, segment=None, timeout=5.0):
        """Where a region lives: "host" or "gpu:N". With ``segment`` (a
        peer's name), the peer's region of that id."""
        return self._native.region_memory(region, segment, timeout)

    def sim_device_buffer(self, length, device=0):
        """For tests: ``length`` bytes of simulated GPU ``device``'s memory
        (engines made with ``gpu="sim"``), an object with
        ``__cuda_array_interface__`` and DLPack, as a CUDA tensor has, and
        ``write(offset, bytes)`` / ``read(offset, length)`` through the
        simulated copy engine (no host thread can touch it otherwise)."""
        return self._native.sim_device_buffer(length, device)

    def unregister(self, region):
        """Unregisters a region by id (refused while a batch uses it)."""
        self._native.unregister(region)
        self._held.pop(region, None)

    def alloc(self, length):
        """Allocates and registers ``length`` bytes of shared memory;
        returns (region id, address). ``unregister`` frees it."""
        return self._native.alloc(length)

    def locate(self, addr, length):
        """(region id, offset) of a local address range."""
        return self._native.locate(addr, length)

    def write_bytes(self, addr, data):
        """Copies ``data`` into registered memory at ``addr``."""
        data = bytes(data)
        self._native.locate(addr, len(data))  # raises unless all of it is registered
        ctypes.memmove(addr, data, len(data))

    def read_bytes(self, addr, length):
        """Copies ``length`` bytes of registered memory at ``addr``."""
        self._native.locate(addr, length)
        return ctypes.string_at(addr, length)

    # Peers and batches -------------------------------------------------

    def open_segment(self, name, transport=None, timeout=5.0):
        """Opens a peer, with a transport ("shm", "tcp", "cuda_ipc") or the
        engine's order (cuda_ipc first for GPU memory on one host); returns
        the transport used. Later calls naming it use it."""
        return self._native.open_segment(name, transport, timeout)

    def open_segments(self, names, transport=None, timeout=5.0):
        """Opens a TP group's peers in one call, their handshakes
        concurrent, all within ``timeout``; returns, per name in order, the
        transport used or the exception its open raised (returned, not
        raised, so one dead rank does not hide the others)."""
        return self._native.open_segments(list(names), transport, timeout)

    def segment_regions(self, name, timeout=5.0):
        """The peer's regions as (region id, address, length)."""
        return self._native.segment_regions(name, timeout)

    def transfer(self, name, op, blocks, timeout=30.0, checksum=None):
        """Moves blocks (5-tuples) with ``op`` "write" or "read" and waits;
        returns the bytes moved. ``checksum``: True checks every block's
        CRC32C at its destination before the batch is done (a mismatch
        raises ``CorruptError`` naming the block), False does not, None
        follows the engine's ``checksum``."""
        return self._native.transfer(name, op, [tuple(b) for b in blocks], timeout, checksum)

    def write(self, name, blocks, timeout=30.0, checksum=None, grant=None):
        """``transfer(name, "write", blocks)``. With ``grant`` (from the
        target's ``fence`` of the blocks' range), the push lands only where
        no newer fence covers it, else it raises ``FencedError`` and
        nothing of it lands (a granted write takes the engine's checksum
        setting: ``checksum=`` with ``grant=`` is refused)."""
        if grant is not None:
            if checksum is not None:
                raise ValueError("checksum= with grant= is not supported: set Engine(checksum=...) instead")
            return _native.write_granted(self._native, name, [tuple(b) for b in blocks], grant, timeout)
        return self.transfer(name, "write", blocks, timeout, checksum)

    def read(self, name, blocks, timeout=30.0, checksum=None):
        """``transfer(name, "read", blocks)``."""
        return self.transfer(name, "read", blocks, timeout, checksum)

    def transfer_addrs(self, name, op, local_addrs, remote_addrs, lengths, timeout=30.0, checksum=None):
        """Moves blocks named by addresses and waits; returns the bytes."""
        return self._native.transfer_addrs(name, op, local_addrs, remote_addrs, lengths, timeout, checksum)

    def submit(self, name, op, local_addrs, remote_addrs, lengths, timeout=30.0, checksum=None):
        """Submits blocks named by addresses; returns a batch id at once.
        ``timeout`` is the batch's deadline."""
        return self._native.submit_addrs(name, op, local_addrs, remote_addrs, lengths, timeout, checksum)

    def wait(self, batch, timeout=30.0, with_transport=False):
        """Waits for a batch: its bytes, or its error raised. With
        ``with_transport``: (bytes, the transport that carried it)."""
        if not with_transport:
            return self._native.wait(batch, timeout)
        transport = self._native.batch_transport(batch)
        return self._native.wait(batch, timeout), transport

    def batch_transport(self, batch):
        """The transport that carries a batch ("shm", "cma", "tcp", ...),
        from its submission until ``wait``, ``poll`` or ``reap`` consumes it."""
        return self._native.batch_transport(batch)

    def poll(self, batch):
        """A batch's bytes once done, None while running; raises its error."""
        return self._native.poll(batch)

    def wait_gpu_stream(self, device, stream, timeout=30.0):
        """Waits, at most ``timeout`` seconds, for the work queued so far on
        a caller's CUDA stream (an int handle such as
        ``torch.cuda.current_stream().cuda_stream``; 0: ``device``'s default
        stream), and not for work queued on it after this call: before a
        transfer reads memory a kernel on that stream writes."""
        self._native.wait_gpu_stream(device, stream, timeout)

    def cancel(self, batch):
        """Cancels a batch: blocks not yet posted are dropped, and the batch
        ends (``CancelledError`` from ``wait`` or ``poll``) only once every
        posted block has drained, so its memory may be reused when that is
        seen. A batch that already ended keeps its result."""
        self._native.cancel(batch)

    def reap(self, batches, with_transport=False):
        """Of ``batches``, those that ended: {batch: bytes or exception}.
        With ``with_transport``: {batch: (bytes or exception, transport)},
        the transport that carried the batch."""
        ended = {}
        for batch in batches:
            transport = None
            try:
                if with_transport:
                    transport = self._native.batch_transport(batch)
                result = self._native.poll(batch)
            except KvringError as error:
                result = error
            if result is not None:
                ended[batch] = (result, transport) if with_transport else result
        return ended

    # Notifications -----------------------------------------------------

    def notify(self, name, message, timeout=5.0):
        """Sends a notification (bytes or str) to a peer."""
        if isinstance(message, str):
            message = message.encode()
        self._native.notify(name, bytes(message), timeout)

    def notifications(self):
        """Notifications received since the last call, as (sender, bytes)."""
        return self._native.notifications()

    def metrics_text(self):
        """This engine's counters as Prometheus text (what ``/metrics``
        would answer), e.g. ``kvring_memory_info_served_total``: the KV
        layout fetches peers made of this engine."""
        return _native.metrics_text(self._native)

    # KV-cache layer ----------------------------------------------------

    def set_kv_layout(self, attention, dims, region, offset=0):
        """Describes this engine's KV cache, contiguous in ``region`` from
        ``offset``: "mha" with (layers, blocks, kv_heads, head_dim,
        dtype_bytes, tokens_per_block, tp), or "mla" with (layers, blocks,
        latent_dim, dtype_bytes, tokens_per_block, index_dim).

        The layout is fixed for the engine's life once published: peers
        fetch it once per open segment and compute every push from their
        copy. The same layout again is accepted; a different one raises
        ``LayoutMismatchError`` (start a new engine to publish another)."""
        self._native.set_kv_layout(attention, list(dims), region, offset)

    def push_blocks(self, name, src_ids, dst_ids, timeout=30.0, grant=None):
        """Writes blocks ``src_ids`` of every layer into the peer's
        ``dst_ids``; returns the bytes moved. With ``grant`` (the peer's
        ``fence_blocks(dst_ids)``, sent with the block table) the push
        raises ``FencedError`` once the blocks were fenced again.

        The peer's layout is fetched on the first KV call to an open
        segment and kept with it (a peer's layout is fixed for its life):
        later pushes, layer by layer, cost no control round trip."""
        return self._native.kv_transfer(name, "push", list(src_ids), list(dst_ids), None, timeout, grant)

    def pull_blocks(self, name, src_ids, dst_ids, timeout=30.0):
        """Reads the peer's blocks ``src_ids`` into ours ``dst_ids``."""
        return self._native.kv_transfer(name, "pull", list(src_ids), list(dst_ids), None, timeout)

    def push_layer(self, name, layer, src_ids, dst_ids, timeout=30.0, grant=None):
        """Writes one layer's blocks as soon as it is computed (naming
        ``grant``, as ``push_blocks``)."""
        return self._native.kv_transfer(name, "push", list(src_ids), list(dst_ids), layer, timeout, grant)

    def push_layer_tagged(self, name, layer, slot, src_ids, dst_ids, timeout=30.0):
        """As ``push_layer``, the push tagged for request slot ``slot``
        (``arrival_tag(slot, layer)``), so the peer can wait for this
        layer's bytes with ``wait_landed`` instead of a notification per
        layer. Tags are counted by the target over tcp (and rdma); a link
        that cannot carry them (shm, cma) fails the push with
        ``UnsupportedError``. Waits up to ``timeout`` seconds; returns the
        bytes moved."""
        return _native.push_layer_tagged(self._native, name, layer, slot, list(src_ids), list(dst_ids), timeout)

    def push_layer_heads_tagged(self, name, layer, slot, src_ids, dst_ids, heads, src, dst, timeout=30.0):
        """``push_layer_tagged`` between tensor-parallel ranks of different
        sizes of an MHA/GQA cache (each rank holding its share of the KV
        heads): per block pair, the heads this rank shares with the peer
        go to their place in the peer's block (kvring's
        ``kv::plan_layer_heads``). ``heads`` is ``(kv_heads, head_bytes,
        tokens_per_block, order)``, ``order`` ``"hnd"`` (a block is
        ``[heads, tokens, head_dim]``: one run per block) or ``"nhd"``
        (``[tokens, heads, head_dim]``: one run per token); ``src`` and
        ``dst`` are ``(tp_size, tp_rank)`` of this rank and of the peer.
        Each side's bytes per block must be its heads' worth
        (``LayoutMismatchError`` otherwise). Returns the bytes moved (0,
        nothing sent, when this rank holds none of the peer's heads)."""
        return _native.push_layer_heads_tagged(
            self._native, name, layer, slot, list(src_ids), list(dst_ids), tuple(heads), tuple(src), tuple(dst), timeout
        )

    # Fenced destinations (this engine as the target) ----------------------

    def fence(self, region, offset, length):
        """Fences ``length`` bytes at ``offset`` of this engine's ``region``
        (a request's blocks) and returns the new grant: from the moment
        this returns, no push naming an older grant (or none) lands there,
        and one in flight has stopped. Hand the grant to the one sender
        that may write there (``write(..., grant=g)``)."""
        return _native.fence(self._native, region, offset, length)

    def fence_blocks(self, ids):
        """Fences blocks ``ids`` of this engine's KV layout in every layer
        and kind under one grant (a request's blocks), returned: the
        sender pushes them with ``push_blocks(..., grant=)``."""
        return _native.fence_blocks(self._native, list(ids))

    # Arrival tags (this engine as the target of tagged pushes) ----------

    def grant_arrival(self, tag, ranges, sender=None):
        """Binds ``tag`` to the ranges its request was given, each
        ``(region, offset, length)`` of this engine's regions: only bytes
        landing wholly inside them count under it, each byte once. With
        ``sender`` (the pushing engine's name, as it proved it with the
        shared token), only that sender's bytes count, and other senders
        may be granted the same tag, each counted apart; without a token a
        sender grant raises ``UnsupportedError``. A tag already granted
        raises ``InvalidArgumentError``."""
        ranges = [(int(r), int(o), int(n)) for r, o, n in ranges]
        _native.grant_arrival(self._native, tag, ranges, sender)

    def landed(self, tag, sender=None):
        """Bytes landed under ``tag`` (under ``sender``'s grant of it)."""
        return _native.landed(self._native, tag, sender)

    def wait_landed(self, tag, nbytes, timeout=30.0, sender=None):
        """Waits until ``nbytes`` have landed under ``tag`` (under
        ``sender``'s grant of it), for at most ``timeout`` seconds:
        ``TransferTimeoutError`` past it. Other threads may use the engine
        meanwhile."""
        _native.wait_landed(self._native, tag, nbytes, timeout, sender)

    def forget_arrival(self, tag, sender=None):
        """Forgets ``tag`` (only ``sender``'s grant of it, with ``sender``),
        freeing its slot; returns the bytes it had counted."""
        return _native.forget_arrival(self._native, tag, sender)

    def close(self):
        """Stops the engine; later calls raise EngineClosedError."""
        self._native.close()
        self._held.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

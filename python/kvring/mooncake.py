"""A drop-in for Mooncake's Python ``TransferEngine`` on kvring.

Method names, argument order and the int convention match Mooncake's
(0 = success, negative = failure; async batch ids are positive, 0 = failure).
Failures are logged on the ``kvring.mooncake`` logger with kvring's reason;
nothing falls back silently. Segment names are ``host:port`` (the peer's
``get_rpc_port()``), or the peer's ``local_hostname`` with a metadata server
(etcd, redis, Mooncake's HTTP metadata server).

    from kvring.mooncake import TransferEngine   # was: from mooncake.engine import TransferEngine
"""

import enum
import logging
import os
import socket

from . import Engine, transports
from .errors import KvringError

log = logging.getLogger("kvring.mooncake")

P2PHANDSHAKE = "P2PHANDSHAKE"
_PROTOCOLS = ("tcp", "shm", "rdma", "nvlink")
# Mooncake's protocol -> kvring's transport: "nvlink" (GPU memory between
# processes of one host) is cuda_ipc.
_TRANSPORTS = {"nvlink": "cuda_ipc"}
_METADATA_SCHEMES = ("etcd://", "redis://", "http://")
# Protocols of Mooncake's that kvring has no transport for, and why.
_UNSUPPORTED_PROTOCOLS = {
    "efa": "AWS EFA (libfabric) is not a kvring transport; use \"tcp\" (or \"rdma\" where built in)",
    "hip": "AMD GPUs are not a kvring GPU provider",
    "nvlink_intra": "use \"nvlink\" (kvring's cuda_ipc between processes of one host)",
    "xgmi": "AMD GPUs are not a kvring GPU provider",
}


# Mooncake's module flags: what this build can do. kvring has no EFA, AMD,
# Moore Threads or intra-node-NVLink transport; Mooncake's "nvlink" is
# kvring's cuda_ipc, so it (and CUDA) are there when that transport is.
SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_MUSA = False
SUPPORT_INTRA_NVLINK = False
SUPPORT_MNNVL = "cuda_ipc" in transports()
SUPPORT_CUDA = SUPPORT_MNNVL

_HOST_BUFFER_ALIGN = 4096
_host_buffers = {}  # address -> ctypes buffer keeping it alive


def _device_names(device_name):
    """Mooncake's ``device_name`` as kvring's device list: names split at
    commas, a ``:port`` suffix dropped (kvring uses each device's active
    port); ``[]`` for none, ``None`` when it is not a str."""
    if device_name is None:
        return []
    if not isinstance(device_name, str):
        return None
    return [part.strip().split(":", 1)[0] for part in device_name.split(",") if part.strip()]


def allocate_host_buffer(size):
    """``size`` bytes of zeroed, page-aligned host memory for
    ``register_memory``; its address, or 0 (Mooncake's null) when ``size``
    is not a positive int. Freed by ``free_host_buffer``."""
    import ctypes

    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        if size != 0:
            log.error("allocate_host_buffer: size must be a positive int, got %r", size)
        return 0
    try:
        raw = (ctypes.c_char * (size + _HOST_BUFFER_ALIGN))()
    except (MemoryError, OverflowError) as error:
        log.error("allocate_host_buffer(%d): %s", size, error)
        return 0
    base = ctypes.addressof(raw)
    addr = (base + _HOST_BUFFER_ALIGN - 1) // _HOST_BUFFER_ALIGN * _HOST_BUFFER_ALIGN
    _host_buffers[addr] = raw
    return addr


def free_host_buffer(ptr):
    """Frees memory from ``allocate_host_buffer``; 0 is a no-op, as
    Mooncake's; an address it did not hand out is logged and left alone."""
    if ptr == 0:
        return
    if _host_buffers.pop(ptr, None) is None:
        log.error("free_host_buffer: %r was not allocated by allocate_host_buffer (or was freed)", ptr)


class TransferOpcode(enum.IntEnum):
    """Mooncake's opcode enum (``TransferOpcode.Read`` / ``.Write``)."""

    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


class TransferNotify:
    """A notification: the sender's name and its message."""

    def __init__(self, name="", msg=""):
        self.name = name
        self.msg = msg

    def __repr__(self):
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


# What a bad call raises underneath (kvring's errors; a wrong type or value
# given to the native module): turned into Mooncake's failure value.
_FAILURES = (KvringError, TypeError, ValueError, OverflowError)


def _reason(error):
    """kvring's message, or the type error's with its class named."""
    return str(error) if isinstance(error, KvringError) else f"{type(error).__name__}: {error}"


def _opcode_op(opcode):
    """Mooncake's opcode (TransferOpcode, or its int) -> "write" / "read"."""
    try:
        value = int(opcode)
    except (TypeError, ValueError):
        raise TypeError(f"opcode must be a TransferOpcode (Read or Write), got {opcode!r}") from None
    if value not in (int(TransferOpcode.Read), int(TransferOpcode.Write)):
        raise ValueError(f"opcode {opcode!r} is neither TransferOpcode.Read (0) nor TransferOpcode.Write (1)")
    return "write" if value == int(TransferOpcode.Write) else "read"


def _timeout():
    try:
        return max(5.0, float(os.environ.get("MC_TRANSFER_TIMEOUT", "30")))
    except ValueError:
        return 30.0


class TransferEngine:
    """Mooncake's ``TransferEngine``, on a kvring engine."""

    TransferOpcode = TransferOpcode

    def __init__(self):
        self._engine = None
        self._protocol = None
        self._registered = {}  # address -> region id
        self._managed = {}  # address -> region id (allocate_managed_buffer)
        self._batches = {}  # Mooncake batch id -> kvring batch id
        self._opened = set()  # segment names opened with our protocol
        self._next_batch = 1
        self._timeout = _timeout()

    # Set-up --------------------------------------------------------------

    def initialize(self, local_hostname, metadata_server, protocol, device_name):
        """Starts the engine. ``metadata_server``: "P2PHANDSHAKE", an etcd
        address (``etcd://host:port`` or bare ``host:port``), redis
        (``redis://host:port[/db]``) or Mooncake's HTTP metadata server
        (``http://host:port/metadata``). ``protocol``: "tcp", "shm",
        "nvlink" (GPU memory on one host: kvring's cuda_ipc) or "rdma" (must
        be built in). With "tcp", a peer on this host is reached as kvring's
        order has it (its shared memory, or its own memory by cross-memory
        attach) and others over tcp; "shm", "nvlink" and "rdma" are taken as
        asked. The GPU provider is the CUDA driver, or the simulator with
        ``KVRING_GPU=sim``."""
        if self._engine is not None:
            log.error("initialize: this TransferEngine is already initialized")
            return -1
        for what, value in (("local_hostname", local_hostname), ("metadata_server", metadata_server),
                            ("protocol", protocol)):
            if not isinstance(value, str):
                log.error("initialize: %s must be a str, got %r", what, value)
                return -1
        if protocol in _UNSUPPORTED_PROTOCOLS:
            log.error("initialize: protocol %r: %s", protocol, _UNSUPPORTED_PROTOCOLS[protocol])
            return -1
        if protocol not in _PROTOCOLS:
            log.error("initialize: unknown protocol %r (kvring knows %s)", protocol, ", ".join(_PROTOCOLS))
            return -1
        transport = _TRANSPORTS.get(protocol, protocol)
        if transport not in transports():
            log.error(
                "initialize: protocol %r is not built into this kvring module (it has %s); not falling back",
                protocol,
                ", ".join(transports()),
            )
            return -1
        rdma = {}
        if transport == "rdma":
            # Mooncake's device_name: the HCAs to use, comma-separated
            # ("mlx5_0,mlx5_1"; a ":port" suffix is allowed). Each is used or
            # the engine is not made (the reason logged): never another NIC,
            # never tcp in its place.
            names = _device_names(device_name)
            if names is None:
                log.error("initialize: device_name must be a str, got %r", device_name)
                return -1
            rdma = {"rdma": "on", "rdma_devices": names or None}
        elif device_name:
            log.info("initialize: device_name %r is ignored by the %s transport", device_name, protocol)
        if metadata_server == P2PHANDSHAKE:
            metadata = None
        elif "://" in metadata_server:
            if not metadata_server.startswith(_METADATA_SCHEMES):
                log.error(
                    "initialize: metadata server %r: kvring speaks P2PHANDSHAKE, etcd://, redis:// and http://",
                    metadata_server,
                )
                return -1
            metadata = metadata_server
        else:
            metadata = "etcd://" + metadata_server
        host, _, port = local_hostname.rpartition(":") if ":" in local_hostname else (local_hostname, "", "0")
        try:
            listen = f"{socket.gethostbyname(host)}:{int(port)}"
        except (OSError, ValueError) as error:
            log.error("initialize: local_hostname %r: %s", local_hostname, error)
            return -1
        try:
            self._engine = Engine(name=local_hostname if metadata else None, listen=listen, metadata=metadata, **rdma)
        except KvringError as error:
            log.error("initialize: %s", error)
            return -1
        self._protocol = transport
        self._native = self._engine._native
        return 0

    def initialize_ext(self, local_hostname, metadata_server, protocol, device_name, metadata_type):
        """``initialize`` with the metadata server's type apart, as
        Mooncake's: ``metadata_type`` ("etcd", "redis", "http") is put in
        front of a ``metadata_server`` that has no ``scheme://``;
        "P2PHANDSHAKE" is the peer handshake whatever the type."""
        if not isinstance(metadata_server, str) or not isinstance(metadata_type, str):
            log.error("initialize_ext: metadata_server and metadata_type must be str, got %r and %r",
                      metadata_server, metadata_type)
            return -1
        if metadata_server != P2PHANDSHAKE and "://" not in metadata_server:
            if metadata_type not in ("etcd", "redis", "http"):
                log.error("initialize_ext: metadata type %r: kvring speaks etcd, redis and http", metadata_type)
                return -1
            metadata_server = f"{metadata_type}://{metadata_server}"
        return self.initialize(local_hostname, metadata_server, protocol, device_name)

    def get_rpc_port(self):
        """The port peers name this engine by (``host:port``)."""
        return self._engine.port if self._engine else -1

    def close(self):
        """Stops the engine (not in Mooncake's API; its destructor does it)."""
        if self._engine is not None:
            self._engine.close()

    def _call(self, what, fn, *args, failure=-1):
        if self._engine is None:
            log.error("%s: call initialize() first", what)
            return failure
        try:
            return fn(*args)
        except _FAILURES as error:
            log.error("%s: %s", what, _reason(error))
            return failure

    def _segment(self, target):
        """Opens ``target`` with the protocol chosen at initialize, once:
        later transfers name it and the native side reopens it if it goes
        stale (a peer restart)."""
        if target not in self._opened:
            # "tcp" is the network: on one host kvring's order (shm, cma)
            # moves the bytes without a socket.
            transport = None if self._protocol == "tcp" else self._protocol
            self._engine.open_segment(target, transport, self._timeout)
            self._opened.add(target)
        return target

    # Memory ----------------------------------------------------------------

    def register_memory(self, buffer_addr, capacity, location="*"):
        """Registers ``capacity`` bytes at ``buffer_addr``. ``location`` as
        Mooncake's: "*" finds out where the address lives (host memory, or
        the GPU holding it: a CUDA tensor's ``data_ptr()`` registers as that
        GPU's memory); "cpu:N" or "cuda:N" says so, and is checked."""

        def register():
            self._registered[buffer_addr] = self._engine.register(buffer_addr, capacity, location=location)
            return 0

        return self._call("register_memory", register)

    def unregister_memory(self, buffer_addr):
        """Unregisters the memory registered at ``buffer_addr``."""

        def unregister():
            region = self._registered.get(buffer_addr)
            if region is None:
                region = self._engine._native.region_at(buffer_addr)
            self._engine.unregister(region)
            self._registered.pop(buffer_addr, None)
            return 0

        return self._call("unregister_memory", unregister)

    def batch_register_memory(self, buffer_addresses, capacities, location="*"):
        """Registers each (address, capacity); 0 only if every one took."""
        if not isinstance(buffer_addresses, (list, tuple)) or not isinstance(capacities, (list, tuple)):
            log.error("batch_register_memory: addresses and capacities must be lists, got %r and %r",
                      type(buffer_addresses).__name__, type(capacities).__name__)
            return -1
        if len(buffer_addresses) != len(capacities):
            log.error("batch_register_memory: %d addresses, %d capacities", len(buffer_addresses), len(capacities))
            return -1
        codes = [self.register_memory(a, c, location) for a, c in zip(buffer_addresses, capacities)]
        return 0 if all(code == 0 for code in codes) else -1

    def batch_unregister_memory(self, buffer_addresses):
        """Unregisters each address; 0 only if every one went."""
        if not isinstance(buffer_addresses, (list, tuple)):
            log.error("batch_unregister_memory: addresses must be a list, got %r", type(buffer_addresses).__name__)
            return -1
        codes = [self.unregister_memory(a) for a in buffer_addresses]
        return 0 if all(code == 0 for code in codes) else -1

    def allocate_managed_buffer(self, length):
        """Allocates and registers ``length`` bytes; returns the address (0 on failure)."""

        def allocate():
            region, addr = self._engine.alloc(length)
            self._managed[addr] = region
            return addr

        return self._call("allocate_managed_buffer", allocate, failure=0)

    def free_managed_buffer(self, buffer_addr, length):
        """Frees a buffer from ``allocate_managed_buffer``."""

        def free():
            region = self._managed.get(buffer_addr)
            if region is None:
                log.error("free_managed_buffer: %#x is not a managed buffer (or was freed)", buffer_addr)
                return -1
            self._engine.unregister(region)
            del self._managed[buffer_addr]
            return 0

        return self._call("free_managed_buffer", free)

    def get_first_buffer_address(self, segment_name):
        """The address of the peer's first registered buffer (0 if none)."""

        def first():
            regions = self._engine.segment_regions(self._segment(segment_name), self._timeout)
            return regions[0][1] if regions else 0

        return self._call("get_first_buffer_address", first, failure=0)

    def write_bytes_to_buffer(self, dest_address, src_ptr, length):
        """Copies ``length`` bytes of ``src_ptr`` into registered memory."""
        return self._call("write_bytes_to_buffer", lambda: self._engine.write_bytes(dest_address, src_ptr[:length]) or 0)

    def read_bytes_from_buffer(self, source_address, length):
        """Bytes of registered memory (b"" on failure)."""
        return self._call("read_bytes_from_buffer", self._engine.read_bytes, source_address, length, failure=b"")

    # Transfers -------------------------------------------------------------

    def _sync(self, what, op, target, buffers, peers, lengths):
        # The hot path: no closure, one native call once the segment is open.
        if self._engine is None:
            log.error("%s: call initialize() first", what)
            return -1
        try:
            self._native.transfer_addrs(self._segment(target), op, buffers, peers, lengths, self._timeout)
            return 0
        except _FAILURES as error:
            log.error("%s: %s", what, _reason(error))
            return -1

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        """Writes ``length`` bytes at ``buffer`` to the peer's address; waits."""
        return self._sync("transfer_sync_write", "write", target_hostname, [buffer], [peer_buffer_address], [length])

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        """Reads ``length`` bytes at the peer's address into ``buffer``; waits."""
        return self._sync("transfer_sync_read", "read", target_hostname, [buffer], [peer_buffer_address], [length])

    def transfer_sync(self, target_hostname, buffer, peer_buffer_address, length, opcode, notify=None, transport_hint=""):
        """Either direction by ``opcode``; with ``notify`` (a TransferNotify)
        the peer gets it after the bytes are in place."""
        return self.batch_transfer_sync(
            target_hostname, [buffer], [peer_buffer_address], [length], opcode, notify, transport_hint, _what="transfer_sync"
        )

    def batch_transfer_sync(
        self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify=None, transport_hint="", _what=None
    ):
        """One batch in either direction by ``opcode``; waits. With
        ``notify`` (a TransferNotify) the peer gets it after every byte of
        the batch is in place."""
        what = _what or "batch_transfer_sync"
        try:
            op = _opcode_op(opcode)
        except (TypeError, ValueError) as error:
            log.error("%s: %s", what, error)
            return -1
        code = self._sync(what, op, target_hostname, buffers, peer_buffer_addresses, lengths)
        if code == 0 and notify is not None:
            code = self._call(what, self._notify, target_hostname, notify)
        return code

    def _notify(self, target, notify):
        name, msg = getattr(notify, "name", None), getattr(notify, "msg", None)
        if not isinstance(name, str) or not isinstance(msg, str):
            raise TypeError(f"notify must be a TransferNotify(name: str, msg: str), got {notify!r}")
        self._engine.notify(self._segment(target), f"{name}\0{msg}".encode(), self._timeout)
        return 0

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""):
        """Writes every (buffer, peer address, length) as one batch; waits."""
        return self._sync("batch_transfer_sync_write", "write", target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""):
        """Reads every (buffer, peer address, length) as one batch; waits."""
        return self._sync("batch_transfer_sync_read", "read", target_hostname, buffers, peer_buffer_addresses, lengths)

    def _async(self, what, op, target, buffers, peers, lengths, failure):
        def submit():
            batch = self._engine.submit(self._segment(target), op, buffers, peers, lengths, self._timeout)
            ours = self._next_batch
            self._next_batch += 1
            self._batches[ours] = batch
            return ours

        return self._call(what, submit, failure=failure)

    def batch_transfer_async_write(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""):
        """Submits a write batch; returns its id (0 on failure)."""
        return self._async("batch_transfer_async_write", "write", target_hostname, buffers, peer_buffer_addresses, lengths, 0)

    def batch_transfer_async_read(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""):
        """Submits a read batch; returns its id (0 on failure)."""
        return self._async("batch_transfer_async_read", "read", target_hostname, buffers, peer_buffer_addresses, lengths, 0)

    def batch_transfer_async(self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint=""):
        """Submits a batch in either direction by ``opcode``; returns its id
        (0 on failure)."""
        try:
            op = _opcode_op(opcode)
        except (TypeError, ValueError) as error:
            log.error("batch_transfer_async: %s", error)
            return 0
        return self._async("batch_transfer_async", op, target_hostname, buffers, peer_buffer_addresses, lengths, 0)

    def get_batch_transfer_status(self, batch_ids):
        """Waits for every batch: 0 if all succeeded, -1 if any failed or timed out."""
        if isinstance(batch_ids, (str, bytes)) or not hasattr(batch_ids, "__iter__"):
            log.error("get_batch_transfer_status: batch_ids must be a list of ids, got %r", batch_ids)
            return -1
        failed = False
        for ours in batch_ids:
            batch = self._batches.pop(ours, None) if isinstance(ours, int) else None
            if batch is None:
                log.error("get_batch_transfer_status: unknown batch id %r", ours)
                failed = True
                continue
            if self._call("get_batch_transfer_status", self._engine.wait, batch, self._timeout) == -1:
                failed = True
        return -1 if failed else 0

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        """Submits one write; returns its batch id, or Mooncake's failure
        sentinel 0 (a batch id is unsigned: a -1 read as an id passed
        engines' ``batch_id != 0`` checks)."""
        return self._async("transfer_submit_write", "write", target_hostname, [buffer], [peer_buffer_address], [length], 0)

    def transfer_check_status(self, batch_id):
        """1 done, 0 still running, -1 failed (or unknown), -2 timed out."""
        batch = self._batches.get(batch_id) if isinstance(batch_id, int) else None
        if batch is None:
            log.error("transfer_check_status: unknown batch id %r", batch_id)
            return -1
        try:
            done = self._engine.poll(batch)
        except KvringError as error:
            del self._batches[batch_id]
            log.error("transfer_check_status: %s", error)
            return -2 if isinstance(error, TimeoutError) else -1
        if done is None:
            return 0
        del self._batches[batch_id]
        return 1

    def get_notifies(self):
        """Notifications received since the last call, as TransferNotify."""

        def take():
            out = []
            for sender, message in self._engine.notifications():
                name, _, msg = message.decode(errors="replace").partition("\0")
                out.append(TransferNotify(name or sender, msg))
            return out

        return self._call("get_notifies", take, failure=[])

    # Peers, topology, the engine underneath ---------------------------------

    def send_probe(self, peer_server_name):
        """0 if the peer answers a fresh handshake now (as the engine this
        one knows by that name), else -1 with the reason logged: what
        SGLang asks before it retries a peer it gave up on."""

        def probe():
            self._engine._native.probe(self._segment(peer_server_name), self._timeout)
            return 0

        return self._call("send_probe", probe)

    def warmup_efa_segment(self, segment_name):
        """Connects to the peer now rather than at the first transfer (what
        Mooncake's EFA warm-up is for; kvring has no EFA: it opens the
        segment on its own transport). 0, or -1 with the reason logged."""

        def warm():
            self._engine.segment_regions(self._segment(segment_name), self._timeout)
            return 0

        return self._call("warmup_efa_segment", warm)

    def get_local_topology(self, device_name=None):
        """This host's topology as Mooncake prints it: a JSON object of
        locations ("cpu:N" per NUMA node) to [preferred NICs, other NICs].
        kvring uses no RDMA NIC from Python, so both lists are empty."""
        return _topology_json()

    def get_engine(self):
        """The engine underneath: a ``kvring.Engine`` (Mooncake hands back
        its C++ engine), or None before ``initialize``."""
        return self._engine

    def get_engine_ptr(self):
        """Mooncake's C++ engine address, for C++ code that takes it: kvring
        has no such object, so 0 (Mooncake's null), with the reason logged
        rather than an address C++ would misread."""
        log.error("get_engine_ptr: kvring has no Mooncake C++ TransferEngine to point at; use get_engine()")
        return 0

    # Transfers ordered after a CUDA stream ------------------------------------

    def _on_cuda(self, what, op, target, buffers, peers, lengths, stream_ptr):
        """Waits for the work queued on ``stream_ptr`` (0: the buffer's
        GPU's default stream), then moves the batch and waits for it. Later
        work the caller queues on the stream is ordered after it, since the
        call returns only then. Raises RuntimeError on failure, as
        Mooncake's does (its host callback ends the process instead)."""
        if self._engine is None:
            raise RuntimeError(f"{what}: call initialize() first")
        try:
            stream = int(stream_ptr)
            native = self._engine._native
            region, _ = native.locate(buffers[0], lengths[0]) if len(buffers) and len(lengths) else (None, 0)
            memory = native.region_memory(region) if region is not None else "host"
            device = int(memory.split(":")[1]) if memory.startswith("gpu:") else 0
            native.wait_gpu_stream(device, stream, self._timeout)
            native.transfer_addrs(self._segment(target), op, buffers, peers, lengths, self._timeout)
        except _FAILURES as error:
            log.error("%s: %s", what, _reason(error))
            raise RuntimeError(f"{what}: {_reason(error)}") from None

    def transfer_write_on_cuda(self, target_hostname, buffer, peer_buffer_address, length, stream_ptr=0, transport_hint=""):
        """Writes after the work queued on ``stream_ptr``; see ``_on_cuda``."""
        self._on_cuda("transfer_write_on_cuda", "write", target_hostname, [buffer], [peer_buffer_address], [length], stream_ptr)

    def transfer_read_on_cuda(self, target_hostname, buffer, peer_buffer_address, length, stream_ptr=0, transport_hint=""):
        """Reads after the work queued on ``stream_ptr``; see ``_on_cuda``."""
        self._on_cuda("transfer_read_on_cuda", "read", target_hostname, [buffer], [peer_buffer_address], [length], stream_ptr)

    def batch_transfer_write_on_cuda(self, target_hostname, buffers, peer_buffer_addresses, lengths, stream_ptr=0, transport_hint=""):
        """A write batch after the work queued on ``stream_ptr``."""
        self._on_cuda("batch_transfer_write_on_cuda", "write", target_hostname, buffers, peer_buffer_addresses, lengths, stream_ptr)

    def batch_transfer_read_on_cuda(self, target_hostname, buffers, peer_buffer_addresses, lengths, stream_ptr=0, transport_hint=""):
        """A read batch after the work queued on ``stream_ptr``."""
        self._on_cuda("batch_transfer_read_on_cuda", "read", target_hostname, buffers, peer_buffer_addresses, lengths, stream_ptr)


def _topology_json():
    """{"cpu:N": [[], []]} for each NUMA node of this host (one when the
    kernel lists none)."""
    import glob
    import json

    nodes = sorted(int(path.rsplit("node", 1)[1]) for path in glob.glob("/sys/devices/system/node/node[0-9]*"))
    return json.dumps({f"cpu:{node}": [[], []] for node in nodes or [0]})

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
        if device_name:
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
            self._engine = Engine(name=local_hostname if metadata else None, listen=listen, metadata=metadata)
        except KvringError as error:
            log.error("initialize: %s", error)
            return -1
        self._protocol = transport
        self._native = self._engine._native
        return 0

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
        except KvringError as error:
            log.error("%s: %s", what, error)
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
        if len(buffer_addresses) != len(capacities):
            log.error("batch_register_memory: %d addresses, %d capacities", len(buffer_addresses), len(capacities))
            return -1
        codes = [self.register_memory(a, c, location) for a, c in zip(buffer_addresses, capacities)]
        return 0 if all(code == 0 for code in codes) else -1

    def batch_unregister_memory(self, buffer_addresses):
        """Unregisters each address; 0 only if every one went."""
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
        except KvringError as error:
            log.error("%s: %s", what, error)
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
        op = "write" if int(opcode) == int(TransferOpcode.Write) else "read"
        code = self._sync("transfer_sync", op, target_hostname, [buffer], [peer_buffer_address], [length])
        if code == 0 and notify is not None:
            code = self._call("transfer_sync", self._notify, target_hostname, notify)
        return code

    def _notify(self, target, notify):
        self._engine.notify(self._segment(target), f"{notify.name}\0{notify.msg}".encode(), self._timeout)
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

    def get_batch_transfer_status(self, batch_ids):
        """Waits for every batch: 0 if all succeeded, -1 if any failed or timed out."""
        failed = False
        for ours in batch_ids:
            batch = self._batches.pop(ours, None)
            if batch is None:
                log.error("get_batch_transfer_status: unknown batch id %r", ours)
                failed = True
                continue
            if self._call("get_batch_transfer_status", self._engine.wait, batch, self._timeout) == -1:
                failed = True
        return -1 if failed else 0

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        """Submits one write; returns its batch id (negative on failure)."""
        return self._async("transfer_submit_write", "write", target_hostname, [buffer], [peer_buffer_address], [length], -1)

    def transfer_check_status(self, batch_id):
        """1 done, 0 still running, -1 failed (or unknown), -2 timed out."""
        batch = self._batches.get(batch_id)
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

"""An LMDeploy migration backend on kvring.

LMDeploy's ``MigrationBackendImpl`` operations. Where LMDeploy is
importable, ``KvringMigrationBackend`` subclasses its ``MigrationBackendImpl``
and is registered in its ``MIGRATION_BACKENDS`` registry as "Kvring";
``register("Mooncake")`` puts it in place of the Mooncake backend, which is
what LMDeploy's ``--migration-backend Mooncake`` then builds (its enum names
no other). Where LMDeploy is not importable the class is the same, on
``object``, and ``LMDEPLOY_UNAVAILABLE`` says why. Arguments are LMDeploy's
own request and message classes (pydantic models) or plain dicts with the
same fields.

- ``p2p_initialize(init_request)``: ``remote_engine_id``, ``protocol`` (TCP,
  or NVLINK: GPU caches on one host, kvring's cuda_ipc); the request's
  engine configs and rank are kept in ``links[remote_engine_id]``.
- ``register_memory_region(request)``: ``mr_key``, ``addr``, ``length``
  (a GPU cache's address registers as that GPU's memory). ``offset`` is
  not added: LMDeploy sends ``tensor.data_ptr()``, which already includes
  the tensor's ``storage_offset()`` (in elements), as its own Mooncake
  backend reads it. LMDeploy registers each cache once per peer: the same
  range again is accepted.
- ``endpoint_info(remote_engine_id, protocol)``: this side's address and
  memory regions, a JSON-ready dict for the peer's ``p2p_connect``.
- ``p2p_connect(remote_engine_id, conn_req)``: ``endpoint_info`` (the dict,
  or its JSON) from the peer.
- ``p2p_migrate(assignment)``: ``remote_engine_id`` and ``batch`` of
  (``mr_key``, ``target_offset``, ``source_offset``, ``length``), as
  LMDeploy's cache engine builds them: ``target_offset`` in the peer's
  region (the prefill side's), ``source_offset`` in ours. Reads every range
  as one batch and returns the bytes moved as an int that is also
  awaitable (LMDeploy awaits it); ``async_op=True`` returns a coroutine
  that waits off the event loop instead.
- ``p2p_drop_connect(remote_engine_id)``: forgets the peer and closes its
  connection. ``store`` / ``load`` (to a KV store) raise
  ``UnsupportedError``.

The native module and the protocol are checked when the backend is
constructed, not at the first transfer.
"""

import importlib.util
import json
import logging
from collections.abc import Mapping

from .errors import InvalidArgumentError, UnknownSegmentError, UnsupportedError

log = logging.getLogger("kvring.lmdeploy")

#: The registry name kvring's backend is registered under.
REGISTERED_AS = "Kvring"


def _lmdeploy():
    """LMDeploy's registry and base class, and why not where it is missing."""
    if importlib.util.find_spec("lmdeploy") is None:
        return None, object, "LMDeploy is not installed (pip install lmdeploy)"
    try:
        from lmdeploy.pytorch.disagg.backend.backend import MIGRATION_BACKENDS
        from lmdeploy.pytorch.disagg.backend.base import MigrationBackendImpl
    except Exception as error:  # noqa: BLE001  (its import chain needs torch and more; any failure means "not usable")
        return None, object, f"LMDeploy did not import ({type(error).__name__}: {error})"
    return MIGRATION_BACKENDS, MigrationBackendImpl, None


MIGRATION_BACKENDS, _Base, LMDEPLOY_UNAVAILABLE = _lmdeploy()


def _field(obj, name):
    if isinstance(obj, Mapping):
        if name not in obj:
            raise InvalidArgumentError(f"missing field {name!r} in {sorted(obj)}")
        return obj[name]
    try:
        return getattr(obj, name)
    except AttributeError:
        raise InvalidArgumentError(f"{type(obj).__name__} has no field {name!r}") from None


def _optional(obj, name):
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


# LMDeploy's protocol -> kvring's transport: NVLINK (GPU caches of one
# host) is cuda_ipc.
_TRANSPORTS = {"nvlink": "cuda_ipc"}


def _protocol(value):
    """``MigrationProtocol.TCP``, ``"tcp"``, ``"TCP"`` -> ``"tcp"``;
    ``MigrationProtocol.NVLINK`` -> ``"cuda_ipc"``."""
    name = getattr(value, "name", value)
    if not isinstance(name, str):
        raise InvalidArgumentError(f"protocol {value!r} is not a name")
    return _TRANSPORTS.get(name.lower(), name.lower())


class Migrated(int):
    """Bytes a migration moved: an int, and awaitable (to the same int), so
    LMDeploy's ``await backend.p2p_migrate(...)`` and a plain call both work."""

    def __await__(self):
        return int(self)
        yield  # noqa: unreachable  (makes this a generator: an awaitable's iterator)


class _Link:
    """One peer: what ``p2p_initialize`` said and ``p2p_connect`` found."""

    def __init__(self, request, protocol):
        self.protocol = protocol
        self.rank = _optional(request, "rank")
        self.local_engine_config = _optional(request, "local_engine_config")
        self.remote_engine_config = _optional(request, "remote_engine_config")
        self.address = None
        self.mrs = {}


class KvringMigrationBackend(_Base):
    """LMDeploy's migration backend, on one kvring engine."""

    def __init__(self, protocol="tcp", listen="127.0.0.1:0", engine=None):
        # Importing the native module (and so every import error) happens here.
        from . import Engine, transports

        self._default = _protocol(protocol)
        if self._default not in transports():
            raise UnsupportedError(f"protocol {self._default!r} is not built into this kvring module (it has {transports()})")
        # RDMA asked for is RDMA or an error now (no libibverbs, no device),
        # never tcp in its place at the first transfer.
        self._engine = engine or Engine(listen=listen, **({"rdma": "on"} if self._default == "rdma" else {}))
        self._local = {}  # mr_key -> (addr, length)
        self.links = {}  # remote_engine_id -> _Link

    @property
    def engine(self):
        """The kvring engine underneath."""
        return self._engine

    def p2p_initialize(self, init_request):
        """Starts a link to ``remote_engine_id`` over ``protocol``."""
        remote = str(_field(init_request, "remote_engine_id"))
        protocol = _protocol(_field(init_request, "protocol"))
        from . import transports

        if protocol not in transports():
            raise UnsupportedError(f"protocol {protocol!r} is not built into this kvring module (it has {transports()})")
        self.links[remote] = _Link(init_request, protocol)

    def register_memory_region(self, register_mr_request):
        """Registers ``addr + offset`` for ``length`` bytes under ``mr_key``."""
        key = str(_field(register_mr_request, "mr_key"))
        addr = _field(register_mr_request, "addr")
        length = _field(register_mr_request, "length")
        if key in self._local:
            if self._local[key] == (addr, length):
                return  # the same cache, registered for another peer
            raise InvalidArgumentError(f"memory region {key!r} is already registered as {self._local[key]}, not {(addr, length)}")
        self._engine.register(addr, length)
        self._local[key] = (addr, length)

    def endpoint_info(self, remote_engine_id, protocol):
        """This side's address and regions, for the peer's ``p2p_connect``."""
        return {
            "protocol": _protocol(protocol),
            "address": self._engine.control_addr,
            "mrs": {key: [addr, length] for key, (addr, length) in self._local.items()},
        }

    def p2p_connect(self, remote_engine_id, conn_req):
        """Connects to the peer its ``endpoint_info`` describes."""
        remote = str(remote_engine_id)
        link = self.links.get(remote)
        if link is None:
            raise UnknownSegmentError(f"engine {remote!r}: call p2p_initialize first")
        info = _field(conn_req, "endpoint_info")
        if isinstance(info, (str, bytes)):
            info = json.loads(info)
        link.address = _field(info, "address")
        link.mrs = {str(k): (int(v[0]), int(v[1])) for k, v in _field(info, "mrs").items()}
        self._engine.open_segment(link.address, link.protocol)

    def p2p_drop_connect(self, remote_engine_id):
        """Forgets a peer and closes its connection."""
        link = self.links.pop(str(remote_engine_id), None)
        if link is None:
            raise UnknownSegmentError(f"engine {remote_engine_id!r} was never initialized")
        if link.address is not None:
            self._engine._native.close_segment(link.address)

    def _ranges(self, assignment):
        remote = str(_field(assignment, "remote_engine_id"))
        link = self.links.get(remote)
        if link is None or link.address is None:
            raise UnknownSegmentError(f"engine {remote!r} is not connected (p2p_initialize, then p2p_connect)")
        locals_, remotes, lengths = [], [], []
        for instruct in _field(assignment, "batch"):
            key = str(_field(instruct, "mr_key"))
            if key not in self._local or key not in link.mrs:
                raise InvalidArgumentError(f"memory region {key!r} is not registered on both sides")
            locals_.append(self._local[key][0] + _field(instruct, "source_offset"))
            remotes.append(link.mrs[key][0] + _field(instruct, "target_offset"))
            lengths.append(_field(instruct, "length"))
        return link.address, locals_, remotes, lengths

    def p2p_migrate(self, assignment, async_op=False):
        """Reads the assignment's ranges from the peer as one batch."""
        address, locals_, remotes, lengths = self._ranges(assignment)
        if async_op:
            return self._migrate_later(address, locals_, remotes, lengths)
        if not lengths:
            return Migrated(0)
        return Migrated(self._engine.transfer_addrs(address, "read", locals_, remotes, lengths))

    async def _migrate_later(self, address, locals_, remotes, lengths):
        import asyncio

        if not lengths:
            return 0
        batch = self._engine.submit(address, "read", locals_, remotes, lengths)
        return await asyncio.get_running_loop().run_in_executor(None, self._engine.wait, batch)

    def store(self, assignment, async_op=False):
        """Not served: kvring moves blocks between engines, not to a store."""
        raise UnsupportedError("kvring's LMDeploy backend migrates between engines; store (to a KV store) is not served")

    def load(self, assignment, async_op=False):
        """Not served: kvring moves blocks between engines, not from a store."""
        raise UnsupportedError("kvring's LMDeploy backend migrates between engines; load (from a KV store) is not served")


def register(name=REGISTERED_AS):
    """Registers ``KvringMigrationBackend`` in LMDeploy's registry under
    ``name`` ("Mooncake": in place of LMDeploy's Mooncake backend, which
    ``--migration-backend Mooncake`` then builds); raises
    ``UnsupportedError`` saying why where LMDeploy is not importable."""
    if MIGRATION_BACKENDS is None:
        raise UnsupportedError(LMDEPLOY_UNAVAILABLE)
    MIGRATION_BACKENDS.register_module(name=name, force=True, module=KvringMigrationBackend)
    log.info("registered kvring's migration backend in LMDeploy's MIGRATION_BACKENDS as %r", name)


if MIGRATION_BACKENDS is not None:
    register(REGISTERED_AS)

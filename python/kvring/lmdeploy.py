"""An LMDeploy migration backend on kvring.

The five operations of LMDeploy's ``MigrationBackendImpl``. Arguments are
duck-typed: LMDeploy's own request objects (pydantic models) or plain dicts
with the same fields work alike.

- ``p2p_initialize(init_request)``: ``remote_engine_id``, ``protocol``
  (TCP, or NVLINK: GPU caches on one host, kvring's cuda_ipc).
- ``register_memory_region(request)``: ``mr_key``, ``addr``, ``offset``,
  ``length`` (the region is ``addr + offset`` for ``length`` bytes; a GPU
  cache's address registers as that GPU's memory).
- ``endpoint_info(remote_engine_id, protocol)``: this side's address and
  memory regions, a JSON-ready dict for the peer's ``p2p_connect``.
- ``p2p_connect(remote_engine_id, conn_req)``: ``endpoint_info`` (the dict,
  or its JSON) from the peer.
- ``p2p_migrate(assignment)``: ``remote_engine_id`` and ``batch`` of
  (``mr_key``, ``target_offset``, ``source_offset``, ``length``): reads the
  peer's ``source_offset`` of region ``mr_key`` into ours at
  ``target_offset``, synchronously, as one batch.

The native module and the protocol are checked when the backend is
constructed, not at the first transfer.
"""

import json
from collections.abc import Mapping

from .errors import InvalidArgumentError, UnknownSegmentError, UnsupportedError


def _field(obj, name):
    if isinstance(obj, Mapping):
        if name not in obj:
            raise InvalidArgumentError(f"missing field {name!r} in {sorted(obj)}")
        return obj[name]
    try:
        return getattr(obj, name)
    except AttributeError:
        raise InvalidArgumentError(f"{type(obj).__name__} has no field {name!r}") from None


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


class KvringMigrationBackend:
    """LMDeploy's migration backend, on one kvring engine."""

    def __init__(self, protocol="tcp", listen="127.0.0.1:0", engine=None):
        # Importing the native module (and so every import error) happens here.
        from . import Engine, transports

        self._default = _protocol(protocol)
        if self._default not in transports():
            raise UnsupportedError(f"protocol {self._default!r} is not built into this kvring module (it has {transports()})")
        self._engine = engine or Engine(listen=listen)
        self._local = {}  # mr_key -> (addr, length)
        self._peers = {}  # remote_engine_id -> {"protocol", "address", "mrs"}

    @property
    def engine(self):
        """The kvring engine underneath."""
        return self._engine

    def p2p_initialize(self, init_request):
        remote = str(_field(init_request, "remote_engine_id"))
        protocol = _protocol(_field(init_request, "protocol"))
        from . import transports

        if protocol not in transports():
            raise UnsupportedError(f"protocol {protocol!r} is not built into this kvring module (it has {transports()})")
        self._peers[remote] = {"protocol": protocol, "address": None, "mrs": {}}

    def register_memory_region(self, register_mr_request):
        key = str(_field(register_mr_request, "mr_key"))
        addr = _field(register_mr_request, "addr") + _field(register_mr_request, "offset")
        length = _field(register_mr_request, "length")
        if key in self._local:
            raise InvalidArgumentError(f"memory region {key!r} is already registered")
        self._engine.register(addr, length)
        self._local[key] = (addr, length)

    def endpoint_info(self, remote_engine_id, protocol):
        return {
            "protocol": _protocol(protocol),
            "address": self._engine.control_addr,
            "mrs": {key: [addr, length] for key, (addr, length) in self._local.items()},
        }

    def p2p_connect(self, remote_engine_id, conn_req):
        remote = str(remote_engine_id)
        if remote not in self._peers:
            raise UnknownSegmentError(f"engine {remote!r}: call p2p_initialize first")
        info = _field(conn_req, "endpoint_info")
        if isinstance(info, (str, bytes)):
            info = json.loads(info)
        peer = self._peers[remote]
        peer["address"] = _field(info, "address")
        peer["mrs"] = {str(k): (int(v[0]), int(v[1])) for k, v in _field(info, "mrs").items()}
        self._engine.open_segment(peer["address"], peer["protocol"])

    def p2p_migrate(self, assignment, async_op=False):
        remote = str(_field(assignment, "remote_engine_id"))
        peer = self._peers.get(remote)
        if peer is None or peer["address"] is None:
            raise UnknownSegmentError(f"engine {remote!r} is not connected (p2p_initialize, then p2p_connect)")
        locals_, remotes, lengths = [], [], []
        for instruct in _field(assignment, "batch"):
            key = str(_field(instruct, "mr_key"))
            if key not in self._local or key not in peer["mrs"]:
                raise InvalidArgumentError(f"memory region {key!r} is not registered on both sides")
            length = _field(instruct, "length")
            locals_.append(self._local[key][0] + _field(instruct, "target_offset"))
            remotes.append(peer["mrs"][key][0] + _field(instruct, "source_offset"))
            lengths.append(length)
        if not lengths:
            return 0
        return self._engine.transfer_addrs(peer["address"], "read", locals_, remotes, lengths)

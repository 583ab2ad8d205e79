"""What NIXL's ``nixl._bindings`` module gives its Python users, on kvring.

NIXL's own agent (``nixl._api.nixl_agent``) and its tests reach through
``nixl._bindings`` for memory-type constants (``DRAM_SEG``), descriptor
lists, error classes (``nixlNotFoundError``, ``nixlNoTelemetryError``),
thread-sync constants and the agent class the Python agent is built on
(``nixlAgent(name, nixlAgentConfig)``). A ``nixl`` package whose
``_bindings`` is this module and ``_api`` is ``kvring.nixl`` runs code
written for NIXL unchanged (tests/peers/nixl/shim is one).

Memory types are NIXL's names as strings ("DRAM", "VRAM", ...), which is
what kvring's lists carry: ``nixlXferDList(DRAM_SEG, descs).getType() ==
DRAM_SEG``. ``nixlAgent`` here is the agent's engine, made by
``nixl_agent``'s constructor through this module's attribute (so a caller
may wrap it, as NIXL's ``test_sync_mode_agent`` does).
"""

import os

from .. import Engine
from ..errors import InvalidArgumentError
from . import _backends
from ._descs import nixlRegDList, nixlXferDList
from ._errors import (
    NoSuchBackendError,
    UnknownKeyError,
    nixlBackendError,
    nixlCancelledError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlUnknownError,
)
from ._handles import nixlXferTelemetry

# NIXL's memory types (nixl_mem_t), by the names kvring's lists carry.
DRAM_SEG = "DRAM"
VRAM_SEG = "VRAM"
FILE_SEG = "FILE"
BLK_SEG = "BLOCK"
OBJ_SEG = "OBJ"

# NIXL's operations (nixl_xfer_op_t).
NIXL_READ = "READ"
NIXL_WRITE = "WRITE"

# NIXL's thread-sync modes (nixl_thread_sync_t), NIXL 1.5.1's values.
# kvring's engine is safe to call from any thread in every mode: the mode
# is kept (``nixlAgentConfig.syncMode``), not acted on.
NIXL_THREAD_SYNC_NONE = 0
NIXL_THREAD_SYNC_STRICT = 1
NIXL_THREAD_SYNC_RW = 2
NIXL_THREAD_SYNC_DEFAULT = NIXL_THREAD_SYNC_NONE  # an alias in NIXL 1.5.1

DEFAULT_COMM_PORT = 8888

# kvring has no UCX GPU device API (NIXL's prep_mem_view): NIXL's tests
# skip what needs it when this is False.
HAVE_UCX_GPU_DEVICE_API = False

class nixlAgentConfig:  # noqa: N801  (NIXL's name)
    """NIXL's agent configuration record, as ``nixl_agent`` fills it.
    ``token`` is kvring's: the cluster's pre-shared token (default
    ``KVRING_TOKEN``), or None."""

    def __init__(self):
        self.useProgThread = True
        self.useListenThread = False
        self.listenPort = 0
        self.syncMode = NIXL_THREAD_SYNC_DEFAULT
        self.pthrDelay = 0
        self.lthrDelay = 100000
        self.captureTelemetry = False
        self.listenHost = "127.0.0.1"
        self.token = os.environ.get("KVRING_TOKEN", "").encode() or None  # as kvring.Engine reads it

    def __repr__(self):
        shown = dict(vars(self), token="<set>" if self.token else None)  # never print the token
        return f"nixlAgentConfig({shown!r})"


# NIXL's status codes (nixl_status_t) that its C++-style calls return;
# failures raise kvring's exception instead, as NIXL's bindings raise theirs.
NIXL_SUCCESS = 0
NIXL_IN_PROG = 1
_STATUS = {"DONE": NIXL_SUCCESS, "PROC": NIXL_IN_PROG}


def ucx_rdma(value=None):
    """What ``UCX_NET_DEVICES`` (NIXL's UCX backend's NIC choice) means for
    kvring's RDMA, as keyword arguments of ``Engine``: unset or "all", kvring's
    default (every device with an active port); RDMA devices named as UCX
    names them (``mlx5_0:1``), those and no other (``rdma="on"``: each used,
    or the agent is not made and the error says which and why); only
    network interfaces (``eth0``: UCX's tcp), no RDMA."""
    value = os.environ.get("UCX_NET_DEVICES") if value is None else value
    if value is None or value.strip() in ("", "all"):
        return {}
    entries = [part.strip() for part in value.split(",") if part.strip()]
    rdma = [entry.split(":", 1)[0] for entry in entries if ":" in entry]
    if rdma:
        return {"rdma": "on", "rdma_devices": rdma}
    return {"rdma": "off"}


class nixlAgent:  # noqa: N801  (NIXL's name)
    """The agent's engine: one kvring engine named ``name``, listening as
    ``config`` says, under ``nixl_agent``. Its methods are NIXL's C++
    agent's, as its bindings give them (``createBackend``, ``registerMem``,
    ``createXferReq``, ``postXferReq``, ...), each done by the
    ``nixl_agent`` over this engine: handles are ints, results NIXL's
    status codes, failures kvring's exceptions."""

    def __init__(self, name, config):
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"an agent's name is a non-empty str, got {name!r}")
        self.name = name
        self.config = config
        self.sync_mode = config.syncMode
        self.engine = Engine(
            name=name, listen=f"{config.listenHost}:{config.listenPort}", token=config.token, **ucx_rdma()
        )
        self._api_ref = None  # the nixl_agent that made this one (a weak reference)
        self._owned = None  # or the one made for the calls below
        self._handles = {}  # int -> nixl_xfer_handle
        self._next_handle = 1
        self._backends = {}  # int -> backend name

    def _api(self):
        agent = self._api_ref() if self._api_ref is not None else None
        if agent is None:
            if self._owned is None:
                from ._agent import nixl_agent

                self._owned = nixl_agent._over(self)
            agent = self._owned
        return agent

    def _handle(self, reqh):
        handle = self._handles.get(reqh)
        if handle is None:
            raise InvalidArgumentError(f"transfer request handle {reqh!r} is unknown or released")
        return handle

    @staticmethod
    def _status(handle, state):
        if state == "ERR":
            raise handle.error
        return _STATUS[state]

    def getAvailPlugins(self):  # noqa: N802  (NIXL's name)
        """Backend names kvring stands in for."""
        return self._api().get_plugin_list()

    def getPluginParams(self, backend):  # noqa: N802  (NIXL's name)
        """(parameters with their defaults, memory types) of a backend kvring
        stands in for or implements (POSIX: NIXL's, and DRAM, FILE)."""
        _backends.check(backend)
        return _backends.plugin_params(backend), _backends.plugin_mem_types(backend)

    def createBackend(self, backend, init_params=None):  # noqa: N802  (NIXL's name)
        """Creates a backend kvring stands in for; its handle (an int)."""
        self._api().create_backend(backend, init_params)
        handle = len(self._backends) + 1
        self._backends[handle] = backend
        return handle

    def getBackendParams(self, handle):  # noqa: N802  (NIXL's name)
        """(parameters, memory types) of a created backend."""
        name = self._backends.get(handle)
        if name is None:
            raise nixlNotFoundError(f"backend handle {handle!r} was not created here")
        return self._api().get_backend_params(name), self._api().get_backend_mem_types(name)

    def queryMem(self, descs, backend):  # noqa: N802  (NIXL's name)
        """Per descriptor of a registration list, what a created backend
        knows of it: POSIX, a file's info dict or None where none is."""
        name = self._backends.get(backend)
        if name is None:
            raise nixlNotFoundError(f"backend handle {backend!r} was not created here")
        return self._api().query_memory(descs, name)

    def _names(self, backends):
        return [self._backends[h] for h in backends or () if h in self._backends]

    def registerMem(self, descs, backends=()):  # noqa: N802  (NIXL's name)
        """Registers a registration list; NIXL_SUCCESS."""
        self._api().register_memory(descs, backends=self._names(backends))
        return NIXL_SUCCESS

    def deregisterMem(self, descs, backends=()):  # noqa: N802  (NIXL's name)
        """Unregisters what ``registerMem`` registered; NIXL_SUCCESS."""
        self._api().deregister_memory(descs, backends=self._names(backends))
        return NIXL_SUCCESS

    def getLocalMD(self):  # noqa: N802  (NIXL's name)
        """This agent's metadata, as bytes."""
        return self._api().get_agent_metadata()

    def loadRemoteMD(self, metadata):  # noqa: N802  (NIXL's name)
        """Loads a peer's metadata; its name, as bytes."""
        return self._api().add_remote_agent(metadata)

    def invalidateRemoteMD(self, agent):  # noqa: N802  (NIXL's name)
        """Forgets a peer."""
        self._api().remove_remote_agent(agent)
        return NIXL_SUCCESS

    def createXferReq(self, operation, local_descs, remote_descs, remote_agent, notif_msg="", backends=()):  # noqa: N802
        """A transfer request between two transfer lists; its handle (an int)."""
        handle = self._api().initialize_xfer(operation, local_descs, remote_descs, remote_agent, notif_msg, self._names(backends))
        reqh, self._next_handle = self._next_handle, self._next_handle + 1
        self._handles[reqh] = handle
        return reqh

    def postXferReq(self, reqh, notif_msg=""):  # noqa: N802  (NIXL's name)
        """Posts a request: NIXL_SUCCESS or NIXL_IN_PROG; a failure raises."""
        handle = self._handle(reqh)
        return self._status(handle, self._api().transfer(handle, notif_msg))

    def getXferStatus(self, reqh):  # noqa: N802  (NIXL's name)
        """NIXL_SUCCESS or NIXL_IN_PROG; a failure raises."""
        handle = self._handle(reqh)
        return self._status(handle, self._api().check_xfer_state(handle))

    def getXferTelemetry(self, reqh):  # noqa: N802  (NIXL's name)
        """The request's last posting's telemetry (``nixlNoTelemetryError``
        where the agent collects none)."""
        return self._api().get_xfer_telemetry(self._handle(reqh))

    def releaseXferReq(self, reqh):  # noqa: N802  (NIXL's name)
        """Releases a request (a posting in progress is waited for first)."""
        self._api().release_xfer_handle(self._handle(reqh))
        del self._handles[reqh]
        return NIXL_SUCCESS

    def getNotifs(self, notif_map, backends=()):  # noqa: N802  (NIXL's name)
        """Adds the notifications since the last call to ``notif_map``
        ({agent name: [bytes, ...]}) and returns it."""
        for sender, messages in self._api().get_new_notifs().items():
            notif_map.setdefault(sender, []).extend(messages)
        return notif_map

    def genNotif(self, remote_agent, msg, backends=()):  # noqa: N802  (NIXL's name)
        """Sends a notification not tied to a transfer."""
        self._api().send_notif(remote_agent, msg)


__all__ = [
    "DRAM_SEG", "VRAM_SEG", "FILE_SEG", "BLK_SEG", "OBJ_SEG", "NIXL_READ", "NIXL_WRITE",
    "NIXL_THREAD_SYNC_NONE", "NIXL_THREAD_SYNC_STRICT", "NIXL_THREAD_SYNC_RW", "NIXL_THREAD_SYNC_DEFAULT",
    "DEFAULT_COMM_PORT", "HAVE_UCX_GPU_DEVICE_API", "NIXL_SUCCESS", "NIXL_IN_PROG", "nixlRegDList", "nixlXferDList", "nixlAgent", "nixlAgentConfig",
    "nixlInvalidParamError", "nixlNotFoundError", "nixlNotSupportedError", "nixlRepostActiveError",
    "nixlNoTelemetryError", "nixlRemoteDisconnectError", "nixlCancelledError", "nixlBackendError",
    "nixlNotAllowedError", "nixlNotPostedError", "nixlMismatchError", "nixlUnknownError", "nixlXferTelemetry", "NoSuchBackendError", "UnknownKeyError",
]

"""``nixl_agent``: NIXL's Python agent on a kvring engine.

One agent is one kvring engine named after the agent. Memory is registered
in place; descriptor lists are located once (``prep_xfer_dlist``) and
transfers built from them hold their descriptors, so ``transfer`` is one
submission and ``check_xfer_state`` one poll of the batch's status word.

Notifications are keyed by the sending agent's name (the engine's name).
A transfer's notification is sent once its batch has ended ``DONE``, seen
by ``transfer`` or ``check_xfer_state`` (or any later call of the agent):
its bytes are in place before the peer reads it, and the peer has it
queued by the time ``DONE`` is returned.

Metadata (``get_agent_metadata``) is kvring's own segment descriptor
(name, epoch, control address, regions) as bytes; ``add_remote_agent``
opens the peer it describes. The listener-based exchange of NIXL's
examples runs over kvring's control plane: the agent's engine listens on
``listen_port``; ``fetch_remote_metadata`` is a handshake with the peer,
``send_local_metadata`` and ``invalidate_local_metadata`` travel as
notifications the receiving agent acts on (they never reach its user),
authenticated by the cluster's token (``_listener``).

The constructor builds its engine through ``_bindings.nixlAgent`` and
``_bindings.nixlAgentConfig``, as NIXL's agent builds its C++ agent, so
that code (and NIXL's own tests) that wraps that class sees what NIXL's
would.
"""

import atexit
import enum
import logging
import math
import os
import time
import weakref

from .. import _native
from ..errors import (
    BusyError,
    CancelledError,
    InvalidArgumentError,
    KvringError,
    StaleBatchError,
    TransferTimeoutError,
    UnauthorizedError,
    UnknownSegmentError,
    UnsupportedError,
)
from . import _backends, _bindings, _descs, _listener, _posix
from ._errors import UnknownKeyError, nixlBackendError, nixlNoTelemetryError, nixlNotFoundError, nixlNotSupportedError
from ._handles import nixl_prepped_dlist_handle, nixl_xfer_handle, nixlXferTelemetry

log = logging.getLogger("kvring.nixl")

DEFAULT_COMM_PORT = _bindings.DEFAULT_COMM_PORT
NIXL_INIT_AGENT = "NIXL_INIT_AGENT"
_OPS = {"WRITE": "write", "READ": "read"}
_MD_MAGIC = b"KVRNIXL1"
# The agent's own notifications (metadata sent and withdrawn); never handed
# to its user.
_CONTROL = _listener.CONTROL
# NIXL's reading of a boolean setting (NIXL_TELEMETRY_ENABLE), case aside.
_YES = ("y", "yes", "on", "1", "true", "enable")
_NO = ("n", "no", "off", "0", "false", "disable")
_warned_no_token = False
# How long a metadata fetch or send tries each time before it is left
# pending (retried by the next call that looks).
_RETRY_S = 0.5
_TIMEOUT_S = 30.0

_live = weakref.WeakSet()
_post = _native.post


@atexit.register
def _close_all():
    """Closes every agent left open before the interpreter goes away (their
    engines' threads are joined while Python still runs)."""
    for agent in list(_live):
        agent._close()


class nixl_thread_sync_t(enum.Enum):  # noqa: N801  (NIXL's name)
    """NIXL's thread-synchronization modes. kvring's engine may be called
    from any thread in every mode; the mode is kept, as NIXL's agent
    passes it on."""

    NIXL_THREAD_SYNC_NONE = _bindings.NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = _bindings.NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = _bindings.NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = _bindings.NIXL_THREAD_SYNC_DEFAULT


class nixl_agent_config:  # noqa: N801  (NIXL's name)
    """NIXL's agent configuration. kvring's lanes progress every transfer,
    so ``enable_prog_thread`` changes nothing; ``enable_listen_thread``
    makes the engine listen on ``listen_port`` (loopback unless
    ``KVRING_LISTEN`` names a host) for the
    metadata exchange of NIXL's examples; ``capture_telemetry`` asks for
    telemetry (``NIXL_TELEMETRY_ENABLE``, when set, decides, as in NIXL);
    ``num_threads`` is accepted and unused; ``sync_mode`` must be a
    ``nixl_thread_sync_t`` or None (NIXL's default: STRICT with the
    listener, NONE without)."""

    def __init__(
        self,
        enable_prog_thread=True,
        enable_listen_thread=False,
        listen_port=0,
        capture_telemetry=False,
        num_threads=0,
        backends=("UCX",),
        sync_mode=None,
    ):
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})")
        self.backends = list(backends)
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


def _listen_addr(conf):
    """Where the engine listens, as (host, port): loopback, on
    ``listen_port`` with the listener on. ``KVRING_LISTEN`` (kvring's
    ``listen`` setting, e.g. ``0.0.0.0:0``) gives the host for peers on
    other hosts, and the port without a listener. Loopback by default, as
    every kvring engine: one reachable from other hosts without a token
    lets anyone who reaches it read and write its registered memory."""
    configured = os.environ.get("KVRING_LISTEN")
    host, port = "127.0.0.1", 0
    if configured:
        host, _, configured_port = configured.rpartition(":")
        port = int(configured_port or 0)
    if conf.enable_listen:
        if not isinstance(conf.port, int) or isinstance(conf.port, bool) or not 0 <= conf.port < 65536:
            raise InvalidArgumentError(f"listen_port must be a port number, got {conf.port!r}")
        port = conf.port
    return host, port


def _token(token):
    """The agent's token: the argument, else ``KVRING_TOKEN``, else None;
    as bytes."""
    if token is None:
        token = os.environ.get("KVRING_TOKEN") or None
    if isinstance(token, str):
        token = token.encode()
    if token is not None and (not isinstance(token, (bytes, bytearray)) or not token):
        raise InvalidArgumentError("a token is a non-empty str or bytes")
    return None if token is None else bytes(token)


def _telemetry(conf):
    """Whether the agent collects telemetry, by NIXL's rule:
    ``NIXL_TELEMETRY_ENABLE`` when set (its yes or no), else the config's
    ``capture_telemetry``."""
    setting = os.environ.get("NIXL_TELEMETRY_ENABLE")
    if setting is None:
        return bool(conf.capture_telemetry)
    if setting.lower() in _YES:
        return True
    if setting.lower() in _NO:
        if conf.capture_telemetry:
            log.warning("NIXL_TELEMETRY_ENABLE=%s: telemetry asked for in the agent's config is off", setting)
        return False
    raise InvalidArgumentError(f"NIXL_TELEMETRY_ENABLE={setting!r}: use one of {_YES} or {_NO}")


class _ConfFromCore:
    """The telemetry setting of a ``_bindings.nixlAgentConfig``, as
    ``_telemetry`` reads a ``nixl_agent_config``."""

    def __init__(self, config):
        self.capture_telemetry = config.captureTelemetry


def _agent_name(name):
    """An agent's name as str: NIXL's agent takes bytes too (its
    ``add_remote_agent`` returns them)."""
    if isinstance(name, (bytes, bytearray)):
        return bytes(name).decode()
    return name


def _message(msg):
    """A notification as bytes (NIXL takes str too)."""
    if isinstance(msg, str):
        return msg.encode()
    if isinstance(msg, (bytes, bytearray, memoryview)):
        return bytes(msg)
    raise InvalidArgumentError(f"a notification is bytes or str, got {type(msg).__name__}")


def _op(operation):
    """kvring's opcode for NIXL's operation name; an unknown one raises
    ``UnknownKeyError`` (a ``KeyError``, as NIXL's dict lookup)."""
    op = _OPS.get(operation) if isinstance(operation, str) else None
    if op is None:
        raise UnknownKeyError(f"operation must be \"WRITE\" or \"READ\", got {operation!r}")
    return op


def _indices(indices):
    """Block indices as a list of ints (numpy arrays included)."""
    if hasattr(indices, "tolist"):
        indices = indices.tolist()
    if not isinstance(indices, list):
        indices = list(indices)
    return indices


class nixl_agent:  # noqa: N801  (NIXL's name)
    """NIXL's agent: registration, descriptor lists, transfers,
    notifications and metadata, on one kvring engine named ``agent_name``."""

    def __init__(self, agent_name, nixl_conf=None, instantiate_all=False, token=None):
        """``token``: the cluster's pre-shared token (str or bytes; default
        ``KVRING_TOKEN``): the engine proves it to every peer, and the
        listener messages carry its proof. Without one, the agent warns
        (once per process) that anyone reaching its port can re-point it."""
        if not isinstance(agent_name, str) or not agent_name:
            raise InvalidArgumentError(f"an agent's name is a non-empty str, got {agent_name!r}")
        conf = nixl_conf or nixl_agent_config()
        names = list(_backends.PLUGINS) if instantiate_all and nixl_conf is None else list(conf.backends)
        for name in names:
            _backends.check(name)  # at construction, never at the first transfer
        token = _token(token)
        sync = conf.sync_mode or (
            nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if conf.enable_listen else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
        )
        config = _bindings.nixlAgentConfig()
        config.useProgThread = conf.enable_pthread
        config.useListenThread = conf.enable_listen
        config.listenHost, config.listenPort = _listen_addr(conf)
        config.syncMode = sync.value
        config.captureTelemetry = conf.capture_telemetry
        config.token = token
        self._closed = True  # until the engine exists
        core = _bindings.nixlAgent(agent_name, config)  # looked up now: callers may wrap it
        core._api_ref = weakref.ref(self)
        self._attach(core, _telemetry(conf), names)

    @classmethod
    def _over(cls, core):
        """An agent over ``core`` (a ``_bindings.nixlAgent`` made by its
        caller), for NIXL's C++-style calls on that class."""
        self = cls.__new__(cls)
        self._closed = True
        self._attach(core, _telemetry(_ConfFromCore(core.config)), [])
        return self

    def _attach(self, core, telemetry, names):
        """The agent's state, around ``core``'s engine."""
        global _warned_no_token
        agent_name, token = core.name, core.config.token
        self.agent = core
        self._telemetry = telemetry
        self._engine = core.engine
        self._native = self._engine._native
        self._closed = False
        self.name = agent_name
        self._verifier = _listener.Verifier(_listener.key(token), agent_name)
        self._listen_key = _listener.key(token)
        self._epoch = None  # this engine's, found when first needed
        self._epochs = {}  # agent name -> the epoch its metadata was loaded at
        if token is None and not _warned_no_token:
            _warned_no_token = True
            log.warning(
                "kvring.nixl agent %s has no token (pass token= or set KVRING_TOKEN): anyone who reaches its port "
                "(%s) can send it metadata, re-point agents it knows and read or write what it registered",
                agent_name,
                self._engine.control_addr,
            )
        self.plugin_list = list(_backends.PLUGINS)
        self._posix = None  # the POSIX backend, once created
        self.backends = {}
        self.backend_mems = {}
        self.backend_options = {}
        for name in names:
            self.create_backend(name)
        self.notifs = {}
        self._unread = {}  # notifications taken from the engine, not yet handed out
        self._remotes = {}  # agent name -> the address its segment is opened by
        self._regions = {}  # (addr, len) -> region id
        self._gpu_ranges = set()  # the (addr, len) of _regions that are GPU memory
        self._pending = weakref.WeakSet()  # posted handles whose notification waits for DONE
        self._fetches = {}  # agent name -> "ip:port" still to fetch from
        self._sends = set()  # "ip:port" still to send our metadata to
        self._timeout = _TIMEOUT_S
        _live.add(self)
        log.info("kvring.nixl agent %s: engine at %s, backends %s", agent_name, self._engine.control_addr, names)

    # Backends ----------------------------------------------------------

    def get_plugin_list(self):
        """NIXL backends kvring stands in for."""
        return list(self.plugin_list)

    def get_plugin_mem_types(self, backend):
        """Memory types a backend moves ("DRAM", "VRAM"; POSIX's "DRAM",
        "FILE"); [] for others."""
        return _backends.plugin_mem_types(backend) if backend in self.plugin_list else []

    def get_plugin_params(self, backend):
        """A backend's parameters and defaults: POSIX's are NIXL's; the
        others take none."""
        return _backends.plugin_params(backend)

    def get_backend_mem_types(self, backend):
        """Memory types of a created backend; [] for others."""
        return list(self.backend_mems.get(backend, []))

    def get_backend_params(self, backend):
        """A created backend's parameters: none."""
        return dict(self.backend_options.get(backend, {}))

    def create_backend(self, backend, initParams=None):  # noqa: N803  (NIXL's name)
        """Adds a backend kvring stands in for; raises for any other."""
        _backends.check(backend)
        if backend == _posix.NAME and self._posix is None:
            self._posix = _posix.Backend(self.name, initParams)
        self.backends[backend] = len(self.backends)
        self.backend_mems[backend] = _backends.backend_mem_types(backend)
        self.backend_options[backend] = dict(initParams or {})

    def _posix_backend(self, why):
        """The POSIX backend, or NIXL's error for a FILE list without one."""
        if self._posix is None:
            raise nixlNotFoundError(f"{why}: no backend of agent {self.name!r} moves FILE memory (create_backend(\"POSIX\") first)")
        return self._posix

    def _backend(self, backends):
        """The backend a transfer is said to use: the first asked for, else
        the first created."""
        for name in backends or ():
            if name not in self.backends:
                raise InvalidArgumentError(f"backend {name!r} was not created on agent {self.name!r} (it has {list(self.backends)})")
        chosen = list(backends or ()) or list(self.backends)
        if not chosen:
            raise UnsupportedError(f"agent {self.name!r} has no backend: create_backend(\"UCX\") first")
        return chosen[0]

    # Memory ------------------------------------------------------------

    def get_reg_descs(self, descs, mem_type=None, is_sorted=False):
        """A registration list (``nixlRegDList``) from tuples, an N x 3
        numpy array, tensors or a list already made. As NIXL's: input it
        cannot describe gives None (the reason logged as an error), an
        unknown memory type raises (``KeyError`` and
        ``InvalidArgumentError``). The agent's own calls that take
        descriptors (``register_memory``, ``prep_xfer_dlist``, ...) raise
        the reason instead."""
        return self._descs_or_none(_descs.nixlRegDList, descs, mem_type)

    def get_xfer_descs(self, descs, mem_type=None, is_sorted=False):
        """A transfer list (``nixlXferDList``), as ``get_reg_descs``."""
        return self._descs_or_none(_descs.nixlXferDList, descs, mem_type)

    def _descs_or_none(self, cls, descs, mem_type):
        try:
            return _descs.build(cls, descs, mem_type)
        except UnknownKeyError:
            raise
        except InvalidArgumentError as error:
            log.error("agent %s: no %s: %s", self.name, cls.__name__, error)
            return None

    def register_memory(self, reg_list, mem_type=None, is_sorted=False, backends=()):
        """Registers every descriptor's memory in place; returns the list.
        "VRAM" descriptors register as GPU ``dev_id``'s memory (checked);
        on any failure what this call registered is unregistered again."""
        descs = _descs.build(_descs.nixlRegDList, reg_list, mem_type)
        if descs.getType() == "FILE":
            self._posix_backend("register_memory").register(descs)
            return descs
        self._backend(backends)
        done = []
        try:
            for addr, length, dev, _meta in descs:
                location = "host" if descs.getType() == "DRAM" else f"gpu:{dev}"
                region = self._native.register(addr, length, location)
                if (addr, length) not in self._regions:
                    done.append((addr, length))
                self._regions[(addr, length)] = region
                if location == "host":
                    self._gpu_ranges.discard((addr, length))
                else:
                    self._gpu_ranges.add((addr, length))
        except KvringError:
            for key in done:
                self._native.unregister(self._regions.pop(key))
            raise
        return descs

    def deregister_memory(self, dereg_list, backends=()):
        """Unregisters what ``register_memory`` registered."""
        descs = _descs.build(_descs.nixlRegDList, dereg_list)
        if descs.getType() == "FILE":
            self._posix_backend("deregister_memory").deregister(descs)
            return
        if self._posix is not None:
            self._posix_deregister(descs)
            return
        for addr, length, _dev, _meta in descs:
            region = self._regions.get((addr, length))
            if region is None:
                raise InvalidArgumentError(f"({addr:#x}, {length}) is not registered with agent {self.name!r}")
            # Forgotten only once unregistered: one still in use by a
            # transfer (RegionBusyError) stays, to be deregistered later.
            self._native.unregister(region)
            del self._regions[(addr, length)]
            self._gpu_ranges.discard((addr, length))

    def _posix_deregister(self, descs):
        """Unregisters DRAM with the POSIX backend present: the ranges leave
        ``_regions`` under the backend's lock (a posting checks them under
        it), then the postings already in flight are waited for (bounded),
        so no file read lands in memory unregistered under it."""
        keys = list(dict.fromkeys((addr, length) for addr, length, _dev, _meta in descs))
        for addr, length in keys:
            if (addr, length) not in self._regions:
                raise InvalidArgumentError(f"({addr:#x}, {length}) is not registered with agent {self.name!r}")
        with self._posix.lock:
            regions = [self._regions.pop(key) for key in keys]
            self._gpu_ranges.difference_update(keys)
        try:
            self._posix.drain(self._timeout)
        except BusyError:
            self._regions.update(zip(keys, regions))
            raise
        for region in regions:
            self._native.unregister(region)

    def _host_ranges(self):
        """The (addr, len) of host memory registered here: what a POSIX
        transfer may read into or write from."""
        return [key for key in self._regions if key not in self._gpu_ranges]

    def query_memory(self, reg_list, backend, mem_type=None):
        """Per descriptor, what ``backend`` knows of it (NIXL's
        ``queryMem``): POSIX reads each meta as a file path, an info dict
        ({"size", "mode", "mtime"}, strings) or None where no file is.
        A backend not created here raises ``InvalidArgumentError`` (a
        ``ValueError``, as NIXL's); one that answers no queries (UCX)
        ``nixlNotSupportedError``."""
        descs = _descs.build(_descs.nixlRegDList, reg_list, mem_type)
        if backend not in self.backends:
            raise InvalidArgumentError(f"backend {backend!r} was not created on agent {self.name!r} (it has {list(self.backends)})")
        if backend != _posix.NAME:
            raise nixlNotSupportedError(f"backend {backend!r} answers no memory queries (NIXL's neither): POSIX does")
        return self._posix.query(descs)

    # Peers and metadata ------------------------------------------------

    def get_agent_metadata(self):
        """This agent's metadata: kvring's segment descriptor, as bytes."""
        return _MD_MAGIC + bytes(self._native.descriptor())

    def get_partial_agent_metadata(self, descs=None, inc_conn_info=False, backends=()):
        """The whole metadata: kvring's descriptor describes address ranges,
        so a part is no smaller."""
        return self.get_agent_metadata()

    def add_remote_agent(self, metadata):
        """Opens the agent ``metadata`` describes; returns its name, as
        bytes (NIXL's agent does; every call taking an agent's name takes
        bytes or str)."""
        name, addr = self._open_metadata(metadata)
        self._remotes[name] = addr
        self._fetches.pop(name, None)
        return name.encode()

    def _open_metadata(self, metadata):
        """(name, address) of the agent ``metadata`` describes, opened: its
        name is the one a live handshake there answered with."""
        if not isinstance(metadata, (bytes, bytearray)) or not bytes(metadata[: len(_MD_MAGIC)]) == _MD_MAGIC:
            raise InvalidArgumentError(
                "not a kvring.nixl agent's metadata: both agents must run kvring.nixl (get_agent_metadata's bytes)"
            )
        name, addr, _transport = self._native.open_described(bytes(metadata[len(_MD_MAGIC) :]), None, self._timeout)
        return name, addr

    def remove_remote_agent(self, agent):
        """Forgets a remote agent and closes its connection."""
        agent = _agent_name(agent)
        addr = self._remotes.pop(agent, None)
        self._epochs.pop(agent, None)
        if addr is None:
            raise UnknownSegmentError(f"unknown agent {agent!r} (agents known: {sorted(self._remotes)})")
        self._native.close_segment(addr)

    def make_connection(self, remote_agent, backends=()):
        """Connects to a known agent now rather than at the first transfer."""
        self._native.segment_info(self._addr(remote_agent), self._timeout)

    def _addr(self, agent):
        """The address a known agent's segment is opened by."""
        agent = _agent_name(agent)
        if agent == self.name:
            return self._engine.control_addr  # loopback
        addr = self._remotes.get(agent)
        if addr is None:
            self._progress()
            addr = self._remotes.get(agent)
        if addr is None:
            raise UnknownSegmentError(
                f"unknown agent {agent!r}: add_remote_agent(its metadata) or fetch_remote_metadata first "
                f"(agents known: {sorted(self._remotes)})"
            )
        return addr

    def fetch_remote_metadata(self, remote_agent, ip_addr="", port=DEFAULT_COMM_PORT, label=""):
        """Asks the agent listening at ``ip_addr:port`` for its metadata (a
        handshake); ``check_remote_metadata`` says when it is loaded (tried
        again there while the peer is not up yet)."""
        if not ip_addr:
            raise UnsupportedError("kvring.nixl has no central metadata server: pass the peer's ip_addr and port")
        self._fetches[_agent_name(remote_agent)] = f"{ip_addr}:{int(port)}"
        self._try_fetch(remote_agent)

    def send_local_metadata(self, ip_addr="", port=DEFAULT_COMM_PORT):
        """Sends this agent's metadata to the agent listening at
        ``ip_addr:port`` (tried again by later calls while it is not up)."""
        if not ip_addr:
            raise UnsupportedError("kvring.nixl has no central metadata server: pass the peer's ip_addr and port")
        addr = f"{ip_addr}:{int(port)}"
        self._sends.add(addr)
        self._try_send(addr)

    def send_partial_agent_metadata(self, descs=None, inc_conn_info=False, backends=(), ip_addr="", port=DEFAULT_COMM_PORT, label=""):
        """``send_local_metadata`` (the whole metadata is no larger)."""
        self.send_local_metadata(ip_addr, port)

    def invalidate_local_metadata(self, ip_addr="", port=DEFAULT_COMM_PORT):
        """Tells the agent at ``ip_addr:port`` (default: every agent this one
        knows) to forget this agent."""
        targets = [f"{ip_addr}:{int(port)}"] if ip_addr else sorted(set(self._remotes.values()))
        for addr in targets:
            self._sends.discard(addr)
            try:
                self._send_control(addr, _listener.DROP, self._own_epoch().to_bytes(8, "big"), self._timeout)
            except KvringError as error:
                log.info("invalidate_local_metadata: %s (gone already?): %s", addr, error)

    def check_remote_metadata(self, agent, descs=None):
        """True once ``agent``'s metadata is loaded here."""
        self._progress()
        return _agent_name(agent) in self._remotes

    def _own_epoch(self):
        """This engine's epoch (what a ``_DROP`` names)."""
        if self._epoch is None:
            _name, self._epoch, _transport = self._native.segment_info(self._engine.control_addr, self._timeout)
        return self._epoch

    def _send_control(self, addr, kind, payload, timeout):
        """A listener message to the agent at ``addr``, with the token's
        proof bound to that agent's name (from the handshake)."""
        receiver, _epoch, _transport = self._native.segment_info(addr, timeout)
        message = _listener.encode(self._listen_key, kind, self.name, receiver, payload)
        self._native.notify(addr, message, timeout)

    def _try_fetch(self, agent):
        addr = self._fetches.get(agent)
        if addr is None:
            return
        try:
            name, _epoch, _transport = self._native.segment_info(addr, _RETRY_S)
        except KvringError as error:
            log.debug("fetch_remote_metadata: %s at %s not there yet: %s", agent, addr, error)
            return
        del self._fetches[agent]
        if name != agent:
            log.warning("fetch_remote_metadata: %s answers as agent %r, not %r", addr, name, agent)
        self._remotes[name] = addr

    def _try_send(self, addr):
        try:
            self._send_control(addr, _listener.LOAD, self.get_agent_metadata(), _RETRY_S)
        except KvringError as error:
            log.debug("send_local_metadata: %s not there yet: %s", addr, error)
            return
        self._sends.discard(addr)

    # Descriptor lists and transfers --------------------------------------

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, is_sorted=False, backends=()):
        """Locates a descriptor list once: this agent's memory
        (``"NIXL_INIT_AGENT"`` or ``""``) or a remote agent's (its name; this
        agent's own name for loopback)."""
        descs = _descs.build(_descs.nixlXferDList, xfer_list, mem_type)
        self._backend(backends)
        agent_name = _agent_name(agent_name)
        if descs.getType() == "FILE":
            self._posix_backend("prep_xfer_dlist")
            if agent_name not in (NIXL_INIT_AGENT, "", None, self.name):
                raise nixlNotFoundError(f"FILE descriptors are this agent's ({self.name!r}) own files, not agent {agent_name!r}'s")
            init = agent_name in (NIXL_INIT_AGENT, "", None)
            return nixl_prepped_dlist_handle(None, None if init else agent_name, "FILE", descs)
        addrs, lengths = descs.addrs(), descs.lengths()
        gpu = descs.getType() == "VRAM"
        if agent_name in (NIXL_INIT_AGENT, "", None):
            prepared = _native.prepare(self._native, None, addrs, lengths, gpu, self._timeout)
            return nixl_prepped_dlist_handle(prepared, None, descs.getType(), descs)
        prepared = _native.prepare(self._native, self._addr(agent_name), addrs, lengths, gpu, self._timeout)
        return nixl_prepped_dlist_handle(prepared, agent_name, descs.getType(), descs)

    def make_prepped_xfer(
        self,
        operation,
        local_xfer_side,
        local_indices,
        remote_xfer_side,
        remote_indices,
        notif_msg=b"",
        backends=(),
        skip_desc_merge=False,
    ):
        """A transfer of ``local_indices`` of a local prepped list to
        ``remote_indices`` of a remote one (vLLM's path)."""
        op = _op(operation)
        for side, handle in (("local", local_xfer_side), ("remote", remote_xfer_side)):
            if not isinstance(handle, nixl_prepped_dlist_handle):
                raise InvalidArgumentError(f"the {side} side must be a handle from prep_xfer_dlist, got {type(handle).__name__}")
        if local_xfer_side.agent is not None:
            raise InvalidArgumentError(f"the local side was prepared for agent {local_xfer_side.agent!r}, not NIXL_INIT_AGENT")
        if remote_xfer_side.agent is None:
            raise InvalidArgumentError("the remote side was prepared as NIXL_INIT_AGENT: prepare it for the remote agent's name")
        if "FILE" in (local_xfer_side.mem_type, remote_xfer_side.mem_type):
            return self._posix_xfer(op, local_xfer_side, local_indices, remote_xfer_side, remote_indices, notif_msg, backends)
        xfer = _native.make_xfer(
            op, local_xfer_side.prepared(), _indices(local_indices), remote_xfer_side.prepared(), _indices(remote_indices)
        )
        return nixl_xfer_handle(xfer, remote_xfer_side.agent, operation, self._backend(backends), _message(notif_msg))

    def _posix_xfer(self, op, local_side, local_indices, remote_side, remote_indices, notif_msg, backends):
        """A POSIX transfer between this agent's memory (DRAM) and its files
        (FILE), from two prepped lists (``_posix.Backend.request`` checks
        the rest)."""
        posix = self._posix_backend("a FILE transfer")
        if local_side.mem_type != "DRAM" or remote_side.mem_type != "FILE":
            raise InvalidArgumentError(
                f"a POSIX transfer is local DRAM to or from remote FILE, got {local_side.mem_type} and {remote_side.mem_type}"
            )
        if backends and _posix.NAME not in backends:
            raise InvalidArgumentError(f"FILE memory moves with the POSIX backend, not {list(backends)}")
        sides = []
        for name, side, indices in (("local", local_side, local_indices), ("remote", remote_side, remote_indices)):
            rows, count = side.descs, len(side.descs)
            picked = []
            for index in _indices(indices):
                if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
                    raise InvalidArgumentError(f"{name} index {index!r} is past its list of {count}")
                picked.append(rows[index][:3])
            sides.append(picked)
        local_side.prepared(), remote_side.prepared()  # each raises if released
        operation = "READ" if op == "read" else "WRITE"
        request = posix.request(operation, sides[0], sides[1], remote_side.agent, _message(notif_msg), self._host_ranges())
        return nixl_xfer_handle(request, remote_side.agent, op, _posix.NAME, b"")

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent, notif_msg=b"", backends=()):
        """A transfer between two transfer lists, paired one to one."""
        _op(operation)
        local = _descs.build(_descs.nixlXferDList, local_descs)
        remote = _descs.build(_descs.nixlXferDList, remote_descs)
        if len(local) != len(remote):
            raise InvalidArgumentError(
                f"{len(local)} local descriptors and {len(remote)} remote ones: a transfer pairs them one to one"
            )
        every = list(range(len(local)))
        if "FILE" in (local.getType(), remote.getType()):
            self._backend(backends)
            return self._posix_xfer(
                _op(operation),
                nixl_prepped_dlist_handle(None, None, local.getType(), local),
                every,
                nixl_prepped_dlist_handle(None, _agent_name(remote_agent), remote.getType(), remote),
                every,
                notif_msg,
                backends,
            )
        return self.make_prepped_xfer(
            operation,
            self.prep_xfer_dlist(NIXL_INIT_AGENT, local, backends=backends),
            every,
            self.prep_xfer_dlist(remote_agent, remote, backends=backends),
            every,
            notif_msg,
            backends,
        )

    def transfer(self, handle, notif_msg=b""):
        """Posts a transfer: "PROC" once the lanes have it (poll it with
        ``check_xfer_state``), "ERR" if it could not start (the reason
        logged, and kept as ``handle.error``). A handle still in progress
        raises ``BusyError``."""
        xfer = handle._xfer if not handle._released else handle.xfer()  # xfer() raises for a released one
        if handle.batch is not None:
            raise BusyError(f"{handle!r} is still in progress: wait for DONE before posting it again")
        if isinstance(xfer, _posix.Request):
            return self._posix_post(handle, xfer, notif_msg)
        if notif_msg:
            handle.notif = _message(notif_msg)
        clock = time.perf_counter_ns
        started = clock()
        try:
            handle.batch = _post(self._native, xfer, self._timeout)
            handle.posted_ns, handle.post_ns = started, clock() - started
        except KvringError as error:
            handle.done, handle.error = False, error
            log.error("transfer to %s: %s", handle.agent, error)
            return "ERR"
        handle.done, handle.error = False, None
        if handle.notif:
            self._pending.add(handle)
        return "PROC"

    def _posix_post(self, handle, request, notif_msg):
        """Posts a POSIX transfer: "PROC", or "ERR" if its memory or file
        range was deregistered since the request was made."""
        if notif_msg:
            raise nixlBackendError("the POSIX backend has no notifications (NIXL's neither): pass no notif_msg")
        started = time.perf_counter_ns()
        try:
            handle.batch = self._posix.post(request, self._host_ranges)
        except KvringError as error:
            handle.done, handle.error = False, error
            log.error("POSIX transfer: %s", error)
            return "ERR"
        handle.posted_ns, handle.post_ns = started, time.perf_counter_ns() - started
        handle.done, handle.error = False, None
        return "PROC"

    def check_xfer_state(self, handle):
        """"DONE", "PROC" or "ERR" (the reason as ``handle.error``)."""
        if isinstance(handle._xfer, _posix.Request):
            handle.xfer()  # raises for a released handle
            return _posix.state(handle)
        batch = handle.batch
        if batch is not None and not handle._released:  # the polling loop's path: one native call
            try:
                moved = self._native.poll(batch)
            except KvringError as error:
                return self._failed(handle, error)
            return "PROC" if moved is None else self._ended(handle)
        handle.xfer()
        if handle.done:
            return "DONE"
        if handle.error is not None:
            return "ERR"
        raise InvalidArgumentError(f"{handle!r} was never posted: transfer(handle) first")

    def _state(self, handle):
        try:
            moved = self._native.poll(handle.batch)
        except KvringError as error:
            return self._failed(handle, error)
        return "PROC" if moved is None else self._ended(handle)

    def _failed(self, handle, error):
        """A posting that failed: "ERR", the reason kept and logged."""
        handle.batch, handle.error = None, error
        self._pending.discard(handle)
        log.error("transfer to %s: %s", handle.agent, error)
        return "ERR"

    def _ended(self, handle):
        """A posting that ended well: its notification goes now."""
        handle.batch, handle.done, handle.ended_ns = None, True, time.perf_counter_ns()
        self._pending.discard(handle)
        if handle.notif:
            try:
                self._native.notify(self._addr(handle.agent), handle.notif, self._timeout)
            except KvringError as error:
                handle.done, handle.error = False, error
                log.error("transfer to %s: its bytes are in place, its notification failed: %s", handle.agent, error)
                return "ERR"
        return "DONE"

    def get_xfer_telemetry(self, handle):
        """The last posting's telemetry (``nixlXferTelemetry``; vLLM's
        connector asks for it, with ``capture_telemetry=True``, after
        DONE). Raises ``nixlNoTelemetryError`` where the agent collects
        none (NIXL's rule: ``NIXL_TELEMETRY_ENABLE`` when set, else the
        config's ``capture_telemetry``), ``InvalidArgumentError`` until a
        posting is done. Durations are whole microseconds, rounded up: a
        post or transfer that took any time reports at least 1."""
        xfer = handle.xfer()
        if not self._telemetry:
            raise nixlNoTelemetryError(
                f"agent {self.name!r} collects no telemetry: nixl_agent_config(capture_telemetry=True), "
                "or NIXL_TELEMETRY_ENABLE=y"
            )
        if not handle.done:
            raise InvalidArgumentError(f"{handle!r} has no finished posting to report")
        wall_us = (time.time_ns() - (time.perf_counter_ns() - handle.posted_ns)) // 1000
        post_us = math.ceil(handle.post_ns / 1000)
        xfer_us = math.ceil((handle.ended_ns - handle.posted_ns) / 1000)
        return nixlXferTelemetry(wall_us, post_us, xfer_us, xfer.bytes, len(xfer))

    def query_xfer_backend(self, handle):
        """The backend name the transfer was made with."""
        handle.xfer()
        return handle.backend

    def release_xfer_handle(self, handle):
        """Releases a transfer handle. One still in progress is cancelled,
        as NIXL documents for releasing an in-flight handle: the blocks not
        yet posted are withdrawn, and the call returns only once what was
        already on its way has drained, so that no write of the transfer
        lands (and no read of it reaches the source) after it returns; the
        handle's memory may then be reused. That drain is bounded by the
        agent's timeout (``_TIMEOUT_S``, 30 s): past it,
        ``TransferTimeoutError`` is raised and the handle is kept, in
        flight and cancelled (its memory not yet safe to reuse), so the
        call may be made again."""
        handle.xfer()
        if handle.batch is not None:
            if isinstance(handle._xfer, _posix.Request):
                # A file read or write in progress cannot be withdrawn: it
                # is waited for (bounded), as NIXL's POSIX backend does.
                try:
                    _posix.wait(handle, self._timeout)
                except KvringError as error:
                    log.warning("release_xfer_handle: its last posting ended: %s", error)
                handle.batch = None
            else:
                self._cancel(handle)
        self._pending.discard(handle)
        handle.release()

    def _cancel(self, handle):
        """Cancels ``handle``'s posting and waits for it to settle: it ends
        cancelled, or done or failed if it ended first (kept, as
        ``handle.error``, and logged)."""
        batch = handle.batch
        try:
            self._native.cancel(batch)
        except StaleBatchError:
            pass  # its result was consumed already: nothing to cancel
        try:
            self._native.wait(batch, self._timeout)
            handle.done, handle.error = True, None  # it ended before the cancel reached it
        except TransferTimeoutError as error:
            log.error("release_xfer_handle: %r did not settle within %.1f s of its cancel", handle, self._timeout)
            raise TransferTimeoutError(
                f"{handle!r} was cancelled but what it had posted did not drain within {self._timeout} s; "
                "its memory may still be written: release it again before reusing that memory"
            ) from error
        except CancelledError as error:
            handle.done, handle.error = False, error
        except StaleBatchError:
            pass  # consumed by an earlier wait: it had ended
        except KvringError as error:
            handle.done, handle.error = False, error
            log.warning("release_xfer_handle: its last posting ended: %s", error)
        handle.batch = None

    def release_dlist_handle(self, handle):
        """Releases a prepped descriptor list handle."""
        handle.prepared()
        handle.release()

    # Notifications ---------------------------------------------------------

    def _progress(self):
        """Takes the engine's notifications (acting on the agents' own),
        finishes postings whose notification waits, retries pending
        metadata fetches and sends."""
        for sender, message in self._native.notifications():
            if not message.startswith(_CONTROL):
                self._unread.setdefault(sender, []).append(message)
                continue
            try:
                kind, payload = self._verifier.open(sender, message)
                if kind == _listener.LOAD:
                    self._load_from(sender, payload)
                else:
                    self._drop_from(sender, payload)
            except KvringError as error:
                log.error("agent %s: listener message from %r refused: %s", self.name, sender, error)
        for handle in list(self._pending):
            if handle.batch is not None and not handle._released:
                self._state(handle)
        for agent in list(self._fetches):
            self._try_fetch(agent)
        for addr in list(self._sends):
            self._try_send(addr)

    def _load_from(self, sender, metadata):
        """A ``_LOAD``: loads the sender's own metadata, never another
        agent's, and never re-points a name at another engine while the
        engine it names now still answers as that name (a restarted one
        does not: its epoch changed)."""
        if not metadata.startswith(_MD_MAGIC):
            raise UnauthorizedError("metadata that is not a kvring.nixl agent's")
        name, addr = self._open_metadata(metadata)
        known = self._remotes.get(name)
        refusal = None
        if name != sender:
            refusal = f"metadata of agent {name!r} sent by {sender!r}: an agent sends only its own"
        elif known is not None and known != addr and self._answers_as(known, name):
            refusal = f"metadata re-pointing agent {name!r} from {known} to {addr} while {known} still answers as it"
        if refusal is not None:
            if addr not in self._remotes.values() and addr != self._engine.control_addr:
                self._native.close_segment(addr)  # opened only to read its name
            raise UnauthorizedError(refusal)
        _name, epoch, _transport = self._native.segment_info(addr, self._timeout)
        self._remotes[name], self._epochs[name] = addr, epoch
        self._fetches.pop(name, None)

    def _answers_as(self, addr, name):
        """True if the engine at ``addr`` answers a fresh handshake as ``name``."""
        try:
            self._native.probe(addr, _RETRY_S)
            return self._native.segment_info(addr, _RETRY_S)[0] == name
        except KvringError:
            return False

    def _drop_from(self, sender, payload):
        """A ``_DROP``: forgets the sender, and only the incarnation (epoch)
        of it that it names."""
        if len(payload) != 8:
            raise UnauthorizedError(f"a withdrawal of {len(payload)} bytes, not an epoch's 8")
        addr = self._remotes.get(sender)
        if addr is None:
            return  # nothing of it here
        epoch = int.from_bytes(payload, "big")
        loaded = self._epochs.get(sender)
        if loaded is None:
            loaded = self._native.segment_info(addr, self._timeout)[1]
        if epoch != loaded:
            raise UnauthorizedError(f"a withdrawal of agent {sender!r} at epoch {epoch:#x}, loaded at {loaded:#x}")
        del self._remotes[sender]
        self._epochs.pop(sender, None)
        self._native.close_segment(addr)

    def get_new_notifs(self, backends=()):
        """Notifications since the last call: {agent name: [bytes, ...]}."""
        self._progress()
        new, self._unread = self._unread, {}
        return new

    def update_notifs(self, backends=()):
        """Adds new notifications to ``self.notifs`` and returns it."""
        for sender, messages in self.get_new_notifs().items():
            self.notifs.setdefault(sender, []).extend(messages)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name, lookup_tag, backends=(), tag_is_prefix=True):
        """True (and that notification removed) once one from
        ``remote_agent_name`` starts with ``lookup_tag`` (or contains it)."""
        tag = _message(lookup_tag)
        messages = self.update_notifs().get(_agent_name(remote_agent_name), [])
        for message in messages:
            if message.startswith(tag) if tag_is_prefix else tag in message:
                messages.remove(message)
                return True
        return False

    def send_notif(self, remote_agent_name, notif_msg, backend=None):
        """Sends a notification not tied to a transfer."""
        self._native.notify(self._addr(remote_agent_name), _message(notif_msg), self._timeout)

    # Serialized lists and teardown -------------------------------------------

    def get_serialized_descs(self, descs):
        """A descriptor list as bytes (kvring's fixed form, no pickle)."""
        return _descs.serialize(descs)

    def deserialize_descs(self, serialized_descs):
        """A descriptor list from ``get_serialized_descs``'s bytes."""
        return _descs.deserialize(serialized_descs)

    def _close(self):
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        if self._posix is not None:
            self._posix.close()
        try:
            self._engine.close()
        except KvringError as error:
            log.debug("closing agent %s: %s", self.name, error)

    def __del__(self):
        if not getattr(self, "_closed", True):
            self._close()

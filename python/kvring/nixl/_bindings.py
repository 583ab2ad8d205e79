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

from .. import Engine
from ..errors import InvalidArgumentError
from ._descs import nixlRegDList, nixlXferDList
from ._errors import (
    NoSuchBackendError,
    UnknownKeyError,
    nixlInvalidParamError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlNotSupportedError,
    nixlRepostActiveError,
)

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
    ``token`` is kvring's: the cluster's pre-shared token (or None)."""

    def __init__(self):
        self.useProgThread = True
        self.useListenThread = False
        self.listenPort = 0
        self.syncMode = NIXL_THREAD_SYNC_DEFAULT
        self.pthrDelay = 0
        self.lthrDelay = 100000
        self.captureTelemetry = False
        self.listenHost = "127.0.0.1"
        self.token = None

    def __repr__(self):
        shown = dict(vars(self), token="<set>" if self.token else None)  # never print the token
        return f"nixlAgentConfig({shown!r})"


class nixlAgent:  # noqa: N801  (NIXL's name)
    """The agent's engine: one kvring engine named ``name``, listening as
    ``config`` says. ``nixl_agent`` does everything else in Python."""

    def __init__(self, name, config):
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"an agent's name is a non-empty str, got {name!r}")
        self.name = name
        self.sync_mode = config.syncMode
        self.engine = Engine(name=name, listen=f"{config.listenHost}:{config.listenPort}", token=config.token)


__all__ = [
    "DRAM_SEG", "VRAM_SEG", "FILE_SEG", "BLK_SEG", "OBJ_SEG", "NIXL_READ", "NIXL_WRITE",
    "NIXL_THREAD_SYNC_NONE", "NIXL_THREAD_SYNC_STRICT", "NIXL_THREAD_SYNC_RW", "NIXL_THREAD_SYNC_DEFAULT",
    "DEFAULT_COMM_PORT", "HAVE_UCX_GPU_DEVICE_API", "nixlRegDList", "nixlXferDList", "nixlAgent", "nixlAgentConfig",
    "nixlInvalidParamError", "nixlNotFoundError", "nixlNotSupportedError", "nixlRepostActiveError",
    "nixlNoTelemetryError", "NoSuchBackendError", "UnknownKeyError",
]

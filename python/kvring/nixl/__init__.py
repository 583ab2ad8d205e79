"""A drop-in for NIXL's Python agent (``nixl._api``) on kvring.

    from kvring.nixl import nixl_agent, nixl_agent_config   # was: from nixl._api import ...

``nixl_agent(name, nixl_agent_config(...))`` with the methods NIXL's users
call, same names, argument shapes and results. Backends kvring stands in
for are listed in ``_backends`` (and the README); any other is refused when
the agent is made. Errors are kvring's exception classes, named as NIXL's
below too.
"""

from ..errors import BusyError, InvalidArgumentError, UnknownSegmentError, UnsupportedError
from ._agent import DEFAULT_COMM_PORT, NIXL_INIT_AGENT, nixl_agent, nixl_agent_config
from ._backends import STANDS_IN_FOR
from ._descs import nixlRegDList, nixlXferDList
from ._handles import nixl_prepped_dlist_handle, nixl_xfer_handle, nixlXferTelemetry

# NIXL's exception names, as kvring's classes.
nixlInvalidParamError = InvalidArgumentError
nixlNotFoundError = UnknownSegmentError
nixlNotSupportedError = UnsupportedError
nixlRepostActiveError = BusyError

__all__ = [
    "DEFAULT_COMM_PORT",
    "NIXL_INIT_AGENT",
    "STANDS_IN_FOR",
    "nixl_agent",
    "nixl_agent_config",
    "nixlRegDList",
    "nixlXferDList",
    "nixl_prepped_dlist_handle",
    "nixl_xfer_handle",
    "nixlXferTelemetry",
    "nixlInvalidParamError",
    "nixlNotFoundError",
    "nixlNotSupportedError",
    "nixlRepostActiveError",
]

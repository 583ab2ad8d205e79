"""A drop-in for NIXL's Python agent (``nixl._api``) on kvring.

    from kvring.nixl import nixl_agent, nixl_agent_config   # was: from nixl._api import ...

``nixl_agent(name, nixl_agent_config(...))`` with the methods NIXL's users
call, same names, argument shapes and results. Backends kvring stands in
for are listed in ``_backends`` (and the README); any other is refused when
the agent is made. Errors are kvring's exception classes, named as NIXL's
below too.

Code that imports NIXL's modules by name (``nixl._api``, ``nixl._bindings``,
``nixl._utils``, ``nixl.logging``: vLLM's connector, NIXL's own tests)
runs on kvring with a ``nixl`` package on its path that maps them to this
package, ``_bindings``, ``_utils`` and ``logging``: ``install_as_nixl()``
does that (tests/peers/nixl/shim/nixl/__init__.py is the whole package).
"""

import sys

from ._agent import DEFAULT_COMM_PORT, NIXL_INIT_AGENT, nixl_agent, nixl_agent_config, nixl_thread_sync_t
from ._backends import STANDS_IN_FOR
from ._descs import nixlRegDList, nixlXferDList
from ._errors import (
    nixlInvalidParamError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlNotSupportedError,
    nixlRepostActiveError,
)
from ._handles import nixl_prepped_dlist_handle, nixl_xfer_handle, nixlXferTelemetry

# NIXL's backend handle type (an opaque int there; kvring's are names).
nixl_backend_handle = int


def install_as_nixl(package=None):
    """Makes ``import nixl._api`` (and ``nixl._bindings``, ``nixl._utils``,
    ``nixl.logging``) give kvring.nixl's modules, as a user switches an
    engine from NIXL to kvring. ``package`` is the ``nixl`` package module
    doing it (a shim's ``__init__``), or None to make one."""
    from . import _bindings, _utils, logging

    if package is None:
        package = type(sys)("nixl")
        package.__path__ = []
        sys.modules["nixl"] = package
    this = sys.modules[__name__]
    for sub, module in (("_api", this), ("_bindings", _bindings), ("_utils", _utils), ("logging", logging)):
        sys.modules[f"nixl.{sub}"] = module
        setattr(package, sub, module)
    for name in __all__:
        setattr(package, name, getattr(this, name))
    return package


__all__ = [
    "DEFAULT_COMM_PORT",
    "NIXL_INIT_AGENT",
    "STANDS_IN_FOR",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_thread_sync_t",
    "nixl_backend_handle",
    "nixlRegDList",
    "nixlXferDList",
    "nixl_prepped_dlist_handle",
    "nixl_xfer_handle",
    "nixlXferTelemetry",
    "nixlInvalidParamError",
    "nixlNoTelemetryError",
    "nixlNotFoundError",
    "nixlNotSupportedError",
    "nixlRepostActiveError",
]

"""NIXL backend names kvring stands in for, and what it does with each.

A NIXL agent names its backends (``nixl_agent_config(backends=[...])``,
``create_backend``). kvring has one engine per agent and its own
transport order, so each name it stands in for maps to that order; a name
it does not stand in for is refused when the agent is made (or the backend
created), never at the first transfer.

| NIXL backend | kvring |
| --- | --- |
| UCX, UCX_MO | the engine's order: cuda_ipc (GPU memory, same host), shm (kvring's shared memory), cma (the peer's own memory, same host), tcp |
| Mooncake | the same order (NIXL's Mooncake backend is Mooncake's engine; kvring stands in for it) |
| POSIX | kvring.nixl's own POSIX backend (``_posix``): this agent's host memory to and from files, with pread/pwrite, as NIXL's POSIX plugin |
| GDS, GDS_MT, OBJ, HF3FS, GUSLI, AZURE_BLOB (storage) | refused: kvring moves memory between engines and, with POSIX, to files; not through GPUDirect Storage or object stores |
| LIBFABRIC, UCCL, GPUNETIO, anything else | refused: no kvring transport takes their place in the Python build (no RDMA there yet) |
"""

from . import _posix
from ._errors import NoSuchBackendError

# Backends kvring stands in for -> what it uses (the engine's transport order).
STANDS_IN_FOR = {
    "UCX": "kvring (cuda_ipc, shm, cma, tcp)",
    "UCX_MO": "kvring (cuda_ipc, shm, cma, tcp)",
    "Mooncake": "kvring (cuda_ipc, shm, cma, tcp)",
}
# Backends kvring.nixl itself implements, as NIXL's plugin of that name.
OWN = {_posix.NAME: "kvring.nixl's POSIX backend (pread/pwrite between host memory and files)"}
# Every backend an agent can create (NIXL's plugin list).
PLUGINS = [*STANDS_IN_FOR, *OWN]
STORAGE = ("GDS", "GDS_MT", "OBJ", "HF3FS", "GUSLI", "AZURE_BLOB")
MEM_TYPES = ["DRAM", "VRAM"]


def plugin_mem_types(name):
    """Memory types a backend moves, as NIXL's ``getPluginParams`` lists them."""
    return list(_posix.PLUGIN_MEM_TYPES if name == _posix.NAME else MEM_TYPES)


def backend_mem_types(name):
    """Memory types of a created backend, as NIXL's ``getBackendParams``."""
    return list(_posix.BACKEND_MEM_TYPES if name == _posix.NAME else MEM_TYPES)


def plugin_params(name):
    """A backend's parameters and defaults (NIXL's ``getPluginParams``)."""
    return dict(_posix.PLUGIN_PARAMS) if name == _posix.NAME else {}


def check(name):
    """Returns ``name`` if kvring stands in for it (or implements it), else raises saying why
    (``NoSuchBackendError``: kvring's ``UnsupportedError``, NIXL's
    ``nixlNotFoundError``)."""
    if name in STANDS_IN_FOR or name in OWN:
        return name
    if not isinstance(name, str):
        raise NoSuchBackendError(f"a backend is named by a str, got {name!r}")
    if name in STORAGE:
        why = "a storage backend: kvring moves memory between engines, and to files with POSIX only"
    else:
        why = "no kvring transport stands in for it in this build"
    raise NoSuchBackendError(f"NIXL backend {name!r}: {why}; kvring stands in for {', '.join(PLUGINS)}")

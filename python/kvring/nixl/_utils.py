"""NIXL's ``nixl._utils``: raw host memory for its tests and examples.

``malloc_passthru(size)`` returns the address of ``size`` bytes from the C
allocator, ``free_passthru(addr)`` frees it, as NIXL's helpers do. The
caller owns the memory: unregister it before freeing it.
"""

import ctypes

from ..errors import InvalidArgumentError

_libc = ctypes.CDLL(None)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]


def malloc_passthru(size):
    """``size`` bytes of host memory (malloc): their address, as an int."""
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise InvalidArgumentError(f"malloc_passthru takes a size > 0, got {size!r}")
    addr = _libc.malloc(size)
    if not addr:
        raise MemoryError(f"malloc({size}) failed")
    return addr


def free_passthru(addr):
    """Frees what ``malloc_passthru`` returned."""
    _libc.free(addr)

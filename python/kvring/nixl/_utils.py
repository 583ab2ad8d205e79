"""NIXL's ``nixl._utils``: raw host memory for its tests and examples.

``malloc_passthru(size)`` returns the address of ``size`` bytes from the C
allocator, aligned to 4 KiB (``aligned_alloc``, as NIXL's), and
``free_passthru(addr)`` frees it; ``ba_buf(addr, size)`` fills memory with
0xba and ``verify_transfer(a, b, size)`` checks two ranges are equal, as
NIXL's test helpers do. The caller owns the memory: unregister it before
freeing it.
"""

import ctypes

from ..errors import InvalidArgumentError

_ALIGN = 4096
_libc = ctypes.CDLL(None)
_libc.aligned_alloc.restype = ctypes.c_void_p
_libc.aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]


def malloc_passthru(size):
    """``size`` bytes of host memory, 4 KiB aligned: their address, as an int."""
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise InvalidArgumentError(f"malloc_passthru takes a size > 0, got {size!r}")
    rounded = (size + _ALIGN - 1) // _ALIGN * _ALIGN  # C11 asks a multiple of the alignment
    addr = _libc.aligned_alloc(_ALIGN, rounded)
    if not addr:
        raise MemoryError(f"aligned_alloc({_ALIGN}, {rounded}) failed")
    return addr


def free_passthru(addr):
    """Frees what ``malloc_passthru`` returned."""
    _libc.free(addr)


def ba_buf(addr, size):
    """Fills ``size`` bytes at ``addr`` with 0xba."""
    ctypes.memset(addr, 0xBA, size)


def verify_transfer(addr1, addr2, size):
    """Raises ``AssertionError`` unless the ``size`` bytes at ``addr1`` and
    ``addr2`` are equal."""
    first, second = ctypes.string_at(addr1, size), ctypes.string_at(addr2, size)
    if first != second:
        at = next(i for i in range(size) if first[i] != second[i])
        raise AssertionError(f"transfer differs at byte {at}: {first[at]:#x} != {second[at]:#x}")

"""Turning what callers pass as memory into (address, length, keep-alive).

An int is an address (Mooncake's convention): the caller keeps the memory
valid. Anything with the buffer protocol (numpy arrays, bytearray,
memoryview, mmap) is used in place, never copied: its address comes from a
ctypes view of the buffer, and that view is kept with the registration, so
the object cannot be freed or resized (a bytearray refuses while exported)
until it is unregistered.
"""

import ctypes

from .errors import InvalidArgumentError


def address_of(memory, length=None):
    """Returns (address, length, keep) for an int address or a buffer object."""
    if isinstance(memory, bool):
        raise InvalidArgumentError(f"memory must be an address or a buffer, got {memory!r}")
    if isinstance(memory, int):
        if memory <= 0:
            raise InvalidArgumentError(f"address must be positive, got {memory}")
        if length is None or not isinstance(length, int) or length <= 0:
            raise InvalidArgumentError(f"an address needs a positive int length, got {length!r}")
        return memory, length, None
    try:
        view = memoryview(memory)
    except TypeError:
        raise InvalidArgumentError(
            f"memory must be an int address or an object with the buffer protocol, got {type(memory).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgumentError(
            f"{type(memory).__name__} is not contiguous (strides {view.strides}): "
            "kvring moves contiguous memory only; pass a contiguous copy or its parts"
        )
    if view.readonly:
        raise InvalidArgumentError(f"{type(memory).__name__} is read-only: registered memory must be writable")
    if view.nbytes == 0:
        raise InvalidArgumentError("an empty buffer cannot be registered")
    if length is not None and (not isinstance(length, int) or not 0 < length <= view.nbytes):
        raise InvalidArgumentError(f"length {length!r} must be 1..{view.nbytes} for this buffer")
    anchor = (ctypes.c_char * view.nbytes).from_buffer(view.cast("B"))
    return ctypes.addressof(anchor), length or view.nbytes, (view, anchor)

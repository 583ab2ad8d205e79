"""Turning what callers pass as memory into (address, length, keep-alive,
location).

An int is an address (Mooncake's convention): the caller keeps the memory
valid, and the engine's GPU provider says where it lives (host memory, or
the GPU holding it). Anything with the buffer protocol (numpy arrays,
bytearray, memoryview, mmap) is host memory used in place, never copied: its
address comes from a ctypes view of the buffer, and that view is kept with
the registration, so the object cannot be freed or resized (a bytearray
refuses while exported) until it is unregistered. GPU memory comes as an
object with ``__cuda_array_interface__`` (CuPy, Numba, PyTorch) or DLPack
(``__dlpack__``/``__dlpack_device__``: PyTorch, JAX, CuPy), read without
importing any of them; the object itself is kept while registered.

Only contiguous memory is taken: kvring moves byte ranges.
"""

import ctypes

from . import _native
from .errors import InvalidArgumentError

# DLPack's device type for CUDA memory.
_KDL_CUDA = 2


def _check_length(length, nbytes, what):
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or not 0 < length <= nbytes):
        raise InvalidArgumentError(f"length {length!r} must be 1..{nbytes} for this {what}")
    return length or nbytes


def _dense_strides(shape, itemsize):
    strides, step = [], itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def _from_cuda_array_interface(memory, interface, length):
    """(address, length, keep, location) of a ``__cuda_array_interface__``."""
    name = type(memory).__name__
    try:
        ptr, readonly = interface["data"]
        shape = tuple(int(d) for d in interface["shape"])
        typestr = str(interface["typestr"])
        itemsize = int(typestr[2:])
    except (KeyError, TypeError, ValueError) as error:
        raise InvalidArgumentError(
            f"{name}.__cuda_array_interface__ is malformed ({error!r}): it needs data=(ptr, readonly), shape and "
            "a typestr such as '<f2'"
        ) from None
    if interface.get("mask") is not None:
        raise InvalidArgumentError(f"{name} is a masked array: kvring moves plain memory only")
    if readonly:
        raise InvalidArgumentError(f"{name} is read-only: registered memory must be writable")
    if itemsize <= 0 or any(d < 0 for d in shape):
        raise InvalidArgumentError(f"{name}: shape {shape} of {typestr} elements is not an array's")
    strides = interface.get("strides")
    if strides is not None:
        dense = _dense_strides(shape, itemsize)
        if any(int(s) != d for dim, s, d in zip(shape, strides, dense) if dim != 1) or len(strides) != len(shape):
            raise InvalidArgumentError(
                f"{name} is not contiguous (shape {shape}, strides {tuple(strides)} in bytes): kvring moves "
                "contiguous memory only; pass a contiguous copy (.contiguous()) or its parts"
            )
    nbytes = itemsize
    for dim in shape:
        nbytes *= dim
    if nbytes == 0:
        raise InvalidArgumentError(f"an empty {name} cannot be registered")
    if not ptr:
        raise InvalidArgumentError(f"{name}'s data pointer is null")
    # No device in the interface: the GPU provider says which one it is.
    return int(ptr), _check_length(length, nbytes, name), memory, None


def _from_dlpack(memory, length):
    """(address, length, keep, location) of a DLPack producer."""
    name = type(memory).__name__
    device = memory.__dlpack_device__() if hasattr(memory, "__dlpack_device__") else None
    # stream=-1: no synchronization (the array API's word for it): kvring
    # only learns the address here; it copies later, on its own streams.
    kwargs = {"stream": -1} if device is not None and int(device[0]) == _KDL_CUDA else {}
    try:
        capsule = memory.__dlpack__(**kwargs)
    except TypeError:
        capsule = memory.__dlpack__()
    addr, nbytes, location = _native.dlpack_info(capsule)
    # The capsule goes (its deleter runs); the tensor, kept, holds the memory.
    del capsule
    return addr, _check_length(length, nbytes, name), memory, location


def address_of(memory, length=None):
    """Returns (address, length, keep, location) for an int address, a
    buffer object, or a GPU array; location is None where the GPU provider
    is to say (an int, a CUDA array interface), else "host" or "gpu:N"."""
    if isinstance(memory, bool):
        raise InvalidArgumentError(f"memory must be an address or a buffer, got {memory!r}")
    if isinstance(memory, int):
        if memory <= 0:
            raise InvalidArgumentError(f"address must be positive, got {memory}")
        if length is None or not isinstance(length, int) or length <= 0:
            raise InvalidArgumentError(f"an address needs a positive int length, got {length!r}")
        return memory, length, None, None
    try:
        interface = getattr(memory, "__cuda_array_interface__", None)
    except Exception as error:  # e.g. a tensor that requires grad
        raise InvalidArgumentError(f"{type(memory).__name__}.__cuda_array_interface__ failed: {error}") from None
    if interface is not None:
        return _from_cuda_array_interface(memory, interface, length)
    try:
        view = memoryview(memory)
    except TypeError:
        view = None
    if view is None:
        if hasattr(memory, "__dlpack__"):
            return _from_dlpack(memory, length)
        raise InvalidArgumentError(
            f"memory must be an int address, an object with the buffer protocol, __cuda_array_interface__ or "
            f"__dlpack__, got {type(memory).__name__}"
        )
    if not view.c_contiguous:
        raise InvalidArgumentError(
            f"{type(memory).__name__} is not contiguous (strides {view.strides}): "
            "kvring moves contiguous memory only; pass a contiguous copy or its parts"
        )
    if view.readonly:
        raise InvalidArgumentError(f"{type(memory).__name__} is read-only: registered memory must be writable")
    if view.nbytes == 0:
        raise InvalidArgumentError("an empty buffer cannot be registered")
    length = _check_length(length, view.nbytes, "buffer")
    anchor = (ctypes.c_char * view.nbytes).from_buffer(view.cast("B"))
    return ctypes.addressof(anchor), length, (view, anchor), "host"

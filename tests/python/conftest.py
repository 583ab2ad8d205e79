"""Fixtures for the Python suites: peers in their own processes."""

import ctypes
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def pattern(size, seed):
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def digest(array):
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


# The GPU provider the GPU suite runs on: kvring's simulated GPUs, or, with
# TEST_GPU_PROVIDER=cuda, the CUDA driver (the fake libcuda in CI,
# .ci/stage-fakecuda.sh, found on LD_LIBRARY_PATH).
GPU = "cuda" if os.environ.get("TEST_GPU_PROVIDER") == "cuda" else "sim"


def device_buffer(engine, size, device=0):
    """``size`` bytes of memory of GPU ``device``: the simulator's (the
    engine's ``sim_device_buffer``), or, on the CUDA driver, allocated as a
    PyTorch application holds it (``DriverBuffer``)."""
    if GPU == "sim":
        return engine.sim_device_buffer(size, device)
    return DriverBuffer(size, device)


class _Driver:
    """libcuda.so.1 called with ctypes, as an application (PyTorch's
    allocator) calls it: the library instance kvring loads too (one
    ``libcuda.so.1`` per process), each GPU's primary context retained once
    and made current on the calling thread before each call."""

    _instance = None

    @classmethod
    def get(cls):
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.contexts = {}
        self.check(self.lib.cuInit(ctypes.c_uint(0)), "cuInit")

    def check(self, result, what):
        if result != 0:
            raise RuntimeError(f"{what}: CUresult {result}")

    def on(self, device):
        """GPU ``device``'s primary context current on this thread."""
        if device not in self.contexts:
            handle, context = ctypes.c_int(), ctypes.c_void_p()
            self.check(self.lib.cuDeviceGet(ctypes.byref(handle), ctypes.c_int(device)), "cuDeviceGet")
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle), "cuDevicePrimaryCtxRetain")
            self.contexts[device] = context
        self.check(self.lib.cuCtxSetCurrent(self.contexts[device]), "cuCtxSetCurrent")

    def alloc(self, device, size):
        self.on(device)
        ptr = ctypes.c_uint64()
        self.check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)), "cuMemAlloc_v2")
        return ptr.value

    def copy(self, device, dst, src, size):
        """``cudaMemcpy``: on the legacy default stream, then synchronized."""
        self.on(device)
        result = self.lib.cuMemcpyAsync(ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(size), None)
        self.check(result, "cuMemcpyAsync")
        self.check(self.lib.cuStreamSynchronize(None), "cuStreamSynchronize")


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_DLTENSOR = b"dltensor"  # a capsule's name must outlive it
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class DriverBuffer:
    """Device memory allocated through the CUDA driver with ``cuMemAlloc``
    in its GPU's primary context (what ``torch.empty(..., device="cuda:N")``
    holds), with what ``sim_device_buffer`` offers: ``ptr``, ``nbytes``,
    ``device``, ``__cuda_array_interface__``, unversioned DLPack (uint8,
    kDLCUDA; the memory is never freed, so the capsule needs no deleter),
    ``view`` and blocking ``write``/``read`` through the driver's copies."""

    def __init__(self, size, device=0, base=None, shape=None, strides=None):
        self.device = device
        self.nbytes = size
        self.ptr = base if base is not None else _Driver.get().alloc(device, size)
        self.shape = list(shape or [size])
        self.strides = None if strides is None else list(strides)
        self._exported = []  # what DLPack capsules point at, kept alive

    def view(self, shape, strides=None):
        return DriverBuffer(self.nbytes, self.device, self.ptr, shape, strides)

    @property
    def __cuda_array_interface__(self):
        strides = None if self.strides is None else tuple(self.strides)
        return {"shape": tuple(self.shape), "typestr": "|u1", "data": (self.ptr, False), "version": 3, "strides": strides}

    def __dlpack_device__(self):
        return (2, self.device)  # kDLCUDA

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * ndim)(*self.shape)
        strides = None if self.strides is None else (ctypes.c_int64 * ndim)(*self.strides)
        managed = _DLManagedTensor()
        managed.dl_tensor = _DLTensor(
            self.ptr,
            _DLDevice(2, self.device),
            ndim,
            _DLDataType(1, 8, 1),  # kDLUInt, 8 bits, 1 lane
            ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)),
            None if strides is None else ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)),  # NULL: row-major
            0,
        )
        self._exported.append((managed, shape, strides))
        return _capsule_new(ctypes.addressof(managed), _DLTENSOR, None)

    def _range(self, offset, length):
        if offset < 0 or offset + length > self.nbytes:
            raise ValueError(f"{offset}+{length} past the buffer's {self.nbytes} bytes")
        return self.ptr + offset

    def write(self, offset, data):
        data = bytes(data)
        host = ctypes.create_string_buffer(data, len(data))
        _Driver.get().copy(self.device, self._range(offset, len(data)), ctypes.addressof(host), len(data))

    def read(self, offset, length):
        host = ctypes.create_string_buffer(length)
        _Driver.get().copy(self.device, ctypes.addressof(host), self._range(offset, length), length)
        return host.raw


class CudaArray:
    """An object with only ``__cuda_array_interface__``, as Numba's or
    CuPy's arrays (without their DLPack)."""

    def __init__(self, memory):
        self._memory = memory

    @property
    def __cuda_array_interface__(self):
        return self._memory.__cuda_array_interface__


class DLPackTensor:
    """An object with only DLPack, as a JAX array."""

    def __init__(self, memory):
        self._memory = memory

    def __dlpack__(self, stream=None):
        return self._memory.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self._memory.__dlpack_device__()


class TorchLike:
    """What kvring.nixl reads of a torch.Tensor (``data_ptr()``, ``numel()``,
    ``element_size()``, ``device``, ``get_device()``, ``is_contiguous()``),
    over a numpy array (a CPU tensor) or a simulated device buffer (a CUDA
    tensor on GPU ``device``): the suites have no torch."""

    class _Device:
        def __init__(self, name):
            self.name = name

        def __str__(self):
            return self.name

        def __eq__(self, other):
            return str(other) == self.name

        def __hash__(self):
            return hash(self.name)

    def __init__(self, memory, device=None, offset=0, nbytes=None, contiguous=True):
        self._memory = memory
        self._cuda = device is not None
        self._ptr = (memory.ptr if self._cuda else memory.ctypes.data) + offset
        self._nbytes = nbytes if nbytes is not None else memory.nbytes - offset
        self.device = self._Device(f"cuda:{device}" if self._cuda else "cpu")
        self._index = device if self._cuda else -1
        self._contiguous = contiguous

    def data_ptr(self):
        return self._ptr

    def numel(self):
        return self._nbytes // 2  # as a float16 tensor

    def element_size(self):
        return 2

    def get_device(self):
        return self._index

    def is_contiguous(self):
        return self._contiguous

    def rows(self, count):
        """The tensor as ``count`` row tensors (``tensor[i]``)."""
        step = self._nbytes // count
        base = self._ptr - (self._memory.ptr if self._cuda else self._memory.ctypes.data)
        return [
            TorchLike(self._memory, self._index if self._cuda else None, base + i * step, step) for i in range(count)
        ]


class Process:
    """A helper script in its own interpreter, talked to by JSON lines."""

    def __init__(self, script, *args):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = self._line()

    def _line(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"helper exited with {self.proc.wait()}")
        return json.loads(line)

    def ask(self, command):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()


@pytest.fixture
def spawn():
    started = []

    def start(script, *args):
        process = Process(script, *args)
        started.append(process)
        return process

    yield start
    for process in started:
        process.close()

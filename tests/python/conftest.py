"""Fixtures for the Python suites: peers in their own processes."""

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

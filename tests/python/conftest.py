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

"""NIXL's POSIX backend on kvring: bytes between this agent's registered
host memory (DRAM) and files (FILE), with ``pread``/``pwrite``.

What it does is what NIXL's POSIX plugin does (ai-dynamo/nixl,
src/plugins/posix), checked against NIXL 1.5.1 in the same Python:

- ``get_plugin_params("POSIX")`` gives NIXL's parameters and defaults
  (which I/O queue: ``use_aio``, ``use_uring``, ``use_posix_aio``; its
  sizes: ``ios_pool_size``, ``kernel_queue_size``). kvring reads the sizes
  as NIXL does (ints; anything else is refused) and moves bytes with
  ``os.preadv``/``os.pwritev`` on one worker thread per backend, whatever
  queue is named.
- A FILE descriptor is ``(offset, len, fd, meta)``: ``dev_id`` is an open
  file descriptor (NIXL's fd mode), the range is bytes of that file.
  Registering one whose fd is not open is refused here
  (``nixlInvalidParamError``; NIXL takes it and fails at the first I/O).
- ``query_memory`` (``queryMem``) reads each descriptor's meta as a path:
  ``{"size", "mode", "mtime"}`` (strings, as NIXL's) for a file that is
  there, None for one that is not.
- A transfer pairs DRAM descriptors (local) with FILE ones, one to one,
  lengths equal, to the agent itself (``remote_agent`` is its own name):
  WRITE copies memory to the file at the offset, READ the file to memory.
  Every descriptor must lie inside a registration of its kind (a FILE one
  inside a registered range of the same fd), else ``nixlNotFoundError``,
  as NIXL's ("no ... backend had the required registrations"); the memory
  is checked again at each posting, so bytes never land outside a region
  registered now. A notification message is refused
  (``nixlBackendError``: the POSIX plugin has no notifications).
- Posting gives "PROC"; the status is "PROC" until every byte moved, then
  "DONE". A short read (the file ends first) or a failed call ends the
  posting "ERR" with ``nixlBackendError`` (kvring's ``KvringIOError``).
"""

import ctypes
import os
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ..errors import BusyError, InvalidArgumentError, KvringIOError, TransferTimeoutError
from ._errors import nixlBackendError, nixlNotAllowedError, nixlNotFoundError

log = logging.getLogger("kvring.nixl")

NAME = "POSIX"
# NIXL 1.5.1's getPluginParams("POSIX"), parameters and memory types.
PLUGIN_PARAMS = {
    "use_aio": "false",
    "use_uring": "false",
    "use_posix_aio": "false",
    "ios_pool_size": "65536",
    "kernel_queue_size": "256",
}
PLUGIN_MEM_TYPES = ["DRAM", "FILE"]
BACKEND_MEM_TYPES = ["FILE", "DRAM"]
_SIZES = ("ios_pool_size", "kernel_queue_size")


def _cover(ranges, start, length):
    """True if [start, start + length) lies inside one of ``ranges``
    ((start, length) pairs)."""
    return any(at <= start and start + length <= at + size for at, size in ranges)


class Request:
    """A POSIX transfer: (memory address, file descriptor, file offset,
    length) per pair, and the direction."""

    __slots__ = ("backend", "read", "pairs", "bytes")

    def __init__(self, backend, read, pairs):
        self.backend = backend
        self.read = read
        self.pairs = pairs
        self.bytes = sum(length for _addr, _fd, _offset, length in pairs)

    def __len__(self):
        return len(self.pairs)

    def __repr__(self):
        return f"posix.Request({'READ' if self.read else 'WRITE'}, {len(self)} descs, {self.bytes} bytes)"


class Backend:
    """One agent's POSIX backend: its FILE registrations and the worker
    thread that moves the bytes."""

    def __init__(self, agent_name, params=None):
        params = dict(params or {})
        for key in _SIZES:
            value = params.get(key)
            if value is not None:
                try:
                    int(value)
                except (TypeError, ValueError):
                    raise InvalidArgumentError(f"POSIX backend parameter {key}={value!r}: an int, as NIXL reads it") from None
        self.agent_name = agent_name
        self.params = params
        self._files = {}  # fd -> [(offset, len), ...] registered
        # Held while a posting checks its ranges and is queued, and while
        # ranges are deregistered: a posting either is queued before (and
        # is waited for) or sees the range gone.
        self.lock = threading.Lock()
        self._worker = None  # made at the first posting
        self._inflight = set()  # futures of postings not yet ended

    # Registration and queries --------------------------------------------

    def register(self, descs):
        """Registers FILE descriptors (fd mode: ``dev_id`` is an open fd)."""
        rows = list(descs)
        for offset, length, fd, _meta in rows:
            try:
                os.fstat(fd)
            except OSError as error:
                raise InvalidArgumentError(f"FILE descriptor ({offset}, {length}, fd {fd}): fd is not open ({error.strerror})") from None
        for offset, length, fd, _meta in rows:
            self._files.setdefault(fd, []).append((offset, length))

    def deregister(self, descs):
        """Forgets FILE registrations (each must have been registered)."""
        rows = list(descs)
        for offset, length, fd, _meta in rows:
            if (offset, length) not in self._files.get(fd, ()):
                raise InvalidArgumentError(f"FILE ({offset}, {length}, fd {fd}) is not registered with the POSIX backend")
        with self.lock:
            for offset, length, fd, _meta in rows:
                ranges = self._files.get(fd, [])
                if (offset, length) in ranges:
                    ranges.remove((offset, length))
                if not ranges:
                    self._files.pop(fd, None)
        self.drain()

    @staticmethod
    def query(descs):
        """Per descriptor, its meta read as a path: NIXL's info dict
        (strings) for a file that is there, None for one that is not."""
        found = []
        for _addr, _len, _dev, meta in descs:
            path = os.fsdecode(meta) if isinstance(meta, bytes) else meta
            try:
                st = os.stat(path)
            except FileNotFoundError:
                found.append(None)
                continue
            except PermissionError as error:
                raise nixlNotAllowedError(f"queryMem: {path!r}: {error.strerror}") from None
            except (OSError, ValueError) as error:
                raise nixlBackendError(f"queryMem: {path!r}: {error}") from None
            found.append({"size": str(st.st_size), "mode": str(st.st_mode), "mtime": str(int(st.st_mtime))})
        return found

    # Transfers -----------------------------------------------------------

    def request(self, operation, local, remote, remote_agent, notif, regions):
        """A transfer of ``local`` (DRAM, (addr, len, dev) rows) to or from
        ``remote`` (FILE rows) on this agent; ``regions`` are the agent's
        registered (addr, len) memory ranges."""
        if remote_agent != self.agent_name:
            raise nixlNotFoundError(
                f"a POSIX transfer is to the agent itself ({self.agent_name!r}), got remote agent {remote_agent!r}"
            )
        local, remote = list(local), list(remote)
        if len(local) != len(remote) or not local:
            raise InvalidArgumentError(f"{len(local)} DRAM and {len(remote)} FILE descriptors: a POSIX transfer pairs them one to one, at least one")
        pairs = []
        for index, ((addr, length, _dev), (offset, flen, fd)) in enumerate(zip(local, remote)):
            if length != flen:
                raise InvalidArgumentError(f"descriptor {index}: {length} bytes of memory and {flen} of file (lengths must match)")
            if not _cover(self._files.get(fd, ()), offset, flen):
                raise nixlNotFoundError(
                    f"descriptor {index}: file bytes [{offset}, {offset + flen}) of fd {fd} are not inside a FILE registration"
                )
            if not _cover(regions, addr, length):
                raise nixlNotFoundError(f"descriptor {index}: memory ({addr:#x}, {length}) is not inside registered DRAM")
            pairs.append((addr, fd, offset, length))
        if notif:
            raise nixlBackendError("the POSIX backend has no notifications (NIXL's neither): pass no notif_msg")
        return Request(self, operation == "READ", pairs)

    def post(self, request, regions):
        """Starts a posting; its future. The memory (``regions()``: the
        agent's registered (addr, len) ranges) and the file ranges are
        checked against what is registered now."""
        with self.lock:
            registered = regions()
            for index, (addr, fd, offset, length) in enumerate(request.pairs):
                if not _cover(self._files.get(fd, ()), offset, length):
                    raise nixlNotFoundError(f"descriptor {index}: fd {fd} [{offset}, {offset + length}) was deregistered since the request was made")
                if not _cover(registered, addr, length):
                    raise nixlNotFoundError(f"descriptor {index}: memory ({addr:#x}, {length}) was deregistered since the request was made")
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvring-posix-{self.agent_name}")
            future = self._worker.submit(_move, request.read, request.pairs)
            self._inflight.add(future)
        future.add_done_callback(self._inflight.discard)
        return future

    def drain(self, timeout=30.0):
        """Waits (bounded) for every posting in flight to end: memory or a
        file range is about to be deregistered."""
        for future in list(self._inflight):
            try:
                future.exception(timeout=timeout)
            except FutureTimeout:
                raise BusyError(f"a POSIX transfer did not end within {timeout} s: deregistration refused") from None

    def close(self, timeout=30.0):
        """Ends the worker once what it runs has ended (waited for, bounded:
        a file that hangs is left to its thread and logged)."""
        if self._worker is None:
            return
        try:
            self.drain(timeout)
        except BusyError as error:
            log.error("closing agent %s's POSIX backend: %s", self.agent_name, error)
        self._worker.shutdown(wait=False)
        self._worker = None


def _move(read, pairs):
    """The worker's job: every pair moved in full, or ``nixlBackendError``."""
    for addr, fd, offset, length in pairs:
        # The range was checked inside a registered region when posted, and
        # deregistration waits for this posting (Backend.drain).
        view = memoryview((ctypes.c_ubyte * length).from_address(addr))
        done = 0
        while done < length:
            part = view[done:]
            try:
                moved = os.preadv(fd, [part], offset + done) if read else os.pwritev(fd, [part], offset + done)
            except InterruptedError:
                continue
            except OSError as error:
                raise KvringIOError(f"POSIX {'read' if read else 'write'} of fd {fd} at {offset + done}: {error.strerror}") from None
            if moved == 0:
                raise KvringIOError(f"POSIX read of fd {fd}: the file ends at {offset + done}, {length - done} bytes short")
            done += moved


def state(handle):
    """A POSIX posting's state: "PROC", "DONE" or "ERR" (the reason as
    ``handle.error``)."""
    future = handle.batch
    if future is None:
        if handle.done:
            return "DONE"
        if handle.error is not None:
            return "ERR"
        raise InvalidArgumentError(f"{handle!r} was never posted: transfer(handle) first")
    if not future.done():
        return "PROC"
    handle.batch = None
    error = future.exception()
    if error is not None:
        handle.done, handle.error = False, error
        log.error("POSIX transfer: %s", error)
        return "ERR"
    handle.done, handle.error, handle.ended_ns = True, None, time.perf_counter_ns()
    return "DONE"


def wait(handle, timeout):
    """Waits (bounded) for a POSIX posting to end; its state."""
    if handle.batch is not None:
        try:
            handle.batch.exception(timeout=timeout)
        except FutureTimeout:
            raise TransferTimeoutError(f"{handle!r} did not end within {timeout} s") from None
    return state(handle)


__all__ = ["NAME", "PLUGIN_PARAMS", "PLUGIN_MEM_TYPES", "BACKEND_MEM_TYPES", "Backend", "Request", "state", "wait"]

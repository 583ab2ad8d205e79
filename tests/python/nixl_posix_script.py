"""POSIX transfers written for NIXL's C++-style bindings (``nixl._bindings``):
prints one line per case with its outcome (the NIXL error class raised, or
what moved), so that its output on NIXL 1.5.1 and on kvring.nixl (through
tests/peers/nixl/shim) can be compared line for line
(test_nixl_posix.py). Run in an empty folder: it writes its file there."""

import os
import sys

import numpy as np

import nixl._bindings as b

ERRORS = ("nixlNotFoundError", "nixlInvalidParamError", "nixlBackendError", "nixlNotSupportedError", "nixlNotAllowedError")
SIZE = 16384


def error_name(error):
    for name in ERRORS:
        if isinstance(error, getattr(b, name)):
            return name
    return f"other {type(error).__name__}"


def run(agent, op, local, remote, target="posix-script", notif=None):
    """Makes, posts and polls (bounded) one request; its outcome."""
    try:
        args = (op, b.nixlXferDList(b.DRAM_SEG, local), b.nixlXferDList(b.FILE_SEG, remote), target)
        req = agent.createXferReq(*args, notif) if notif is not None else agent.createXferReq(*args)
    except Exception as error:  # noqa: BLE001  (the class is the outcome)
        return f"create: {error_name(error)}"
    try:
        status = agent.postXferReq(req)
        posted = "IN_PROG" if status == b.NIXL_IN_PROG else "SUCCESS"
        for _ in range(10_000_000):
            if status != b.NIXL_IN_PROG:
                break
            status = agent.getXferStatus(req)
        assert status == b.NIXL_SUCCESS, status
        return f"posted {posted}, ended SUCCESS"
    except Exception as error:  # noqa: BLE001
        return f"posted, then {error_name(error)}"
    finally:
        agent.releaseXferReq(req)


def main():
    config = b.nixlAgentConfig()
    config.useProgThread = False
    agent = b.nixlAgent("posix-script", config)
    params, mems = agent.getPluginParams("POSIX")
    print("params:", sorted(params.items()))
    print("mems:", [str(m).rsplit(".", 1)[-1].replace("_SEG", "") for m in mems])
    backend = agent.createBackend("POSIX", params)
    mem = (np.arange(SIZE) % 251).astype(np.uint8)
    back = np.zeros(SIZE, dtype=np.uint8)
    fd = os.open("posix-script.bin", os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
    try:
        agent.registerMem(b.nixlRegDList(b.DRAM_SEG, [(mem.ctypes.data, SIZE, 0, ""), (back.ctypes.data, SIZE, 0, "")]), [backend])
        agent.registerMem(b.nixlRegDList(b.FILE_SEG, [(0, 2 * SIZE, fd, "posix-script.bin")]), [backend])
        info = agent.queryMem(b.nixlRegDList(b.FILE_SEG, [(0, 0, 0, "posix-script.bin"), (0, 0, 0, "no-such-file")]), backend)
        print("query:", [sorted(i) if i is not None else None for i in info])
        m, k = mem.ctypes.data, back.ctypes.data
        print("write:", run(agent, b.NIXL_WRITE, [(m, 4096, 0), (m + 4096, SIZE - 4096, 0)], [(SIZE, 4096, fd), (0, SIZE - 4096, fd)]))
        print("file:", os.pread(fd, 4096, SIZE) == mem[:4096].tobytes(), os.pread(fd, SIZE - 4096, 0) == mem[4096:].tobytes())
        print("read:", run(agent, b.NIXL_READ, [(k, SIZE, 0)], [(0, SIZE, fd)]))
        print("read back:", back[: SIZE - 4096].tobytes() == mem[4096:].tobytes())
        print("unknown fd:", run(agent, b.NIXL_WRITE, [(m, 16, 0)], [(0, 16, 999)]))
        print("past range:", run(agent, b.NIXL_WRITE, [(m, 16, 0)], [(2 * SIZE - 8, 16, fd)]))
        print("memory not registered:", run(agent, b.NIXL_WRITE, [(m + SIZE - 8, 16, 0)], [(0, 16, fd)]))
        print("lengths differ:", run(agent, b.NIXL_WRITE, [(m, 16, 0)], [(0, 8, fd)]))
        print("notification:", run(agent, b.NIXL_WRITE, [(m, 16, 0)], [(0, 16, fd)], notif="done"))
        print("another agent:", run(agent, b.NIXL_WRITE, [(m, 16, 0)], [(0, 16, fd)], target="elsewhere"))
        os.ftruncate(fd, 100)
        print("read past the end:", run(agent, b.NIXL_READ, [(k, 4096, 0)], [(0, 4096, fd)]))
        ucx = b.nixlAgent("posix-script-ucx", config)
        try:
            ucx.queryMem(b.nixlRegDList(b.FILE_SEG, [(0, 0, 0, "posix-script.bin")]), ucx.createBackend("UCX", {}))
            print("query on UCX: answered")
        except Exception as error:  # noqa: BLE001
            print("query on UCX:", error_name(error))
        try:
            b.nixlAgent("posix-script-none", config).registerMem(b.nixlRegDList(b.FILE_SEG, [(0, 16, fd, "")]), [])
            print("FILE without POSIX: registered")
        except Exception as error:  # noqa: BLE001
            print("FILE without POSIX:", error_name(error))
    finally:
        os.close(fd)
    print("done")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    # NIXL 1.5.1's process crashes at exit (SIGSEGV in its teardown, as
    # tests/peers/nixl/run.py notes): leave without it, on both sides.
    os._exit(0)

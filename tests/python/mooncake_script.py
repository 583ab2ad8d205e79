"""A script written against Mooncake's Python TransferEngine API, as its
quick start does. Only the import line differs from running it on Mooncake:

    from mooncake.engine import TransferEngine

It runs as two processes: `server PROTOCOL` prints its session id and
buffer address and waits; `client PROTOCOL SESSION ADDRESS` moves data to
and from it and checks every byte. It exits 0 only if everything matched.
"""

import sys

import numpy as np

from kvring.mooncake import TransferEngine

HOSTNAME = "127.0.0.1"
METADATA_SERVER = "P2PHANDSHAKE"
DEVICE_NAME = ""
SIZE = 1024 * 1024


def server(protocol):
    engine = TransferEngine()
    if engine.initialize(HOSTNAME, METADATA_SERVER, protocol, DEVICE_NAME) != 0:
        raise RuntimeError("initialize failed")
    session_id = f"{HOSTNAME}:{engine.get_rpc_port()}"
    if protocol == "shm":
        # Memory a same-host peer can map comes from the engine.
        server_ptr = engine.allocate_managed_buffer(SIZE)
        if server_ptr == 0:
            raise RuntimeError("allocate_managed_buffer failed")
        buffer = None
    else:
        buffer = np.zeros(SIZE, dtype=np.uint8)
        server_ptr = buffer.ctypes.data
        if engine.register_memory(server_ptr, SIZE) != 0:
            raise RuntimeError("Mooncake memory registration failed.")
    print(session_id, server_ptr, flush=True)
    sys.stdin.readline()  # the client is done
    data = engine.read_bytes_from_buffer(server_ptr, SIZE)
    print(int(np.frombuffer(data, dtype=np.uint8).astype(np.uint64).sum()), flush=True)
    sys.stdin.readline()


def client(protocol, session_id, server_ptr):
    engine = TransferEngine()
    if engine.initialize(HOSTNAME, METADATA_SERVER, protocol, DEVICE_NAME) != 0:
        raise RuntimeError("initialize failed")
    source = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    target = np.zeros(SIZE, dtype=np.uint8)
    for buf in (source, target):
        if engine.register_memory(buf.ctypes.data, buf.nbytes) != 0:
            raise RuntimeError("register_memory failed")
    assert engine.get_first_buffer_address(session_id) == server_ptr

    # One write, one read back.
    assert engine.transfer_sync_write(session_id, source.ctypes.data, server_ptr, 65536) == 0
    assert engine.transfer_sync_read(session_id, target.ctypes.data, server_ptr, 65536) == 0
    assert np.array_equal(source[:65536], target[:65536])

    # Batches of 64 KiB blocks, sync and async.
    blocks = 16
    size = 65536
    src = [source.ctypes.data + i * size for i in range(blocks)]
    dst = [server_ptr + i * size for i in range(blocks)]
    assert engine.batch_transfer_sync_write(session_id, src, dst, [size] * blocks) == 0
    target[:] = 0
    assert engine.batch_transfer_sync_read(session_id, [target.ctypes.data + i * size for i in range(blocks)], dst, [size] * blocks) == 0
    assert np.array_equal(source, target)

    target[:] = 0
    first = engine.batch_transfer_async_read(session_id, [target.ctypes.data], [server_ptr], [SIZE // 2])
    second = engine.batch_transfer_async_read(session_id, [target.ctypes.data + SIZE // 2], [server_ptr + SIZE // 2], [SIZE // 2])
    assert first > 0 and second > 0
    assert engine.get_batch_transfer_status([first, second]) == 0
    assert np.array_equal(source, target)

    batch_id = engine.transfer_submit_write(session_id, source.ctypes.data, server_ptr, 4096)
    assert batch_id >= 0
    while True:
        status = engine.transfer_check_status(batch_id)
        if status == 1:
            break
        assert status == 0, status

    # Failures are negative codes, never exceptions.
    assert engine.transfer_sync_write(session_id, source.ctypes.data, server_ptr + SIZE, 4096) < 0
    assert engine.transfer_sync_write("127.0.0.1:1", source.ctypes.data, server_ptr, 4096) < 0
    assert engine.unregister_memory(source.ctypes.data) == 0
    assert engine.transfer_sync_write(session_id, source.ctypes.data, server_ptr, 4096) < 0
    print(int(source.astype(np.uint64).sum()), flush=True)


if __name__ == "__main__":
    role, protocol = sys.argv[1], sys.argv[2]
    if role == "server":
        server(protocol)
    else:
        client(protocol, sys.argv[3], int(sys.argv[4]))

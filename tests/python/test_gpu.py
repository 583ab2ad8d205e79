"""GPU memory from Python on kvring's simulated GPU (no host thread can touch
its memory; copies land only when their events say so): device arrays
registered through ``__cuda_array_interface__``, DLPack and bare addresses,
moved between two processes over cuda_ipc and verified; the Mooncake layer
and the LMDeploy backend with GPU addresses; bad objects refused clearly.

With ``TEST_GPU_PROVIDER=cuda`` (``.ci/stage-fakecuda.sh``, over the fake
libcuda) the same tests run on the CUDA provider, the device memory
allocated through the driver as a PyTorch application holds it (conftest's
``device_buffer``), in this process and in the peers'."""

import ctypes
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

import kvring
from conftest import GPU, CudaArray, DLPackTensor, device_buffer, digest, pattern
from kvring.lmdeploy import KvringMigrationBackend
from kvring.mooncake import TransferEngine

SIZE = 1 << 20


def test_a_device_array_moves_between_two_processes_over_cuda_ipc(spawn):
    peer = spawn("gpu_peer.py", "--device", "1", "--via", "dlpack")
    assert peer.info["memory"] == "gpu:1", "a DLPack tensor registers as its device's memory"
    engine = kvring.Engine(gpu=GPU)
    source = device_buffer(engine, SIZE, device=0)
    source.write(0, pattern(SIZE, 5).tobytes())
    mine = engine.register(CudaArray(source))
    assert engine.region_memory(mine) == "gpu:0", "the provider says which GPU an interface's pointer is on"
    name, theirs = peer.info["addr"], peer.info["region"]
    assert engine.open_segment(name) == "cuda_ipc"
    assert engine.region_memory(theirs, name) == "gpu:1"

    # Push, then the target reads its own device memory (its copy engine).
    assert engine.write(name, [(mine, 0, theirs, 0, SIZE)]) == SIZE
    assert peer.ask(f"digest 0 {SIZE}") == digest(pattern(SIZE, 5))

    # Pull by addresses (Mooncake's convention) into a DLPack tensor on GPU 1.
    assert peer.ask("fill 9") == "ok"
    back = device_buffer(engine, SIZE, device=1)
    assert engine.region_memory(engine.register(DLPackTensor(back))) == "gpu:1"
    assert engine.transfer_addrs(name, "read", [back.ptr + 4096], [peer.info["buffer"]], [65536]) == 65536
    assert back.read(4096, 65536) == pattern(SIZE, 9)[:65536].tobytes()

    # A bare device address registers as that GPU's memory, as Mooncake's does.
    third = device_buffer(engine, 4096, device=0)
    assert engine.region_memory(engine.register(third.ptr, 4096)) == "gpu:0"
    engine.close()


def test_non_contiguous_and_malformed_gpu_objects_are_refused_clearly():
    engine = kvring.Engine(gpu=GPU)
    buffer = device_buffer(engine, 1 << 16)
    # Column-major 64 x 64 bytes: every byte is there, but not in row order.
    strided = buffer.view([64, 64], [1, 64])
    for wrapped in (CudaArray(strided), DLPackTensor(strided)):
        with pytest.raises(kvring.InvalidArgumentError, match="not contiguous"):
            engine.register(wrapped)
    # Row-major, the same bytes register (a size-1 dimension's stride is free).
    region = engine.register(DLPackTensor(buffer.view([256, 1, 256], [256, 7, 1])))
    assert engine.region_memory(region) == "gpu:0"
    engine.unregister(region)

    class Interface:
        def __init__(self, interface):
            self.__cuda_array_interface__ = interface

    good = dict(buffer.__cuda_array_interface__)
    for bad, why in [
        ({**good, "data": (buffer.ptr, True)}, "read-only"),
        ({**good, "mask": object()}, "masked"),
        ({"shape": (16,), "typestr": "|u1"}, "malformed"),
        ({**good, "typestr": "|V"}, "malformed"),
        ({**good, "shape": (0,)}, "empty"),
        ({**good, "data": (0, False)}, "null"),
    ]:
        with pytest.raises(kvring.InvalidArgumentError, match=why):
            engine.register(Interface(bad))

    # A DLPack capsule someone already consumed.
    set_name = ctypes.pythonapi.PyCapsule_SetName
    set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]

    class Consumed:
        name = b"used_dltensor"  # outlives the capsule

        def __dlpack__(self, stream=None):
            capsule = buffer.__dlpack__()
            set_name(capsule, self.name)
            return capsule

    with pytest.raises(kvring.InvalidArgumentError, match="already consumed"):
        engine.register(Consumed())
    # Neither a buffer nor a GPU array.
    with pytest.raises(kvring.InvalidArgumentError, match="__cuda_array_interface__ or __dlpack__"):
        engine.register(object())
    # GPU memory said to be host memory: refused, not copied by a host thread.
    with pytest.raises(kvring.InvalidArgumentError, match="is memory of GPU 0, registered as host memory"):
        engine.register(CudaArray(buffer), location="host")
    with pytest.raises(kvring.InvalidArgumentError, match="not auto, host"):
        engine.register(buffer.ptr, 4096, location="npu:0")
    # A CPU tensor through DLPack (numpy's own producer) is host memory.
    host = np.zeros(4096, dtype=np.uint8)
    assert engine.region_memory(engine.register(DLPackTensor(host))) == "host"
    # The testing helper needs the simulator.
    plain = kvring.Engine()
    with pytest.raises(kvring.InvalidArgumentError, match='gpu="sim"'):
        plain.sim_device_buffer(4096)
    plain.close()
    engine.close()


def test_mooncake_classifies_a_gpu_address_as_device_memory_and_moves_it(spawn, monkeypatch, caplog):
    monkeypatch.setenv("KVRING_GPU", GPU)  # this engine's and the peer's provider
    peer = spawn("gpu_peer.py", "--device", "0", "--via", "address")
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") == 0
    tensor = device_buffer(engine._engine, SIZE, 1)  # what tensor.data_ptr() would name
    tensor.write(0, pattern(SIZE, 3).tobytes())
    assert engine.register_memory(tensor.ptr, SIZE) == 0
    assert engine._engine.region_memory(engine._registered[tensor.ptr]) == "gpu:1"
    session = peer.info["addr"]
    assert engine.transfer_sync_write(session, tensor.ptr, peer.info["buffer"], SIZE) == 0
    assert peer.ask(f"digest 0 {SIZE}") == digest(pattern(SIZE, 3))
    assert engine.transfer_sync_read(session, tensor.ptr + 8192, peer.info["buffer"], 4096) == 0
    assert tensor.read(8192, 4096) == pattern(SIZE, 3)[:4096].tobytes()

    # Mooncake's locations: "cuda:N" is checked; "cpu:0" for GPU memory is
    # refused with the reason logged, never registered as host memory.
    caplog.set_level(logging.ERROR, logger="kvring.mooncake")
    other = device_buffer(engine._engine, 4096, 0)
    assert engine.register_memory(other.ptr, 4096, "cpu:0") < 0
    assert "is memory of GPU 0, registered as host memory" in caplog.text
    assert engine.register_memory(other.ptr, 4096, "cuda:1") < 0
    assert engine.register_memory(other.ptr, 4096, "cuda:0") == 0
    engine.close()


def test_the_lmdeploy_backend_migrates_gpu_caches_over_nvlink(spawn):
    prefill = spawn("gpu_peer.py", "--device", "1", "--lmdeploy")
    backend = KvringMigrationBackend(protocol="nvlink", engine=kvring.Engine(gpu=GPU))
    cache = device_buffer(backend.engine, SIZE, 0)
    backend.register_memory_region({"mr_key": 0, "addr": cache.ptr, "offset": 0, "length": SIZE})
    region = backend.engine.locate(cache.ptr, SIZE)[0]
    assert backend.engine.region_memory(region) == "gpu:0", "a GPU cache registers as device memory"
    backend.p2p_initialize({"remote_engine_id": "prefill-0", "protocol": "NVLINK"})
    backend.p2p_connect("prefill-0", {"endpoint_info": json.dumps(prefill.info)})
    block = 16 << 10
    ranges = [(3, 0), (7, 1), (8, 2)]
    moved = backend.p2p_migrate(
        {
            "remote_engine_id": "prefill-0",
            "batch": [
                {"mr_key": 0, "target_offset": src * block, "source_offset": dst * block, "length": block}
                for src, dst in ranges
            ],
        }
    )
    assert moved == 3 * block
    source = pattern(SIZE, 21)
    for src, dst in ranges:
        assert cache.read(dst * block, block) == source[src * block : (src + 1) * block].tobytes()
    backend.engine.close()


def test_mooncakes_on_cuda_transfers_wait_for_the_stream_and_move_device_memory(spawn, monkeypatch, caplog):
    monkeypatch.setenv("KVRING_GPU", GPU)
    peer = spawn("gpu_peer.py", "--device", "0", "--via", "address")
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") == 0
    tensor = device_buffer(engine.get_engine(), SIZE, 1)
    tensor.write(0, pattern(SIZE, 4).tobytes())
    assert engine.register_memory(tensor.ptr, SIZE) == 0
    session, theirs = peer.info["addr"], peer.info["buffer"]
    # Stream 0: the buffer's GPU's default stream (nothing of the caller's queued).
    assert engine.transfer_write_on_cuda(session, tensor.ptr, theirs, SIZE) is None
    assert peer.ask(f"digest 0 {SIZE}") == digest(pattern(SIZE, 4))
    assert engine.batch_transfer_read_on_cuda(session, [tensor.ptr + 4096, tensor.ptr + 8192], [theirs, theirs + 4096], [4096, 4096], 0) is None
    assert tensor.read(4096, 8192) == pattern(SIZE, 4)[:8192].tobytes()
    assert engine.batch_transfer_write_on_cuda(session, [tensor.ptr], [theirs + 65536], [4096], stream_ptr=0) is None
    assert engine.transfer_read_on_cuda(session, tensor.ptr, theirs + 65536, 4096, 0) is None
    # Mooncake raises here (its host callback cannot return a code): so does kvring.
    caplog.set_level(logging.ERROR, logger="kvring.mooncake")
    # The simulator knows its streams; the driver finds a stream's context
    # (cuStreamGetCtx), and the fake refuses a handle it never made.
    not_a_stream = "not a stream of this process" if GPU == "sim" else "caller stream's context: CUDA_ERROR_INVALID_HANDLE"
    with pytest.raises(RuntimeError, match=not_a_stream):
        engine.transfer_write_on_cuda(session, tensor.ptr, theirs, 4096, stream_ptr=0xDEAD)
    with pytest.raises(RuntimeError, match="127.0.0.1:1"):
        engine.transfer_write_on_cuda("127.0.0.1:1", tensor.ptr, theirs, 4096)
    with pytest.raises(RuntimeError, match="local addresses, 1 remote"):
        engine.batch_transfer_write_on_cuda(session, [tensor.ptr, tensor.ptr], [theirs], [16])
    assert "transfer_write_on_cuda" in caplog.text
    engine.close()


def test_a_nixl_agent_moves_vram_tensors_between_two_processes(spawn, monkeypatch):
    from conftest import TorchLike
    from kvring.nixl import nixl_agent

    monkeypatch.setenv("KVRING_GPU", GPU)
    peer = spawn("gpu_peer.py", "--device", "1", "--nixl")
    agent = nixl_agent("decode")
    memory = device_buffer(agent._engine, SIZE, 0)
    memory.write(0, pattern(SIZE, 6).tobytes())
    tensor = TorchLike(memory, 0)
    reg = agent.register_memory([tensor])  # a CUDA tensor: VRAM, GPU 0
    assert reg.getType() == "VRAM" and reg[0][:3] == (memory.ptr, SIZE, 0)
    assert agent.add_remote_agent(bytes.fromhex(peer.info["metadata"])) == b"gpu-peer"
    remote = agent.deserialize_descs(bytes.fromhex(peer.info["descs"]))
    assert remote.getType() == "VRAM" and remote[0][2] == 1
    # Row tensors of ours against the same rows of theirs.
    rows = tensor.rows(4)
    local = agent.get_xfer_descs(rows)
    theirs = agent.get_xfer_descs([(remote[0][0] + i * (SIZE // 4), SIZE // 4, 1) for i in range(4)], "VRAM")
    handle = agent.initialize_xfer("WRITE", local, theirs, "gpu-peer", b"vram-done")
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    assert state == "DONE", handle.error
    assert peer.ask(f"digest 0 {SIZE}") == digest(pattern(SIZE, 6))
    assert peer.ask("notifs") == {"decode": ["vram-done"]}
    # Host memory listed as VRAM is refused, saying so.
    host = np.zeros(4096, dtype=np.uint8)
    agent.register_memory([(host.ctypes.data, 4096, 0, "")], "DRAM")
    with pytest.raises(kvring.InvalidArgumentError, match="is host memory, listed as VRAM"):
        agent.prep_xfer_dlist("", [(host.ctypes.data, 4096, 0)], "VRAM")
    agent.release_xfer_handle(handle)
    agent.remove_remote_agent("gpu-peer")


def test_wait_gpu_stream_waits_on_a_callers_stream_and_refuses_without_a_gpu():
    engine = kvring.Engine(gpu=GPU)
    engine.register(CudaArray(device_buffer(engine, 4096, device=0)))
    engine.wait_gpu_stream(0, 0, timeout=5.0)  # the device's default stream: nothing queued
    engine.close()
    if GPU == "sim":
        plain = kvring.Engine(gpu=None)
        with pytest.raises(kvring.errors.InvalidArgumentError, match="no GPU provider"):
            plain.wait_gpu_stream(0, 0, timeout=1.0)
        plain.close()
        return
    # The driver is loaded here: a process that sees no GPU has no provider.
    refused = subprocess.run(
        [sys.executable, "-c", NO_GPU_WAIT],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 0 and "no GPU provider" in refused.stdout, refused.stdout + refused.stderr


NO_GPU_WAIT = """
import kvring
plain = kvring.Engine(gpu=None)
try:
    plain.wait_gpu_stream(0, 0, timeout=1.0)
except kvring.errors.InvalidArgumentError as error:
    print(error)
plain.close()
"""

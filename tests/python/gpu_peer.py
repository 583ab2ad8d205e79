"""A second process for the GPU suites: a kvring engine on the simulated GPU
(or the CUDA driver with TEST_GPU_PROVIDER=cuda, conftest's GPU) holding one
device buffer, answering commands on stdin, one per line, with
one JSON line each.

    python gpu_peer.py [--device N] [--size N] [--via dlpack|cai|address] [--lmdeploy | --nixl]

Prints {"addr", "buffer", "region", "size", "memory"} once ready (with
--lmdeploy, an LMDeploy backend's endpoint info instead, its buffer filled
with pattern 21; with --nixl, a kvring.nixl agent "gpu-peer"'s metadata and
serialized VRAM descriptors, hex). Commands: fill SEED | digest OFFSET LEN |
notifs (a nixl agent's new notifications) | exit.
"""

import argparse
import hashlib
import json
import os

import kvring
from conftest import GPU, CudaArray, DLPackTensor, TorchLike, device_buffer, pattern
from kvring.lmdeploy import KvringMigrationBackend
from peer_commands import answer_commands


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument("--via", choices=["dlpack", "cai", "address"], default="dlpack")
    parser.add_argument("--lmdeploy", action="store_true")
    parser.add_argument("--nixl", action="store_true")
    args = parser.parse_args()

    agent = None
    if args.nixl:
        from kvring.nixl import nixl_agent

        os.environ["KVRING_GPU"] = GPU
        agent = nixl_agent("gpu-peer")
        engine = agent._engine
    else:
        engine = kvring.Engine(gpu=GPU)
    buffer = device_buffer(engine, args.size, args.device)
    if agent is not None:
        descs = agent.register_memory([TorchLike(buffer, args.device)])
        info = {
            "metadata": agent.get_agent_metadata().hex(),
            "descs": agent.get_serialized_descs(descs.trim()).hex(),
            "buffer": buffer.ptr,
        }
        print(json.dumps(info), flush=True)
    elif args.lmdeploy:
        backend = KvringMigrationBackend(protocol="nvlink", engine=engine)
        buffer.write(0, pattern(args.size, 21).tobytes())
        backend.register_memory_region({"mr_key": 0, "addr": buffer.ptr, "offset": 0, "length": args.size})
        backend.p2p_initialize({"remote_engine_id": "decode-0", "protocol": "nvlink"})
        print(json.dumps(backend.endpoint_info("decode-0", "nvlink")), flush=True)
    else:
        memory = {"dlpack": DLPackTensor(buffer), "cai": CudaArray(buffer), "address": buffer.ptr}[args.via]
        region = engine.register(memory, args.size if args.via == "address" else None)
        info = {
            "addr": engine.control_addr,
            "buffer": buffer.ptr,
            "region": region,
            "size": args.size,
            "memory": engine.region_memory(region),
        }
        print(json.dumps(info), flush=True)

    def fill(seed):
        buffer.write(0, pattern(args.size, int(seed)).tobytes())
        return "ok"

    def digest(offset, length):
        return hashlib.sha256(buffer.read(int(offset), int(length))).hexdigest()

    def notifs():
        return {k: [m.decode() for m in v] for k, v in agent.get_new_notifs().items()}

    answer_commands({"fill": fill, "digest": digest, "notifs": notifs})
    engine.close()


if __name__ == "__main__":
    main()

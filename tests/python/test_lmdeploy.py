"""kvring.lmdeploy: LMDeploy's five migration operations across two
processes, with LMDeploy-shaped request objects and with plain dicts."""

import enum
import json
from dataclasses import dataclass, field
from typing import List

import numpy as np
import pytest

import kvring
from kvring.lmdeploy import KvringMigrationBackend


class MigrationProtocol(enum.Enum):
    """Shaped like lmdeploy.pytorch.disagg.conn.protocol.MigrationProtocol."""

    TCP = 1
    RDMA = 2
    NVLINK = 3


@dataclass
class DistServeInitRequest:
    remote_engine_id: str
    protocol: MigrationProtocol
    local_engine_id: str = "decode-0"


@dataclass
class DistServeRegisterMRMessage:
    protocol: MigrationProtocol
    remote_engine_id: str
    mr_key: int
    addr: int
    offset: int
    length: int


@dataclass
class DistServeKVTransferEndpointInfo:
    protocol: MigrationProtocol
    endpoint_info: str


@dataclass
class AssignmentInstruct:
    mr_key: int
    target_offset: int
    source_offset: int
    length: int


@dataclass
class MigrationAssignment:
    protocol: MigrationProtocol
    remote_engine_id: str
    batch: List[AssignmentInstruct] = field(default_factory=list)


def prefill_pattern():
    return np.random.default_rng(21).integers(0, 256, 1 << 20, dtype=np.uint8)


def test_decode_migrates_block_ranges_from_a_prefill_process(spawn):
    prefill = spawn("lmdeploy_peer.py")
    endpoint = prefill.info
    backend = KvringMigrationBackend(protocol=MigrationProtocol.TCP)
    cache = np.zeros(1 << 20, dtype=np.uint8)
    backend.register_memory_region(
        DistServeRegisterMRMessage(MigrationProtocol.TCP, "prefill-0", 0, cache.ctypes.data, 0, cache.nbytes)
    )
    backend.p2p_initialize(DistServeInitRequest("prefill-0", MigrationProtocol.TCP))
    mine = backend.endpoint_info("prefill-0", MigrationProtocol.TCP)
    assert mine["address"] == backend.engine.control_addr and "0" in mine["mrs"]
    backend.p2p_connect("prefill-0", DistServeKVTransferEndpointInfo(MigrationProtocol.TCP, json.dumps(endpoint)))

    # Blocks 3, 7 and 8 of the prefill cache into 0, 1, 2 of ours.
    block = 16 << 10
    ranges = [(3, 0), (7, 1), (8, 2)]
    moved = backend.p2p_migrate(
        MigrationAssignment(
            MigrationProtocol.TCP,
            "prefill-0",
            [AssignmentInstruct(0, dst * block, src * block, block) for src, dst in ranges],
        )
    )
    assert moved == 3 * block
    source = prefill_pattern()
    for src, dst in ranges:
        assert np.array_equal(cache[dst * block : (dst + 1) * block], source[src * block : (src + 1) * block])

    # Plain dicts work the same.
    moved = backend.p2p_migrate(
        {"remote_engine_id": "prefill-0", "batch": [{"mr_key": 0, "target_offset": 0, "source_offset": 0, "length": 4096}]}
    )
    assert moved == 4096 and np.array_equal(cache[:4096], source[:4096])
    backend.engine.close()


def test_bad_requests_and_missing_transports_fail_early_and_clearly():
    with pytest.raises(kvring.UnsupportedError, match="not built into"):
        KvringMigrationBackend(protocol=MigrationProtocol.RDMA)  # at construction, not at the first transfer
    backend = KvringMigrationBackend()
    with pytest.raises(kvring.UnsupportedError):
        backend.p2p_initialize({"remote_engine_id": "x", "protocol": "carrier-pigeon"})
    with pytest.raises(kvring.InvalidArgumentError, match="remote_engine_id"):
        backend.p2p_initialize({"protocol": "tcp"})
    with pytest.raises(kvring.UnknownSegmentError, match="p2p_initialize"):
        backend.p2p_connect("nobody", {"endpoint_info": {"address": "127.0.0.1:1", "mrs": {}}})
    with pytest.raises(kvring.UnknownSegmentError, match="not connected"):
        backend.p2p_migrate({"remote_engine_id": "nobody", "batch": []})
    cache = np.zeros(4096, dtype=np.uint8)
    backend.register_memory_region({"mr_key": 1, "addr": cache.ctypes.data, "offset": 0, "length": 4096})
    with pytest.raises(kvring.InvalidArgumentError, match="already registered"):
        backend.register_memory_region({"mr_key": 1, "addr": cache.ctypes.data, "offset": 0, "length": 4096})
    backend.engine.close()

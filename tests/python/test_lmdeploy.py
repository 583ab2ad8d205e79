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

    # Blocks 3, 7 and 8 of the prefill cache into 0, 1, 2 of ours: as
    # LMDeploy's cache engine builds them, target_offset is in the peer's
    # (prefill's) region, source_offset in ours.
    block = 16 << 10
    ranges = [(3, 0), (7, 1), (8, 2)]
    moved = backend.p2p_migrate(
        MigrationAssignment(
            MigrationProtocol.TCP,
            "prefill-0",
            [AssignmentInstruct(0, src * block, dst * block, block) for src, dst in ranges],
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
    # At construction, not at the first transfer: this host has no RDMA
    # device (or no libibverbs), and tcp is not taken in its place.
    with pytest.raises(kvring.KvringError, match="rdma device"):
        KvringMigrationBackend(protocol=MigrationProtocol.RDMA)
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
    # The same cache again (LMDeploy registers it once per peer) is fine;
    # another range under the same key is not.
    backend.register_memory_region({"mr_key": 1, "addr": cache.ctypes.data, "offset": 0, "length": 4096})
    with pytest.raises(kvring.InvalidArgumentError, match="already registered"):
        backend.register_memory_region({"mr_key": 1, "addr": cache.ctypes.data, "offset": 0, "length": 2048})
    with pytest.raises(kvring.UnknownSegmentError, match="never initialized"):
        backend.p2p_drop_connect("nobody")
    for call in (backend.store, backend.load):
        with pytest.raises(kvring.UnsupportedError, match="not served"):
            call({"remote_engine_id": "x", "batch": []})
    backend.engine.close()


def test_migrations_are_awaitable_as_lmdeploy_awaits_them_and_links_drop(spawn):
    import asyncio

    prefill = spawn("lmdeploy_peer.py")
    backend = KvringMigrationBackend()
    cache = np.zeros(1 << 20, dtype=np.uint8)
    backend.register_memory_region({"mr_key": 0, "addr": cache.ctypes.data, "offset": 0, "length": cache.nbytes})
    config = {"num_gpu_blocks": 64}
    backend.p2p_initialize({"remote_engine_id": "prefill-0", "protocol": "tcp", "remote_engine_config": config, "rank": 0})
    # LMDeploy's cache engine reads the peer's config from links[...].
    assert backend.links["prefill-0"].remote_engine_config == config
    backend.p2p_connect("prefill-0", {"endpoint_info": json.dumps(prefill.info)})
    assignment = {"remote_engine_id": "prefill-0", "batch": [{"mr_key": 0, "target_offset": 8192, "source_offset": 0, "length": 4096}]}

    async def migrate():
        first = await backend.p2p_migrate(assignment)  # as LMDeploy's cache engine
        second = await backend.p2p_migrate(assignment, async_op=True)  # waits off the loop
        return first, second

    assert asyncio.run(migrate()) == (4096, 4096)
    assert np.array_equal(cache[:4096], prefill_pattern()[8192 : 8192 + 4096])
    backend.p2p_drop_connect("prefill-0")
    with pytest.raises(kvring.UnknownSegmentError, match="not connected"):
        backend.p2p_migrate(assignment)
    backend.engine.close()


def test_in_lmdeploys_registry_driven_by_lmdeploys_own_classes(spawn):
    """Against LMDeploy's PyPI package, where it installs (it needs torch)."""
    import asyncio

    import kvring.lmdeploy as module

    if module.LMDEPLOY_UNAVAILABLE:
        pytest.skip(f"{module.LMDEPLOY_UNAVAILABLE}: the registry test needs LMDeploy's package")
    from lmdeploy.pytorch.disagg.backend.backend import MIGRATION_BACKENDS
    from lmdeploy.pytorch.disagg.backend.base import MigrationBackendImpl
    from lmdeploy.pytorch.disagg.config import DistServeEngineConfig
    from lmdeploy.pytorch.disagg.conn.protocol import DistServeInitRequest, DistServeKVTransferEndpointInfo
    from lmdeploy.pytorch.disagg.conn.protocol import MigrationProtocol as LMProtocol
    from lmdeploy.pytorch.disagg.messages import AssignmentInstruct as LMInstruct
    from lmdeploy.pytorch.disagg.messages import DistServeRegisterMRMessage as LMRegister
    from lmdeploy.pytorch.disagg.messages import MigrationAssignment as LMAssignment

    assert MIGRATION_BACKENDS.module_dict["Kvring"] is KvringMigrationBackend
    assert issubclass(KvringMigrationBackend, MigrationBackendImpl)
    prefill = spawn("lmdeploy_peer.py")
    backend = MIGRATION_BACKENDS.module_dict["Kvring"]()  # as LMDeploy's cache engine builds it
    config = DistServeEngineConfig(
        tp_size=1, ep_size=1, dp_size=1, pp_size=None, dp_rank=0, block_size=16, num_cpu_blocks=0, num_gpu_blocks=64
    )
    backend.p2p_initialize(
        DistServeInitRequest(
            local_engine_id="decode-0",
            local_engine_config=config,
            remote_engine_id="prefill-0",
            remote_engine_config=config,
            protocol=LMProtocol.TCP,
            rank=0,
        )
    )
    cache = np.zeros(1 << 20, dtype=np.uint8)
    backend.register_memory_region(
        LMRegister(protocol=LMProtocol.TCP, remote_engine_id="prefill-0", mr_key=0, addr=cache.ctypes.data, offset=0, length=cache.nbytes)
    )
    backend.p2p_connect("prefill-0", DistServeKVTransferEndpointInfo(protocol=LMProtocol.TCP, endpoint_info=json.dumps(prefill.info)))
    # LMDeploy's cache engine reads the peer's block count here.
    assert backend.links["prefill-0"].remote_engine_config.num_gpu_blocks == 64
    block = 16 << 10
    ranges = [(5, 0), (2, 1)]  # (prefill block, decode block), as LMDeploy pairs them
    assignment = LMAssignment(
        protocol=LMProtocol.TCP,
        remote_engine_id="prefill-0",
        batch=[LMInstruct(mr_key=0, target_offset=src * block, source_offset=dst * block, length=block) for src, dst in ranges],
    )

    async def migrate():
        return await backend.p2p_migrate(assignment)  # LMDeploy awaits it

    assert asyncio.run(migrate()) == 2 * block
    source = prefill_pattern()
    for src, dst in ranges:
        assert np.array_equal(cache[dst * block : (dst + 1) * block], source[src * block : (src + 1) * block])

    # In place of LMDeploy's Mooncake backend (what --migration-backend Mooncake builds).
    original = MIGRATION_BACKENDS.module_dict.get("Mooncake")
    try:
        module.register("Mooncake")
        assert MIGRATION_BACKENDS.module_dict["Mooncake"] is KvringMigrationBackend
    finally:
        if original is not None:
            MIGRATION_BACKENDS.register_module(name="Mooncake", force=True, module=original)
    backend.p2p_drop_connect("prefill-0")
    backend.engine.close()


def test_register_says_why_without_lmdeploy():
    import kvring.lmdeploy as module

    if not module.LMDEPLOY_UNAVAILABLE:
        pytest.skip("LMDeploy is importable here: the registry test above runs instead")
    with pytest.raises(kvring.UnsupportedError, match="LMDeploy"):
        module.register("Mooncake")

"""The peer's KV layout from Python: fetched once per open segment and kept
(a push per layer costs no control round trip, seen in the target's
``kvring_memory_info_served_total``), and fixed once published (a
different second layout raises ``LayoutMismatchError``)."""

import numpy as np
import pytest

import kvring
from conftest import pattern
from kvring import LayoutMismatchError

TOKEN = "python-layout-cache-token"
# Four layers of 8 blocks, one KV head of 64 float32 per token, 16 tokens a
# block: 4 KiB blocks, K and V, layer-major.
LAYERS, BLOCKS, BLOCK_BYTES = 4, 8, 16 * 64 * 4
DIMS = [LAYERS, BLOCKS, 1, 64, 4, 16, 1]
POOL = LAYERS * 2 * BLOCKS * BLOCK_BYTES


def offset(layer, kind, block):
    return ((layer * 2 + kind) * BLOCKS + block) * BLOCK_BYTES


def served(engine):
    for line in engine.metrics_text().splitlines():
        if line.startswith("kvring_memory_info_served_total "):
            return int(line.split()[1])
    raise AssertionError("no kvring_memory_info_served_total in the metrics")


@pytest.fixture
def pair():
    kv, src = np.zeros(POOL, dtype=np.uint8), pattern(POOL, 1)
    decode, prefill = kvring.Engine(name="decode-lc", token=TOKEN), kvring.Engine(name="prefill-lc", token=TOKEN)
    kv_region = decode.register(kv)
    decode.set_kv_layout("mha", DIMS, kv_region)
    prefill.set_kv_layout("mha", DIMS, prefill.register(src))
    assert prefill.open_segment(decode.control_addr, "tcp") == "tcp"
    yield decode, kv_region, kv, prefill, src
    for e in (prefill, decode):
        e.close()


def test_pushes_layer_by_layer_fetch_the_peer_layout_once(pair):
    decode, _, kv, prefill, src = pair
    assert served(decode) == 0
    for layer in range(LAYERS):
        assert prefill.push_layer_tagged(decode.control_addr, layer, 1, [1, 2], [3, 4]) == 2 * 2 * BLOCK_BYTES
        assert prefill.push_layer(decode.control_addr, layer, [5], [6]) == 2 * BLOCK_BYTES
    assert prefill.push_blocks(decode.control_addr, [0], [7]) == LAYERS * 2 * BLOCK_BYTES
    assert served(decode) == 1, "one memory-info fetch for every push to this segment"
    for layer in range(LAYERS):
        for kind in range(2):
            for s, d in [(1, 3), (2, 4), (5, 6), (0, 7)]:
                there = kv[offset(layer, kind, d) : offset(layer, kind, d) + BLOCK_BYTES]
                here = src[offset(layer, kind, s) : offset(layer, kind, s) + BLOCK_BYTES]
                assert np.array_equal(there, here), (layer, kind, s, d)


def test_a_published_layout_is_fixed(pair):
    decode, region, _, prefill, _ = pair
    decode.set_kv_layout("mha", DIMS, region)  # the same again: no change
    with pytest.raises(LayoutMismatchError, match="fixed once published"):
        decode.set_kv_layout("mha", [LAYERS, BLOCKS // 2, 1, 64, 4, 16, 1], region)
    # Peers still get, and push by, the first one.
    assert prefill.push_blocks(decode.control_addr, [1], [BLOCKS - 1]) == LAYERS * 2 * BLOCK_BYTES

"""Fenced destinations from Python: a decode engine fences a request's
blocks and hands the grant to its sender (``fence``); the prefill engine
pushes naming it (``write(..., grant=)``); once the blocks are fenced again
for another request, a push under the old grant raises ``FencedError`` and
nothing of it lands. Bad fences raise their own class."""

import numpy as np
import pytest

import kvring
from conftest import pattern
from kvring import FencedError, OutOfBoundsError

LEN, BLOCK = 1 << 20, 64 * 1024


@pytest.fixture(params=["tcp", "cma"])
def pair(request):
    kv, src = np.zeros(LEN, dtype=np.uint8), pattern(LEN, 1)
    decode, prefill = kvring.Engine(name="decode-fence"), kvring.Engine(name="prefill-fence")
    kv_region, src_region = decode.register(kv), prefill.register(src)
    assert prefill.open_segment(decode.control_addr, request.param) == request.param
    yield decode, kv_region, kv, prefill, src_region, src
    for e in (prefill, decode):
        e.close()


def test_a_push_under_a_stale_grant_raises_fenced_and_lands_nothing(pair):
    decode, kv_region, kv, prefill, src_region, src = pair
    blocks = [(src_region, i * BLOCK, kv_region, i * BLOCK, BLOCK) for i in range(4)]
    old = decode.fence(kv_region, 0, 4 * BLOCK)
    assert prefill.write(decode.control_addr, blocks, grant=old) == 4 * BLOCK
    assert np.array_equal(kv[: 4 * BLOCK], src[: 4 * BLOCK])

    # The request is aborted; its blocks go to another one.
    new = decode.fence(kv_region, 0, 4 * BLOCK)
    assert new > old
    kv[: 4 * BLOCK] = 0xEE
    with pytest.raises(FencedError):
        prefill.write(decode.control_addr, blocks, grant=old)
    with pytest.raises(FencedError):
        prefill.write(decode.control_addr, blocks)
    assert (kv[: 4 * BLOCK] == 0xEE).all()
    assert prefill.write(decode.control_addr, blocks, grant=new) == 4 * BLOCK
    assert np.array_equal(kv[: 4 * BLOCK], src[: 4 * BLOCK])


def test_a_fence_past_the_region_raises_out_of_bounds(pair):
    decode, kv_region, *_ = pair
    with pytest.raises(OutOfBoundsError):
        decode.fence(kv_region, LEN, 1)


# Two layers of 8 blocks, one KV head of 64 float32 per token, 16 tokens a
# block: 4 KiB blocks, K and V, layer-major (as test_arrivals.py).
LAYERS, BLOCKS, BLOCK_BYTES = 2, 8, 16 * 64 * 4
DIMS = [LAYERS, BLOCKS, 1, 64, 4, 16, 1]
POOL = LAYERS * 2 * BLOCKS * BLOCK_BYTES


def kv_offset(layer, kind, block):
    return ((layer * 2 + kind) * BLOCKS + block) * BLOCK_BYTES


def test_kv_blocks_fenced_per_request_refuse_the_old_grant_in_every_layer():
    kv, src = np.zeros(POOL, dtype=np.uint8), pattern(POOL, 3)
    decode, prefill = kvring.Engine(name="decode-kvf"), kvring.Engine(name="prefill-kvf")
    try:
        decode.set_kv_layout("mha", DIMS, decode.register(kv))
        prefill.set_kv_layout("mha", DIMS, prefill.register(src))
        assert prefill.open_segment(decode.control_addr, "tcp") == "tcp"
        old = decode.fence_blocks([2, 3])
        assert prefill.push_blocks(decode.control_addr, [0, 1], [2, 3], grant=old) == 2 * 2 * LAYERS * BLOCK_BYTES
        new = decode.fence_blocks([2, 3])
        before = kv.copy()
        with pytest.raises(FencedError):
            prefill.push_blocks(decode.control_addr, [4, 5], [2, 3], grant=old)
        for layer in range(LAYERS):
            with pytest.raises(FencedError):
                prefill.push_layer(decode.control_addr, layer, [4, 5], [2, 3], grant=old)
        assert np.array_equal(kv, before)
        prefill.push_blocks(decode.control_addr, [4, 5], [2, 3], grant=new)
        for layer in range(LAYERS):
            for kind in (0, 1):
                at, want = kv_offset(layer, kind, 2), kv_offset(layer, kind, 4)
                assert np.array_equal(kv[at : at + 2 * BLOCK_BYTES], src[want : want + 2 * BLOCK_BYTES])
    finally:
        for e in (prefill, decode):
            e.close()

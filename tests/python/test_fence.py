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

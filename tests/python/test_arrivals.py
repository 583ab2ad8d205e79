"""Arrival tags from Python: a decode engine grants a request's layer the
blocks it gave it and waits for their bytes (``grant_arrival``,
``wait_landed`` with a deadline); a prefill engine pushes that layer tagged
(``push_layer_tagged``); grants keyed by the proven sender, and each bad
input raising its own class."""

import threading

import numpy as np
import pytest

import kvring
from conftest import pattern
from kvring import InvalidArgumentError, TransferTimeoutError, UnsupportedError

TOKEN = "python-arrivals-token"
# Two layers of 8 blocks, one KV head of 64 float32 per token, 16 tokens a
# block: 4 KiB blocks, K and V, layer-major.
LAYERS, BLOCKS, BLOCK_BYTES = 2, 8, 16 * 64 * 4
DIMS = [LAYERS, BLOCKS, 1, 64, 4, 16, 1]
POOL = LAYERS * 2 * BLOCKS * BLOCK_BYTES


def offset(layer, kind, block):
    return ((layer * 2 + kind) * BLOCKS + block) * BLOCK_BYTES


def engine(name, memory, token=TOKEN):
    e = kvring.Engine(name=name, token=token)
    region = e.register(memory)
    e.set_kv_layout("mha", DIMS, region)
    return e, region


@pytest.fixture
def pair():
    kv, src, other_src = np.zeros(POOL, dtype=np.uint8), pattern(POOL, 1), pattern(POOL, 2)
    decode, kv_region = engine("decode-py", kv)
    prefill, _ = engine("prefill-py", src)
    other, _ = engine("prefill-other", other_src)
    for e in (prefill, other):
        assert e.open_segment(decode.control_addr, "tcp") == "tcp"
    yield decode, kv_region, kv, prefill, src, other
    for e in (prefill, other, decode):
        e.close()


def test_a_tagged_layer_push_is_waited_for_by_its_bytes(pair):
    decode, region, kv, prefill, src, _ = pair
    tag = kvring.arrival_tag(7, 1)
    assert tag == 7 << 12 | 1
    # Request slot 7 was given blocks 2 and 3; prefill's are 0 and 1.
    ranges = [(region, offset(1, kind, block), BLOCK_BYTES) for kind in (0, 1) for block in (2, 3)]
    decode.grant_arrival(tag, ranges, sender="prefill-py")
    with pytest.raises(TransferTimeoutError):
        decode.wait_landed(tag, 4 * BLOCK_BYTES, timeout=0.05, sender="prefill-py")

    # The push runs on another thread while decode waits (the GIL and the
    # engine are released during the wait).
    moved = {}
    pusher = threading.Thread(
        target=lambda: moved.setdefault("bytes", prefill.push_layer_tagged(decode.control_addr, 1, 7, [0, 1], [2, 3]))
    )
    pusher.start()
    decode.wait_landed(tag, 4 * BLOCK_BYTES, timeout=10.0, sender="prefill-py")
    pusher.join(10.0)
    assert moved["bytes"] == 4 * BLOCK_BYTES
    assert decode.landed(tag, sender="prefill-py") == 4 * BLOCK_BYTES
    for kind in (0, 1):
        for mine, theirs in ((0, 2), (1, 3)):
            at, want = offset(1, kind, theirs), offset(1, kind, mine)
            assert np.array_equal(kv[at : at + BLOCK_BYTES], src[want : want + BLOCK_BYTES])
    assert decode.forget_arrival(tag, sender="prefill-py") == 4 * BLOCK_BYTES
    assert decode.landed(tag, sender="prefill-py") == 0


def test_another_sender_under_the_same_tag_counts_nothing_for_the_granted_one(pair):
    decode, region, _, prefill, _, other = pair
    tag = kvring.arrival_tag(9, 0)
    ranges = [(region, offset(0, kind, 4), BLOCK_BYTES) for kind in (0, 1)]
    decode.grant_arrival(tag, ranges, sender="prefill-py")
    # Another proven engine pushes the same blocks under the same tag.
    assert other.push_layer_tagged(decode.control_addr, 0, 9, [0], [4]) == 2 * BLOCK_BYTES
    assert decode.landed(tag, sender="prefill-py") == 0
    with pytest.raises(TransferTimeoutError):
        decode.wait_landed(tag, 2 * BLOCK_BYTES, timeout=0.05, sender="prefill-py")
    prefill.push_layer_tagged(decode.control_addr, 0, 9, [0], [4])
    decode.wait_landed(tag, 2 * BLOCK_BYTES, timeout=10.0, sender="prefill-py")
    # Both may be granted one tag, each counted apart.
    decode.grant_arrival(tag, ranges, sender="prefill-other")
    assert decode.landed(tag, sender="prefill-other") == 0
    decode.forget_arrival(tag)


def test_bad_input_raises_its_own_class(pair):
    decode, region, _, prefill, _, _ = pair
    tag = kvring.arrival_tag(3, 0)
    decode.grant_arrival(tag, [(region, 0, BLOCK_BYTES)])
    with pytest.raises(InvalidArgumentError, match="granted already"):
        decode.grant_arrival(tag, [(region, 0, BLOCK_BYTES)])
    with pytest.raises(InvalidArgumentError, match="granted already"):
        decode.grant_arrival(tag, [(region, 0, BLOCK_BYTES)], sender="prefill-py")
    with pytest.raises(InvalidArgumentError):
        decode.grant_arrival(0, [(region, 0, BLOCK_BYTES)])
    with pytest.raises(InvalidArgumentError, match="request slot"):
        kvring.arrival_tag(0, 1)
    with pytest.raises(InvalidArgumentError, match="layer"):
        kvring.arrival_tag(1, 4096)
    with pytest.raises(kvring.KvringError, match="layer"):
        prefill.push_layer_tagged(decode.control_addr, LAYERS, 3, [0], [0])  # no such layer
    with pytest.raises(ValueError):
        decode.wait_landed(tag, 1, timeout=-1.0)
    plain = kvring.Engine(name="untokened", token=None)
    try:
        memory = np.zeros(4096, dtype=np.uint8)
        mine = plain.register(memory)
        with pytest.raises(UnsupportedError, match="token"):
            plain.grant_arrival(5, [(mine, 0, 4096)], sender="prefill-py")
    finally:
        plain.close()


def test_a_tagged_push_over_a_link_that_cannot_count_it_is_refused():
    kv, src = np.zeros(POOL, dtype=np.uint8), pattern(POOL, 3)
    decode, _ = engine("decode-cma", kv, token=None)
    prefill, _ = engine("prefill-cma", src, token=None)
    try:
        assert prefill.open_segment(decode.control_addr, "cma") == "cma"
        with pytest.raises(UnsupportedError, match="cannot count"):
            prefill.push_layer_tagged(decode.control_addr, 0, 1, [0], [0])
    finally:
        prefill.close()
        decode.close()

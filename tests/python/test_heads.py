"""Head-sliced pushes from Python: an MHA/GQA cache across tensor-parallel
sizes (``push_layer_heads_tagged``, routed by ``kvring.push_targets``),
over tcp between engines of this process; every byte of every
destination block checked against the source head it must hold."""

import numpy as np
import pytest

import kvring
from conftest import pattern
from kvring import LayoutMismatchError

TOKEN = "python-heads-token"
# Two layers of 6 blocks, 2 KV heads of 16 float32 per token, 16 tokens a
# block, head-major inside a block ([heads, tokens, head_dim], "hnd").
LAYERS, BLOCKS, KV_HEADS, HEAD_DIM, TOKENS = 2, 6, 2, 16, 16
HEAD_BYTES = HEAD_DIM * 4
HEADS = (KV_HEADS, HEAD_BYTES, TOKENS, "hnd")
RUN = TOKENS * HEAD_BYTES  # one head of one block


def block_bytes(tp):
    return KV_HEADS // tp * RUN


def offset(tp, layer, kind, block):
    return ((layer * 2 + kind) * BLOCKS + block) * block_bytes(tp)


def engine(name, tp, memory):
    e = kvring.Engine(name=name, token=TOKEN)
    region = e.register(memory)
    e.set_kv_layout("mha", [LAYERS, BLOCKS, KV_HEADS, HEAD_DIM, 4, TOKENS, tp], region)
    return e


def pool(tp, seed=None):
    size = LAYERS * 2 * BLOCKS * block_bytes(tp)
    return np.zeros(size, dtype=np.uint8) if seed is None else pattern(size, seed)


def test_routing_follows_the_heads():
    assert kvring.push_targets(0, 2, 1, kv_heads=2) == [0]
    assert kvring.push_targets(1, 2, 1, kv_heads=2) == [0]
    assert kvring.push_targets(0, 1, 2, kv_heads=2) == [0, 1]
    assert kvring.push_targets(0, 1, 2) == [0, 1]  # MLA: d % src_tp
    assert kvring.check_pd_topo((1, 2, 0, 0), (1, 1, 0, 0), "push", "mha")[0] == "heterogeneous"
    with pytest.raises(kvring.InvalidArgumentError, match="do not split evenly"):
        kvring.push_targets(0, 4, 1, kv_heads=6)


def test_tp2_into_tp1_each_source_fills_its_head_of_every_block():
    kv = pool(1)
    decode = engine("decode-heads", 1, kv)
    sources = [pool(2, seed=10 + r) for r in range(2)]
    prefills = [engine(f"prefill-heads-{r}", 2, sources[r]) for r in range(2)]
    try:
        for r, prefill in enumerate(prefills):
            assert prefill.open_segment(decode.control_addr, "tcp") == "tcp"
            moved = prefill.push_layer_heads_tagged(
                decode.control_addr, 1, 3, [0, 1], [4, 2], HEADS, src=(2, r), dst=(1, 0), timeout=10.0
            )
            assert moved == 2 * 2 * RUN  # 2 blocks x K and V x one head
        for kind in (0, 1):
            for mine, theirs in ((0, 4), (1, 2)):
                for r in range(2):
                    at = offset(1, 1, kind, theirs) + r * RUN
                    src = offset(2, 1, kind, mine)
                    assert np.array_equal(kv[at : at + RUN], sources[r][src : src + RUN]), (kind, mine, r)
        # Nothing else was written: layer 0 and the other blocks are zero.
        written = np.zeros(kv.size, dtype=bool)
        for kind in (0, 1):
            for block in (4, 2):
                at = offset(1, 1, kind, block)
                written[at : at + block_bytes(1)] = True
        assert not kv[~written].any()
    finally:
        for e in prefills + [decode]:
            e.close()


def test_tp1_into_tp2_each_destination_gets_its_half():
    src = pool(1, seed=20)
    prefill = engine("prefill-heads-full", 1, src)
    kvs = [pool(2) for _ in range(2)]
    decodes = [engine(f"decode-heads-{d}", 2, kvs[d]) for d in range(2)]
    try:
        for d, decode in enumerate(decodes):
            prefill.open_segment(decode.control_addr, "tcp")
            prefill.push_layer_heads_tagged(decode.control_addr, 0, 1, [3], [5], HEADS, src=(1, 0), dst=(2, d))
            for kind in (0, 1):
                at, want = offset(2, 0, kind, 5), offset(1, 0, kind, 3) + d * RUN
                assert np.array_equal(kvs[d][at : at + RUN], src[want : want + RUN])
        # A geometry that does not match the layouts is refused before anything moves.
        with pytest.raises(LayoutMismatchError, match="heads"):
            prefill.push_layer_heads_tagged(
                decodes[0].control_addr, 0, 1, [3], [5], (KV_HEADS, 2 * HEAD_BYTES, TOKENS, "hnd"), (1, 0), (2, 0)
            )
        with pytest.raises(ValueError, match="order"):
            prefill.push_layer_heads_tagged(decodes[0].control_addr, 0, 1, [3], [5], (2, 64, 16, "thd"), (1, 0), (2, 0))
    finally:
        for e in [prefill] + decodes:
            e.close()

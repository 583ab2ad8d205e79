"""kvring.nixl's descriptor lists at vLLM's size: a list of 65,536
(addr, len, dev_id) tuples (what vLLM's NixlConnector builds on each
handshake) is checked and packed as a whole, and a bad row anywhere in it
is named as before, whichever path (native, numpy, row by row) sees it."""

import numpy as np
import pytest

from kvring.errors import InvalidArgumentError
from kvring.nixl import _descs, nixlRegDList, nixlXferDList

COUNT = 65536
BASE = 0x7F00_0000_0000


def _rows(count=COUNT):
    return [(BASE + i * 4096, 4096, i % 4) for i in range(count)]


def test_a_large_tuple_list_packs_into_one_uint64_array_with_every_row():
    rows = _rows()
    dlist = _descs.build(nixlXferDList, rows, "DRAM")
    assert isinstance(dlist._rows, np.ndarray) and dlist._rows.dtype == np.uint64
    assert dlist._rows.shape == (COUNT, 3)
    assert len(dlist) == COUNT and dlist[0] == rows[0] and dlist[-1] == rows[-1]
    assert list(dlist) == rows
    assert dlist.addrs() == [r[0] for r in rows] and dlist.lengths() == [4096] * COUNT
    # The same list through numpy (rows of numpy ints) and as an array.
    as_array = np.array(rows, dtype=np.uint64)
    assert _descs.build(nixlXferDList, as_array, "DRAM") == dlist
    assert _descs.build(nixlXferDList, [tuple(r) for r in as_array], "DRAM") == dlist
    assert _descs.deserialize(_descs.serialize(dlist)) == dlist


def test_registration_rows_keep_their_metas():
    rows = [(BASE + i * 4096, 4096, 0, "m%d" % i if i % 2 else b"") for i in range(1000)]
    dlist = _descs.build(nixlRegDList, rows, "DRAM")
    assert dlist[1] == rows[1] and dlist[2] == rows[2]
    assert dlist.trim() == _descs.build(nixlXferDList, [r[:3] for r in rows], "DRAM")
    back = _descs.deserialize(_descs.serialize(dlist))
    assert [d[:3] for d in back] == [r[:3] for r in rows]
    assert [d[3] for d in back][:3] == ["", "m1", ""]


@pytest.mark.parametrize(
    "bad, says",
    [
        ((1, 2, -1), "must be ints >= 0"),
        ((1, 2, True), "must be ints >= 0"),
        ((1.0, 2, 3), "must be ints >= 0"),
        ((1, 2, 2**64), "must be ints >= 0"),
        ((np.int64(-5), 2, 3), "must be ints >= 0"),
        ((1, 2), "has 2 fields, 3 needed"),
        ((1, 2, 3, "meta"), "has 4 fields, 3 needed"),
        ((None, 2, 3), "must be ints >= 0"),
    ],
)
def test_a_bad_row_deep_in_a_large_list_is_named(bad, says):
    rows = _rows()
    rows[40000] = bad
    with pytest.raises(InvalidArgumentError, match=f"descriptor 40000.*{says}|descriptor 40000 {says}"):
        _descs.build(nixlXferDList, rows, "DRAM")


def test_a_bad_meta_and_a_negative_numpy_row_are_named():
    rows = [(BASE, 4096, 0, "")] * 10
    rows[7] = (BASE, 4096, 0, 5)
    with pytest.raises(InvalidArgumentError, match="descriptor 7: meta must be str or bytes"):
        _descs.build(nixlRegDList, rows, "DRAM")
    array = np.array(_rows(100), dtype=np.int64)
    array[42, 1] = -1
    with pytest.raises(InvalidArgumentError, match="descriptor 42"):
        _descs.build(nixlXferDList, array, "DRAM")
    with pytest.raises(InvalidArgumentError, match="dtype float64"):
        _descs.build(nixlXferDList, np.zeros((4, 3)), "DRAM")


def test_a_list_is_edited_as_nixls_is():
    dlist = _descs.build(nixlXferDList, _rows(3), "DRAM")
    dlist.addDesc((1, 2, 3))
    assert len(dlist) == 4 and dlist[3] == (1, 2, 3)
    dlist.remDesc(0)
    assert dlist[0] == _rows(3)[1]
    with pytest.raises(InvalidArgumentError):
        dlist.addDesc((1, 2, -3))
    dlist.clear()
    assert dlist.isEmpty() and dlist.descCount() == 0

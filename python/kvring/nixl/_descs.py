"""NIXL's descriptor lists, and turning what NIXL's users pass into them.

A registration list (``nixlRegDList``) holds ``(addr, len, dev_id, meta)``
tuples; a transfer list (``nixlXferDList``) ``(addr, len, dev_id)``. Both
carry a memory type: "DRAM" (host memory; also "cpu"), "VRAM" (GPU
memory; also "cuda") or "FILE" (file bytes, for the POSIX backend:
``(offset, len, fd[, path])``). What becomes a list, as in NIXL's ``_api.py``:

- a list of tuples, with a memory type;
- an N x 3 numpy array of (addr, len, dev_id) rows, with a memory type;
- a torch tensor, or a list of them (CPU tensors are DRAM, CUDA ones
  VRAM, ``get_device()`` the id): read through ``data_ptr()``,
  ``numel()``, ``element_size()``, ``device`` and ``is_contiguous()``,
  without importing torch;
- a list already made, passed along.

Anything else, a memory type kvring does not move ("BLOCK", "OBJ") or an unknown one raises ``InvalidArgumentError`` saying why; NIXL
prints and returns None there, which fails later and further away.

A list keeps its rows as one (N, 3) ``uint64`` numpy array (and, for a
registration list, its metas), never as N Python tuples: vLLM's
NixlConnector passes every block of every layer (65,536 rows and more) on
each handshake, and its side channel waits on it. A list of exact tuples of
exact ints is checked and packed by the native module in one pass; other
sequences by numpy, as a whole; any row in doubt is then checked row by
row, which names it (``benches/nixl_descs.py`` times it beside NIXL's).
numpy is needed, as NIXL's own ``_api`` needs it.

``serialize`` / ``deserialize`` give a fixed binary form (no pickle: bytes
from a peer never run code here).
"""

import struct
from itertools import chain
from operator import itemgetter

import numpy as np

from .. import _native
from ..errors import InvalidArgumentError, UnsupportedError
from ._errors import UnknownKeyError

# NIXL's names for memory kinds -> kvring's: "DRAM" host, "VRAM" GPU.
_MEM_TYPES = {"DRAM": "DRAM", "cpu": "DRAM", "VRAM": "VRAM", "cuda": "VRAM", "FILE": "FILE"}
# NIXL's storage kinds kvring does not move (files it does: POSIX).
_STORAGE = ("BLOCK", "BLK", "OBJ")
# serialize's memory type byte.
_MEM_CODES = {"DRAM": 0, "VRAM": 1, "FILE": 2}
_MEM_NAMES = {code: name for name, code in _MEM_CODES.items()}

_MAGIC = b"KVRNXDL1"
_HEADER = struct.Struct("<8sBBI")  # magic, kind (0 reg, 1 xfer), memory type (_MEM_CODES), count
_ENTRY = struct.Struct("<QQQI")  # addr, len, dev_id, meta length
_MAX_SERIALIZED_DESCS = 1 << 24


def mem_type(name):
    """NIXL's memory type name -> "DRAM", "VRAM" or "FILE", or a clear error."""
    if name in _MEM_TYPES:
        return _MEM_TYPES[name]
    if name in _STORAGE:
        raise UnsupportedError(f"memory type {name!r}: kvring moves host (DRAM) and GPU (VRAM) memory and files (FILE), not block devices or objects")
    raise UnknownKeyError(f"unknown memory type {name!r}: use \"DRAM\" (or \"cpu\"), \"VRAM\" (or \"cuda\") or \"FILE\"")


class _DList:
    """A descriptor list: a memory type, an (N, 3) ``uint64`` array of
    (addr, len, dev_id) rows and, for a registration list, N metas.

    The rows are kept as one array, not as N Python tuples: vLLM builds
    lists of every block of every layer (65,536 descriptors and more) on
    each handshake, and ``prep_xfer_dlist`` reads the addresses and lengths
    back as two columns."""

    __slots__ = ("_mem", "_rows", "_metas")
    _width = 3

    def __init__(self, mem, descs=()):
        self._mem = mem_type(mem) if mem not in ("DRAM", "VRAM", "FILE") else mem
        self._rows, self._metas = _pack(descs, self._width)

    @classmethod
    def _of(cls, mem, rows, metas=None):
        """A list over rows already checked (an (N, 3) uint64 array)."""
        dlist = cls.__new__(cls)
        dlist._mem = mem
        dlist._rows = rows
        dlist._metas = (metas if metas is not None else [""] * len(rows)) if cls._width == 4 else None
        return dlist

    def getType(self):
        """The memory type: "DRAM", "VRAM" or "FILE"."""
        return self._mem

    mem_type = property(getType)

    def descCount(self):
        """How many descriptors."""
        return len(self._rows)

    def isEmpty(self):
        """True when it holds none."""
        return len(self._rows) == 0

    def addrs(self):
        """Every descriptor's address, as a list of ints."""
        return self._rows[:, 0].tolist()

    def lengths(self):
        """Every descriptor's length, as a list of ints."""
        return self._rows[:, 1].tolist()

    def __len__(self):
        return len(self._rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self._rows)))]
        row = tuple(self._rows[index].tolist())
        return row + (self._metas[index],) if self._metas is not None else row

    def __iter__(self):
        rows = map(tuple, self._rows.tolist())
        if self._metas is None:
            return rows
        return (row + (meta,) for row, meta in zip(rows, self._metas))

    def __eq__(self, other):
        return (
            type(other) is type(self)
            and other._mem == self._mem
            and np.array_equal(other._rows, self._rows)
            and other._metas == self._metas
        )

    __hash__ = None  # mutable (addDesc, remDesc, clear), as NIXL's

    def addDesc(self, desc):  # noqa: N802  (NIXL's name)
        """Appends one descriptor (checked as the constructor checks)."""
        row, meta = _pack([_checked(tuple(desc), self._width, len(self._rows))], self._width)
        self._rows = np.concatenate((self._rows, row))
        if self._metas is not None:
            self._metas = self._metas + meta

    def remDesc(self, index):  # noqa: N802  (NIXL's name)
        """Removes descriptor ``index``."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self._rows):
            raise InvalidArgumentError(f"descriptor index {index!r} is past a list of {len(self._rows)}")
        self._rows = np.delete(self._rows, index, axis=0)
        if self._metas is not None:
            self._metas = self._metas[:index] + self._metas[index + 1 :]

    def clear(self):
        """Removes every descriptor."""
        self._rows = _EMPTY
        self._metas = [] if self._metas is not None else None

    def print(self):
        """Prints the list (NIXL's debugging aid)."""
        print(repr(self))

    def __repr__(self):
        return f"{type(self).__name__}({self._mem}, {list(self)!r})"

    def __getstate__(self):
        return (self._mem, tuple(self))

    def __setstate__(self, state):
        self._mem = state[0]
        self._rows, self._metas = _pack(state[1], self._width)


class nixlXferDList(_DList):  # noqa: N801  (NIXL's name)
    """A transfer descriptor list: (addr, len, dev_id) each."""

    __slots__ = ()


class nixlRegDList(_DList):  # noqa: N801  (NIXL's name)
    """A registration descriptor list: (addr, len, dev_id, meta) each."""

    __slots__ = ()
    _width = 4

    def trim(self):
        """The same memory as a transfer list (meta dropped), as NIXL's."""
        return nixlXferDList._of(self._mem, self._rows)


_EMPTY = np.zeros((0, 3), dtype=np.uint64)
_EMPTY.flags.writeable = False


def _ints(types):
    """True when every element type is an integer one a row may hold:
    Python's int or numpy's integer scalars (rows read back from an
    array). bool (an int subclass), floats, str, None and the rest go
    through `_checked`, which names them."""
    return all(t is int or issubclass(t, np.integer) for t in types)


def _pack(descs, width):
    """``descs`` (a sequence of ``width``-field rows) as an (N, 3) uint64
    array and, for ``width`` 4, a list of metas; the errors of `_checked`
    for bad input.

    The common input, rows of exact ints (vLLM's 65,536), is checked as a
    whole: every row's width, the set of element types, the conversion to
    an array and its sign run in C. Any doubt falls back to checking row
    by row, which names the bad row."""
    if isinstance(descs, (list, tuple)) and descs:
        packed = _pack_fast(descs, width)
        if packed is not None:
            return packed
    checked = [_checked(tuple(d), width, i) for i, d in enumerate(descs)]
    if not checked:
        return _EMPTY, ([] if width == 4 else None)
    rows = np.array([d[:3] for d in checked], dtype=np.uint64)
    return rows, ([d[3] for d in checked] if width == 4 else None)


def _pack_fast(descs, width):
    """`_pack` for well-formed rows, or None where anything is in doubt.

    A list of exact tuples of exact ints is packed by the native module in
    one pass (no Python object per row); other sequences by numpy: the
    widths, the element types, the conversion and the sign checked as a
    whole."""
    packed = _native_pack(descs, width) if _native_pack is not None else None
    if packed is not None:
        rows = np.frombuffer(packed, dtype=np.uint64).reshape(len(descs), 3)
        return rows, (list(map(_META, descs)) if width == 4 else None)
    try:
        if set(map(len, descs)) != {width}:
            return None
    except TypeError:  # a row with no length
        return None
    numbers = descs if width == 3 else list(map(_FIRST_THREE, descs))
    metas = list(map(_META, descs)) if width == 4 else None
    if not _ints(set(map(type, chain.from_iterable(numbers)))):
        return None
    if metas is not None and not set(map(type, metas)) <= _META_TYPES:
        return None
    try:
        # As int64 first (the element types are ints, so nothing is
        # truncated), its sign checked below: a cast straight to uint64
        # would wrap a negative numpy scalar where a Python int raises.
        flat = np.fromiter(chain.from_iterable(numbers), dtype=np.int64, count=3 * len(descs))
        rows = flat.reshape(len(descs), 3)
    except OverflowError:  # an int past 2**63: inferred (uint64), or refused
        try:
            rows = np.array(numbers)
        except (OverflowError, ValueError, TypeError):
            return None
    if rows.shape != (len(descs), 3) or rows.dtype.kind not in "iu":
        return None  # mixed signed and unsigned (float64), or past 2**64
    if rows.dtype.kind == "i" and rows.min() < 0:
        return None
    # Non-negative int64 reads the same as uint64: a view, not a copy.
    return (rows.view(np.uint64) if rows.dtype.kind == "i" else rows.astype(np.uint64, copy=False)), metas


# Older native modules lack it: numpy alone then.
_native_pack = getattr(_native, "pack_desc_rows", None)
_FIRST_THREE = itemgetter(0, 1, 2)
_META = itemgetter(3)
_META_TYPES = frozenset({str, bytes})
_U64_LIMIT = 1 << 64


def _checked(desc, width, index):
    """One descriptor's fields, checked: ints in [0, 2**64) (a meta str or
    bytes last)."""
    if len(desc) != width:
        raise InvalidArgumentError(f"descriptor {index} has {len(desc)} fields, {width} needed: {desc!r}")
    numbers = desc[:3]
    for value in numbers:
        if isinstance(value, bool) or not hasattr(value, "__index__") or not 0 <= int(value) < _U64_LIMIT:
            raise InvalidArgumentError(f"descriptor {index}: (addr, len, dev_id) must be ints >= 0 (and < 2**64), got {desc!r}")
    out = tuple(int(v) for v in numbers)
    if width == 4:
        meta = desc[3]
        if not isinstance(meta, (str, bytes)):
            raise InvalidArgumentError(f"descriptor {index}: meta must be str or bytes, got {meta!r}")
        out += (meta,)
    return out


def _is_tensor(obj):
    """Duck-typed torch.Tensor (no import of torch)."""
    return all(hasattr(obj, attr) for attr in ("data_ptr", "element_size", "numel", "device"))


def _tensor_desc(tensor, index):
    if hasattr(tensor, "is_contiguous") and not tensor.is_contiguous():
        raise InvalidArgumentError(f"tensor {index} is not contiguous: pass contiguous tensors (NIXL's rule too)")
    device = str(tensor.device)
    kind = "VRAM" if device.startswith("cuda") else "DRAM"
    dev = tensor.get_device() if hasattr(tensor, "get_device") else 0
    return kind, (int(tensor.data_ptr()), int(tensor.numel()) * int(tensor.element_size()), max(int(dev), 0))


def _from_tensors(tensors, width):
    kinds, descs = set(), []
    for index, tensor in enumerate(tensors):
        if not _is_tensor(tensor):
            raise InvalidArgumentError(f"item {index} of a tensor list is a {type(tensor).__name__}, not a tensor")
        kind, desc = _tensor_desc(tensor, index)
        kinds.add((kind, str(tensor.device)))
        descs.append(desc + ("",) if width == 4 else desc)
    if len(kinds) > 1:
        raise InvalidArgumentError(f"tensors on different devices ({sorted(d for _, d in kinds)}): one list per device")
    return next(iter(kinds))[0], descs


def _from_numpy(array, mem):
    """An N x 3 integer array's rows as uint64, checked as a whole."""
    if array.ndim != 2 or array.shape[1] != 3:
        raise InvalidArgumentError(f"a numpy descriptor array must be N x 3 (addr, len, dev_id), got shape {array.shape}")
    if mem is None:
        raise InvalidArgumentError("a numpy descriptor array needs a memory type (\"DRAM\" or \"VRAM\")")
    kind = mem_type(mem)
    if array.dtype.kind not in "iu":
        raise InvalidArgumentError(f"a numpy descriptor array must hold ints >= 0 (addr, len, dev_id), got dtype {array.dtype}")
    if array.dtype.kind == "i" and len(array) and array.min() < 0:
        row = int(np.argmax((array < 0).any(axis=1)))
        raise InvalidArgumentError(f"descriptor {row}: (addr, len, dev_id) must be ints >= 0, got {tuple(array[row].tolist())!r}")
    return kind, np.ascontiguousarray(array, dtype=np.uint64)


def build(cls, descs, mem=None):
    """``descs`` (any form NIXL takes) as a ``cls`` list."""
    width = cls._width
    if isinstance(descs, cls):
        return descs
    if isinstance(descs, _DList):
        want = "registration" if width == 4 else "transfer"
        raise InvalidArgumentError(f"a {type(descs).__name__} where a {want} list is needed (trim() turns one into the other)")
    if _is_tensor(descs):
        kind, desc = _tensor_desc(descs, 0)
        return cls(kind, [desc + ("",) if width == 4 else desc])
    if isinstance(descs, np.ndarray):
        kind, rows = _from_numpy(descs, mem)
        return cls._of(kind, rows)
    if not isinstance(descs, (list, tuple)):
        raise InvalidArgumentError(f"descriptors must be a list of tuples, an N x 3 numpy array, tensors or a list, got {type(descs).__name__}")
    if not descs:
        if mem is None:
            raise InvalidArgumentError("an empty descriptor list needs a memory type")
        return cls(mem_type(mem), [])
    if isinstance(descs[0], tuple):
        if mem is None:
            raise InvalidArgumentError("a list of descriptor tuples needs a memory type (\"DRAM\", \"VRAM\" or \"FILE\")")
        return cls(mem_type(mem), descs)
    if _is_tensor(descs[0]):
        kind, rows = _from_tensors(descs, width)
        return cls(kind, rows)
    raise InvalidArgumentError(f"descriptors must be tuples or tensors, got a list of {type(descs[0]).__name__}")


# One entry with no meta, as `_ENTRY` packs it: a transfer list's every
# entry, and a registration list's whose metas are all empty.
_ENTRY_DTYPE = np.dtype([("addr", "<u8"), ("len", "<u8"), ("dev", "<u8"), ("meta_len", "<u4")])
assert _ENTRY_DTYPE.itemsize == _ENTRY.size


def serialize(dlist):
    """A list's fixed binary form."""
    if not isinstance(dlist, _DList):
        raise InvalidArgumentError(f"only descriptor lists serialize, got {type(dlist).__name__}")
    reg = isinstance(dlist, nixlRegDList)
    header = _HEADER.pack(_MAGIC, 0 if reg else 1, _MEM_CODES[dlist.getType()], len(dlist))
    metas = [m.encode() if isinstance(m, str) else m for m in dlist._metas] if reg else None
    if not metas or not any(metas):
        entries = np.zeros(len(dlist), dtype=_ENTRY_DTYPE)
        entries["addr"], entries["len"], entries["dev"] = dlist._rows.T
        return header + entries.tobytes()
    parts = [header]
    for (addr, length, dev), meta in zip(dlist._rows.tolist(), metas):
        parts.append(_ENTRY.pack(addr, length, dev, len(meta)) + meta)
    return b"".join(parts)


def deserialize(data):
    """A list from ``serialize``'s bytes; anything else is refused."""
    try:
        data = bytes(data)
        magic, kind, vram, count = _HEADER.unpack_from(data, 0)
    except (TypeError, struct.error):
        raise InvalidArgumentError("not serialized descriptors (too short, or not bytes)") from None
    if magic != _MAGIC or kind > 1 or vram not in _MEM_NAMES or count > _MAX_SERIALIZED_DESCS:
        raise InvalidArgumentError("not descriptors serialized by kvring.nixl (bad header)")
    cls, mem = (nixlRegDList if kind == 0 else nixlXferDList), _MEM_NAMES[vram]
    if len(data) == _HEADER.size + count * _ENTRY.size:
        entries = np.frombuffer(data, dtype=_ENTRY_DTYPE, count=count, offset=_HEADER.size)
        if not entries["meta_len"].any():  # every meta empty: one array
            rows = np.stack((entries["addr"], entries["len"], entries["dev"]), axis=1)
            return cls._of(mem, rows.astype(np.uint64))
    at, descs = _HEADER.size, []
    try:
        for _ in range(count):
            addr, length, dev, meta_len = _ENTRY.unpack_from(data, at)
            at += _ENTRY.size
            meta = data[at : at + meta_len]
            if len(meta) != meta_len:
                raise struct.error("meta cut short")
            at += meta_len
            descs.append((addr, length, dev, meta.decode(errors="surrogateescape")) if kind == 0 else (addr, length, dev))
    except struct.error:
        raise InvalidArgumentError(f"serialized descriptors cut short after {len(descs)} of {count}") from None
    if at != len(data):
        raise InvalidArgumentError(f"{len(data) - at} stray bytes after serialized descriptors")
    return cls(mem, descs)

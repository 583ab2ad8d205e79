"""NIXL's descriptor lists, and turning what NIXL's users pass into them.

A registration list (``nixlRegDList``) holds ``(addr, len, dev_id, meta)``
tuples; a transfer list (``nixlXferDList``) ``(addr, len, dev_id)``. Both
carry a memory type: "DRAM" (host memory; also "cpu") or "VRAM" (GPU
memory; also "cuda"). What becomes a list, as in NIXL's ``_api.py``:

- a list of tuples, with a memory type;
- an N x 3 numpy array of (addr, len, dev_id) rows, with a memory type;
- a torch tensor, or a list of them (CPU tensors are DRAM, CUDA ones
  VRAM, ``get_device()`` the id): read through ``data_ptr()``,
  ``numel()``, ``element_size()``, ``device`` and ``is_contiguous()``,
  without importing torch;
- a list already made, passed along.

Anything else, a memory type kvring does not move ("FILE", "BLOCK",
"OBJ") or an unknown one raises ``InvalidArgumentError`` saying why; NIXL
prints and returns None there, which fails later and further away.

``serialize`` / ``deserialize`` give a fixed binary form (no pickle: bytes
from a peer never run code here).
"""

import struct

from ..errors import InvalidArgumentError, UnsupportedError
from ._errors import UnknownKeyError

# NIXL's names for memory kinds -> kvring's: "DRAM" host, "VRAM" GPU.
_MEM_TYPES = {"DRAM": "DRAM", "cpu": "DRAM", "VRAM": "VRAM", "cuda": "VRAM"}
# NIXL's storage kinds: kvring moves memory, not files or objects.
_STORAGE = ("FILE", "BLOCK", "OBJ")

_MAGIC = b"KVRNXDL1"
_HEADER = struct.Struct("<8sBBI")  # magic, kind (0 reg, 1 xfer), 0 DRAM / 1 VRAM, count
_ENTRY = struct.Struct("<QQQI")  # addr, len, dev_id, meta length
_MAX_SERIALIZED_DESCS = 1 << 24


def mem_type(name):
    """NIXL's memory type name -> "DRAM" or "VRAM", or a clear error."""
    if name in _MEM_TYPES:
        return _MEM_TYPES[name]
    if name in _STORAGE:
        raise UnsupportedError(f"memory type {name!r}: kvring moves host (DRAM) and GPU (VRAM) memory, not storage")
    raise UnknownKeyError(f"unknown memory type {name!r}: use \"DRAM\" (or \"cpu\") or \"VRAM\" (or \"cuda\")")


class _DList:
    """A descriptor list: a memory type and a tuple of descriptors."""

    __slots__ = ("_mem", "_descs")
    _width = 3

    def __init__(self, mem, descs=()):
        self._mem = mem_type(mem) if mem not in ("DRAM", "VRAM") else mem
        self._descs = tuple(_checked(tuple(d), self._width, i) for i, d in enumerate(descs))

    def getType(self):
        """The memory type: "DRAM" or "VRAM"."""
        return self._mem

    mem_type = property(getType)

    def descCount(self):
        """How many descriptors."""
        return len(self._descs)

    def isEmpty(self):
        """True when it holds none."""
        return not self._descs

    def __len__(self):
        return len(self._descs)

    def __getitem__(self, index):
        return self._descs[index]

    def __iter__(self):
        return iter(self._descs)

    def __eq__(self, other):
        return type(other) is type(self) and other._mem == self._mem and other._descs == self._descs

    __hash__ = None  # mutable (addDesc, remDesc, clear), as NIXL's

    def addDesc(self, desc):  # noqa: N802  (NIXL's name)
        """Appends one descriptor (checked as the constructor checks)."""
        self._descs += (_checked(tuple(desc), self._width, len(self._descs)),)

    def remDesc(self, index):  # noqa: N802  (NIXL's name)
        """Removes descriptor ``index``."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self._descs):
            raise InvalidArgumentError(f"descriptor index {index!r} is past a list of {len(self._descs)}")
        self._descs = self._descs[:index] + self._descs[index + 1 :]

    def clear(self):
        """Removes every descriptor."""
        self._descs = ()

    def print(self):
        """Prints the list (NIXL's debugging aid)."""
        print(repr(self))

    def __repr__(self):
        return f"{type(self).__name__}({self._mem}, {list(self._descs)!r})"

    def __getstate__(self):
        return (self._mem, self._descs)

    def __setstate__(self, state):
        self._mem, self._descs = state


class nixlXferDList(_DList):  # noqa: N801  (NIXL's name)
    """A transfer descriptor list: (addr, len, dev_id) each."""

    __slots__ = ()


class nixlRegDList(_DList):  # noqa: N801  (NIXL's name)
    """A registration descriptor list: (addr, len, dev_id, meta) each."""

    __slots__ = ()
    _width = 4

    def trim(self):
        """The same memory as a transfer list (meta dropped), as NIXL's."""
        return nixlXferDList(self._mem, [d[:3] for d in self._descs])


def _checked(desc, width, index):
    """One descriptor's fields, checked: ints >= 0 (a meta str or bytes last)."""
    if len(desc) != width:
        raise InvalidArgumentError(f"descriptor {index} has {len(desc)} fields, {width} needed: {desc!r}")
    numbers = desc[:3]
    for value in numbers:
        if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < 0:
            raise InvalidArgumentError(f"descriptor {index}: (addr, len, dev_id) must be ints >= 0, got {desc!r}")
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


def _from_numpy(array, mem, width):
    if array.ndim != 2 or array.shape[1] != 3:
        raise InvalidArgumentError(f"a numpy descriptor array must be N x 3 (addr, len, dev_id), got shape {array.shape}")
    if mem is None:
        raise InvalidArgumentError("a numpy descriptor array needs a memory type (\"DRAM\" or \"VRAM\")")
    rows = array.tolist()
    return mem_type(mem), [tuple(r) + ("",) if width == 4 else tuple(r) for r in rows]


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
    if type(descs).__module__ == "numpy" and hasattr(descs, "ndim"):
        kind, rows = _from_numpy(descs, mem, width)
        return cls(kind, rows)
    if not isinstance(descs, (list, tuple)):
        raise InvalidArgumentError(f"descriptors must be a list of tuples, an N x 3 numpy array, tensors or a list, got {type(descs).__name__}")
    if not descs:
        if mem is None:
            raise InvalidArgumentError("an empty descriptor list needs a memory type")
        return cls(mem_type(mem), [])
    if isinstance(descs[0], tuple):
        if mem is None:
            raise InvalidArgumentError("a list of descriptor tuples needs a memory type (\"DRAM\" or \"VRAM\")")
        return cls(mem_type(mem), descs)
    if _is_tensor(descs[0]):
        kind, rows = _from_tensors(descs, width)
        return cls(kind, rows)
    raise InvalidArgumentError(f"descriptors must be tuples or tensors, got a list of {type(descs[0]).__name__}")


def serialize(dlist):
    """A list's fixed binary form."""
    if not isinstance(dlist, _DList):
        raise InvalidArgumentError(f"only descriptor lists serialize, got {type(dlist).__name__}")
    reg = isinstance(dlist, nixlRegDList)
    parts = [_HEADER.pack(_MAGIC, 0 if reg else 1, 1 if dlist.getType() == "VRAM" else 0, len(dlist))]
    for desc in dlist:
        meta = desc[3] if reg else b""
        meta = meta.encode() if isinstance(meta, str) else meta
        parts.append(_ENTRY.pack(desc[0], desc[1], desc[2], len(meta)) + meta)
    return b"".join(parts)


def deserialize(data):
    """A list from ``serialize``'s bytes; anything else is refused."""
    try:
        data = bytes(data)
        magic, kind, vram, count = _HEADER.unpack_from(data, 0)
    except (TypeError, struct.error):
        raise InvalidArgumentError("not serialized descriptors (too short, or not bytes)") from None
    if magic != _MAGIC or kind > 1 or vram > 1 or count > _MAX_SERIALIZED_DESCS:
        raise InvalidArgumentError("not descriptors serialized by kvring.nixl (bad header)")
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
    return (nixlRegDList if kind == 0 else nixlXferDList)("VRAM" if vram else "DRAM", descs)

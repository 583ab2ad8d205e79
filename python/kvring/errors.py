"""Exceptions: one class per kvring error kind, all under KvringError.

The native module raises the class registered here for the error's code
(the codes of proto/kvring/control.proto), with kvring's own message.
"""

from . import _native


class KvringError(Exception):
    """Any error kvring reports. ``code`` is its error code's name."""

    code = "INTERNAL"


def _kind(name, code, doc, *bases):
    cls = type(name, (KvringError, *bases), {"__doc__": doc, "code": code})
    globals()[name] = cls
    return cls


# (class name, error code, extra base, what it means)
_KINDS = [
    ("InvalidArgumentError", "INVALID_ARGUMENT", ValueError, "A bad argument: a wrong type, size, name or value."),
    ("UnknownRegionError", "UNKNOWN_REGION", None, "A region id that is not (or no longer) registered."),
    ("OutOfBoundsError", "OUT_OF_BOUNDS", None, "A range past the end of its region."),
    ("LengthOverflowError", "LENGTH_OVERFLOW", None, "An offset plus length that overflows."),
    ("AccessDeniedError", "ACCESS_DENIED", PermissionError, "The region's rights do not allow it."),
    ("RegionOverlapError", "REGION_OVERLAP", None, "The range overlaps a registered region."),
    ("RegionBusyError", "REGION_BUSY", None, "The region is in use by a batch in flight."),
    ("BusyError", "BUSY", None, "A queue is full; try again."),
    ("TransferTimeoutError", "TIMEOUT", TimeoutError, "The wait or the batch's deadline ran out."),
    ("CancelledError", "CANCELLED", None, "The batch was cancelled."),
    ("UnknownBatchError", "UNKNOWN_BATCH", None, "A batch id this engine never issued."),
    ("StaleBatchError", "STALE_BATCH", None, "A batch id whose result was already consumed."),
    ("UnknownSegmentError", "UNKNOWN_SEGMENT", None, "A peer that cannot be found or was closed."),
    ("PeerRestartedError", "PEER_RESTARTED", ConnectionError, "The peer restarted or went away; open it again."),
    ("VersionMismatchError", "VERSION_MISMATCH", None, "The peer speaks another protocol version."),
    ("MalformedMessageError", "MALFORMED_MESSAGE", None, "A peer sent bytes that do not decode."),
    ("MessageTooLargeError", "MESSAGE_TOO_LARGE", None, "A message past its size limit."),
    ("KvringIOError", "IO", OSError, "An operating-system or device error."),
    ("ResourceLimitError", "RESOURCE_LIMIT", None, "A table is full or a system limit is too low."),
    ("UnsupportedError", "UNSUPPORTED", None, "Not built in, or not served by the peer."),
    ("InternalError", "INTERNAL", None, "A bug in kvring."),
    ("UnknownOpcodeError", "UNKNOWN_OPCODE", None, "An opcode this version does not know."),
    ("EngineClosedError", "SHUTDOWN", None, "The engine was closed."),
    ("UnauthorizedError", "UNAUTHORIZED", PermissionError, "The peer refused the token."),
    ("LayoutMismatchError", "LAYOUT_MISMATCH", None, "The two KV-cache layouts cannot exchange blocks."),
    ("CorruptError", "CORRUPT", None, "A checksummed block arrived with other bytes than were sent."),
    ("FencedError", "FENCED", None, "The destination was fenced after the grant the write named; nothing landed."),
    ("ForkError", "FORK", None, "The engine was created before fork(); create one in the child."),
]

BY_CODE = {}
for _name, _code, _base, _doc in _KINDS:
    BY_CODE[_code] = _kind(_name, _code, _doc, *((_base,) if _base else ()))

_native.set_error_classes(BY_CODE)

__all__ = ["KvringError", *[name for name, *_ in _KINDS]]

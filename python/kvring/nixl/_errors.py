"""NIXL's exception names, as kvring's classes.

Where NIXL's meaning is one of kvring's kinds, the name is kvring's class;
where a NIXL caller catches a class kvring has no kind for, a subclass of
the nearest kvring kind that is also NIXL's (or Python's) class.
"""

from ..errors import (
    AccessDeniedError,
    BusyError,
    CancelledError,
    InternalError,
    InvalidArgumentError,
    KvringIOError,
    PeerRestartedError,
    UnknownSegmentError,
    UnsupportedError,
)

nixlInvalidParamError = InvalidArgumentError
nixlNotFoundError = UnknownSegmentError
nixlNotSupportedError = UnsupportedError
nixlRepostActiveError = BusyError
# What engines catch around transfers (SGLang's NIXL connector: these three).
nixlRemoteDisconnectError = PeerRestartedError
nixlCancelledError = CancelledError
nixlBackendError = KvringIOError
nixlNotAllowedError = AccessDeniedError
nixlNotPostedError = InvalidArgumentError  # kvring: "was never posted"
nixlMismatchError = InvalidArgumentError  # kvring: mismatched descriptor lengths or counts
nixlUnknownError = InternalError


class nixlNoTelemetryError(UnsupportedError):  # noqa: N801  (NIXL's name)
    """Telemetry was asked of an agent that does not collect it (NIXL's
    rule: ``NIXL_TELEMETRY_ENABLE`` when set, else the config's
    ``capture_telemetry``)."""

    code = "UNSUPPORTED"


class NoSuchBackendError(UnsupportedError, UnknownSegmentError):
    """A backend kvring does not stand in for: kvring's
    ``UnsupportedError`` and NIXL's ``nixlNotFoundError`` (what NIXL raises
    for a plugin it does not have)."""

    code = "UNSUPPORTED"


class UnknownKeyError(InvalidArgumentError, KeyError):
    """An unknown operation or memory type: kvring's
    ``InvalidArgumentError`` and the ``KeyError`` NIXL raises there (its
    agent looks them up in a dict)."""

    def __str__(self):
        return Exception.__str__(self)  # KeyError's str would quote the message



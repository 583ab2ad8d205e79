"""NIXL's handles: a prepared descriptor list and a transfer request.

Each wraps what the native module prepared once (descriptors located in
registered memory) and knows whether it was released: a released handle
used again raises ``InvalidArgumentError`` instead of reaching freed state.
"""

from ..errors import InvalidArgumentError


class nixl_prepped_dlist_handle:  # noqa: N801  (NIXL's name)
    """A descriptor list located once: this agent's memory (``agent`` is
    None) or a remote agent's."""

    __slots__ = ("_prepared", "agent", "mem_type", "descs", "_released")

    def __init__(self, prepared, agent, mem_type, descs=None):
        self._prepared = prepared
        self.agent = agent
        self.mem_type = mem_type
        self.descs = descs  # the list it was prepared from (POSIX transfers read its rows)
        self._released = False

    def __len__(self):
        return len(self._prepared if self._prepared is not None else self.descs)

    def __repr__(self):
        side = "local" if self.agent is None else f"agent {self.agent!r}"
        return f"nixl_prepped_dlist_handle({side}, {len(self)} descs, released={self._released})"

    def prepared(self):
        """The native list, unless released."""
        if self._released:
            raise InvalidArgumentError("this prepped descriptor list handle was released: prepare it again")
        return self._prepared

    def release(self):
        """Frees it (again: nothing)."""
        self._released = True


class nixl_xfer_handle:  # noqa: N801  (NIXL's name)
    """A transfer request: fixed descriptors to one remote agent, posted
    with ``transfer`` as often as wanted (one posting at a time)."""

    __slots__ = (
        "_xfer", "agent", "op", "backend", "notif", "batch", "done", "error", "_released", "posted_ns", "post_ns",
        "ended_ns", "__weakref__",
    )

    def __init__(self, xfer, agent, op, backend, notif):
        self._xfer = xfer
        self.agent = agent
        self.op = op
        self.backend = backend
        self.notif = notif
        self.batch = None  # the batch of the posting in progress
        self.done = False  # the last posting ended well
        self.error = None  # why the last posting failed
        self._released = False
        # The last posting's clock (perf_counter_ns): when it was posted,
        # how long the post took, when it was seen done.
        self.posted_ns = self.post_ns = self.ended_ns = 0

    def __repr__(self):
        state = "released" if self._released else "PROC" if self.batch else "DONE" if self.done else "idle"
        return f"nixl_xfer_handle({self.op} {len(self._xfer)} descs to {self.agent!r}, {state})"

    def xfer(self):
        """The native transfer, unless released."""
        if self._released:
            raise InvalidArgumentError("this transfer handle was released: make a new one")
        return self._xfer

    def release(self):
        """Marks it released (the agent first cancels a posting in progress
        and waits for it to settle)."""
        self._released = True


class nixlXferTelemetry:  # noqa: N801  (NIXL's name)
    """A transfer's last posting, as NIXL reports it (times in
    microseconds): ``startTime`` (since the epoch), ``postDuration`` (the
    post call), ``xferDuration`` (post to DONE as the agent saw it),
    ``totalBytes``, ``descCount``."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, start_us, post_us, xfer_us, total_bytes, desc_count):
        self.startTime = start_us
        self.postDuration = post_us
        self.xferDuration = xfer_us
        self.totalBytes = total_bytes
        self.descCount = desc_count

    def __repr__(self):
        return (
            f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
            f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, descCount={self.descCount})"
        )

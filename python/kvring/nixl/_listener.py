"""The agents' own listener messages: metadata sent (``_LOAD``) and
withdrawn (``_DROP``), authenticated by the cluster's token.

NIXL's listener thread takes metadata from anyone who reaches its port.
kvring.nixl's messages travel as kvring notifications (over the engine's
control plane, which a tokened engine opens only to peers that prove the
token), and each carries its own proof as well, so that a message is
bound to what it says:

    _CONTROL kind 0x00 | time_ms (8) | nonce (16) | mac (32) | payload

``mac`` is HMAC-SHA256, under a key derived from the token, over the
kind, the sender's name, the receiver's name, the time, the nonce and the
payload. A receiver refuses a message whose mac does not verify (no
token, another token, another receiver, a changed payload), one older or
newer than ``MAX_SKEW_S``, and a nonce it has already seen in that
window (a replay). Without a token (``KVRING_TOKEN`` unset and none
passed) messages carry no proof and are taken from whoever reaches the
port: the agent warns once.

What the token cannot prove is which agent sent a message: every holder
of the cluster's token can prove it. The rules that bind a message to its
sender are the agent's (``_agent``): a ``_LOAD`` loads only the metadata
of the agent that sent it and never re-points a name to another engine
while the old one still answers as that name; a ``_DROP`` forgets only
its sender, and only the incarnation (epoch) it names.
"""

import hashlib
import hmac
import os
import struct
import time

from ..errors import UnauthorizedError

CONTROL = b"\x00kvring.nixl\x00"
LOAD = b"load"
DROP = b"drop"
KINDS = (LOAD, DROP)
# How far a message's time may be from the receiver's clock.
MAX_SKEW_S = 120.0
# Nonces remembered (each for 2 * MAX_SKEW_S); past this, new messages are
# refused until old ones expire, rather than forgetting a nonce early.
MAX_NONCES = 4096
_PROOF = struct.Struct(">Q16s32s")  # time_ms, nonce, mac
_KEY_LABEL = b"kvring.nixl listener messages v1"


def key(token):
    """The listener key for ``token`` (bytes), or None without one."""
    if token is None:
        return None
    return hmac.new(token, _KEY_LABEL, hashlib.sha256).digest()


def _mac(listen_key, kind, sender, receiver, time_ms, nonce, payload):
    fields = (kind, sender.encode(), receiver.encode(), struct.pack(">Q", time_ms), nonce, payload)
    framed = b"".join(struct.pack(">I", len(f)) + f for f in fields)  # unambiguous: each field length-prefixed
    return hmac.new(listen_key, framed, hashlib.sha256).digest()


def encode(listen_key, kind, sender, receiver, payload):
    """One message from ``sender`` to ``receiver`` (agent names)."""
    head = CONTROL + kind + b"\x00"
    if listen_key is None:
        return head + payload
    time_ms, nonce = int(time.time() * 1000), os.urandom(16)
    mac = _mac(listen_key, kind, sender, receiver, time_ms, nonce, payload)
    return head + _PROOF.pack(time_ms, nonce, mac) + payload


class Verifier:
    """Checks the messages an agent receives (one per agent)."""

    def __init__(self, listen_key, receiver):
        self._key = listen_key
        self._receiver = receiver
        self._seen = {}  # nonce -> when it may be forgotten (monotonic s)

    def open(self, sender, message):
        """(kind, payload) of a listener message from ``sender``; raises
        ``UnauthorizedError`` saying why it is refused."""
        rest = message[len(CONTROL) :]
        kind, sep, body = rest[:4], rest[4:5], rest[5:]
        if kind not in KINDS or sep != b"\x00":
            raise UnauthorizedError(f"a listener message of unknown kind {rest[:8]!r}")
        if self._key is None:
            return kind, body
        if len(body) < _PROOF.size:
            raise UnauthorizedError("a listener message without the token's proof (the sender has no token, or another)")
        time_ms, nonce, mac = _PROOF.unpack_from(body)
        payload = body[_PROOF.size :]
        want = _mac(self._key, kind, sender, self._receiver, time_ms, nonce, payload)
        if not hmac.compare_digest(mac, want):
            raise UnauthorizedError(
                "a listener message whose proof does not verify (another token, another receiver, or changed on the way)"
            )
        skew = abs(time.time() - time_ms / 1000)
        if skew > MAX_SKEW_S:
            raise UnauthorizedError(f"a listener message {skew:.0f} s from this host's clock (at most {MAX_SKEW_S:.0f} s)")
        now = time.monotonic()
        for old in [n for n, until in self._seen.items() if until < now]:
            del self._seen[old]
        if nonce in self._seen:
            raise UnauthorizedError("a listener message seen before (a replay)")
        if len(self._seen) >= MAX_NONCES:
            raise UnauthorizedError(f"more than {MAX_NONCES} listener messages within {2 * MAX_SKEW_S:.0f} s: refused")
        self._seen[nonce] = now + 2 * MAX_SKEW_S
        return kind, payload

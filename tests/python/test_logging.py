"""kvring's log events reach Python's logging, under the logger "kvring"."""

import logging
import time

import kvring


def records_matching(caplog, text, deadline=5.0):
    """The captured records whose message contains `text`, waited for:
    events come from kvring's own log thread."""
    end = time.monotonic() + deadline
    while True:
        found = [r for r in caplog.records if text in r.getMessage()]
        if found or time.monotonic() > end:
            return found
        time.sleep(0.01)


def test_an_engine_start_and_stop_are_logged_with_their_fields(caplog):
    caplog.set_level(logging.INFO, logger="kvring")
    with kvring.Engine(name="logging-test") as engine:
        started = records_matching(caplog, "engine started name=logging-test")
        assert started, [r.getMessage() for r in caplog.records]
        record = started[0]
        assert record.levelno == logging.INFO
        assert record.name == "kvring.engine.lifecycle"
        message = record.getMessage()
        assert f"control={engine.control_addr}" in message
        assert "epoch=0x" in message and "lanes=1" in message and "token=false" in message
    assert records_matching(caplog, "engine stopped name=logging-test")


def test_a_peer_gone_mid_session_is_a_warning(caplog, spawn):
    caplog.set_level(logging.DEBUG, logger="kvring")
    peer = spawn("peer.py")
    addr, remote = peer.info["addr"], peer.info["region"]
    with kvring.Engine(name="logging-restart") as engine:
        assert engine.open_segment(addr, "tcp") == "tcp"
        assert records_matching(caplog, "segment opened segment=" + addr)
        peer.close()
        # A transfer to the gone peer fails, which marks its handle stale.
        region = engine.register(bytearray(4096))
        try:
            engine.write(addr, [(region, 0, remote, 0, 4096)], timeout=10.0)
        except kvring.KvringError:
            pass
        warned = records_matching(caplog, "link to a peer broke")
        assert warned and warned[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]

"""End-to-end checksums from Python: the per-transfer flag and the engine's
setting reach the batches (a checksummed push and tcp pull land; what a
transport cannot verify is refused, never moved unchecked, tested in Rust),
and a mismatch is
``CorruptError`` with the wire code CORRUPT. (A corrupted landing itself is
tested in Rust, tests/checksum.rs: its hook is not built into the module.)"""

import pytest

import kvring
from kvring.errors import CorruptError, UnsupportedError

LEN = 64 * 1024


def pair(initiator_name, target_args=None, **initiator_args):
    target = kvring.Engine(name=initiator_name + "-target", **(target_args or {}))
    _region, remote = target.alloc(LEN)
    initiator = kvring.Engine(name=initiator_name, **initiator_args)
    _local, local = initiator.alloc(LEN)
    initiator.write_bytes(local, bytes(range(256)) * (LEN // 256))
    return target, initiator, local, remote


def test_a_checksummed_push_and_tcp_pull_land_with_the_bytes_sent():
    target, initiator, local, remote = pair("py-sum")
    with target, initiator:
        assert initiator.open_segment(target.control_addr, "tcp") == "tcp"
        args = (target.control_addr, "write", [local], [remote], [LEN])
        assert initiator.transfer_addrs(*args, checksum=True) == LEN
        assert target.read_bytes(remote, LEN) == bytes(range(256)) * (LEN // 256)
        # A tcp pull is verified too: each block's CRC32C rides in its reply.
        target.write_bytes(remote, bytes(reversed(range(256))) * (LEN // 256))
        pull = (target.control_addr, "read", [local], [remote], [LEN])
        assert initiator.transfer_addrs(*pull, checksum=True) == LEN
        assert initiator.read_bytes(local, LEN) == bytes(reversed(range(256))) * (LEN // 256)


def test_the_engine_setting_checksums_by_default_and_a_transfer_may_opt_out(monkeypatch):
    monkeypatch.setenv("KVRING_CHECKSUM", "on")
    target, initiator, local, remote = pair("py-sum-env", target_args={"gpu": "sim"})
    with target, initiator:
        initiator.open_segment(target.control_addr, "tcp")
        # The target's GPU memory has no checksum there: a checksummed pull
        # of it (by the engine's setting) is refused, naming why.
        device = target.sim_device_buffer(LEN)
        target.register(device.ptr, LEN)
        pull = (target.control_addr, "read", [local], [device.ptr], [LEN])
        with pytest.raises(UnsupportedError, match="GPU memory"):
            initiator.transfer_addrs(*pull)
        assert initiator.transfer_addrs(*pull, checksum=False) == LEN
        batch = initiator.submit(target.control_addr, "write", [local], [remote], [LEN])
        assert initiator.wait(batch) == LEN


def test_corrupt_is_its_own_error_kind():
    assert issubclass(CorruptError, kvring.KvringError)
    assert CorruptError.code == "CORRUPT"

"""End-to-end checksums from Python: the per-transfer flag and the engine's
setting reach the batches (a checksummed push lands; what a transport
cannot verify is refused, never moved unchecked), and a mismatch is
``CorruptError`` with the wire code CORRUPT. (A corrupted landing itself is
tested in Rust, tests/checksum.rs: its hook is not built into the module.)"""

import pytest

import kvring
from kvring.errors import CorruptError, UnsupportedError

LEN = 64 * 1024


def pair(initiator_name, **initiator_args):
    target = kvring.Engine(name=initiator_name + "-target")
    _region, remote = target.alloc(LEN)
    initiator = kvring.Engine(name=initiator_name, **initiator_args)
    _local, local = initiator.alloc(LEN)
    initiator.write_bytes(local, bytes(range(256)) * (LEN // 256))
    return target, initiator, local, remote


def test_a_checksummed_push_lands_and_a_tcp_pull_is_refused_with_the_reason():
    target, initiator, local, remote = pair("py-sum")
    with target, initiator:
        assert initiator.open_segment(target.control_addr, "tcp") == "tcp"
        args = (target.control_addr, "write", [local], [remote], [LEN])
        assert initiator.transfer_addrs(*args, checksum=True) == LEN
        assert target.read_bytes(remote, LEN) == bytes(range(256)) * (LEN // 256)
        with pytest.raises(UnsupportedError, match="tcp READ"):
            initiator.transfer_addrs(target.control_addr, "read", [local], [remote], [LEN], checksum=True)
        # Unchecked, the same pull runs.
        assert initiator.transfer_addrs(target.control_addr, "read", [local], [remote], [LEN], checksum=False) == LEN


def test_the_engine_setting_checksums_by_default_and_a_transfer_may_opt_out(monkeypatch):
    monkeypatch.setenv("KVRING_CHECKSUM", "on")
    target, initiator, local, remote = pair("py-sum-env")
    with target, initiator:
        initiator.open_segment(target.control_addr, "tcp")
        pull = (target.control_addr, "read", [local], [remote], [LEN])
        with pytest.raises(UnsupportedError):
            initiator.transfer_addrs(*pull)
        assert initiator.transfer_addrs(*pull, checksum=False) == LEN
        batch = initiator.submit(target.control_addr, "write", [local], [remote], [LEN])
        assert initiator.wait(batch) == LEN


def test_corrupt_is_its_own_error_kind():
    assert issubclass(CorruptError, kvring.KvringError)
    assert CorruptError.code == "CORRUPT"

"""As Mooncake's transfer_engine_shm_test.py: two engines on this host with
protocol "shm", managed buffers written and read back; a write to a large
managed buffer after it was freed fails."""

import os
import unittest

from mooncake.engine import TransferEngine

_SMALL_LEN = 4096
_LARGE_LEN = 256 * 1024 * 1024 + 4096


def _segment_name(engine, host="127.0.0.1"):
    return f"{host}:{engine.get_rpc_port()}"


def _shm_free_bytes():
    if not os.path.isdir("/dev/shm"):
        return 0
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


@unittest.skipUnless(os.path.isdir("/dev/shm"), "POSIX shm requires /dev/shm")
class TransferEngineShmManagedBufferTest(unittest.TestCase):
    def setUp(self):
        needed = 2 * 256 * 1024 * 1024 + 16 * 1024 * 1024
        free = _shm_free_bytes()
        if free < needed:
            self.skipTest(f"/dev/shm has {free} free bytes; need at least {needed}")
        self.initiator = TransferEngine()
        self.target = TransferEngine()
        self.assertEqual(self.initiator.initialize("127.0.0.1:0", "P2PHANDSHAKE", "shm", ""), 0)
        self.assertEqual(self.target.initialize("127.0.0.1:0", "P2PHANDSHAKE", "shm", ""), 0)
        self.target_name = _segment_name(self.target)
        self._to_free = []

    def tearDown(self):
        for engine, addr, length in reversed(self._to_free):
            if addr:
                engine.free_managed_buffer(addr, length)
        self._to_free.clear()
        self.initiator.close()
        self.target.close()

    def _alloc(self, engine, length):
        addr = engine.allocate_managed_buffer(length)
        self.assertNotEqual(addr, 0, f"allocate_managed_buffer({length}) failed")
        self._to_free.append((engine, addr, length))
        return addr

    def test_small_managed_buffer_write_read(self):
        src = self._alloc(self.initiator, _SMALL_LEN)
        dst = self._alloc(self.target, _SMALL_LEN)
        payload = b"shm-managed-buffer-payload"
        self.assertEqual(self.initiator.write_bytes_to_buffer(src, payload, len(payload)), 0)
        self.assertEqual(self.initiator.transfer_sync_write(self.target_name, src, dst, len(payload)), 0)
        self.assertEqual(self.target.read_bytes_from_buffer(dst, len(payload)), payload)
        zeros = bytes(len(payload))
        self.assertEqual(self.initiator.write_bytes_to_buffer(src, zeros, len(payload)), 0)
        self.assertEqual(self.initiator.transfer_sync_read(self.target_name, src, dst, len(payload)), 0)
        self.assertEqual(self.initiator.read_bytes_from_buffer(src, len(payload)), payload)

    # kvring's shm link checks the region's live word in its file's header
    # before each copy, and the owner's unregister clears it and waits out
    # copies in progress (mem/shm.rs, revocation): a write after free fails.
    def test_free_large_managed_buffer_then_write_fails(self):
        needed = _LARGE_LEN + 256 * 1024 * 1024 + 16 * 1024 * 1024
        if _shm_free_bytes() < needed:
            self.skipTest(f"/dev/shm needs about {needed} free bytes")
        src = self._alloc(self.initiator, _SMALL_LEN)
        dst = self.target.allocate_managed_buffer(_LARGE_LEN)
        self.assertNotEqual(dst, 0, "allocate_managed_buffer of 256 MiB+ failed")
        self._to_free.append((self.target, dst, _LARGE_LEN))
        payload = b"before-free"
        self.assertEqual(self.initiator.write_bytes_to_buffer(src, payload, len(payload)), 0)
        self.assertEqual(self.initiator.transfer_sync_write(self.target_name, src, dst, len(payload)), 0)
        self.assertEqual(self.target.read_bytes_from_buffer(dst, len(payload)), payload)
        self.assertEqual(self.target.free_managed_buffer(dst, _LARGE_LEN), 0)
        self._to_free = [item for item in self._to_free if item[1] != dst]
        ret = self.initiator.transfer_sync_write(self.target_name, src, dst, len(payload))
        self.assertNotEqual(ret, 0, "WRITE after free_managed_buffer should fail")

"""As Mooncake's transfer_engine_initiator_test.py, with its target started
the way Mooncake's scripts/run_tests.sh starts it (a second process): random
strings written to the target and read back, one at a time, in sync batches
of 100 and in async batches of 100, every byte compared.

Peers are found by P2PHANDSHAKE (Mooncake's run_tests.sh uses its HTTP
metadata server, which comes with Mooncake's package, not kvring's);
CIRCLE defaults to 200 here (Mooncake's 1000) to keep CI short."""

import os
import random
import socket
import string
import subprocess
import sys
import time
import unittest

from mooncake.engine import TransferEngine

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _random_string(length):
    chars = string.ascii_letters + string.digits + string.punctuation
    return "".join(random.choices(chars, k=length))


class TestVLLMAdaptorTransfer(unittest.TestCase):
    DEFAULT_BUFFER_CAPACITY = 64 * 1024 * 1024

    @classmethod
    def setUpClass(cls):
        cls.target_server_name = os.getenv("TARGET_SERVER_NAME", f"127.0.0.1:{_free_port()}")
        cls.initiator_server_name = os.getenv("INITIATOR_SERVER_NAME", f"127.0.0.1:{_free_port()}")
        cls.metadata_server = os.getenv("MC_METADATA_SERVER", "P2PHANDSHAKE")
        cls.protocol = os.getenv("PROTOCOL", "tcp")
        cls.circle = int(os.getenv("CIRCLE", 200))

        env = dict(os.environ, TARGET_SERVER_NAME=cls.target_server_name, MC_METADATA_SERVER=cls.metadata_server,
                   PROTOCOL=cls.protocol)
        cls.target = subprocess.Popen([sys.executable, os.path.join(HERE, "transfer_engine_target.py")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:
            line = cls.target.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Target server ready" in line:
                break
        if not lines or "Target server ready" not in lines[-1]:
            cls.target.kill()
            raise RuntimeError("target did not start: " + "".join(lines))

        cls.adaptor = TransferEngine()
        ret = cls.adaptor.initialize(cls.initiator_server_name, cls.metadata_server, cls.protocol, "")
        if ret != 0:
            raise RuntimeError(f"Initialization failed with code {ret}")
        if cls.metadata_server == "P2PHANDSHAKE":
            cls.initiator_server_name = (
                cls.initiator_server_name.rpartition(":")[0] + ":" + str(cls.adaptor.get_rpc_port())
            )
        cls._fallback_buffer_addr = None

    @classmethod
    def _ensure_buffer_available(cls):
        src_addr = cls.adaptor.get_first_buffer_address(cls.initiator_server_name)
        if src_addr == 0:
            if cls._fallback_buffer_addr is None:
                cls._fallback_buffer_addr = cls.adaptor.allocate_managed_buffer(cls.DEFAULT_BUFFER_CAPACITY)
                if cls._fallback_buffer_addr == 0:
                    raise RuntimeError("Failed to allocate fallback buffer")
            src_addr = cls._fallback_buffer_addr
        return src_addr

    @classmethod
    def tearDownClass(cls):
        if cls._fallback_buffer_addr is not None:
            cls.adaptor.free_managed_buffer(cls._fallback_buffer_addr, cls.DEFAULT_BUFFER_CAPACITY)
            cls._fallback_buffer_addr = None
        cls.adaptor.close()
        cls.target.kill()
        cls.target.wait(timeout=30)

    def test_random_write_circle_times(self):
        adaptor = self.adaptor
        src_addr = self._ensure_buffer_available()
        dst_addr = adaptor.get_first_buffer_address(self.target_server_name)
        self.assertNotEqual(dst_addr, 0, "Target server has no registered buffers")
        for i in range(self.circle):
            src_data = _random_string(random.randint(16, 256)).encode("utf-8")
            data_len = len(src_data)
            self.assertEqual(adaptor.write_bytes_to_buffer(src_addr, src_data, data_len), 0, f"[{i}] write")
            self.assertEqual(adaptor.transfer_sync_write(self.target_server_name, src_addr, dst_addr, data_len), 0,
                             f"[{i}] WRITE transferSyncExt failed")
            self.assertEqual(adaptor.write_bytes_to_buffer(src_addr, bytes(data_len), data_len), 0, f"[{i}] clear")
            self.assertEqual(adaptor.transfer_sync_read(self.target_server_name, src_addr, dst_addr, data_len), 0,
                             f"[{i}] READ transferSyncExt failed")
            self.assertEqual(adaptor.read_bytes_from_buffer(src_addr, data_len), src_data, f"[{i}] Data mismatch")

    def _batches(self, asynchronous):
        adaptor = self.adaptor
        batch_size, offset_size = 100, 1024
        circles = max(2, self.circle // 100)
        base_src = self._ensure_buffer_available()
        base_dst = adaptor.get_first_buffer_address(self.target_server_name)
        self.assertNotEqual(base_dst, 0, "Target server has no registered buffers")
        srcs = [base_src + i * offset_size for i in range(batch_size)]
        dsts = [base_dst + i * offset_size for i in range(batch_size)]
        for i in range(circles):
            data = [_random_string(random.randint(32, 128)).encode("utf-8") for _ in range(batch_size)]
            lens = [len(d) for d in data]
            for j in range(batch_size):
                self.assertEqual(adaptor.write_bytes_to_buffer(srcs[j], data[j], lens[j]), 0, f"[{i}-{j}] write")
            if asynchronous:
                batch_id = adaptor.batch_transfer_async_write(self.target_server_name, srcs, dsts, lens)
                self.assertNotEqual(batch_id, 0, f"[{i}] batch_transfer_async_write failed in submitting")
                self.assertEqual(adaptor.get_batch_transfer_status([batch_id]), 0, f"[{i}] batch {batch_id}")
            else:
                self.assertEqual(adaptor.batch_transfer_sync_write(self.target_server_name, srcs, dsts, lens), 0,
                                 f"[{i}] batch_transfer_sync_write failed")
            for j in range(batch_size):
                self.assertEqual(adaptor.write_bytes_to_buffer(srcs[j], bytes(lens[j]), lens[j]), 0, f"[{i}-{j}] clear")
            if asynchronous:
                batch_id = adaptor.batch_transfer_async_read(self.target_server_name, srcs, dsts, lens)
                self.assertNotEqual(batch_id, 0, f"[{i}] batch_transfer_async_read failed in submitting")
                self.assertEqual(adaptor.get_batch_transfer_status([batch_id]), 0, f"[{i}] batch {batch_id}")
            else:
                self.assertEqual(adaptor.batch_transfer_sync_read(self.target_server_name, srcs, dsts, lens), 0,
                                 f"[{i}] batch_transfer_sync_read failed")
            for j in range(batch_size):
                self.assertEqual(adaptor.read_bytes_from_buffer(srcs[j], lens[j]), data[j],
                                 f"[{i}-{j}] Data mismatch in batch read")

    def test_batch_write_read(self):
        self._batches(asynchronous=False)

    def test_async_batch_write_read(self):
        self._batches(asynchronous=True)

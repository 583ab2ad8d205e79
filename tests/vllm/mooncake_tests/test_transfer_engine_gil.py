"""As Mooncake's test_transfer_engine_gil.py: registering and unregistering
one buffer lets other Python threads run (the GIL is released), seen with
the switch interval set to 10 s so only a released GIL lets the worker in."""

import ctypes
import mmap
import socket
import sys
import threading
import unittest

from mooncake.engine import TransferEngine


class _OneShotWorker:
    def __init__(self):
        self.arm = threading.Event()
        self.ran = threading.Event()
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        self.ready.set()
        while not self.stop.is_set():
            if not self.arm.wait(timeout=0.1):
                continue
            self.arm.clear()
            if not self.stop.is_set():
                self.ran.set()

    def start(self):
        self.thread.start()
        if not self.ready.wait(timeout=5):
            raise RuntimeError("worker did not start")

    def observe(self, call, max_calls):
        self.ran.clear()
        self.arm.set()
        calls = 0
        for index in range(max_calls):
            result = call(index)
            if result != 0:
                raise RuntimeError(f"memory registration returned {result}")
            calls += 1
            if self.ran.is_set():
                break
        self.arm.clear()
        return self.ran.is_set(), calls

    def close(self):
        self.stop.set()
        self.arm.set()
        self.thread.join(timeout=5)


class TestTransferEngineGil(unittest.TestCase):
    def test_single_memory_registration_releases_gil(self):
        max_calls = 2048
        # Mooncake's test makes one pass of 2048 calls; on a loaded 2-core
        # host the worker may not be scheduled within one pass (about 10 ms
        # of kvring calls), so up to `rounds` passes, each as Mooncake's.
        rounds = 8
        region_size = 4096
        region = mmap.mmap(-1, max_calls * region_size)
        base_address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        ctypes.memset(base_address, 0, max_calls * region_size)
        addresses = [base_address + i * region_size for i in range(max_calls)]
        sizes = [region_size] * max_calls

        engine = TransferEngine()
        hostname = socket.gethostbyname(socket.gethostname())
        self.assertEqual(engine.initialize(f"{hostname}:0", "P2PHANDSHAKE", "tcp", ""), 0)

        worker = _OneShotWorker()
        worker.start()
        old_switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(10.0)
        registered = set()
        try:
            def register_one(index):
                result = engine.register_memory(addresses[index], region_size)
                if result == 0:
                    registered.add(addresses[index])
                return result

            for _ in range(rounds):
                register_observed, _ = worker.observe(register_one, max_calls)
                self.assertEqual(engine.batch_unregister_memory(list(registered)), 0)
                registered.clear()
                if register_observed:
                    break

            def unregister_one(index):
                result = engine.unregister_memory(addresses[index])
                if result == 0:
                    registered.discard(addresses[index])
                return result

            for _ in range(rounds):
                self.assertEqual(engine.batch_register_memory(addresses, sizes), 0)
                registered.update(addresses)
                unregister_observed, _ = worker.observe(unregister_one, max_calls)
                self.assertEqual(engine.batch_unregister_memory(list(registered)), 0)
                registered.clear()
                if unregister_observed:
                    break
        finally:
            if registered:
                engine.batch_unregister_memory(list(registered))
            sys.setswitchinterval(old_switch_interval)
            worker.close()
            del base_address
            engine.close()

        self.assertTrue(register_observed, "register_memory retained the GIL")
        self.assertTrue(unregister_observed, "unregister_memory retained the GIL")

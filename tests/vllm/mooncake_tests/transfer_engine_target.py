"""As Mooncake's transfer_engine_target.py: a target engine that registers a
buffer and waits (run by the initiator test as Mooncake's run_tests.sh
runs it, in its own process)."""

import os
import sys
import time

from mooncake.engine import TransferEngine

target_server_name = os.getenv("TARGET_SERVER_NAME", "127.0.0.1:12345")
metadata_server = os.getenv("MC_METADATA_SERVER", "127.0.0.1:2379")
protocol = os.getenv("PROTOCOL", "tcp")
lifetime_s = float(os.getenv("TARGET_LIFETIME_S", "600"))  # bounded: never outlives a lost parent by long

DEFAULT_BUFFER_CAPACITY = 64 * 1024 * 1024

target = TransferEngine()
ret = target.initialize(target_server_name, metadata_server, protocol, "")
if ret != 0:
    raise RuntimeError(f"Target initialization failed with code {ret}")

buffer_addr = target.get_first_buffer_address(target_server_name)
if buffer_addr == 0:
    buffer_addr = target.allocate_managed_buffer(DEFAULT_BUFFER_CAPACITY)
    if buffer_addr == 0:
        raise RuntimeError("Failed to allocate fallback buffer for target")
    print(f"Target allocated fallback buffer at {buffer_addr}", flush=True)

print(f"Target server ready at {target_server_name}", flush=True)
end = time.monotonic() + lifetime_s
while time.monotonic() < end and os.getppid() != 1:
    time.sleep(0.2)
sys.exit(0)

"""The prefill side for the LMDeploy adapter test, in its own process:
registers one memory region (filled with a known pattern), prints its
endpoint info as JSON, then answers `exit`."""

import json
import sys

import numpy as np

from kvring.lmdeploy import KvringMigrationBackend

SIZE = 1 << 20

backend = KvringMigrationBackend(protocol="tcp")
cache = np.random.default_rng(21).integers(0, 256, SIZE, dtype=np.uint8)
backend.register_memory_region({"mr_key": 0, "addr": cache.ctypes.data, "offset": 0, "length": SIZE})
backend.p2p_initialize({"remote_engine_id": "decode-0", "protocol": "tcp"})
print(json.dumps(backend.endpoint_info("decode-0", "tcp")), flush=True)
sys.stdin.readline()

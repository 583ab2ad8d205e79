"""A kvring.nixl target in its own process, for test_nixl_cancel.py: one
DRAM buffer of SIZE bytes, every byte 7, behind the agent's listener.

    python nixl_cancel_peer.py NAME PORT SIZE

Prints {"addr", "size"} once its listener answers, then waits for "exit"
on stdin (a stopped or slow peer is the test's doing, by signal).
"""

import json
import sys

import numpy as np

from kvring.nixl import nixl_agent, nixl_agent_config


def main():
    name, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    agent = nixl_agent(name, nixl_agent_config(True, True, port))
    buffer = np.full(size, 7, dtype=np.uint8)
    agent.register_memory([(buffer.ctypes.data, size, 0, "")], "DRAM")
    print(json.dumps({"addr": buffer.ctypes.data, "size": size}), flush=True)
    for line in sys.stdin:
        if line.strip() == "exit":
            break
    agent._close()


if __name__ == "__main__":
    main()

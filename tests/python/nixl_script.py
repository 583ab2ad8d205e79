"""A script written against NIXL's Python agent API, in the style of NIXL's
own two-peer examples (blocking_send_recv_example.py, nixl_api_example.py).
Only the import line differs from running it on NIXL:

    from nixl._api import nixl_agent, nixl_agent_config

It runs as two processes on one host, exchanging metadata through the
agents' listeners: `target PORT` registers a buffer filled with a known
pattern and waits; `initiator PORT` READs it and checks every byte, then
WRITEs its own pattern into the target through prepped descriptor lists
(vLLM's path) with a notification, after which the target checks what
arrived. Each prints "Test Complete." and exits 0 only if everything matched.
"""

import sys

import numpy as np

from kvring.nixl import nixl_agent, nixl_agent_config

IP = "127.0.0.1"
BLOCK = 4096
BLOCKS = 16


def target(port):
    config = nixl_agent_config(True, True, port)
    agent = nixl_agent("target", config)
    buffer = np.random.default_rng(7).integers(0, 256, BLOCK * BLOCKS, dtype=np.uint8)
    addr = buffer.ctypes.data
    reg_descs = agent.register_memory([(addr + i * BLOCK, BLOCK, 0, "") for i in range(BLOCKS)], "DRAM")
    if not reg_descs:
        print("Memory registration failed.")
        sys.exit(1)
    target_descs = reg_descs.trim()
    target_desc_str = agent.get_serialized_descs(target_descs)
    print("ready", flush=True)

    # Send the descriptor list to the initiator once its metadata is here.
    ready = False
    while not ready:
        ready = agent.check_remote_metadata("initiator")
    agent.send_notif("initiator", target_desc_str)

    # The initiator READs, then WRITEs its pattern and notifies with UUID.
    while not agent.check_remote_xfer_done("initiator", b"UUID"):
        continue
    expected = np.random.default_rng(8).integers(0, 256, BLOCK * BLOCKS, dtype=np.uint8)
    # Blocks were written in reverse order: block i lands in BLOCKS-1-i.
    for i in range(BLOCKS):
        got = buffer[(BLOCKS - 1 - i) * BLOCK : (BLOCKS - i) * BLOCK]
        if not np.array_equal(got, expected[i * BLOCK : (i + 1) * BLOCK]):
            print(f"Data verification failed for block {i}.")
            sys.exit(1)
    agent.deregister_memory(reg_descs)
    print("Test Complete.", flush=True)


def initiator(port):
    config = nixl_agent_config(True, True, 0)
    agent = nixl_agent("initiator", config)
    buffer = np.zeros(BLOCK * BLOCKS, dtype=np.uint8)
    addr = buffer.ctypes.data
    reg_descs = agent.register_memory([(addr, BLOCK * BLOCKS, 0, "")], "DRAM")

    agent.fetch_remote_metadata("target", IP, port)
    agent.send_local_metadata(IP, port)

    notifs = agent.get_new_notifs()
    while len(notifs) == 0:
        notifs = agent.get_new_notifs()
    target_descs = agent.deserialize_descs(notifs["target"][0])
    initiator_descs = agent.get_xfer_descs([(addr + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)], "DRAM")

    ready = False
    while not ready:
        ready = agent.check_remote_metadata("target")

    # READ the target's blocks into ours.
    xfer_handle = agent.initialize_xfer("READ", initiator_descs, target_descs, "target")
    if not xfer_handle:
        print("Creating transfer failed.")
        sys.exit(1)
    state = agent.transfer(xfer_handle)
    if state == "ERR":
        print("Posting transfer failed.")
        sys.exit(1)
    while True:
        state = agent.check_xfer_state(xfer_handle)
        if state == "ERR":
            print("Transfer got to Error state.")
            sys.exit(1)
        elif state == "DONE":
            break
    expected = np.random.default_rng(7).integers(0, 256, BLOCK * BLOCKS, dtype=np.uint8)
    if not np.array_equal(buffer, expected):
        print("Data verification failed after READ.")
        sys.exit(1)

    # WRITE our pattern through prepped lists, blocks in reverse order.
    buffer[:] = np.random.default_rng(8).integers(0, 256, BLOCK * BLOCKS, dtype=np.uint8)
    local_prep_handle = agent.prep_xfer_dlist("NIXL_INIT_AGENT", initiator_descs)
    remote_prep_handle = agent.prep_xfer_dlist("target", target_descs)
    indices = np.arange(BLOCKS)
    xfer_handle_2 = agent.make_prepped_xfer(
        "WRITE", local_prep_handle, indices, remote_prep_handle, indices[::-1], b"UUID"
    )
    state = agent.transfer(xfer_handle_2)
    while state != "DONE":
        state = agent.check_xfer_state(xfer_handle_2)
        if state == "ERR":
            print("Transfer 2 got to Error state.")
            sys.exit(1)

    agent.release_xfer_handle(xfer_handle)
    agent.release_xfer_handle(xfer_handle_2)
    agent.release_dlist_handle(local_prep_handle)
    agent.release_dlist_handle(remote_prep_handle)
    agent.remove_remote_agent("target")
    agent.invalidate_local_metadata(IP, port)
    agent.deregister_memory(reg_descs)
    print("Test Complete.", flush=True)


if __name__ == "__main__":
    mode, port = sys.argv[1], int(sys.argv[2])
    target(port) if mode == "target" else initiator(port)

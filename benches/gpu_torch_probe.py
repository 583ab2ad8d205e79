"""A probe of kvring on a real GPU with real torch tensors (the first steps
of the GPU review's checklist): what the driver says of PyTorch's
allocations (the address range attributes beside the mapping), and two
processes moving torch memory through kvring's Python module, with the
caller's current device and CUDA context compared before and after.

    python3 benches/gpu_torch_probe.py all     # every case, each in its own process

Needs torch with CUDA and kvring's module (`pip install .`); prints one
RANGES and one TRANSFER JSON line per allocator setting (default, and
PyTorch's expandable segments)."""

import ctypes
import hashlib
import json
import os
import subprocess
import sys
import time

SIZE = 64 << 20


def cu():
    lib = ctypes.CDLL("libcuda.so.1")
    return lib


def ranges(label):
    import torch

    lib = cu()
    base = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    piece = base[1 << 20 :]
    out = {"label": label, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    for name, t in (("base", base), ("slice", piece)):
        ptr = ctypes.c_uint64(t.data_ptr())
        row = {"ptr": hex(t.data_ptr())}
        for attr, key in ((11, "RANGE_START"), (12, "RANGE_SIZE"), (19, "MAPPING_BASE"), (18, "MAPPING_SIZE"), (14, "ALLOWED_HANDLE_TYPES"), (15, "GDR_CAPABLE")):
            value = ctypes.c_uint64(0)
            rc = lib.cuPointerGetAttribute(ctypes.byref(value), attr, ptr)
            row[key] = hex(value.value) if rc == 0 else f"err {rc}"
        b, s = ctypes.c_uint64(0), ctypes.c_size_t(0)
        rc = lib.cuMemGetAddressRange_v2(ctypes.byref(b), ctypes.byref(s), ptr)
        row["GetAddressRange"] = f"{hex(b.value)}+{hex(s.value)}" if rc == 0 else f"err {rc}"
        out[name] = row
    print("RANGES", json.dumps(out), flush=True)


def current_ctx(lib):
    ctx = ctypes.c_void_p(0)
    lib.cuCtxGetCurrent(ctypes.byref(ctx))
    return ctx.value


def target():
    import torch
    import kvring

    pattern = (torch.arange(SIZE, device="cuda", dtype=torch.int64) * 2654435761 % 251).to(torch.uint8)
    t = torch.zeros(SIZE + 4096, dtype=torch.uint8, device="cuda")[4096:]  # a slice, not the allocation base
    engine = kvring.Engine()
    region = engine.register(t)
    print(json.dumps({"addr": engine.control_addr, "region": region, "memory": engine.region_memory(region), "ptr": t.data_ptr()}), flush=True)
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "digest":
            off, ln = int(rest[0]), int(rest[1])
            torch.cuda.synchronize()
            print(hashlib.sha256(t[off : off + ln].cpu().numpy().tobytes()).hexdigest(), flush=True)
        elif cmd == "fill":
            t.copy_(pattern.flip(0))
            torch.cuda.synchronize()
            print("ok", flush=True)
        elif cmd == "exit":
            break
    engine.close()


def initiator(label, env):
    import torch
    import kvring

    lib = cu()
    peer = subprocess.Popen([sys.executable, __file__, "target"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    info = json.loads(peer.stdout.readline())
    ask = lambda c: (peer.stdin.write(c + "\n"), peer.stdin.flush(), peer.stdout.readline().strip())[2]
    pattern = (torch.arange(SIZE, device="cuda", dtype=torch.int64) * 2654435761 % 251).to(torch.uint8)
    torch.cuda.synchronize()
    dev_before, ctx_before = torch.cuda.current_device(), current_ctx(lib)
    engine = kvring.Engine()
    mine = engine.register(pattern)
    ctx_after_register = current_ctx(lib)
    transport = engine.open_segment(info["addr"])
    t0 = time.perf_counter()
    moved = engine.write(info["addr"], [(mine, 0, info["region"], 0, SIZE)])
    t1 = time.perf_counter()
    want = hashlib.sha256(pattern.cpu().numpy().tobytes()).hexdigest()
    got = ask(f"digest 0 {SIZE}")
    ask("fill")
    back = torch.zeros(SIZE, dtype=torch.uint8, device="cuda")
    mine_back = engine.register(back)
    moved_back = engine.read(info["addr"], [(mine_back, 0, info["region"], 0, SIZE)])
    torch.cuda.synchronize()
    read_ok = bool(torch.equal(back, pattern.flip(0)))
    # Many small blocks: 4 KiB x 4096 scattered.
    blocks = [(mine, i * 16384, info["region"], i * 16384, 4096) for i in range(4096)]
    t2 = time.perf_counter()
    engine.write(info["addr"], blocks)
    t3 = time.perf_counter()
    print("TRANSFER", json.dumps({
        "label": label, "transport": transport, "target_memory": info["memory"], "moved": moved,
        "write_64MiB_GBps": round(SIZE / (t1 - t0) / 1e9, 2), "write_verified": got == want,
        "read_back": moved_back, "read_verified": read_ok,
        "4KiBx4096_ms": round((t3 - t2) * 1e3, 3),
        "current_device_unchanged": torch.cuda.current_device() == dev_before,
        "ctx_unchanged_after_register": ctx_after_register == ctx_before,
        "ctx_unchanged_at_end": current_ctx(lib) == ctx_before,
    }), flush=True)
    ask("exit")
    peer.wait(timeout=30)
    engine.close()


def main():
    mode = sys.argv[1]
    if mode == "target":
        return target()
    if mode == "ranges":
        return ranges(sys.argv[2])
    if mode == "transfer":
        return initiator(sys.argv[2], dict(os.environ))
    # all: each case in its own process (the allocator setting is read at start)
    for label, conf in (("default", None), ("expandable", "expandable_segments:True")):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        for sub in ("ranges", "transfer"):
            try:
                r = subprocess.run([sys.executable, __file__, sub, label], env=env, timeout=120, capture_output=True, text=True)
                print(f"--- {sub} {label}: rc={r.returncode}")
                print(r.stdout[-4000:])
                if r.returncode:
                    print(r.stderr[-4000:])
            except subprocess.TimeoutExpired as e:
                print(f"--- {sub} {label}: TIMEOUT", (e.stdout or b"")[-2000:], (e.stderr or b"")[-2000:])


if __name__ == "__main__":
    main()

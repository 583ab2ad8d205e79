"""The GPU review's nine-step first-run checklist (../shared/GPU-REVIEW.md,
"The first real-GPU run should check, in order"), each step a line that
says PASS, FAIL or NOT RUN with why, on a machine with an NVIDIA GPU,
torch with CUDA and kvring's Python module.

    python3 benches/gpu_checklist.py            # steps 1-8; step 9 is benches/gpu_check.sh
    GPU_CHECK_KVRING=path/to/kvring python3 benches/gpu_checklist.py

Cases that need two processes start this file again as the peer
(`benches/gpu_torch_probe.py target`). What one GPU cannot show (copies
across GPUs, NVLink, a NIC for dma-buf) is NOT RUN with that reason, never
PASS. Exit status: 1 if any step FAILed."""

import ctypes
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE = os.path.join(HERE, "gpu_torch_probe.py")
RESULTS = []


def report(step, name, status, detail):
    RESULTS.append(status)
    print(f"{status:7} step {step} {name}: {detail}", flush=True)


def kvring_bin():
    found = os.environ.get("GPU_CHECK_KVRING") or shutil.which("kvring")
    if found:
        return found
    local = os.path.join(HERE, "..", "target", "release", "kvring")
    return local if os.path.exists(local) else None


def clean_env(**extra):
    """The environment without this script's own variables (kvring refuses
    unknown KVRING_* settings) plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_KVRING"}
    env.update(extra)
    return env


def probe(case, label, conf=None, nofile=None):
    """Runs the probe's ``case`` in its own process (the allocator setting
    is read at torch's start); returns its JSON line of that kind."""
    env = clean_env()
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf

    def limit():
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    r = subprocess.run([sys.executable, PROBE, case, label], env=env, timeout=180, capture_output=True, text=True,
                       preexec_fn=limit)
    key = "TRANSFER" if case == "transfer" else "RANGES"
    for line in r.stdout.splitlines():
        if line.startswith(key + " "):
            return json.loads(line[len(key) + 1:])
    raise RuntimeError(f"rc={r.returncode}: {(r.stderr or r.stdout)[-1500:]}")


def step1_load():
    exe = kvring_bin()
    if not exe:
        return report(1, "load", "NOT RUN", "no kvring binary (GPU_CHECK_KVRING, PATH, target/release)")
    out = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=60, env=clean_env()).stdout
    gpus = next((l for l in out.splitlines() if l.startswith("gpus:")), "gpus: (no line)")
    ok = "none" not in gpus.split(":", 1)[1][:10]
    report(1, "load (kvring info lists the GPUs the driver reports)", "PASS" if ok else "FAIL", gpus.strip())


def transfer_step(step, name, label, conf=None, nofile=None):
    try:
        t = probe("transfer", label, conf, nofile)
    except Exception as error:  # noqa: BLE001 - any failure is this step's
        return report(step, name, "FAIL", str(error)[-600:]), None
    ok = t["write_verified"] and t["read_verified"] and t["transport"] == "cuda_ipc"
    report(step, name, "PASS" if ok else "FAIL",
           f"transport {t['transport']}, write verified {t['write_verified']}, read verified {t['read_verified']}")
    return None, t


def step2_no_side_effects(t):
    if t is None:
        return report(2, "no side effects on PyTorch", "FAIL", "the transfer it is read from failed")
    ok = t["current_device_unchanged"] and t["ctx_unchanged_after_register"] and t["ctx_unchanged_at_end"]
    import torch

    more = "" if torch.cuda.device_count() > 1 else "; one GPU: contexts on other GPUs cannot be looked for"
    report(2, "no side effects on PyTorch", "PASS" if ok else "FAIL",
           f"device unchanged {t['current_device_unchanged']}, context unchanged after register "
           f"{t['ctx_unchanged_after_register']} and at the end {t['ctx_unchanged_at_end']}{more}")


def step4_ranges():
    try:
        r = probe("ranges", "expandable", "expandable_segments:True")
    except Exception as error:  # noqa: BLE001
        return report(4, "expandable segments: the mapping, not the reservation", "FAIL", str(error)[-600:])
    base = r["base"]
    report(4, "expandable segments: the mapping, not the reservation", "PASS",
           f"RANGE_SIZE {base['RANGE_SIZE']} (the reservation) beside cuMemGetAddressRange "
           f"{base['GetAddressRange']} (what kvring sizes pieces by)")


def step5_copies():
    """Pageable host memory (a plain bytearray, never pinned) written into a
    peer's GPU memory over cuda_ipc, and read back."""
    import kvring
    import torch

    size = 8 << 20
    peer = subprocess.Popen([sys.executable, PROBE, "target"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=clean_env())
    try:
        info = json.loads(peer.stdout.readline())
        engine = kvring.Engine()
        host = bytearray(os.urandom(size))
        region = engine.register(host)
        engine.open_segment(info["addr"])
        engine.write(info["addr"], [(region, 0, info["region"], 0, size)])
        back = bytearray(size)
        back_region = engine.register(back)
        engine.read(info["addr"], [(back_region, 0, info["region"], 0, size)])
        ok = back == host
        report(5, "copies: pageable host <-> a peer's GPU (cuda_ipc)", "PASS" if ok else "FAIL",
               f"8 MiB written from a plain bytearray and read back: equal {ok}")
        engine.close()
    except Exception as error:  # noqa: BLE001
        report(5, "copies: pageable host <-> a peer's GPU (cuda_ipc)", "FAIL", f"{type(error).__name__}: {error}")
    finally:
        try:
            peer.stdin.write("exit\n")
            peer.stdin.flush()
            peer.wait(timeout=30)
        except Exception:  # noqa: BLE001
            peer.kill()
    if torch.cuda.device_count() < 2:
        report(5, "copies across GPUs (one process, two processes)", "NOT RUN", "this machine has one GPU")


def step6_wait_stream():
    """The wait must end with the work queued before the call, not wait for
    a 2 s kernel queued 100 ms after it (GPU-REVIEW #10)."""
    import kvring
    import torch

    engine = kvring.Engine()
    engine.register(torch.zeros(4096, dtype=torch.uint8, device="cuda"))  # loads the driver
    stream = torch.cuda.Stream()
    khz = ctypes.c_int(0)
    ctypes.CDLL("libcuda.so.1").cuDeviceGetAttribute(ctypes.byref(khz), 13, 0)  # CU_DEVICE_ATTRIBUTE_CLOCK_RATE
    cycles_per_s = (khz.value or 1_500_000) * 1e3
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(0.01 * cycles_per_s))
    took = {}

    def wait():
        start = time.monotonic()
        try:
            engine.wait_gpu_stream(0, stream.cuda_stream, 30.0)
            took["s"] = time.monotonic() - start
        except Exception as error:  # noqa: BLE001
            took["error"] = f"{type(error).__name__}: {error}"

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.1)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(2.0 * cycles_per_s))
    thread.join(60)
    stream.synchronize()
    engine.close()
    if "error" in took:
        return report(6, "*_on_cuda waits for work queued before the call only", "FAIL", took["error"])
    ok = took.get("s", 99) < 1.0
    report(6, "*_on_cuda waits for work queued before the call only", "PASS" if ok else "FAIL",
           f"returned after {took.get('s', float('nan')):.3f} s; a 2 s kernel was queued 0.1 s after the call")


def step7_dmabuf():
    lib = ctypes.CDLL("libcuda.so.1")
    value = ctypes.c_int(0)
    rc = lib.cuDeviceGetAttribute(ctypes.byref(value), 124, 0)  # CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
    report(7, "dma-buf", "NOT RUN",
           f"DMA_BUF_SUPPORTED = {value.value if rc == 0 else f'error {rc}'}; no RDMA NIC here to register one with")


def step8_failures():
    exe = kvring_bin()
    if exe:
        out = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=60,
                             env=clean_env(CUDA_VISIBLE_DEVICES="")).stdout
        gpus = next((l for l in out.splitlines() if l.startswith("gpus:")), "gpus: (no line)").strip()
        ok = "no CUDA driver" not in gpus and ("100" in gpus or "NO_DEVICE" in gpus.upper() or "no CUDA-capable" in gpus)
        report(8, "no visible GPU gives the driver's own error", "PASS" if ok else "FAIL", gpus)
    else:
        report(8, "no visible GPU gives the driver's own error", "NOT RUN", "no kvring binary")

    import kvring

    peer = subprocess.Popen([sys.executable, PROBE, "target"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=clean_env())
    info = json.loads(peer.stdout.readline())
    import torch

    src = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
    engine = kvring.Engine()
    region = engine.register(src)
    engine.open_segment(info["addr"])
    engine.write(info["addr"], [(region, 0, info["region"], 0, 64 << 20)])
    peer.kill()
    peer.wait()
    start = time.monotonic()
    outcome = "no error"
    try:
        for _ in range(50):
            engine.write(info["addr"], [(region, 0, info["region"], 0, 64 << 20)], timeout=10.0)
    except Exception as error:  # noqa: BLE001
        outcome = f"{type(error).__name__}: {str(error)[:200]}"
    took = time.monotonic() - start
    engine.close()
    ok = outcome != "no error" and took < 30
    report(8, "a peer killed (-9) between writes gives a typed error, not a hang", "PASS" if ok else "FAIL",
           f"after {took:.1f} s: {outcome}")
    stubs = "/usr/local/cuda/lib64/stubs"
    if exe and os.path.exists(os.path.join(stubs, "libcuda.so")):
        out = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=60,
                             env=clean_env(LD_LIBRARY_PATH=stubs)).stdout
        gpus = next((l for l in out.splitlines() if l.startswith("gpus:")), "").strip()
        report(8, "the stub libcuda.so first on the path", "PASS" if "34" in gpus or "stub" in gpus else "FAIL", gpus)
    else:
        report(8, "the stub libcuda.so first on the path", "NOT RUN", f"no stub library under {stubs}")


def main():
    step1_load()
    _, default = transfer_step(3, "legacy path: a slice of the default allocator, opened by a peer", "default")
    step2_no_side_effects(default)
    step4_ranges()
    transfer_step(4, "expandable segments: moved between processes", "expandable", "expandable_segments:True")
    transfer_step(4, "expandable segments under RLIMIT_NOFILE 1024", "expandable",
                  "expandable_segments:True", nofile=1024)
    report(4, "Docker's default seccomp", "NOT RUN", "no container runtime here (kvring no longer calls pidfd_getfd)")
    step5_copies()
    step6_wait_stream()
    step7_dmabuf()
    step8_failures()
    report(9, "the bench", "NOT RUN", "benches/gpu_check.sh runs it")
    failed = RESULTS.count("FAIL")
    print(f"{RESULTS.count('PASS')} passed, {failed} failed, {RESULTS.count('NOT RUN')} not run", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

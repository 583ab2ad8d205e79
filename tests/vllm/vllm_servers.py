"""vLLM servers on 127.0.0.1 and the toy proxy's two steps, for the checks
and the bench. Every wait has a deadline; every server is killed with its
process group when done."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
SHIMS = {"kvring-nixl": os.path.join(HERE, "shims", "nixl"), "kvring-mooncake": os.path.join(HERE, "shims", "mooncake")}
CPU_ACCELERATOR_SHIM = os.path.join(HERE, "shims", "cpu_accelerator")
SERVED_NAME = "tiny"
READY_DEADLINE_S = 300  # a server takes 20-50 s here; more with four starting on two cores
NUM_WORDS = 508


def prompts_of(lengths):
    """One prompt per length, of the tokenizer's words, all different."""
    return [" ".join(f"w{(i * 7 + n * 13) % NUM_WORDS}" for i in range(n)) for n in lengths]


def _connector_config(connector, name):
    if connector in ("nixl", "nixl-push"):
        name = "NixlConnector" if connector == "nixl" else "NixlPushConnector"
        return {"kv_connector": name, "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    if connector == "mooncake":
        return {
            "kv_connector": "MooncakeConnector",
            "kv_role": "kv_both",
            "engine_id": name,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        }
    raise ValueError(f"unknown connector {connector!r}")


class Server:
    """One ``vllm.entrypoints.openai.api_server`` process on 127.0.0.1,
    serving the model folder ``model`` by its relative name from its parent.

    ``connector``: None (a single instance), "nixl", "nixl-push" or
    "mooncake";
    ``impl``: whose library the connector gets, "kvring" (the shim on
    PYTHONPATH) or "native" (the installed nixl / mooncake package)."""

    def __init__(self, name, model, port, core, logdir, connector=None, side_port=None, impl="kvring"):
        self.name, self.model, self.port, self.core = name, model, port, core
        self.connector, self.side_port, self.impl = connector, side_port, impl
        self.engine_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.log_path = os.path.join(logdir, f"{name}.log")
        self.url = f"http://127.0.0.1:{port}"
        self.proc = None

    def command(self):
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", os.path.basename(self.model), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enforce-eager", "--dtype", "float32", "--max-model-len", "256", "--block-size", "32",
            "--no-enable-prefix-caching", "--seed", "0", "--max-num-seqs", "8",
        ]
        if self.connector:
            cmd += ["--kv-transfer-config", json.dumps(_connector_config(self.connector, self.engine_id))]
        return cmd

    def environment(self):
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
            VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=str(self.core),
            OMP_NUM_THREADS="1",
        )
        # Absolute: the server runs in its model's folder.
        paths = [os.path.abspath(p) for p in env.get("KVRING_VLLM_PYTHONPATH", "").split(os.pathsep) if p]
        if self.connector in ("nixl", "nixl-push"):
            env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_port))
        if self.connector == "mooncake":
            env.update(VLLM_MOONCAKE_BOOTSTRAP_PORT=str(self.side_port))
            # vLLM's MooncakeConnector asks torch for an accelerator it does
            # not use on CPU (see shims/cpu_accelerator/sitecustomize.py).
            paths.append(CPU_ACCELERATOR_SHIM)
        if self.connector and self.impl == "kvring":
            paths.insert(0, SHIMS["kvring-mooncake" if self.connector == "mooncake" else "kvring-nixl"])
        inherited = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(paths + inherited)
        return env

    def start(self):
        log = open(self.log_path, "ab")
        log.write(f"\n=== start {' '.join(self.command())}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.command(), env=self.environment(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     cwd=os.path.dirname(self.model))
        log.close()

    def wait_ready(self, deadline_s=READY_DEADLINE_S):
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; last lines:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} not ready in {deadline_s} s; last lines:\n{self.tail()}")

    def tail(self, lines=30):
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return "(no log)"

    def stop(self):
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # The engine core and its helpers share the group: make sure none is left.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def restart(self):
        """Killed at once (a crash, not a shutdown), then started again on
        the same ports with a new engine id."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.engine_id = f"{self.name}-{uuid.uuid4().hex[:8]}"
        self.start()
        self.wait_ready()

    def log_mark(self):
        """Where the log ends now, for ``log_since``."""
        try:
            return os.path.getsize(self.log_path)
        except OSError:
            return 0

    def log_since(self, mark):
        with open(self.log_path, "rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace")

    def metrics(self):
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            return resp.read().decode()

    def metric(self, name):
        """The sum of a metric's samples (every label set), or 0."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def running_line(self):
        try:
            return "; ".join(l for l in self.metrics().splitlines()
                             if re.match(r"vllm:num_requests_(running|waiting)\b", l))
        except OSError as error:
            return str(error)

    def wait_idle(self, deadline_s):
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            try:
                if self.metric("vllm:num_requests_running") == 0 and self.metric("vllm:num_requests_waiting") == 0:
                    return True
            except OSError:
                pass
            time.sleep(0.5)
        return False


def threads_of(pid):
    """Each thread's name, state and the kernel function it sleeps in: the
    native side of a stall (kvring's threads are named), no debugger needed."""
    rows = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        fields = []
        for name in ("comm", "wchan", "syscall"):
            try:
                with open(f"/proc/{pid}/task/{tid}/{name}") as f:
                    fields.append(f.read().strip().split(" ")[0])
            except OSError:
                fields.append("?")
        rows.append(f"  tid {tid} {fields[0]:<16} wchan={fields[1]} syscall={fields[2]}")
    return "\n".join(rows)


def dump_stacks(servers, why):
    """Prints every process of each server, its Python stacks (py-spy, from
    the venv) and the last warnings of its log: what a stall was waiting on,
    in the CI log, since a stall cannot be attached to after the run."""
    import shutil

    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    print(f"--- stacks ({why})", flush=True)
    for server in servers:
        if server.proc is None or server.proc.poll() is not None:
            continue
        pids = subprocess.run(["pgrep", "-g", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                with open(f"/proc/{pid}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue
            if "resource_track" in comm or not spy:
                continue
            print(f"[{server.name} pid {pid} {comm}]\n{threads_of(pid)}", flush=True)
            try:
                # --nonblocking: a process stopped by a tracer can hang a
                # blocking dump (seen on a stalled worker).
                out = subprocess.run([spy, "dump", "--nonblocking", "--pid", pid], capture_output=True, text=True,
                                     timeout=30)
                lines = [l for l in (out.stdout + out.stderr).splitlines() if "_bootstrap" not in l]
            except subprocess.TimeoutExpired:
                lines = ["(py-spy did not answer in 30 s)"]
            print("\n".join(lines[:80]), flush=True)
        noted = [l for l in server.tail(400).splitlines()
                 if re.search(r"WARN|ERROR|kvring|Mooncake|mooncake", l) and "/health" not in l]
        print(f"[{server.name} log]\n" + "\n".join(noted[-25:]), flush=True)
    if not spy:
        print("(py-spy not installed: no stacks)", flush=True)
    print("--- end of stacks", flush=True)


def stop_all(servers):
    for s in servers:
        s.stop()


def complete(url, prompt, max_tokens, kv_transfer_params=None, timeout=120, request_id=None):
    """One /v1/completions request, greedy. Returns the text and
    kv_transfer_params, or {"error": ...} (an HTTP error's body, or "client
    timeout" when the client gave up first)."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": False}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        # As vLLM's toy proxy: one id for both steps (the push connector
        # matches prefill's blocks to decode's registration by it).
        headers["X-Request-Id"] = request_id
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers=headers)
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            out = json.loads(resp.read())
    except urllib.error.HTTPError as error:
        return {"error": f"HTTP {error.code}: {error.read().decode(errors='replace')[:300]}"}
    except TimeoutError:  # socket.timeout is TimeoutError since Python 3.10
        return {"error": "client timeout"}
    except urllib.error.URLError as error:
        if isinstance(error.reason, TimeoutError):
            return {"error": "client timeout"}
        return {"error": f"URLError: {error.reason}"}
    elapsed = time.perf_counter() - start
    return {"text": out["choices"][0]["text"], "kv_transfer_params": out.get("kv_transfer_params"),
            "elapsed_s": elapsed}


def disagg_nixl(prefill, decode, prompt, max_tokens, only_prefill=False):
    """vLLM's toy proxy for NixlConnector: prefill (max_tokens=1,
    do_remote_decode), then decode with the kv_transfer_params it returned,
    both under one X-Request-Id."""
    request_id = uuid.uuid4().hex
    first = complete(prefill.url, prompt, 1, request_id=request_id, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    if "error" in first:
        return first
    params = first.get("kv_transfer_params")
    if only_prefill:
        return params
    if not params:
        return {"error": f"prefill returned no kv_transfer_params: {first!r}"}
    return complete(decode.url, prompt, max_tokens, kv_transfer_params=params, request_id=request_id)


def disagg_mooncake(prefill, decode, prompt, max_tokens, only_prefill=False):
    """vLLM's Mooncake proxy's two steps: prefill with do_remote_decode and a
    transfer id; decode with do_remote_prefill, the prefill's engine id and
    bootstrap address, and the same transfer id. Prefill holds the blocks
    until decode asks for them."""
    transfer_id = f"xfer-{uuid.uuid4().hex}"
    first = complete(prefill.url, prompt, 1,
                     kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id})
    if "error" in first:
        return first
    params = {"do_remote_prefill": True, "remote_engine_id": prefill.engine_id,
              "remote_bootstrap_addr": f"http://127.0.0.1:{prefill.side_port}", "transfer_id": transfer_id}
    if only_prefill:
        return params
    return complete(decode.url, prompt, max_tokens, kv_transfer_params=params)

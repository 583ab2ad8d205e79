"""Two hosts on one machine, for the check's cross-host mode.

Prefill runs in one network namespace and decode in another, joined by a
veth pair: tests/netns.rs's recipe (``ip netns add``, a veth pair, an
address on each end), so the two sides reach each other only through
their veth addresses, over tcp.

The transport is left to kvring's order, and the check asserts it took
tcp. The two namespaces share the machine's boot id and hostname (kvring's
host id), its pid namespace and /dev/shm, so nothing but kvring's own
reasoning keeps it off shm and cma: before trusting a same-host peer, the
initiator looks for the other end of its control connection among the
claimed pid's sockets in its own network namespace, and a peer in another
namespace is not found there, so kvring treats it as another host
(``src/transport/cma/owner.rs``). ``one_namespace_transport`` is the
control: two engines in one of the namespaces, where kvring's order takes
cma; so "tcp" across the two is the namespace boundary's doing.

Needs root and iproute2's ``ip``; ``unavailable()`` says why not.
"""

import ctypes
import fcntl
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys

CLONE_NEWNET = 0x40000000  # <sched.h>, setns(2)
PREFIX = "kvpd"  # namespaces are PREFIX<pid><a|b>: unique per run, swept once their run is gone
# Each run holds a lock on MARKS/PREFIX<pid> while its namespaces live: the
# mark says "this example made them", the lock "its run is alive", across
# pid namespaces too (where a live run's pid is absent from our /proc).
MARKS = "/run/kvring-pd"


def ip(*args):
    """Runs ``ip ARGS``; raises with its stderr on failure."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def unavailable():
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if subprocess.run(["ip", "netns", "list"], capture_output=True, timeout=30).returncode != 0:
        return "`ip netns list` failed"
    return None


def _lock(path, create):
    """An fd of ``path`` holding its exclusive lock, or None: the file is
    absent (and not ``create``), another process holds it, or it was
    replaced while we waited (its owner deleted it: ours is stale)."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != os.stat(path).st_ino:
            raise FileNotFoundError(path)
    except OSError:
        os.close(fd)
        return None
    return fd


def sweep():
    """Deletes namespaces a previous run of this example left (killed
    before its cleanup ran: SIGKILL): only those whose mark under MARKS no
    live run holds. A namespace of this name without a mark was not made
    here, and a marked one whose run lives (in any pid namespace) is left
    alone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for run in sorted(set(re.findall(rf"^({PREFIX}\d+)[ab]\b", listed, re.M))):
        mark = os.path.join(MARKS, run)
        fd = _lock(mark, create=False)
        if fd is None:
            continue
        try:
            for side in "ab":
                subprocess.run(["ip", "netns", "del", run + side], capture_output=True, timeout=30)
            os.unlink(mark)
        finally:
            os.close(fd)


class TwoHosts:
    """Namespaces ``a`` (prefill) and ``b`` (decode) joined by a veth pair,
    deleted on leaving the ``with`` block, whatever ends it (an exception,
    Ctrl-C, SIGTERM: turned into SystemExit so the ``finally`` runs)."""

    def __init__(self):
        pid = os.getpid()
        self.a, self.b = f"{PREFIX}{pid}a", f"{PREFIX}{pid}b"
        subnet = 100 + pid % 150  # 10.214.x.0/24: one per run; the namespaces never route to each other's
        self.a_ip, self.b_ip = f"10.214.{subnet}.1", f"10.214.{subnet}.2"
        self.veth = (f"kvpa{pid}", f"kvpb{pid}")
        self.made = []
        self.veth_made = False
        self.mark = None  # (path, locked fd) while this run's namespaces may exist
        self.previous_term = None
        # The cluster's pre-shared token (KVRING_TOKEN): engines listening
        # beyond loopback should have one, as between real hosts.
        self.token = secrets.token_hex(16)

    def __enter__(self):
        sweep()
        self.previous_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            va, vb = self.veth
            os.makedirs(MARKS, mode=0o700, exist_ok=True)
            path = os.path.join(MARKS, f"{PREFIX}{os.getpid()}")
            fd = _lock(path, create=True)
            if fd is None:
                raise RuntimeError(f"{path} is held by a live run (same pid in another pid namespace?)")
            self.mark = (path, fd)
            for ns in (self.a, self.b):
                ip("netns", "add", ns)
                self.made.append(ns)
            ip("link", "add", va, "type", "veth", "peer", "name", vb)
            self.veth_made = True  # from here the veth is ours to delete
            ip("link", "set", va, "netns", self.a)  # the veth pair goes with the namespaces
            ip("link", "set", vb, "netns", self.b)
            for ns, dev, addr in ((self.a, va, self.a_ip), (self.b, vb, self.b_ip)):
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                ip("-n", ns, "link", "set", dev, "up")
                ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made = []
        if self.previous_term is not None:
            signal.signal(signal.SIGTERM, self.previous_term)
            self.previous_term = None
        if self.veth_made:  # never one of this name that was there before
            subprocess.run(["ip", "link", "del", self.veth[0]], capture_output=True, timeout=30)  # if it never moved
            self.veth_made = False
        if self.mark is not None:
            path, fd = self.mark
            os.unlink(path)  # before the lock goes: a sweeper that then locks finds it replaced
            os.close(fd)
            self.mark = None

    def place(self, role):
        """Where a worker of ``role`` runs: (namespace, address, token)."""
        return (self.a if role == "prefill" else self.b, self.a_ip if role == "prefill" else self.b_ip, self.token)


def enter(place):
    """Moves this process into ``place``'s network namespace, as ``ip netns
    exec`` does (setns), and sets the cluster's token. Only the calling
    thread moves: called first thing in a worker, before its kvring engine
    starts the threads that inherit the namespace from it."""
    ns, _, token = place
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)
    os.environ["KVRING_TOKEN"] = token
    # kvring warns at each handshake that the peer it reached is not the
    # process of this namespace its descriptor names (so no shm or cma):
    # expected here, and the Python KV-layer calls handshake once per push
    # (they ask the peer for its layout), so say it once per peer.
    logging.getLogger("kvring.transport.cma.owner").addFilter(_Once())


class _Once(logging.Filter):
    """Lets each distinct message through once."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def filter(self, record):
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


def hosted(place, main, *args):
    """A worker's process target: ``main(*args)`` inside ``place``."""
    enter(place)
    main(*args)


# The control: two kvring engines in one namespace, each in a process of
# its own started by `ip netns exec` (tests/netns.rs's way). The target
# prints its address and holds a buffer of its own (what cma reaches)
# until its stdin closes.
_TARGET = """
import sys, kvring
engine = kvring.Engine(name="ctl-b", listen=sys.argv[1] + ":0")
memory = bytearray(1 << 16)
engine.register(memory)
print(engine.control_addr, flush=True)
sys.stdin.read()
"""
_INITIATOR = """
import sys, kvring
engine = kvring.Engine(name="ctl-a", listen=sys.argv[1] + ":0")
print(engine.open_segment(sys.argv[2]), flush=True)
"""


def one_namespace_transport(hosts, timeout=120):
    """The transport kvring's order takes between two processes of one
    namespace (decode's), started as the workers are but side by side."""
    env = dict(os.environ, KVRING_TOKEN=hosts.token)
    target = subprocess.Popen(
        ["ip", "netns", "exec", hosts.b, sys.executable, "-c", _TARGET, hosts.b_ip],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )
    try:
        addr = target.stdout.readline().strip()
        if not addr:
            raise RuntimeError("the control's target printed no address")
        done = subprocess.run(
            ["ip", "netns", "exec", hosts.b, sys.executable, "-c", _INITIATOR, hosts.b_ip, addr],
            capture_output=True, text=True, timeout=timeout, env=env,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the control's initiator failed: {done.stderr.strip()}")
        return done.stdout.strip()
    finally:
        target.stdin.close()
        try:
            target.wait(timeout=30)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait()

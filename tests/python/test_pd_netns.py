"""examples/pd/netns.py's cleanup deletes only what its own run made: not
an interface of its veth's name that was there before, not a namespace of
its naming scheme that it did not mark, not one whose run is alive (in any
pid namespace: the mark's lock says so, not /proc). Needs root and
iproute2, as the example does (CI runs as root)."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "pd"))
import netns  # noqa: E402

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))


def namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split()


def link_exists(name):
    return subprocess.run(["ip", "link", "show", name], capture_output=True, timeout=30).returncode == 0


def test_a_failed_run_leaves_an_interface_of_its_veths_name_that_was_there_before():
    pid = os.getpid()
    netns.ip("link", "add", f"kvpa{pid}", "type", "veth", "peer", "name", f"kvpx{pid}")
    try:
        with pytest.raises(RuntimeError, match="link add"):
            with netns.TwoHosts():
                pass
        assert link_exists(f"kvpa{pid}"), "the run deleted an interface it did not create"
        assert f"{netns.PREFIX}{pid}a" not in namespaces(), "the failed run left its namespace"
        assert not os.path.exists(os.path.join(netns.MARKS, f"{netns.PREFIX}{pid}"))
    finally:
        subprocess.run(["ip", "link", "del", f"kvpa{pid}"], capture_output=True, timeout=30)


def test_sweep_deletes_only_marked_namespaces_whose_run_is_gone():
    os.makedirs(netns.MARKS, exist_ok=True)
    unmarked, live, dead = (f"{netns.PREFIX}{n}" for n in (999991, 999992, 999993))
    holder = None
    try:
        for run in (unmarked, live, dead):
            netns.ip("netns", "add", run + "a")
        # A live run (as another pid namespace's would be: no /proc entry
        # here) holds its mark's lock.
        code = (
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()"
        )
        holder = subprocess.Popen(
            [sys.executable, "-c", code, os.path.join(netns.MARKS, live)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert holder.stdout.readline().strip() == "held"
        open(os.path.join(netns.MARKS, dead), "w").close()  # marked, its run gone (SIGKILL)
        netns.sweep()
        listed = namespaces()
        assert unmarked + "a" in listed, "swept a namespace this example did not mark"
        assert live + "a" in listed, "swept a live run's namespace"
        assert dead + "a" not in listed, "left a dead run's namespace"
        assert not os.path.exists(os.path.join(netns.MARKS, dead))
    finally:
        if holder is not None:
            holder.stdin.close()
            holder.wait(timeout=30)
        for run in (unmarked, live, dead):
            subprocess.run(["ip", "netns", "del", run + "a"], capture_output=True, timeout=30)
            try:
                os.unlink(os.path.join(netns.MARKS, run))
            except FileNotFoundError:
                pass


def test_a_run_deletes_its_namespaces_veth_and_mark_on_leaving():
    with netns.TwoHosts() as hosts:
        mark = os.path.join(netns.MARKS, f"{netns.PREFIX}{os.getpid()}")
        assert hosts.a in namespaces() and hosts.b in namespaces() and os.path.exists(mark)
    assert hosts.a not in namespaces() and hosts.b not in namespaces()
    assert not link_exists(hosts.veth[0]) and not os.path.exists(mark)

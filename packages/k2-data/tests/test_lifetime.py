"""k2_data.lifetime: a parent's children die with it, SIGKILL included, and nothing else does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from k2_data import lifetime

# the parent: children of every kind a k2 command has, then their pids on stdout
PARENT = textwrap.dedent(
    """
    import multiprocessing as mp, os, subprocess, sys, time
    from k2_data import lifetime

    def idle():
        time.sleep(120)

    if __name__ == "__main__":
        lifetime.spawn(["bash", "-c", "sleep 120 & sleep 120"])           # a tied tree
        lifetime.spawn(["bash", "-c", "trap '' TERM; sleep 120"])         # deaf to SIGTERM
        subprocess.Popen(["sleep", "120"], start_new_session=True)        # a session of its own
        spawn = mp.get_context("spawn")
        queue = spawn.SimpleQueue()                                       # starts the resource tracker
        spawn.Process(target=idle).start()
        mp.get_context("fork").Process(target=idle).start()               # holds the watchdog's pipe
        lifetime.adopt()
        time.sleep(1.0)
        print(os.getpid(), lifetime.tether().group, flush=True)
        if sys.argv[1] == "exit":
            os._exit(0)
        time.sleep(120)
    """
)


def _start_parent(tmp_path, how: str) -> tuple[subprocess.Popen, int, int]:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.Popen(
        [sys.executable, str(script), how], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    pid, group = map(int, proc.stdout.readline().split())
    return proc, pid, group


def _wait_gone(procs: dict[int, int], within_s: float) -> dict[int, int]:
    deadline = time.monotonic() + within_s
    while True:
        left = {p: s for p, s in procs.items() if lifetime.alive(p, s)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _kinds(tree: dict[int, int]) -> list[str]:
    cmds = []
    for pid in tree:
        try:
            cmds.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode())
        except OSError:
            pass
    return cmds


def test_sigkill_of_the_parent_takes_every_child_with_it(tmp_path):
    bystander = subprocess.Popen(["sleep", "60"])  # ours, not the parent's: must survive
    proc, pid, group = _start_parent(tmp_path, "sleep")
    try:
        tree = lifetime.descendants(pid)
        cmds = _kinds(tree)
        # the watchdog, 2 bash trees (bash may exec its last command), a new session, the tracker,
        # a spawned and a forked worker
        assert len(tree) >= 8, cmds
        assert any("resource_tracker" in c for c in cmds) and group in tree
        assert sum(os.getpgid(p) == group for p in tree) >= 4  # the watchdog and the spawned trees
        os.kill(pid, signal.SIGKILL)
        proc.wait()
        # SIGTERM, then SIGKILL after GRACE_S for the one that ignores it
        assert _wait_gone(tree, lifetime.GRACE_S + 5) == {}
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        proc.kill()
        proc.wait()


def test_a_normal_exit_stops_children_left_running(tmp_path):
    proc, pid, _ = _start_parent(tmp_path, "exit")
    tree = lifetime.descendants(pid)  # read before the parent's exit re-parents them
    proc.wait()
    assert proc.returncode == 0
    assert _wait_gone(tree, lifetime.GRACE_S + 5) == {}


def test_the_watchdog_records_pid_and_start_time():
    """A recorded pid is signalled only while its start time matches (a reused pid is someone
    else's), and `descendants` sees grandchildren."""
    child = subprocess.Popen(["bash", "-c", "sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(tree := lifetime.descendants(os.getpid())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.pid in tree and len(tree) >= 2
        start = lifetime.start_time(child.pid)
        assert lifetime.alive(child.pid, start) and not lifetime.alive(child.pid, start + 1)
    finally:
        for p in lifetime.descendants(child.pid):
            os.kill(p, signal.SIGKILL)
        child.kill()
        child.wait()

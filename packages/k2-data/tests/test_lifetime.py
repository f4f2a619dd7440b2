"""k2_data.lifetime: a parent's children die with it, SIGKILL included, and nothing else does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from k2_data import lifetime

# the parent: children of every kind a k2 command has, then their pids on stdout
PARENT = textwrap.dedent(
    """
    import json, multiprocessing as mp, os, subprocess, sys, time
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
        # a session whose leader exits at once, leaving a process behind (a server's helper)
        sh = subprocess.Popen(["sh", "-c", "sleep 120 & exec sleep 0.3"], start_new_session=True)
        while not (left_behind := lifetime.descendants(sh.pid)):
            time.sleep(0.01)
        lifetime.adopt()  # returns once the watchdog has recorded them
        time.sleep(1.0)
        print(os.getpid(), lifetime.tether().group, json.dumps(left_behind), flush=True)
        if sys.argv[1] == "exit":
            sys.stdin.readline()  # the test has read the tree
            os._exit(0)
        time.sleep(120)
    """
)


def _start_parent(tmp_path, how: str) -> tuple[subprocess.Popen, int, int, dict[int, int]]:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.Popen(
        [sys.executable, str(script), how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    pid, group, left_behind = proc.stdout.readline().split(" ", 2)
    return proc, int(pid), int(group), {int(k): v for k, v in json.loads(left_behind).items()}


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
    proc, pid, group, left_behind = _start_parent(tmp_path, "sleep")
    try:
        tree = lifetime.descendants(pid)
        assert len(left_behind) == 1 and not set(left_behind) & set(tree)  # re-parented away
        tree.update(left_behind)
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
    proc, pid, _, left_behind = _start_parent(tmp_path, "exit")
    tree = {**lifetime.descendants(pid), **left_behind}  # read before the parent's exit re-parents them
    assert len(tree) >= 9
    proc.stdin.write("exit\n")
    proc.stdin.flush()
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


@pytest.mark.slow  # a real `k2 data agentic` with a live MCP server and a sandboxed program
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
def test_sigkill_of_k2_data_agentic_stops_its_mcp_servers_and_sandboxes(tmp_path):
    """The agent calls the kvstore MCP server (live for the whole trajectory), then runs a program
    that sleeps in the sandbox; the pipeline is SIGKILLed while both run. The server is started by
    a script that leaves a background process in its session (as `npx` leaves node): the server
    itself exits when its stdin closes, that process does not."""
    pytest.importorskip("mcp")
    server_cmd = tmp_path / "kvstore.sh"
    server_cmd.write_text(
        f"#!/bin/sh\nsleep 120 &\nexec {sys.executable} -m k2_data.agentic.servers.kvstore\n"
    )
    server_cmd.chmod(0o755)
    from k2_data.agentic.scripted import ScriptedTeacher
    from k2_data.loopback import LoopbackServer

    plan = [("kv_set", {"key": "a", "value": "1"}), ("run_python", {"code": "import time; time.sleep(120)"})]
    with LoopbackServer(ScriptedTeacher(plan=plan)) as server:
        # the CLI of `k2 data agentic`
        proc = subprocess.Popen(
            [sys.executable, "-m", "k2_data.agentic", "--out", str(tmp_path / "o"), "--base-url",
             server.base_url, "--model", "t", "--mcp-server", str(server_cmd), "--code-tool",
             "--code-timeout-s", "300", "--agents", "1", "--tasks-per-agent", "1",
             "--tools-per-agent", "5", "--edge-rate", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while True:  # until the MCP server and the sandboxed program run side by side
                assert proc.poll() is None, proc.stderr.read()[-3000:]
                assert time.monotonic() < deadline, "the MCP server and the sandbox did not both start"
                tree = lifetime.descendants(proc.pid)
                cmds = _kinds(tree)
                if any("servers.kvstore" in c for c in cmds) and any("main.py" in c for c in cmds):
                    break
                time.sleep(0.2)
            assert any("_sandbox_launcher" in c for c in cmds) and any(c == "sleep 120 " for c in cmds), cmds
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            assert _wait_gone(tree, lifetime.GRACE_S + 5) == {}, _kinds(tree)
        finally:
            proc.kill()
            proc.wait()

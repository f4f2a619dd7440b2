"""k2_rl.rewards.code.code_reward: 1.0 only when the tests run to their end, in the sandbox."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from k2_data import sandbox
from k2_data import unit_tests as grader  # the protocol code_reward runs
from k2_rl.rewards.code import code_reward

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux"),
    pytest.mark.skipif(os.geteuid() != 0, reason="full containment needs root (uid drop, namespaces)"),
]

PROGRAM = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(1, 2) == 3\nassert add(-5, 5) == 0\nassert add('a', 'b') == 'ab'\n"
SLACK_S = 3.0


def timed(program: str, tests: str = TESTS, timeout_s: float = 10.0) -> tuple[float, float]:
    t0 = time.monotonic()
    r = code_reward(textwrap.dedent(program), tests, timeout_s=timeout_s)
    return r, time.monotonic() - t0


@pytest.fixture
def spy(monkeypatch):
    """Record the SandboxResult of each code_reward call."""
    results = []

    def run_python(*args, **kwargs):
        res = sandbox.run_python(*args, **kwargs)
        results.append(res)
        return res

    monkeypatch.setattr(grader, "run_python", run_python)
    return results


def test_correct_program():
    r, dt = timed(PROGRAM)
    assert r == 1.0 and dt < 5


def test_failing_assert():
    assert timed(PROGRAM, TESTS + "assert add(2, 2) == 5\n")[0] == 0.0


def test_syntax_and_runtime_errors():
    assert timed("def add(a, b:\n    return a + b\n")[0] == 0.0
    assert timed(PROGRAM, TESTS + "assert (\n")[0] == 0.0
    assert timed("def add(a, b):\n    return undefined_name\n")[0] == 0.0


def test_infinite_loop_times_out():
    r, dt = timed(PROGRAM + "while True:\n    pass\n", timeout_s=2)
    assert r == 0.0 and dt < 2 + SLACK_S


def test_fork_bomb(spy):
    r, dt = timed(
        """
        import os
        print(os.getuid(), flush=True)
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """,
        timeout_s=2,
    )
    assert r == 0.0 and dt < 2 + SLACK_S
    assert sandbox.uid_processes(int(spy[-1].stdout.split()[0])) == []
    assert timed(PROGRAM)[0] == 1.0  # the machine is fine afterwards


def test_memory_4gb(spy):
    r, dt = timed(PROGRAM + "hog = bytearray(4 << 30)\n")
    assert r == 0.0 and dt < 5
    assert spy[-1].killed_reason == "memory"


def test_network_is_unavailable():
    prog = PROGRAM + textwrap.dedent(
        """
        import socket
        def fetch():
            s = socket.create_connection(("127.0.0.1", 22), timeout=2)
            return s
        """
    )
    assert timed(prog, TESTS + "assert fetch()\n")[0] == 0.0
    # the same program passes when the tests only need that connecting fails
    tests = TESTS + "try:\n    fetch()\n    assert False, 'connected'\nexcept OSError:\n    pass\n"
    assert timed(prog, tests)[0] == 1.0


def test_cannot_write_outside_workdir():
    prog = PROGRAM + textwrap.dedent(
        """
        import os
        def try_write(path):
            try:
                with open(path, "w") as f:
                    f.write("x")
                return True
            except OSError:
                return False
        """
    )
    tests = TESTS + (
        "assert not try_write('/tmp/k2_reward_escape')\n"
        "assert not try_write('/root/k2_reward_escape')\n"
        "assert not try_write('/var/tmp/k2_reward_escape')\n"
        "assert try_write('inside.txt')\n"
    )
    assert timed(prog, tests)[0] == 1.0
    assert not os.path.exists("/tmp/k2_reward_escape") and not os.path.exists("/root/k2_reward_escape")


def test_cannot_read_tests_or_nonce(monkeypatch, spy):
    """The program hunts for the tests and the nonce in files, fds, /proc and its own memory."""
    nonce = "feedfacecafebeef0123456789abcdef"
    monkeypatch.setattr(grader.secrets, "token_hex", lambda n: nonce)
    marker = "K2_HIDDEN_TEST_MARKER_91"
    attack = textwrap.dedent(
        f"""
        import gc, os, re, sys
        # kept reversed so that the patterns themselves are not in gc-visible objects
        REVERSED = [{nonce[::-1]!r}, {marker[::-1]!r}]
        found = []

        def scan(where, data):
            if isinstance(data, str):
                data = data.encode(errors="replace")
            if any(p[::-1].encode() in data for p in REVERSED):
                found.append(where)

        for fd in range(3, 256):
            try:
                scan(f"fd{{fd}}", os.pread(fd, 1 << 20, 0))
            except OSError:
                pass
        for root in ["/tmp", "/var/tmp", "/dev/shm", ".", "/run"]:
            for dirpath, _, names in os.walk(root):
                for n in names:
                    try:
                        with open(os.path.join(dirpath, n), "rb") as f:
                            scan(n, f.read(1 << 20))
                    except OSError:
                        pass
        for pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
            for what in ["cmdline", "environ"]:
                try:
                    with open(f"/proc/{{pid}}/{{what}}", "rb") as f:
                        scan(what, f.read())
                except OSError:
                    pass
            try:  # the memory of every process we can see (the notary is non-dumpable)
                with open(f"/proc/{{pid}}/maps") as maps, open(f"/proc/{{pid}}/mem", "rb", 0) as mem:
                    for line in maps:
                        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                        if "rw" in line.split()[1] and hi - lo < (64 << 20):
                            try:
                                mem.seek(lo)
                                scan(f"mem{{pid}}", mem.read(hi - lo))
                            except (OSError, ValueError, OverflowError):
                                pass
            except OSError:
                pass
        for obj in gc.get_objects():
            if isinstance(obj, (dict, list, tuple)):
                scan("gc", repr(obj)[:100000])
        if found:
            print("FOUND", found)
            print(REVERSED[0][::-1])  # a leak would score 1.0 here
            sys.stdout.flush()
            os._exit(0)
        print("ATTACK DONE: nothing found")
        sys.stdout.flush()
        os._exit(0)
        """
    )
    tests = f"# {marker}\nassert add(1, 2) == 3\n"
    r, _ = timed(PROGRAM + attack, tests)
    assert r == 0.0
    assert "ATTACK DONE: nothing found" in spy[-1].stdout, spy[-1].stdout + spy[-1].stderr


def test_kill_parent_does_not_help():
    r, _ = timed(PROGRAM + "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n")
    assert r == 0.0  # PermissionError: the parent is another uid
    r, _ = timed(
        PROGRAM
        + "import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError:\n    pass\n"
    )
    assert r == 1.0  # the driver survived and still printed the nonce


def test_early_exits_score_zero():
    assert timed(PROGRAM + "import os\nos._exit(0)\n")[0] == 0.0
    assert timed(PROGRAM + "import sys\nsys.exit(0)\n")[0] == 0.0
    assert timed(PROGRAM, "import sys\nassert add(1, 2) == 3\nsys.exit(0)\nassert add(1, 1) == 5\n")[0] == 0.0
    assert timed(PROGRAM + "raise KeyboardInterrupt\n")[0] == 0.0
    # exiting from an atexit hook or a thread after a failed test does not help either
    prog = PROGRAM + "import atexit, os\natexit.register(lambda: os._exit(0))\n"
    assert timed(prog, TESTS + "assert add(1, 1) == 5\n")[0] == 0.0


def test_fake_nonce_scores_zero():
    prog = PROGRAM + textwrap.dedent(
        """
        import os, secrets, sys
        for _ in range(100):
            print(secrets.token_hex(16))
        print("OK\\nPASSED\\n" + "0" * 32)
        sys.stdout.flush()
        os._exit(0)
        """
    )
    assert timed(prog)[0] == 0.0


def test_huge_output_is_capped(spy):
    r, dt = timed(PROGRAM + "import sys\nwhile True:\n    sys.stdout.write('y' * 65536)\n", timeout_s=10)
    assert r == 0.0 and dt < 5
    assert spy[-1].killed_reason == "output" and len(spy[-1].stdout) <= 64_000


def test_parallel_rewards(spy):
    prog = PROGRAM + "import os\nprint(os.getuid())\n"
    programs = [prog] * 12 + [prog + "assert False\n"] * 4
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        rewards = list(pool.map(lambda p: code_reward(p, TESTS, timeout_s=20), programs))
    assert rewards == [1.0] * 12 + [0.0] * 4
    assert time.monotonic() - t0 < 20
    uids = {int(r.stdout.split()[0]) for r in spy}
    assert len(spy) == 16 and all(sandbox.uid_processes(uid) == [] for uid in uids)


def test_registered_code_reward_reads_the_fenced_program_and_the_tasks_tests():
    from k2_rl.rewards import get_reward

    reward = get_reward("code")
    response = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert reward("write add", response, {"tests": "assert add(2, 3) == 5"}) == 1.0
    assert reward("write add", response, {"tests": "assert add(2, 3) == 6"}) == 0.0

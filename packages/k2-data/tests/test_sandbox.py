"""k2_data.sandbox: limits, containment (network, filesystem, signals, processes), parallel runs."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest
from k2_data.sandbox import run_many, run_python, sandbox_status, uid_processes

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux"),
    pytest.mark.skipif(os.geteuid() != 0, reason="full containment needs root (uid drop, namespaces)"),
]
NOBODY = 65534


def run(code: str, **kw):
    return run_python(textwrap.dedent(code), **kw)


def test_contained_on_this_machine():
    st = sandbox_status()
    assert st["namespaces"] is True and st["network_isolated"] is True, st
    assert st["uid_drop"] is True and st["degraded_reason"] is None


def test_basic_io_files_identity_env():
    r = run(
        """
        import os, sys
        data = sys.stdin.read()
        print(data.upper(), end="")
        print(open("data/in.txt").read())
        print(os.getuid(), os.getgid(), os.getgroups(), os.getcwd())
        print(os.environ.get("HOME"), os.environ.get("PATH"), sorted(os.environ))
        print(sys.flags.isolated, sys.flags.no_site, sys.executable)
        sys.stderr.write("err\\n")
        """,
        stdin="hello\n",
        files={"data/in.txt": "payload"},
    )
    assert r.ok and r.returncode == 0 and r.killed_reason is None and not r.timed_out
    out = r.stdout.splitlines()
    assert out[0] == "HELLO" and out[1] == "payload"
    uid, gid, groups, cwd = out[2].split(" ", 3)
    assert int(uid) != 0 and int(uid) == int(gid) and groups == "[]"
    assert cwd == "/tmp/sandbox"
    assert "/root" not in out[3] and out[3].startswith("/tmp/sandbox /usr/bin:/bin")
    assert out[4] == "1 1 /usr/bin/python3"
    assert r.stderr == "err\n" and r.duration_s < 5


def test_exit_code_and_exception():
    assert run("raise SystemExit(7)").returncode == 7
    r = run("1/0")
    assert r.returncode == 1 and "ZeroDivisionError" in r.stderr and r.killed_reason is None


def test_wall_clock_timeout_kills_everything():
    t0 = time.monotonic()
    r = run("import os, time\nprint(os.getuid(), flush=True)\nwhile True: time.sleep(0.01)", timeout_s=1)
    assert r.timed_out and r.killed_reason == "timeout" and not r.ok
    assert 1.0 <= r.duration_s < 3 and time.monotonic() - t0 < 4
    assert uid_processes(int(r.stdout)) == []


def test_cpu_limit():
    r = run("while True: pass", timeout_s=8, cpu_s=1)
    assert r.killed_reason == "cpu" and not r.timed_out and r.returncode == -24  # SIGXCPU


def test_memory_limit():
    r = run("b = bytearray(4 << 30)\nprint('allocated')", memory_mb=256)
    assert r.killed_reason == "memory" and "allocated" not in r.stdout and r.duration_s < 5


def test_output_cap_no_hang():
    t0 = time.monotonic()
    r = run("import sys\nwhile True: sys.stdout.write('x' * 65536)", max_output_bytes=10_000, timeout_s=10)
    assert r.killed_reason == "output" and r.stdout_truncated and len(r.stdout) == 10_000
    assert time.monotonic() - t0 < 5
    r = run("import sys\nsys.stderr.write('e' * 100_000)", max_output_bytes=1000)
    assert r.killed_reason == "output" and r.stderr_truncated and len(r.stderr) == 1000


def test_no_network():
    r = run(
        """
        import socket
        for addr in [("127.0.0.1", 22), ("127.0.0.1", 80), ("8.8.8.8", 53)]:
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect(addr)
                print("CONNECTED", addr)
            except OSError as e:
                print("refused", e.errno)
        try:
            socket.getaddrinfo("example.com", 80)
            print("RESOLVED")
        except OSError:
            print("no dns")
        import os
        print(sorted(line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]))
        """
    )
    assert r.ok, r.stderr
    assert "CONNECTED" not in r.stdout and "RESOLVED" not in r.stdout
    assert r.stdout.count("refused 101") == 3  # ENETUNREACH: only a down loopback exists
    assert r.stdout.splitlines()[-1] == "['lo']"


def test_writes_only_inside_workdir(tmp_path):
    os.chmod(tmp_path, 0o777)  # even a world-writable host dir must be out of reach
    targets = ["/tmp/k2_sandbox_escape", "/var/tmp/k2_sandbox_escape", "/dev/shm/k2_sandbox_escape",
               "/root/k2_sandbox_escape", "/etc/k2_sandbox_escape", str(tmp_path / "escape"),
               os.path.join(os.getcwd(), "k2_sandbox_escape")]  # fmt: skip
    r = run(
        f"""
        import os
        for p in {targets!r}:
            try:
                with open(p, "w") as f:
                    f.write("x")
                print("WROTE", p)
            except OSError as e:
                print("denied", p, type(e).__name__)
        with open("inside.txt", "w") as f:
            f.write("ok" * 1000)
        os.makedirs("sub/dir")
        print("inside", os.path.getsize("inside.txt"))
        """
    )
    assert r.ok, r.stderr
    assert "WROTE" not in r.stdout and r.stdout.count("denied") == len(targets)
    assert "inside 2000" in r.stdout
    for p in targets:
        assert not os.path.exists(p)
    # the work dir is private and gone: the next run does not see the file
    r2 = run("import os\nprint(os.listdir('.'))")
    assert r2.stdout.strip() == "['main.py']"


def test_cannot_read_host_tmp_or_root(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    os.chmod(secret, 0o644)
    r = run(
        f"""
        for p in [{str(secret)!r}, "/root/.bashrc", "/proc/1/environ"]:
            try:
                print("READ", open(p).read()[:20])
            except OSError as e:
                print("denied", type(e).__name__)
        """
    )
    assert "TOPSECRET" not in r.stdout and "READ" not in r.stdout, r.stdout


def test_cannot_kill_parent_or_host_processes():
    me = os.getpid()
    r = run(
        f"""
        import os, signal
        for pid in [os.getppid(), {me}, 1]:
            try:
                os.kill(pid, signal.SIGKILL)
                print("KILLED", pid)
            except OSError as e:
                print("denied", type(e).__name__)
        print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
        """
    )
    assert r.ok and "KILLED" not in r.stdout, r.stdout
    assert os.getpid() == me  # still alive
    # a fresh PID namespace: only the init and the program itself are visible
    assert r.stdout.splitlines()[-1] == "[1, 2]"


def test_fork_bomb_contained_and_cleaned_up():
    t0 = time.monotonic()
    r = run(
        """
        import os
        print(os.getuid(), flush=True)
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """,
        timeout_s=3,
    )
    assert r.timed_out and time.monotonic() - t0 < 8
    assert uid_processes(int(r.stdout.split()[0])) == []
    # the machine is fine: a normal run right after works and is fast
    r2 = run("print(sum(range(10)))")
    assert r2.ok and r2.stdout == "45\n" and r2.duration_s < 3


def test_detached_children_are_killed():
    r = run(
        """
        import os, time
        print(os.getuid(), flush=True)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        print("parent done")
        """,
        timeout_s=10,
    )
    uid, out = r.stdout.split("\n", 1)
    assert r.ok and out == "parent done\n" and r.duration_s < 3
    assert uid_processes(int(uid)) == []


def test_run_as_nobody():
    r = run("import os\nprint(os.getuid())", uid=NOBODY)
    assert r.ok and r.stdout == f"{NOBODY}\n"
    assert uid_processes(NOBODY) == []


def test_run_many_parallel():
    codes = [
        f"import os\nprint(os.getuid())\nprint(sum(i * i for i in range({k} * 1000)))" for k in range(16)
    ]
    t0 = time.monotonic()
    results = run_many(codes, max_workers=8, timeout_s=20)
    assert len(results) == 16
    for k, r in enumerate(results):
        assert r.ok, r.stderr
        assert int(r.stdout.split()[1]) == sum(i * i for i in range(k * 1000))
    assert time.monotonic() - t0 < 20
    uids = {int(r.stdout.split()[0]) for r in results}
    assert len(uids) >= 2  # concurrent runs get distinct uids
    assert all(uid_processes(uid) == [] for uid in uids)


def test_run_many_never_raises():
    results = run_many(["print(1)", "while True: pass"], max_workers=2, timeout_s=1, files={"/abs": "x"})
    assert [r.killed_reason for r in results] == ["error", "error"]
    assert all("relative path" in r.stderr for r in results)
    assert run_many([]) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError, match="files"):
        run_python("pass", files={"../x": ""})

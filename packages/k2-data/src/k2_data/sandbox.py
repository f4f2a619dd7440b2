"""Run untrusted Python in a contained, resource-limited child process.

Used for RL code rewards (`k2_rl.rewards.code`) and agentic data synthesis. One call to
`run_python` is one sandboxed process tree; `run_many` runs many of them from a thread pool.

Design (Linux, caller is root, the normal case on training hosts):

* **Launcher.** The parent starts `SANDBOX_PYTHON -I -S -B -c <launcher>` in a new session
  (`start_new_session=True`) with stdin/stdout/stderr pipes. No `preexec_fn` is used (it is not
  safe with threads); all setup happens in that fresh, single-threaded root process. Its
  configuration (code, files, limits) arrives on an unlinked temporary file passed as an fd, so
  nothing about the run is visible in `/proc/*/cmdline`.
* **Namespaces.** The launcher `unshare`s a new network namespace (only a down loopback: every
  `connect`, even to 127.0.0.1, fails), a mount namespace, an IPC namespace and a PID namespace.
  In the mount namespace the world-writable directories (`/tmp`, `/var/tmp`, `/dev/shm`,
  `/run/lock`) are covered by empty read-only-for-others tmpfs mounts, and the working directory
  `/tmp/sandbox` is a fresh size-capped tmpfs owned by the sandbox uid: the only place the
  program can write, and gone with the namespace. The first process in the PID namespace is a
  small root "init" that reaps orphans and relays the program's exit status; when it exits (or
  is killed, or the launcher dies: `PR_SET_PDEATHSIG`) the kernel kills every process left in
  the namespace, so `setsid`/double-fork cannot escape. A fresh `/proc` hides host processes.
* **Privileges.** The program runs as a dedicated unprivileged uid/gid (`setgroups([])`,
  `setresgid`, `setresuid`) with `PR_SET_NO_NEW_PRIVS` (no setuid binaries). By default each
  concurrent run gets its *own* uid from a pool (`SANDBOX_UID_BASE` ..., coordinated across
  processes with `flock` files in `/run/k2-sandbox`): `RLIMIT_NPROC` counts processes per uid,
  so with a shared uid (e.g. `nobody`) one run's fork bomb would make its neighbours' forks fail.
  `uid=65534` runs as `nobody` if wanted. It cannot signal its parent (different uid: `EPERM`).
* **Limits.** `RLIMIT_CPU` (`cpu_s`), `RLIMIT_AS` (`memory_mb`), `RLIMIT_FSIZE`, `RLIMIT_NOFILE`,
  `RLIMIT_NPROC`, `RLIMIT_CORE=0`; a wall-clock deadline after which the parent SIGKILLs the
  process group (which contains the PID-namespace init, so the whole namespace dies); output read
  with a cap (the run is killed when stdout or stderr exceeds `max_output_bytes`). After every
  run any process still owned by the run's uid is killed (a backstop, `/proc` scan) before the
  uid is reused. The launcher's session is recorded with the caller's watchdog
  (`k2_data.lifetime`), so it dies within seconds of the caller, SIGKILL included; the launcher's
  `alarm()` is the backstop.
* **Interpreter.** `/usr/bin/python3 -I -S -B` (isolated mode, no site, no bytecode writes): a
  system interpreter the sandbox uid can read, not the venv under `/root`. Environment scrubbed:
  `PATH=/usr/bin:/bin`, `HOME=TMPDIR=<workdir>`.

Degradation: when namespaces cannot be created (or the caller is not root) the run still gets
rlimits, the session kill and (as root) the uid drop, in a private host temp directory; a warning
saying exactly what is missing is logged once, and `sandbox_status()` reports it. Not covered:
CPU time summed across a fork bomb's processes (bounded by the wall clock), kernel exploits,
reading world-readable host files (the repo, `/usr`), and side channels.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from k2_data import lifetime

log = logging.getLogger(__name__)

SANDBOX_PYTHON = os.environ.get("K2_SANDBOX_PYTHON", "/usr/bin/python3")
SANDBOX_UID_BASE = int(os.environ.get("K2_SANDBOX_UID_BASE", "61000"))
SANDBOX_UID_COUNT = 1000
WORKDIR = "/tmp/sandbox"  # inside the sandbox's mount namespace
MASKED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")
_LOCK_DIR = "/run/k2-sandbox"
_SETUP_FAILED = 125

__all__ = [
    "SandboxError",
    "SandboxResult",
    "run_many",
    "run_python",
    "sandbox_status",
    "uid_processes",
]


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not the program's fault)."""


@dataclass
class SandboxResult:
    """What a sandboxed run did. `killed_reason`: "timeout", "cpu", "memory", "output", "error"
    (the sandbox failed; see stderr) or None (the program ended on its own)."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        """Exited 0 on its own, within every limit."""
        return self.returncode == 0 and self.killed_reason is None


# The launcher (`_sandbox_launcher.py`, a script run as a file): as root in a fresh process it sets
# everything up and execs the sandboxed interpreter; setup errors come back on a status pipe.
_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_launcher.py")


# --------------------------------------------------------------------------------------------
# uid pool and process cleanup


def _uids_of(pid: str) -> set[int]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return {int(x) for x in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def _pids_of_uid(uid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and uid in _uids_of(p)]


def _kill_uid(uid: int, timeout_s: float = 5.0) -> bool:
    """SIGKILL every process owned by `uid` until none is left; False if some survived."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = _pids_of_uid(uid)
        if not pids:
            return True
        if time.monotonic() > deadline:
            log.error("sandbox: processes of uid %d survived SIGKILL: %s", uid, pids)
            return False
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


class _UidPool:
    """Hands out a uid no other run (in this or another process) is using, via flock files."""

    def __init__(self, base: int, count: int) -> None:
        self.base, self.count = base, count
        self._lock = threading.Lock()
        self._next = 0

    def _lock_dir(self) -> str:
        os.makedirs(_LOCK_DIR, mode=0o700, exist_ok=True)
        st = os.lstat(_LOCK_DIR)
        if st.st_uid != 0 or not os.path.isdir(_LOCK_DIR) or os.path.islink(_LOCK_DIR):
            raise SandboxError(f"{_LOCK_DIR} must be a root-owned directory")
        return _LOCK_DIR

    def acquire(self) -> tuple[int, int]:
        lock_dir = self._lock_dir()
        for _ in range(self.count):
            with self._lock:
                uid = self.base + self._next
                self._next = (self._next + 1) % self.count
            try:
                pwd.getpwuid(uid)
                continue  # a real account: never reuse it
            except KeyError:
                pass
            fd = os.open(os.path.join(lock_dir, f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if not _kill_uid(uid):  # leftovers of a crashed previous holder
                os.close(fd)
                continue
            return uid, fd
        raise SandboxError(f"no free sandbox uid in [{self.base}, {self.base + self.count})")

    @staticmethod
    def release(uid: int, fd: int) -> None:
        _kill_uid(uid)
        os.close(fd)


_POOL = _UidPool(SANDBOX_UID_BASE, SANDBOX_UID_COUNT)


def uid_processes(uid: int) -> list[int]:
    """Pids still owned by `uid`. For a pool uid this first waits until no run (in any process)
    holds it, so a non-empty answer means processes escaped cleanup. For monitoring and tests."""
    if os.geteuid() != 0 or not SANDBOX_UID_BASE <= uid < SANDBOX_UID_BASE + SANDBOX_UID_COUNT:
        return _pids_of_uid(uid)
    fd = os.open(os.path.join(_POOL._lock_dir(), f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return _pids_of_uid(uid)
    finally:
        os.close(fd)


_ns_lock = threading.Lock()
_ns_state: dict[str, object] = {}


def _python() -> str:
    if os.path.exists(SANDBOX_PYTHON):
        return SANDBOX_PYTHON
    return sys.executable


def _namespaces_available() -> bool:
    """Probe once whether the launcher can create its namespaces; warn once if not."""
    with _ns_lock:
        if "ok" not in _ns_state:
            reason = None
            if os.geteuid() != 0:
                reason = "not running as root"
            else:
                try:
                    res = _run(
                        "pass",
                        stdin="",
                        timeout_s=10,
                        cpu_s=None,
                        memory_mb=256,
                        max_output_bytes=4096,
                        files=None,
                        inputs=(),
                        nproc=8,
                        uid=None,
                        namespaces=True,
                    )
                    if res.returncode != 0:
                        reason = f"probe exited {res.returncode}: {res.stderr.strip()[-300:]}"
                except SandboxError as e:
                    reason = str(e)
            _ns_state["ok"] = reason is None
            _ns_state["reason"] = reason
            if reason is not None:
                log.warning(
                    "k2 sandbox DEGRADED: no network/mount/PID namespaces (%s): programs can reach the "
                    "network, write world-writable directories (/tmp) and see host processes; "
                    "rlimits, timeouts%s still apply",
                    reason,
                    " and the uid drop" if os.geteuid() == 0 else "",
                )
        return bool(_ns_state["ok"])


def sandbox_status() -> dict[str, object]:
    """How contained runs are on this machine (probes once)."""
    ns = _namespaces_available()
    return {
        "root": os.geteuid() == 0,
        "namespaces": ns,
        "network_isolated": ns,
        "filesystem_isolated": ns,
        "uid_drop": os.geteuid() == 0,
        "python": _python(),
        "degraded_reason": _ns_state.get("reason"),
    }


# --------------------------------------------------------------------------------------------


def _check_files(files: dict[str, str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, text in (files or {}).items():
        norm = os.path.normpath(name)
        if os.path.isabs(name) or norm.startswith("..") or norm in (".", "main.py"):
            raise ValueError(f"files: {name!r} must be a relative path inside the work dir (not main.py)")
        if not isinstance(text, str):
            raise TypeError(f"files[{name!r}]: expected str, got {type(text).__name__}")
        out[norm] = text
    return out


def _tmpfile(data: bytes) -> int:
    f = tempfile.TemporaryFile()
    f.write(data)
    f.flush()
    fd = os.dup(f.fileno())
    f.close()
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def run_python(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 10,
    cpu_s: float | None = None,
    memory_mb: int = 512,
    max_output_bytes: int = 64_000,
    files: dict[str, str] | None = None,
    inputs: Sequence[bytes] = (),
    nproc: int = 64,
    uid: int | None = None,
) -> SandboxResult:
    """Run `code` (as `main.py` in a private work dir) in the sandbox and return what happened.

    `stdin` is fed through a pipe; `files` (relative name -> text) are written next to
    `main.py`. `inputs` are extra byte blobs the program reads from inherited fds whose numbers
    are `sys.argv[1:]` (how `k2_data.unit_tests` passes tests and nonce without a path).
    `cpu_s` defaults to `timeout_s`; `uid` defaults to a fresh uid from the pool.
    Raises `SandboxError` only when the sandbox itself cannot be set up.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")
    if memory_mb < 32:
        raise ValueError(f"memory_mb: expected >= 32, got {memory_mb}")
    return _run(
        code,
        stdin=stdin,
        timeout_s=timeout_s,
        cpu_s=cpu_s,
        memory_mb=memory_mb,
        max_output_bytes=max_output_bytes,
        files=files,
        inputs=inputs,
        nproc=nproc,
        uid=uid,
        namespaces=_namespaces_available(),
    )


def _run(
    code: str,
    *,
    stdin: str,
    timeout_s: float,
    cpu_s: float | None,
    memory_mb: int,
    max_output_bytes: int,
    files: dict[str, str] | None,
    inputs: Sequence[bytes],
    nproc: int,
    uid: int | None,
    namespaces: bool,
) -> SandboxResult:
    all_files = _check_files(files)
    all_files["main.py"] = code
    is_root = os.geteuid() == 0
    lock_fd = None
    if is_root and uid is None:
        uid, lock_fd = _POOL.acquire()
    elif not is_root:
        uid = None
    host_dir = None
    fds: list[int] = []
    try:
        if namespaces:
            workdir = WORKDIR
        else:
            host_dir = workdir = tempfile.mkdtemp(prefix="k2-sandbox-")
        cpu = max(1, math.ceil(cpu_s if cpu_s is not None else timeout_s))
        fsize = 16 << 20
        rlimits = [
            ("RLIMIT_CPU", cpu, cpu + 1),
            ("RLIMIT_AS", memory_mb << 20, memory_mb << 20),
            ("RLIMIT_FSIZE", fsize, fsize),
            ("RLIMIT_NOFILE", 64, 64),
            ("RLIMIT_CORE", 0, 0),
        ]
        if uid is not None:
            rlimits.append(("RLIMIT_NPROC", nproc, nproc))
        input_fds = [_tmpfile(b) for b in inputs]
        fds += input_fds
        py = _python()
        cfg = {
            "namespaces": namespaces,
            "mask": list(MASKED_DIRS),
            "workdir": workdir,
            "tmpfs_opts": f"mode=0700,uid={uid or 0},gid={uid or 0},size=65536k,nr_inodes=4096",
            "files": all_files,
            "uid": uid,
            "gid": uid,
            "rlimits": rlimits,
            "python": py,
            "argv": [py, "-I", "-S", "-B", "main.py", *map(str, input_fds)],
            "env": {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"},
            "pass_fds": input_fds,
            "alarm_s": int(timeout_s) + 10,
        }
        cfg_fd = _tmpfile(json.dumps(cfg).encode())
        fds.append(cfg_fd)
        st_r, st_w = os.pipe()
        fds += [st_r, st_w]
        start = time.monotonic()
        deadline = start + timeout_s
        proc = subprocess.Popen(
            [py, "-I", "-S", "-B", _LAUNCHER, str(cfg_fd), str(st_w)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(cfg_fd, st_w, *input_fds),
            start_new_session=True,
            cwd="/",
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
        lifetime.adopt()  # its own session: the caller's watchdog records it by its group
        for fd in (cfg_fd, st_w, *input_fds):
            os.close(fd)
            fds.remove(fd)
        try:
            return _supervise(proc, st_r, stdin.encode(), start, deadline, max_output_bytes)
        finally:
            _kill_group(proc)
            for f in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    f.close()
                except OSError:
                    pass
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        if uid is not None:
            _kill_uid(uid)
        if lock_fd is not None:
            os.close(lock_fd)
        if host_dir is not None:
            shutil.rmtree(host_dir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log.error("sandbox: launcher %d did not die after SIGKILL", proc.pid)


def _feed_stdin(pipe, data: bytes) -> None:
    try:
        if data:
            pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError, ValueError):
        pass


def _supervise(proc, st_r: int, stdin: bytes, start: float, deadline: float, cap: int) -> SandboxResult:
    # 1. setup: the status pipe closes on exec (EOF) or carries the launcher's error
    status = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SandboxError("sandbox setup did not finish before the deadline")
        ready = selectors.DefaultSelector()
        ready.register(st_r, selectors.EVENT_READ)
        events = ready.select(timeout=left)
        ready.close()
        if events:
            chunk = os.read(st_r, 4096)
            if not chunk:
                break
            status += chunk
    if status:
        raise SandboxError(status.decode(errors="replace"))

    # 2. run: feed stdin, read capped output until EOF, exit or deadline
    threading.Thread(target=_feed_stdin, args=(proc.stdin, stdin), daemon=True).start()
    sel = selectors.DefaultSelector()
    bufs = {"stdout": bytearray(), "stderr": bytearray()}
    trunc = {"stdout": False, "stderr": False}
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    reason = None
    exited_at = None
    try:
        while sel.get_map() and reason is None:
            now = time.monotonic()
            if now >= deadline:
                reason = "timeout"
                break
            if proc.poll() is not None:
                if exited_at is None:
                    exited_at = now
                elif now - exited_at > 0.5:  # something outside the launcher holds the pipes
                    break
            for key, _ in sel.select(timeout=min(0.1, deadline - now)):
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.data]
                room = cap - len(buf)
                if len(data) > room:
                    buf += data[: max(room, 0)]
                    trunc[key.data] = True
                    reason = "output"
                else:
                    buf += data
    finally:
        sel.close()
    if reason is not None:
        _kill_group(proc)
    else:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            reason = "timeout"
            _kill_group(proc)
    rc = proc.returncode
    stderr = bufs["stderr"].decode(errors="replace")
    if reason is None and rc is not None:
        if rc == -signal.SIGXCPU:
            reason = "cpu"
        elif rc != 0 and "MemoryError" in stderr[-2000:]:
            reason = "memory"
    return SandboxResult(
        returncode=rc,
        stdout=bufs["stdout"].decode(errors="replace"),
        stderr=stderr,
        timed_out=reason == "timeout",
        killed_reason=reason,
        duration_s=time.monotonic() - start,
        stdout_truncated=trunc["stdout"],
        stderr_truncated=trunc["stderr"],
    )


def run_many(
    codes: Iterable[str], *, max_workers: int | None = None, **kwargs: object
) -> list[SandboxResult]:
    """`run_python` over `codes` from a thread pool (each run is its own process tree), in order.

    Never raises for a single run: a sandbox failure becomes a result with
    `killed_reason="error"` and the message in `stderr`. `kwargs` go to `run_python`.
    """
    codes = list(codes)
    workers = max_workers or min(32, (os.cpu_count() or 2) * 2)

    def one(code: str) -> SandboxResult:
        t0 = time.monotonic()
        try:
            return run_python(code, **kwargs)  # type: ignore[arg-type]
        except Exception as e:
            log.error("sandbox run failed: %s", e)
            return SandboxResult(None, "", f"{type(e).__name__}: {e}", False, "error", time.monotonic() - t0)

    if not codes:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(codes)))) as pool:
        return list(pool.map(one, codes))

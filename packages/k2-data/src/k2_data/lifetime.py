"""Child processes that die with this process, even when it is SIGKILLed.

    from k2_data import lifetime
    proc = lifetime.spawn([sys.executable, "-m", "worker"])  # a subprocess.Popen tied to us
    lifetime.adopt()  # after a library started processes of its own (multiprocessing, the MCP SDK)

The first use starts this process's watchdog: a small stdlib-only interpreter (this file run as a
script) that leads a process group of its own, reads a pipe whose only writer is this process, and
every second records this process's descendants (pid and start time, from /proc). When the pipe
reaches EOF or the watchdog is re-parented, this process is gone (exited, crashed or SIGKILLed): the
watchdog sends SIGTERM to its group (where `spawn` puts every child, so grandchildren are reached
too), to the groups that recorded descendants lead (the MCP SDK and the sandbox start their
children in new sessions) and to the other recorded descendants (multiprocessing's workers and its
resource tracker, which then sees EOF on its own pipe and exits), waits `GRACE_S` for them, then
SIGKILLs what is left, itself last. The pipe's end is not inherited by exec'd children; a forked
one keeps it open, which is why re-parenting counts too. The tied group is not the terminal's
foreground group: Ctrl-C reaches this process, which stops its children its own way.

Why not PR_SET_PDEATHSIG: it fires when the *thread* that forked exits (a pool thread's exit kills
a healthy child) and never reaches grandchildren. A recorded pid is signalled only while its start
time matches, so a pid the kernel reused for an unrelated process is left alone.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time

GRACE_S = 3.0  # SIGTERM -> SIGKILL
SCAN_EVERY_S = 1.0  # the watchdog's own look at the process tree, between the parent's requests


# ----------------------------------------------------------------------------- /proc


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgrp, start time) of a process, None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2 :].split()  # the command name may hold spaces and ')'
    return rest[0], int(rest[1]), int(rest[2]), int(rest[19])


def _table() -> dict[int, tuple[str, int, int, int]]:
    out = {}
    try:
        names = os.listdir("/proc")
    except OSError:  # no procfs (not Linux): the group is still tied, descendants are not recorded
        return out
    for name in names:
        if name.isdigit() and (st := _stat(int(name))) is not None:
            out[int(name)] = st
    return out


def alive(pid: int, start: int | None = None) -> bool:
    """Whether `pid` runs (not a zombie) and, given `start`, is the process that started then."""
    st = _stat(pid)
    return st is not None and st[0] != "Z" and (start is None or st[3] == start)


def start_time(pid: int) -> int | None:
    st = _stat(pid)
    return None if st is None else st[3]


def descendants(root: int, table: dict[int, tuple[str, int, int, int]] | None = None) -> dict[int, int]:
    """pid -> start time of every living descendant of `root`."""
    table = _table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if table[pid][0] != "Z":
            out[pid] = table[pid][3]
        todo += children.get(pid, [])
    return out


# ----------------------------------------------------------------------------- the watchdog


def _signal_all(sig: int, me: int, group: int, known: dict[int, tuple[int, int]]) -> bool:
    """Send `sig` to the watchdog's group and to the recorded descendants (their groups when they
    lead one); whether anything of theirs still runs."""
    table = _table()
    groups = {group}
    for pid, (start, pgrp) in known.items():
        st = table.get(pid)
        if st is None:  # gone: its group may live on headless (a pgid is not reused while in use)
            if pgrp == pid:
                groups.add(pid)
        elif st[3] == start and st[0] != "Z":
            if pgrp == pid:
                groups.add(pid)
            elif sig:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
    running = any(
        pid != me and st[0] != "Z" and (st[2] in groups or known.get(pid, (None,))[0] == st[3])
        for pid, st in table.items()
    )
    if sig:
        for g in groups:
            try:
                os.killpg(g, sig)
            except OSError:
                pass
    return running


def _watch(parent: int, grace_s: float) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # we signal our own group; Ctrl-C is the parent's business
    me, group = os.getpid(), os.getpgrp()
    known: dict[int, tuple[int, int]] = {}  # pid -> (start time, pgrp) of the parent's descendants

    def scan() -> None:
        table = _table()
        groups = {st[2] for st in table.values() if st[0] != "Z"}
        for pid, (start, pgrp) in list(known.items()):
            st = table.get(pid)
            if (st is None or st[3] != start) and not (pid == pgrp and st is None and pid in groups):
                del known[pid]  # exited (a leader's group may outlive it: kept while it has members)
        for pid, start in descendants(parent, table).items():
            if pid != me:
                known[pid] = (start, table[pid][2])

    scan()
    last = time.monotonic()
    while os.getppid() == parent:
        ready, _, _ = select.select([0], [], [], SCAN_EVERY_S)
        data = os.read(0, 4096) if ready else b""
        if ready and not data:
            break  # EOF: the parent's end closed with the parent
        if os.getppid() != parent:
            break
        if ready or time.monotonic() - last >= SCAN_EVERY_S:
            scan()
            last = time.monotonic()
        if data.count(b"\n"):
            try:
                os.write(1, b"ok\n" * data.count(b"\n"))  # adopt() waits for its request's answer
            except OSError:
                pass
    deadline = time.monotonic() + grace_s
    running = _signal_all(signal.SIGTERM, me, group, known)
    while running and time.monotonic() < deadline:
        time.sleep(0.05)
        running = _signal_all(0, me, group, known)
    if running:
        _signal_all(signal.SIGKILL, me, group, known)
    if any(pid != me and st[2] == group and st[0] != "Z" for pid, st in _table().items()):
        os.killpg(group, signal.SIGKILL)  # whatever forked in our group meanwhile, and ourselves


# ----------------------------------------------------------------------------- this process's side


class Tether:
    """This process's watchdog (see the module docstring); `group` is the process group of tied
    children."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.owner = os.getpid()
        # -I -S: stdlib only, whatever the environment (k2_data's package imports are heavy)
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), str(self.owner), str(grace_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            process_group=0,
            close_fds=True,
        )
        self.group = self.proc.pid
        self._lock = threading.Lock()

    def request(self, line: str, timeout_s: float = 5.0) -> bool:
        """Send one request and wait for the watchdog's answer (it has acted on it then)."""
        with self._lock:
            try:
                self.proc.stdin.write(line.encode() + b"\n")
                self.proc.stdin.flush()
                fd, answer = self.proc.stdout.fileno(), b""
                deadline = time.monotonic() + timeout_s
                while not answer.endswith(b"\n"):
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([fd], [], [], left)[0]:
                        return False
                    chunk = os.read(fd, 64)
                    if not chunk:
                        return False
                    answer += chunk
                return True
            except (BrokenPipeError, OSError, ValueError):
                return False

    def running(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """Stop the watchdog now, which stops every child still tied to this process."""
        with self._lock:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        self.proc.wait()


_tether: Tether | None = None
_tether_lock = threading.Lock()


def tether() -> Tether:
    """This process's watchdog, started on first use (and again if it died, or after a fork)."""
    global _tether
    with _tether_lock:
        if _tether is None or _tether.owner != os.getpid() or not _tether.running():
            _tether = Tether()
        return _tether


def spawn(cmd: list[str], **popen_kw) -> subprocess.Popen:
    """`subprocess.Popen(cmd, **popen_kw)` in the watchdog's process group: the child and its
    descendants die with this process. stdin defaults to /dev/null (a background group must not
    read the terminal)."""
    popen_kw.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen(cmd, process_group=tether().group, **popen_kw)


def adopt() -> None:
    """Have the watchdog record this process's descendants now (it returns once they are): call it
    right after a library started processes its own way (multiprocessing, a new session), rather
    than leave them to the watchdog's next look."""
    if not tether().request("scan"):
        tether().request("scan")  # the watchdog died (it is started again) or is slow: once more


if __name__ == "__main__":
    _watch(int(sys.argv[1]), float(sys.argv[2]))

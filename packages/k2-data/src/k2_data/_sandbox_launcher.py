"""The k2 sandbox's launcher: run as a file by `k2_data.sandbox` (`python -I -S -B THIS CFG_FD STATUS_FD`),
never imported. As root in a fresh process it reads the JSON config from CFG_FD, unshares mount,
IPC, PID and network namespaces, masks directories with empty tmpfs mounts, writes the program's
files into a private tmpfs work dir, forks pid 1 of the new PID namespace (which dies with this
process), sets rlimits and no_new_privs, drops to the sandbox uid and execs the interpreter. A setup
error goes to STATUS_FD (closed by the exec, so EOF there means the program started) and exits 125;
otherwise this process exits with the program's status (or dies of its signal).
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x8000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
UL = ctypes.c_ulong
# set by main(): the stage being set up (for the error message), the status fd, libc
stage = "config"
st_fd = -1
libc = None


def call(fn, *args):
    if fn(*args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def close_quietly(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def drop_and_exec(cfg):
    global stage
    stage = "rlimits"
    for name, soft, hard in cfg["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    stage = "no_new_privs"
    call(libc.prctl, PR_SET_NO_NEW_PRIVS, UL(1), UL(0), UL(0), UL(0))
    if cfg["uid"] is not None:
        stage = "setuid"
        os.setgroups([])
        os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    os.umask(0o077)
    stage = "chdir"
    os.chdir(cfg["workdir"])
    stage = "exec"
    os.execve(cfg["python"], cfg["argv"], cfg["env"])


def relay(status):
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    sig = os.WTERMSIG(status)
    try:
        signal.signal(sig, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (OSError, ValueError):
        pass
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)


def init(cfg, wp):
    # pid 1 of the new PID namespace: dies with the launcher; its death kills the namespace
    global stage
    call(libc.prctl, PR_SET_PDEATHSIG, UL(signal.SIGKILL), UL(0), UL(0), UL(0))
    try:
        call(libc.mount, b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    except OSError:
        pass  # e.g. a container that masks parts of /proc: keep the host's view
    child = os.fork()
    if child == 0:
        os.close(wp)
        drop_and_exec(cfg)
    close_quietly([st_fd] + cfg["pass_fds"])
    while True:
        pid, status = os.wait()
        if pid == child:
            break
    os.write(wp, str(status).encode())
    os._exit(0)


def main() -> None:
    global stage, st_fd, libc
    st_fd = int(sys.argv[2])
    os.set_inheritable(st_fd, False)
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        with os.fdopen(int(sys.argv[1]), "rb") as f:
            cfg = json.loads(f.read())
        work = cfg["workdir"]
        if cfg["namespaces"]:
            stage = "unshare"
            call(libc.unshare, CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET)
            stage = "mount"
            call(libc.mount, b"none", b"/", None, MS_REC | MS_PRIVATE, None)
            for d in cfg["mask"]:
                if os.path.isdir(d) and not os.path.islink(d):
                    call(
                        libc.mount,
                        b"tmpfs",
                        d.encode(),
                        b"tmpfs",
                        MS_NOSUID | MS_NODEV | MS_NOEXEC,
                        b"mode=0755,size=16k,nr_inodes=64",
                    )
            os.makedirs(work, exist_ok=True)
            call(
                libc.mount,
                b"tmpfs",
                work.encode(),
                b"tmpfs",
                MS_NOSUID | MS_NODEV,
                cfg["tmpfs_opts"].encode(),
            )
        stage = "files"
        for rel, text in cfg["files"].items():
            path = os.path.join(work, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        if cfg["uid"] is not None:
            for root, dirs, files in os.walk(work):
                for name in [root] + [os.path.join(root, n) for n in dirs + files]:
                    os.lchown(name, cfg["uid"], cfg["gid"])
        if not cfg["namespaces"]:
            drop_and_exec(cfg)
        stage = "fork"
        rp, wp = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rp)
            init(cfg, wp)
        os.close(wp)
        close_quietly([st_fd] + cfg["pass_fds"])
        signal.alarm(cfg["alarm_s"])  # backstop: our death kills init, whose death kills the namespace
        os.waitpid(pid, 0)
        data = os.read(rp, 64)
        relay(int(data) if data else signal.SIGKILL)
    except BaseException as e:
        try:
            os.write(st_fd, (f"k2 sandbox setup failed at {stage}: {type(e).__name__}: {e}").encode())
        finally:
            os._exit(125)


if __name__ == "__main__":
    main()

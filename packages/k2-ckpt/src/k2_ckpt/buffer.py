"""The two-slot transfer buffer the server broadcasts into and its receiver reads from.

CPU: a file in `/dev/shm` mapped shared (`torch.from_file(shared=True)`) by both processes;
the handle is its path. The buffer lives as long as the `ParameterServer` (warm pages: a
fresh mapping costs a page fault per 4 KiB on both sides); `close()` or process exit removes
the file.
CUDA: a device tensor; the handle is its CUDA IPC handle (`torch.multiprocessing` reduction,
pickled), rebuilt on the receiver's own device index. CUDA cannot open an IPC handle in the
process that exported it, so a receiver in the server's own process gets the tensor itself.

Files are named `k2ckpt-<pid namespace>-<pid>-<id>.buf`: a process killed before its exit
handler ran (SIGKILL, OOM killer) leaves its files behind, and the next buffer created in the
same pid namespace removes the files of processes that no longer exist.
"""

from __future__ import annotations

import atexit
import base64
import errno
import os
import pickle
import re
import tempfile
import uuid

import torch

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_LIVE: set[str] = set()  # shm files this process created; removed at exit if still there
_EXPORTED: dict[str, torch.Tensor] = {}  # CUDA buffers this process handed out, by handle key
_swept = False


def _pid_namespace() -> str:
    """The pid namespace's inode: pids are only comparable inside one namespace."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_stale_files(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove buffer files left by dead processes of this pid namespace; returns their paths."""
    ns = _pid_namespace()
    if ns == "0":
        return []  # cannot tell which pids are ours to judge
    pattern = re.compile(rf"k2ckpt-{ns}-(\d+)-[0-9a-f]+\.buf")
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid() or _pid_alive(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(os.path.join(shm_dir, name))
        except OSError:
            pass
    return removed


def _create_shm_file(total: int) -> str:
    global _swept
    if not _swept:
        _swept = True
        sweep_stale_files()
    path = os.path.join(SHM_DIR, f"k2ckpt-{_pid_namespace()}-{os.getpid()}-{uuid.uuid4().hex[:12]}.buf")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # reserve the pages now: on a full tmpfs a sparse file would fail later, as SIGBUS on
        # first touch, instead of as this error
        os.posix_fallocate(fd, 0, max(total, 1))
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            st = os.statvfs(SHM_DIR)
            raise OSError(
                e.errno,
                f"k2-ckpt needs {total / 2**20:.1f} MiB in {SHM_DIR} for a transfer buffer "
                f"but only {st.f_bavail * st.f_frsize / 2**20:.1f} MiB are free (containers: "
                "raise --shm-size)",
            ) from None
        raise
    os.close(fd)
    return path


@atexit.register
def _cleanup() -> None:
    for path in list(_LIVE):
        try:
            os.unlink(path)
        except OSError:
            pass


class SlotBuffer:
    def __init__(self, slot_bytes: int, num_slots: int, device: torch.device):
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.device = device
        total = slot_bytes * num_slots
        self.path: str | None = None
        self.key = uuid.uuid4().hex
        if device.type == "cpu":
            self.path = _create_shm_file(total)
            _LIVE.add(self.path)
            self.data = torch.from_file(self.path, shared=True, size=total, dtype=torch.uint8)
        elif device.type == "cuda":
            self.data = torch.empty(total, dtype=torch.uint8, device=device)
        else:
            raise ValueError(f"unsupported device {device} for the transfer buffer (cpu or cuda)")

    def slot(self, i: int, nbytes: int | None = None) -> torch.Tensor:
        start = i * self.slot_bytes
        return self.data[start : start + (self.slot_bytes if nbytes is None else nbytes)]

    def handle(self) -> dict:
        if self.path is not None:
            return {"kind": "shm", "path": self.path, "nbytes": self.data.numel()}
        from torch.multiprocessing.reductions import reduce_tensor

        func, args = reduce_tensor(self.data)
        _EXPORTED[self.key] = self.data
        return {
            "kind": "cuda_ipc",
            "pid": os.getpid(),
            "key": self.key,
            "pickle": base64.b64encode(pickle.dumps((func, args))).decode(),
        }

    def unlink(self) -> None:
        if self.path is not None:
            _LIVE.discard(self.path)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        _EXPORTED.pop(self.key, None)
        self.data = torch.empty(0, dtype=torch.uint8)


_MAPPED: dict[tuple[str, int], torch.Tensor] = {}  # receiver side: recently mapped transfer buffers
_MAPPED_KEEP = 3  # slots + two alternating receive arenas


def open_buffer(handle: dict, device: torch.device | None = None) -> torch.Tensor:
    """The receiver's view of a `SlotBuffer` from its handle (the last shm mapping is reused,
    so repeated updates do not page-fault the buffer in again)."""
    kind = handle.get("kind")
    if kind == "shm":
        key = (handle["path"], int(handle["nbytes"]))
        buf = _MAPPED.pop(key, None)
        if buf is None:
            buf = torch.from_file(key[0], shared=True, size=key[1], dtype=torch.uint8)
        _MAPPED[key] = buf  # most recent last
        while len(_MAPPED) > _MAPPED_KEEP:
            del _MAPPED[next(iter(_MAPPED))]
        return buf
    if kind == "cuda_ipc":
        if handle.get("pid") == os.getpid() and handle.get("key") in _EXPORTED:
            return _EXPORTED[handle["key"]]  # the server's own process: IPC cannot reopen it here
        func, args = pickle.loads(base64.b64decode(handle["pickle"]))
        args = list(args)
        if device is not None and device.type == "cuda" and device.index is not None:
            args[6] = device.index  # the sender's index may differ under CUDA_VISIBLE_DEVICES
        return func(*args)
    raise ValueError(f"unknown buffer handle kind {kind!r} (expected 'shm' or 'cuda_ipc')")


def open_sources(handles: list[dict]) -> list[torch.Tensor]:
    """Map the owner's registration arenas copy-on-write (MAP_PRIVATE), afresh for every update:
    staged views cost no copy, an engine writing into its weights in place gets private pages
    instead of corrupting the registered checkpoint, and the next update of the same checkpoint
    sees the registered bytes again rather than those private pages (a reused mapping would)."""
    return [
        torch.from_file(h["path"], shared=False, size=int(h["nbytes"]), dtype=torch.uint8) for h in handles
    ]

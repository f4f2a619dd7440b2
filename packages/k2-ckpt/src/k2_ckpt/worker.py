"""The receiving side: `update_weights_from_ipc`, called inside the inference engine's worker.

It connects to the server's ZMQ PAIR socket, maps the two-slot buffer from its handle, and
for each bucket slices the named tensors out of the slot, validates them against the loader
(name, dtype, shape), and either stages a private copy (staged mode, the default) or loads
them at once (direct mode); then acks so the server can reuse the slot. On "commit" the
staged tensors are loaded and the post-load hook runs; on "abort" the staging is dropped.

Staged mode gives all-or-nothing per receiver at the cost of one model-sized staging copy;
direct mode needs no extra memory and reports exactly which tensors it had applied.

A loader may also have an `abort()` method: it is called when an update is abandoned (the
server aborted, went away, or fell silent), e.g. to drop half-assembled state; and a
`check_staged(names)` method, called with every staged name before a staged commit touches
anything (a failure there still leaves the old weights).
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import zmq
from pydantic import TypeAdapter

from k2_ckpt.buffer import open_buffer, open_sources
from k2_ckpt.dtypes import dtype_from_name, from_bytes
from k2_ckpt.errors import TensorMismatch, UpdateAborted
from k2_ckpt.types import (
    AbortedReply,
    AbortMsg,
    AckReply,
    BucketMsg,
    BufferMsg,
    CommitMsg,
    DoneReply,
    ErrorReply,
    ReadyReply,
    ServerMsg,
)

_SERVER_MSG = TypeAdapter(ServerMsg)

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@runtime_checkable
class WeightLoader(Protocol):
    """What a receiver loads into. `validate` raises `TensorMismatch` naming the tensor."""

    def validate(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None: ...

    def load_weights(self, named: NamedTensors) -> None: ...

    def post_load(self) -> None: ...


class FunctionLoader:
    """Wrap a plain `load_fn(named_tensors)` (e.g. an engine's `model.load_weights`)."""

    def __init__(
        self,
        load_fn: Callable[[NamedTensors], object],
        validate: Callable[[str, torch.dtype, tuple[int, ...]], None] | None = None,
        post_hook: Callable[[], object] | None = None,
    ):
        self._load, self._validate, self._post = load_fn, validate, post_hook

    def validate(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        if self._validate is not None:
            self._validate(name, dtype, shape)

    def load_weights(self, named: NamedTensors) -> None:
        self._load(named)

    def post_load(self) -> None:
        if self._post is not None:
            self._post()


@dataclass
class ReceiveResult:
    checkpoint: str
    tensors: int
    buckets: int
    seconds: float


def update_weights_from_ipc(
    address: str,
    loader: WeightLoader | Callable[[NamedTensors], object],
    *,
    device: torch.device | str | None = None,
    device_id: str = "",
    staged: bool = True,
    timeout_s: float = 300.0,
    zmq_ctx: zmq.Context | None = None,
) -> ReceiveResult:
    """Receive one update from the parameter server at `address` and load it into `loader`.

    Returns when the update is committed; raises `UpdateAborted` (after dropping any staged
    tensors) when the server aborts, and `TimeoutError` when the server is silent for `timeout_s`.
    """
    if not isinstance(loader, WeightLoader):
        loader = FunctionLoader(loader)
    ctx = zmq_ctx or zmq.Context.instance()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 1000)  # let the last reply leave before close
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)  # the server's process or link going away
    gc_was_enabled = gc.isenabled()
    gc.disable()  # an update makes ~10^5 short-lived objects: a cyclic GC pass mid-update stalls the acks
    try:
        sock.connect(address)
        return _Receiver(
            sock,
            monitor,
            loader,
            torch.device(device) if device is not None else None,
            device_id,
            staged,
            timeout_s,
        ).run()
    finally:
        if gc_was_enabled:
            gc.enable()
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        monitor.close(linger=0)
        sock.close()


class _Receiver:
    def __init__(
        self,
        sock: zmq.Socket,
        monitor: zmq.Socket,
        loader: WeightLoader,
        device: torch.device | None,
        device_id: str,
        staged: bool,
        timeout_s: float,
    ):
        self.sock, self.monitor, self.loader, self.device = sock, monitor, loader, device
        self.device_id, self.staged, self.timeout_s = device_id, staged, timeout_s
        self.buf: torch.Tensor | None = None
        self.slot_bytes = 0
        self.checkpoint = ""
        self.staging: dict[str, torch.Tensor] = {}
        self.partial: dict[str, list] = {}  # name -> [bytes, received] for tensors split over buckets
        self.applied: list[str] = []
        self.commit_started = False  # after this, what a failure leaves applied is unknown
        self.failed = False
        self.buckets = 0
        self.sources: list[torch.Tensor] = []
        self.zero_copy = False
        self.pool: dict[str, torch.Tensor] | None = getattr(loader, "staging_pool", None)
        self.typed: dict[
            tuple[int, torch.dtype], torch.Tensor | None
        ] = {}  # (id(buffer), dtype) -> typed view

    def send(self, msg) -> None:
        # a PAIR socket blocks on send while its peer is gone: wait for it like for a message
        self._wait(zmq.POLLOUT, f"accept {msg.op!r}")
        self.sock.send(msg.model_dump_json().encode())

    def recv(self):
        self._wait(zmq.POLLIN, "send anything")
        return _SERVER_MSG.validate_json(self.sock.recv())

    def _wait(self, flag: int, what: str) -> None:
        """Until the socket is ready for `flag`; gives up when the server disconnects (at once)
        or stays silent for `timeout_s`, dropping what was staged."""
        poller = zmq.Poller()
        poller.register(self.sock, flag)
        poller.register(self.monitor, zmq.POLLIN)
        deadline = time.monotonic() + self.timeout_s
        while True:
            events = dict(poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
            if self.sock in events:  # a message that arrived before a disconnect is still read
                return
            if self.monitor in events:
                from zmq.utils.monitor import recv_monitor_message

                if recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED:
                    self._abandon()
                    raise UpdateAborted(
                        f"update of {self.checkpoint!r}: the parameter server closed the "
                        "connection (it gave up on this update or its process died); " + self._left_behind()
                    )
                continue
            if time.monotonic() >= deadline:
                self._abandon()
                raise TimeoutError(
                    f"the parameter server did not {what} for {self.timeout_s:.1f}s; update "
                    "abandoned, " + self._left_behind()
                )

    def _left_behind(self) -> str:
        if self.commit_started:
            return "the commit had started: some tensors may be applied"
        if self.staged:
            return "staged tensors dropped, the old weights are intact"
        return f"{len(self.applied)} tensors had been loaded (direct mode)"

    def _abandon(self) -> None:
        self.staging.clear()
        self.partial.clear()
        abort = getattr(self.loader, "abort", None)
        if abort is not None:
            abort()

    def _applied_report(self) -> list[str] | None:
        if self.commit_started:
            return None  # a commit that failed part-way: unknown
        return [] if self.staged else list(self.applied)

    def run(self) -> ReceiveResult:
        t0 = time.perf_counter()
        while True:
            msg = self.recv()
            if isinstance(msg, BufferMsg):
                self.buf = open_buffer(msg.handle, self.device)
                self.sources = open_sources(msg.sources)
                self.slot_bytes, self.checkpoint = msg.slot_bytes, msg.checkpoint
                self.zero_copy = msg.zero_copy and self.staged
                self.send(ReadyReply(device_id=self.device_id, staged=self.staged))
            elif isinstance(msg, BucketMsg):
                if not self.failed:
                    self.on_bucket(msg)
            elif isinstance(msg, CommitMsg):
                if self.on_commit():
                    n = len(self.applied)
                    self.send(
                        DoneReply(applied=n, seconds=time.perf_counter() - t0, views_buffer=self.zero_copy)
                    )
                    return ReceiveResult(self.checkpoint, n, self.buckets, time.perf_counter() - t0)
            elif isinstance(msg, AbortMsg):
                self._abandon()
                self.send(AbortedReply(applied=self._applied_report()))
                raise UpdateAborted(f"update of {self.checkpoint!r} aborted by the server: {msg.reason}")

    def _error(self, e: BaseException, bucket: int | None, tensor: str | None) -> None:
        self.failed = True
        kind = "mismatch" if isinstance(e, TensorMismatch) else "worker_error"
        self.send(
            ErrorReply(
                kind=kind,
                message=f"{type(e).__name__}: {e}",
                bucket=bucket,
                tensor=tensor,
                traceback=traceback.format_exc(),
                applied=self._applied_report(),
            )
        )

    def _stage_buffer(self, name: str, nbytes: int, device: torch.device) -> torch.Tensor:
        """A private byte buffer for `name`, reused across updates when the loader keeps a pool
        (`loader.staging_pool`): warm memory copies ~5x faster than freshly faulted pages."""
        pool = self.pool
        buf = pool.get(name) if pool is not None else None
        if buf is not None and (buf.dtype != torch.uint8 or buf.dim() != 1):  # pooled as the tensor it was
            buf = buf.reshape(-1).view(torch.uint8)
        if buf is None or buf.numel() != nbytes or buf.device != device:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if pool is not None:
                pool[name] = buf
        return buf

    def _view(
        self, buf: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int]
    ) -> torch.Tensor:
        """`shape`-shaped `dtype` view of buf[offset:offset + nbytes], made in one call
        (as_strided on a typed view of the whole buffer): a K2 update carries ~10^5 tensors,
        and slicing + viewing + reshaping costs ~3x more per tensor."""
        key = (id(buf), dtype)
        typed = self.typed.get(key, False)
        if typed is False:
            try:
                typed = buf.view(dtype)
            except RuntimeError:  # a buffer whose size is not a multiple of the element size
                typed = None
            self.typed[key] = typed
        esize = typed.element_size() if typed is not None else 1
        if typed is None or offset % esize:
            return from_bytes(buf[offset : offset + nbytes], dtype, shape)
        strides, step = [], 1
        for d in reversed(shape):
            strides.append(step)
            step *= d
        return typed.as_strided(shape, strides[::-1], typed.storage_offset() + offset // esize)

    def on_bucket(self, msg: BucketMsg) -> None:
        assert self.buf is not None, "bucket before buffer"
        if msg.source is not None:  # the owner's bytes, read in place from its shared arena
            buf, base = self.sources[msg.source], msg.source_offset
        else:
            buf, base = self.buf, msg.offset
        ready: list[tuple[str, torch.Tensor]] = []
        name = None
        try:
            for name, dtype_name, shape, tensor_nbytes, chunk_start, nbytes, buf_offset in msg.columns():
                dtype = dtype_from_name(dtype_name)
                if chunk_start == 0:
                    self.loader.validate(name, dtype, tuple(shape))
                if self.zero_copy and nbytes == tensor_nbytes:  # whole, where it landed
                    ready.append((name, self._view(buf, base + buf_offset, nbytes, dtype, shape)))
                    continue
                src = buf[base + buf_offset : base + buf_offset + nbytes]
                if self.zero_copy:  # the bytes stay where they landed until the next update
                    if chunk_start == 0:
                        whole = buf[base + buf_offset : base + buf_offset + tensor_nbytes]
                        self.partial[name] = [whole, 0]
                    part = self.partial[name]
                    if src.data_ptr() != part[0].data_ptr() + chunk_start:
                        # chunks from different buffers (the owner's arena, then the receive
                        # arena): fall back to assembling a private copy
                        own = self._stage_buffer(name, tensor_nbytes, src.device)
                        own[: part[1]].copy_(part[0][: part[1]])
                        own[chunk_start : chunk_start + nbytes].copy_(src)
                        part[0] = own
                    part[1] += nbytes
                    if part[1] == tensor_nbytes:
                        ready.append((name, from_bytes(self.partial.pop(name)[0], dtype, shape)))
                    continue
                if chunk_start == 0 and nbytes == tensor_nbytes:
                    # staged: a private copy; direct: a view, copied out by load_weights below
                    data = (
                        self._stage_buffer(name, tensor_nbytes, src.device).copy_(src) if self.staged else src
                    )
                    ready.append((name, from_bytes(data, dtype, shape)))
                    continue
                if name not in self.partial:
                    self.partial[name] = [self._stage_buffer(name, tensor_nbytes, src.device), 0]
                part = self.partial[name]
                part[0][chunk_start : chunk_start + nbytes].copy_(src)
                part[1] += nbytes
                if part[1] == tensor_nbytes:
                    ready.append((name, from_bytes(self.partial.pop(name)[0], dtype, shape)))
            name = None
            if self.staged:
                self.staging.update(ready)
            else:
                # one tensor per call: a loader that fails part-way leaves exactly `applied` loaded,
                # and the error names the tensor it failed on
                for name, t in ready:
                    self.loader.load_weights([(name, t)])
                    self.applied.append(name)
                name = None
            if self.buf.is_cuda:
                torch.cuda.current_stream(self.buf.device).synchronize()  # slot reads done before the ack
            self.buckets += 1
            self.send(AckReply(bucket=msg.bucket))
        except Exception as e:  # reported to the server with its traceback
            self._error(e, msg.bucket, name)

    def on_commit(self) -> bool:
        try:
            if self.partial:
                raise RuntimeError(f"commit with incomplete tensors {sorted(self.partial)}")
            check = getattr(self.loader, "check_staged", None)
            if self.staged and check is not None:  # e.g. a loader that takes only complete updates
                check(list(self.staging))
            self.commit_started = self.staged  # direct mode: everything is applied already, and listed
            if self.staged:
                commit = getattr(self.loader, "commit_staged", None) or self.loader.load_weights
                commit(self.staging.items())
                self.applied = list(self.staging)
                self.staging.clear()
                if self.zero_copy and self.pool is not None:
                    self.pool.clear()  # staging lives in the arenas: do not hold old weights
            self.loader.post_load()
            return True
        except Exception as e:
            self._error(e, None, None)
            return False

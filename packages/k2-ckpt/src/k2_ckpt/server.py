"""The parameter server: one per training rank, pushing registered weights to receivers.

Protocol of one `update` (every rank runs it; see the README for the sequence diagram):

1. gather metas (all ranks), agree on the bucket size (min over ranks), plan buckets;
2. each receiving rank binds a ZMQ PAIR socket; the addresses are all-gathered and rank 0
   calls `req_func({device_id: address})` in a thread, which makes the inference side call
   `update_weights_from_ipc`;
3. each server queues the buffer handle for its receiver (delivered once it connects); a rank
   that called `req_func` waits for its own receiver's "ready", so that a `req_func` error is
   known at the first vote, which the other ranks reach without waiting for theirs;
4. per bucket k: (slots) wait until the receiver acked bucket k-2 so slot k%2 is free; every
   `agree_every` buckets agree that no rank failed (a one-int all-reduce); the owner copies
   host -> its place in the buffer (on CPU it broadcasts from its shared arena in place);
   `broadcast` from the owner; tell the receiver "bucket k is at offset o" and move on
   without waiting: the receiver loads bucket k while bucket k+1 is broadcast. On CPU the
   buffer is a model-sized receive arena (two, alternating), so no slot is ever reused;
5. wait for the last acks, agree, send "commit", wait for "done", agree.

Any failure (a receiver's error reply with its traceback, a receiver that disconnects, a
wait that passes `timeout_s`, `req_func` raising) makes that rank vote "failed" at the next
agreement point; every rank then stops, sends its receiver "abort", all-gathers the failure
reports and raises the same `UpdateError`.

`_Update` holds one update's state and runs these steps (`connect`, `broadcast`, `commit`, then
`finish` or `abort`); a failure inside a step is recorded by `_Update._capturing`, never raised
past a collective, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
import zmq
from pydantic import TypeAdapter, ValidationError

from k2_ckpt.buffer import SlotBuffer
from k2_ckpt.device import default_device, device_id, free_memory_bytes
from k2_ckpt.errors import (
    BadCheckpoint,
    CheckpointExists,
    CheckpointNotFound,
    CkptError,
    RankFailure,
    UpdateError,
)
from k2_ckpt.host import HostCheckpoint
from k2_ckpt.planner import ALIGN, plan_buckets
from k2_ckpt.types import (
    AbortedReply,
    AbortMsg,
    AckReply,
    Bucket,
    BucketMsg,
    BufferMsg,
    CommitMsg,
    DoneReply,
    ErrorReply,
    ReadyReply,
    TensorMeta,
    WorkerMsg,
)

log = logging.getLogger(__name__)
_WORKER_MSG = TypeAdapter(WorkerMsg)

ReqFunc = Callable[[dict[str, str]], object]


@dataclass
class ServerConfig:
    max_bucket_bytes: int = 256 << 20  # upper bound per slot
    memory_fraction: float = 0.25  # of the device's free memory, for both slots together
    num_slots: int = 2  # 2 = broadcast of bucket k+1 overlaps loading of bucket k
    timeout_s: float = 60.0  # longest wait on a receiver for any one step
    # ranks vote "anyone failed?" before every n-th bucket (and before the commit): each vote is
    # a sync point across ranks, so fewer votes pipeline better; a failure stops the
    # broadcast at most n buckets later (its receiver is no longer fed meanwhile)
    agree_every: int = 4
    # CPU only: receive every bucket straight into a model-sized shared arena (two, alternating)
    # instead of two bucket slots, so receivers stage views and copy nothing; costs 2x the
    # checkpoint in /dev/shm per receiving rank
    cpu_receive_arena: bool = True
    abort_timeout_s: float = 2.0  # how long an abort waits for the receiver's reply
    # the server's process group gives up on a collective after this long: a rank that left the
    # protocol (killed, or an error outside it) makes the others fail instead of hang. Default:
    # room for `agree_every` + 2 receiver waits of `timeout_s` between two collectives, >= 5 min
    collective_timeout_s: float | None = None
    # CUDA only: time the owner's host -> device copies with CUDA events (UpdateStats.h2d_s);
    # off by default, the benchmark turns it on
    time_h2d: bool = False
    socket_dir: str = field(default_factory=tempfile.gettempdir)


@dataclass
class UpdateStats:
    checkpoint: str
    seconds: float
    nbytes: int  # bytes broadcast (all ranks' tensors)
    num_buckets: int
    bucket_bytes: int
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase, in order
    h2d_s: float | None = None  # device time of this rank's H2D copies (ServerConfig.time_h2d)
    h2d_bytes: int = 0  # bytes this rank copied host -> device

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _collective_bound_s(cfg: ServerConfig, timeout_s: float) -> float:
    """Longest a rank may legitimately sit in one of the server's collectives: the other ranks
    may each wait on their receivers (`agree_every` acks, the commit, the abort) in between."""
    return (max(1, cfg.agree_every) + 2) * timeout_s + cfg.abort_timeout_s


@dataclass
class _Plan:
    """The cached plan of one checkpoint: valid while `key` (every rank's registration uid, the
    agreed bucket-size bound) stays the same."""

    key: tuple[tuple[int, ...], int]
    metas: list[TensorMeta]
    bucket_bytes: int
    buckets: list[Bucket]


class _Failed(Exception):
    def __init__(self, failure: RankFailure):
        self.failure = failure


class _ReqThread(threading.Thread):
    def __init__(self, req_func: ReqFunc, mapping: dict[str, str]):
        super().__init__(name="k2ckpt-req", daemon=True)
        self.req_func, self.mapping = req_func, mapping
        self.error: str | None = None

    def run(self) -> None:
        try:
            self.req_func(self.mapping)
        except BaseException:
            self.error = traceback.format_exc()


class _ReceiverLink:
    """The server's end of the PAIR socket to its receiver, with death detection.

    Messages go through an outbox: `post` never blocks (a bound PAIR socket cannot send before
    its peer connects), so a rank whose receiver is still being started by `req_func` on
    another rank goes on to the first failure vote instead of waiting for it; anything that
    waits for a reply delivers the outbox first."""

    def __init__(
        self, ctx: zmq.Context, address: str, rank: int, timeout_s: float, alive: Callable[[], None]
    ):
        self.address, self.rank, self.timeout_s, self.alive = address, rank, timeout_s, alive
        self.sock = ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.connected = False
        self.bucket: int | None = None  # for error reports
        self.last_acked: int | None = None
        self.staged = True  # the receiver's mode, from its "ready"
        self.views_buffer = False  # from its "done": its weights may view the transfer buffer
        self.error_applied: list[str] | None = None  # direct mode: what its error reply said it had loaded
        self.outbox: deque[tuple[str, bytes]] = deque()  # (op, encoded message), in order

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        if self.address.startswith("ipc://"):
            try:
                os.unlink(self.address[len("ipc://") :])
            except OSError:
                pass

    def _fail(self, kind: str, message: str) -> _Failed:
        return _Failed(RankFailure(rank=self.rank, kind=kind, message=message, bucket=self.bucket))

    def _check_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_ACCEPTED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                last = "none" if self.last_acked is None else str(self.last_acked)
                raise self._fail(
                    "worker_died",
                    f"the receiver disconnected from {self.address} "
                    f"(process died or closed its socket); last bucket it acked: {last}",
                )

    def _wait(self, flag: int, what: str, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            if self.sock.poll(50, flag):
                return
            try:
                self._check_monitor()
            except _Failed:
                if self.sock.poll(0, flag):  # e.g. its last reply arrived together with its close
                    return
                raise
            self.alive()
            if time.monotonic() > deadline:
                state = "connected" if self.connected else "never connected"
                raise self._fail(
                    "timeout",
                    f"receiver ({state}) did not {what} within "
                    f"{self.timeout_s if timeout_s is None else timeout_s:.1f}s",
                )

    def post(self, msg) -> None:
        """Queue `msg` and send what the socket takes now, without waiting."""
        self.outbox.append((msg.op, msg.model_dump_json().encode()))
        self.flush(block=False)

    def send(self, msg, timeout_s: float | None = None) -> None:
        """Queue `msg` and wait until it and everything queued before it has been sent."""
        self.outbox.append((msg.op, msg.model_dump_json().encode()))
        self.flush(block=True, timeout_s=timeout_s)

    def flush(self, block: bool, timeout_s: float | None = None) -> None:
        budget = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        while self.outbox:
            op, data = self.outbox[0]
            if block:
                self._wait(zmq.POLLOUT, f"accept {op!r}", max(0.0, deadline - time.monotonic()))
            try:
                self.sock.send(data, zmq.NOBLOCK)
                self.outbox.popleft()
                continue
            except zmq.Again:
                if not block:
                    return
                # writable at the poll, gone at the send: the receiver disconnected in between
                # (a killed worker). Its disconnect event, the liveness check or the deadline
                # turns that into the rank's failure; never an unexpected zmq error.
                self._check_monitor()
                self.alive()
                if time.monotonic() > deadline:
                    raise self._fail(
                        "worker_died",
                        f"the receiver at {self.address} stopped accepting "
                        f"messages ({op!r} could not be sent within {budget:.1f}s)",
                    ) from None
                time.sleep(0.01)

    def recv(self, what: str, timeout_s: float | None = None):
        self.flush(block=True, timeout_s=timeout_s)  # the reply may depend on what is still queued
        self._wait(zmq.POLLIN, what, timeout_s)
        return self._decode(self.sock.recv(zmq.NOBLOCK))

    def try_recv(self):
        self.flush(block=False)
        if self.sock.poll(0, zmq.POLLIN):
            return self._decode(self.sock.recv(zmq.NOBLOCK))
        self._check_monitor()
        return None

    def abort(self, reason: str, wait_s: float | None) -> AbortedReply | None:
        """Drop what is not yet delivered and send "abort", best effort. With `wait_s`, wait that
        long for the receiver's "aborted", skipping late error replies for earlier buckets;
        without (a dead or hung receiver cannot acknowledge), give the send 0.05 s. None when
        no "aborted" came."""
        self.outbox.clear()
        with contextlib.suppress(_Failed):
            self.send(AbortMsg(reason=reason), timeout_s=0.05 if wait_s is None else wait_s)
            deadline = time.monotonic() + (wait_s or 0.0)
            while wait_s is not None and time.monotonic() < deadline:
                try:
                    msg = self.recv("acknowledge the abort", timeout_s=max(0.0, deadline - time.monotonic()))
                except _Failed as f:
                    if f.failure.kind in ("timeout", "worker_died"):
                        break
                    continue  # a late error reply for an earlier bucket
                if isinstance(msg, AbortedReply):
                    return msg
        return None

    def _decode(self, raw: bytes):
        try:
            msg = _WORKER_MSG.validate_json(raw)
        except ValidationError as e:  # a receiver speaking another protocol version: this rank's failure
            raise self._fail("server_error", f"malformed message from the receiver: {e}") from None
        if isinstance(msg, ReadyReply):
            self.staged = msg.staged
        if isinstance(msg, ErrorReply):
            self.error_applied = msg.applied
            raise _Failed(
                RankFailure(
                    rank=self.rank,
                    kind=msg.kind,
                    message=msg.message,
                    bucket=msg.bucket,
                    tensor=msg.tensor,
                    traceback=msg.traceback,
                )
            )
        return msg


class ParameterServer:
    """Holds this rank's checkpoint shards in host memory and broadcasts them to receivers.

    Needs `torch.distributed` initialised; creates its own process group (gloo on CPU, NCCL on
    CUDA) over all ranks so it coexists with the trainer's groups. Every method that talks to
    other ranks (`gather_metas`, `update`) must be called on all ranks in the same order.
    """

    def __init__(
        self,
        *,
        device: torch.device | str | None = None,
        config: ServerConfig | None = None,
        group: dist.ProcessGroup | None = None,
    ):
        if not dist.is_initialized():
            raise RuntimeError("ParameterServer needs torch.distributed initialised (init_process_group)")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device(device) if device is not None else default_device(self.rank)
        self.config = config or ServerConfig()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # object collectives on NCCL use the current device
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        # None when the caller brought its own group (its timeout is the caller's business)
        self._collective_timeout_s: float | None = None
        if group is None:
            self._collective_timeout_s = self.config.collective_timeout_s or max(
                300.0, _collective_bound_s(self.config, self.config.timeout_s)
            )
            group = dist.new_group(backend=backend, timeout=timedelta(seconds=self._collective_timeout_s))
        self.group = group
        self.device_id = device_id(self.device, self.rank)
        self._ckpts: dict[str, HostCheckpoint] = {}
        self._zmq = zmq.Context()
        self.last_stats: UpdateStats | None = None
        self._buffer: SlotBuffer | None = None
        self._recv_arenas: list[SlotBuffer | None] = [None, None]
        self._live_arena: int | None = None
        self._plan_cache: dict[str, _Plan] = {}

    # ---- registration (local: no collectives) ----

    def register_checkpoint(
        self,
        name: str,
        files: Iterable[str | os.PathLike] | None = None,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> list[TensorMeta]:
        """Hold this rank's shard of checkpoint `name`: safetensors `files` and/or `named_tensors`."""
        if name in self._ckpts:
            raise CheckpointExists(
                f"checkpoint {name!r} is already registered on rank {self.rank}; unregister it first"
            )
        if files is None and named_tensors is None:
            raise ValueError("register_checkpoint needs files=... or named_tensors=...")
        ckpt = HostCheckpoint(name, self.rank, shared_arena=self.device.type == "cpu")
        try:
            for path in files or ():
                ckpt.add_safetensors(path)
            if named_tensors is not None:
                ckpt.add_named_tensors(named_tensors)
        except BaseException:
            ckpt.close()  # free its arenas (and their /dev/shm files) now, not at exit
            raise
        self._ckpts[name] = ckpt
        return list(ckpt.metas)

    def unregister_checkpoint(self, name: str) -> None:
        ckpt = self._ckpts.pop(name, None)
        if ckpt is None:
            raise CheckpointNotFound(f"checkpoint {name!r} is not registered on rank {self.rank}")
        ckpt.close()
        self._plan_cache.pop(name, None)

    def checkpoints(self) -> list[str]:
        return sorted(self._ckpts)

    # ---- collectives ----

    def _all_gather(self, obj: object) -> list:
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _agree(self, failed: bool) -> bool:
        """True when no rank failed; every rank learns the same answer."""
        flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item()) == 0

    def gather_metas(self, name: str) -> list[TensorMeta]:
        """Every rank's tensor metadata for `name` (collective; raises the same error everywhere)."""
        ckpt = self._ckpts.get(name)
        gathered = self._all_gather([m.model_dump() for m in ckpt.metas] if ckpt is not None else None)
        missing = [r for r, g in enumerate(gathered) if g is None]
        if missing:
            raise CheckpointNotFound(f"checkpoint {name!r} is not registered on rank(s) {missing}")
        metas = [TensorMeta.model_validate(m) for g in gathered for m in g]
        seen: dict[str, int] = {}
        for m in metas:
            if m.name in seen:
                raise BadCheckpoint(
                    f"tensor {m.name!r} of checkpoint {name!r} is registered on both "
                    f"rank {seen[m.name]} and rank {m.owner}"
                )
            seen[m.name] = m.owner
        return metas

    def _plan(self, name: str) -> _Plan:
        """Metas, bucket size and plan for `name`, in one small all-gather when nothing changed.

        Every rank contributes (its registration's uid, its bucket-size bound); metas are
        re-gathered and the plan rebuilt only when some rank re-registered. All ranks see the
        same gathered values, so they take the same branch."""
        cfg = self.config
        ckpt = self._ckpts.get(name)
        free = free_memory_bytes(self.device)
        if self.device.type == "cuda" and self._buffer is not None:
            free += self._buffer.data.numel()  # our own slots are reused, not allocated again
        # rounded to MiB so that small changes in free memory keep the same plan (and its cache)
        local = min(cfg.max_bucket_bytes, int(free * cfg.memory_fraction) // cfg.num_slots >> 20 << 20)
        local = max(local, ALIGN)
        mine = torch.tensor(
            [ckpt.uid if ckpt is not None else 0, local], dtype=torch.int64, device=self.device
        )
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine, group=self.group)
        uids = tuple(int(p[0]) for p in parts)
        missing = [r for r, u in enumerate(uids) if u == 0]
        if missing:
            raise CheckpointNotFound(f"checkpoint {name!r} is not registered on rank(s) {missing}")
        bound = min(int(p[1]) for p in parts)
        cached = self._plan_cache.get(name)
        if cached is not None and cached.key == (uids, bound):
            return cached
        metas = self.gather_metas(name)
        per_owner: dict[int, int] = {}  # never allocate more than the largest owner's aligned total
        for m in metas:
            per_owner[m.owner] = per_owner.get(m.owner, 0) + (m.nbytes + ALIGN - 1) // ALIGN * ALIGN
        bucket_bytes = max(ALIGN, min(bound, max(per_owner.values(), default=ALIGN)) // ALIGN * ALIGN)
        plan = _Plan((uids, bound), metas, bucket_bytes, plan_buckets(metas, bucket_bytes))
        self._plan_cache[name] = plan
        return plan

    # ---- update ----

    def update(
        self,
        name: str,
        req_func: ReqFunc,
        ranks: list[int] | None = None,
        *,
        timeout_s: float | None = None,
        req_on_all_ranks: bool = False,
    ) -> UpdateStats:
        """Push checkpoint `name` to the receivers of `ranks` (None: every rank) by broadcast.

        `req_func(mapping)` is called once (on rank 0, in a thread) with {device_id: zmq address}
        and must make each receiver call `update_weights_from_ipc` with its address. With
        `req_on_all_ranks=True` every rank calls it (for receivers driven by their own training
        rank, e.g. an engine in the same process); each receiver picks `mapping[its device_id]`.
        Raises `UpdateError` (the same on every rank) if any receiver fails.
        """
        cfg = self.config
        timeout = cfg.timeout_s if timeout_s is None else timeout_s
        if (
            self._collective_timeout_s is not None
            and _collective_bound_s(cfg, timeout) > self._collective_timeout_s
        ):
            raise ValueError(
                f"timeout_s={timeout:g}: ranks may then wait up to {_collective_bound_s(cfg, timeout):.0f}s "
                f"in one collective, more than the server group's {self._collective_timeout_s:.0f}s "
                "(ServerConfig.collective_timeout_s)"
            )
        receivers = set(range(self.world_size)) if ranks is None else set(ranks)
        bad = sorted(r for r in receivers if not 0 <= r < self.world_size)
        if bad:
            raise ValueError(f"ranks={sorted(receivers)}: {bad} outside 0..{self.world_size - 1}")
        upd = _Update(self, name, timeout, receiving=self.rank in receivers)
        try:
            upd.connect(req_func, req_on_all_ranks)
            if upd.broadcast() and upd.commit():
                return upd.finish()
            upd.abort()
        finally:
            upd.close()

    def _slot_buffer(self, bucket_bytes: int) -> SlotBuffer:
        """The transfer buffer, kept across updates: fresh memory would cost a page fault per
        4 KiB on both sides (measured: first touch runs at ~1.5 GB/s, warm memcpy at ~10 GB/s)."""
        buf = self._buffer
        if buf is None or buf.slot_bytes != bucket_bytes or buf.num_slots != self.config.num_slots:
            if buf is not None:
                buf.close()
            buf = self._buffer = SlotBuffer(bucket_bytes, self.config.num_slots, self.device)
            buf.data.fill_(0)  # touch every page once, here rather than inside the first update
        return buf

    def _drop_receive_arenas(self) -> None:
        """Close both receive arenas (a receiver's mapping outlives the file); the next update
        makes fresh ones."""
        for a in self._recv_arenas:
            if a is not None:
                a.close()
        self._recv_arenas, self._live_arena = [None, None], None

    def _receive_arena(self, nbytes: int) -> int:
        """Index of the receive arena to fill: never the one the receiver's weights may view."""
        use = 1 if self._live_arena == 0 else 0
        arena = self._recv_arenas[use]
        if arena is None or arena.data.numel() != nbytes:
            if arena is not None:
                arena.close()
            arena = SlotBuffer(max(nbytes, ALIGN), 1, self.device)
            arena.data.fill_(0)  # fault the pages in now, not inside the timed update
            self._recv_arenas[use] = arena
        return use

    def close(self) -> None:
        """Free host memory and the transfer buffer (their /dev/shm files are removed)."""
        for ckpt in self._ckpts.values():
            ckpt.close()
        self._ckpts.clear()
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
        self._drop_receive_arenas()
        self._zmq.term()


class _Update:
    """One `ParameterServer.update` on this rank: its state (plan, receiver link, transfer buffer
    and offsets, `req_func` thread, phase marks, H2D events, the first failure) and its steps in
    protocol order: `connect`, `broadcast`, `commit`, then `finish` or `abort`.

    Every step runs on every rank, and each rank issues the same collectives in the same order
    whatever failed: a failure inside a step is recorded (`_capturing`), not raised, and acted on
    at the next vote (`ParameterServer._agree`), which every rank reaches."""

    def __init__(self, server: ParameterServer, name: str, timeout_s: float, receiving: bool):
        self.ps, self.name, self.timeout_s, self.receiving = server, name, timeout_s, receiving
        self.t0 = time.perf_counter()
        self.marks: list[tuple[str, float]] = [("start", self.t0)]
        self.h2d_events: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
        self.failure: RankFailure | None = None  # this rank's first failure
        self.link: _ReceiverLink | None = None
        self.req: _ReqThread | None = None
        self.plan = server._plan(name)  # collective: raises the same error on every rank
        self._mark("plan")
        self.ckpt = server._ckpts[name]
        # CPU receiving ranks receive into a model-sized arena (bucket k at offsets[k], never
        # reused within the update); every other rank reuses `num_slots` bucket slots
        self.zero_copy = receiving and server.device.type == "cpu" and server.config.cpu_receive_arena
        self.reuse_slots = not self.zero_copy
        self.buf: SlotBuffer | None = None
        self.offsets: list[int] = []
        self.arena_idx: int | None = None
        self.inflight: deque[int] = deque()  # buckets posted to the receiver and not yet acked
        self.scratch: torch.Tensor | None = None  # broadcast target once this rank failed
        self.committed: bool | None = None  # None: this rank's receiver was not asked to commit
        self._allocate()

    # ---- failures ----

    @contextmanager
    def _capturing(self, prefix: str = "") -> Iterator[None]:
        """Record the first `_Failed` raised inside as this rank's failure (its kind prefixed
        with `prefix`) and go on: the ranks act on it together at the next vote."""
        try:
            yield
        except _Failed as f:
            if self.failure is None:
                f.failure.kind = prefix + f.failure.kind
                self.failure = f.failure

    def _fail(self, kind: str, message: str, **kw) -> _Failed:
        return _Failed(RankFailure(rank=self.ps.rank, kind=kind, message=message, **kw))

    def alive(self) -> None:
        """Raise the `req_func` thread's error (on the ranks that called it) as this rank's."""
        if self.req is not None and self.req.error is not None:
            raise self._fail("req_func", "req_func raised", traceback=self.req.error)

    def _vote(self) -> bool:
        """The vote: True when no rank failed."""
        return self.ps._agree(self.failure is not None)

    def _mark(self, phase: str) -> None:
        self.marks.append((phase, time.perf_counter()))

    # ---- steps ----

    def _allocate(self) -> None:
        """The transfer buffer and bucket k's offset in it; a local failure (no memory, /dev/shm
        full) is voted on like any other."""
        ps, cfg, plan = self.ps, self.ps.config, self.plan
        try:
            if self.zero_copy:
                total = 0
                for b in plan.buckets:  # a split tensor's chunks end up contiguous
                    self.offsets.append(total)
                    total += (b.nbytes + ALIGN - 1) // ALIGN * ALIGN
                self.arena_idx = ps._receive_arena(total)
                self.buf = ps._recv_arenas[self.arena_idx]
            else:
                self.offsets = [(k % cfg.num_slots) * plan.bucket_bytes for k in range(len(plan.buckets))]
                self.buf = ps._slot_buffer(plan.bucket_bytes)
        except (OSError, RuntimeError) as e:
            self.failure = RankFailure(
                rank=ps.rank,
                kind="server_error",
                traceback=traceback.format_exc(),
                message=f"could not allocate the transfer buffer on {ps.device}: {e}",
            )

    def connect(self, req_func: ReqFunc, req_on_all_ranks: bool) -> None:
        """Bind the receiver's socket, all-gather the addresses, start `req_func` and queue the
        buffer handle; a rank that called `req_func` waits for its own receiver's "ready"."""
        ps, cfg, plan = self.ps, self.ps.config, self.plan
        if self.receiving:
            path = os.path.join(cfg.socket_dir, f"k2ckpt-{uuid.uuid4().hex[:12]}-r{ps.rank}.sock")
            self.link = _ReceiverLink(ps._zmq, f"ipc://{path}", ps.rank, self.timeout_s, self.alive)
        link = self.link
        pairs = ps._all_gather((ps.device_id, link.address if link else None))
        mapping = {dev: addr for dev, addr in pairs if addr is not None}
        if ps.rank == 0 or req_on_all_ranks:
            self.req = _ReqThread(req_func, mapping)
            self.req.start()
        with self._capturing():
            if link is not None and self.buf is not None:
                link.post(
                    BufferMsg(
                        handle=self.buf.handle(),
                        slot_bytes=plan.bucket_bytes,
                        num_slots=cfg.num_slots,
                        checkpoint=self.name,
                        num_buckets=len(plan.buckets),
                        sources=[a.handle() for a in self.ckpt.arenas],
                        zero_copy=self.zero_copy,
                    )
                )
                if self.req is not None:
                    # this rank called req_func: its own receiver's "ready" (or req_func's
                    # error) is known before the first vote, which the other ranks reach
                    # without waiting for theirs, so a req_func that reached no receiver
                    # fails the update everywhere at once
                    link.recv("report ready")
            self._mark("connect")

    def broadcast(self) -> bool:
        """Broadcast every bucket into the buffer at `offsets[k]` (a reused slot first waits for
        the receiver's ack of bucket k - num_slots), voting every `agree_every` buckets, then
        wait for the last acks and vote. False when a rank failed."""
        ps, link, buckets = self.ps, self.link, self.plan.buckets
        num_slots, every = ps.config.num_slots, max(1, ps.config.agree_every)
        prepared: tuple[torch.Tensor, tuple[int, int] | None] | None = None
        for k, bucket in enumerate(buckets):
            if self.failure is None:
                with self._capturing():
                    if link is not None:
                        link.bucket = k
                        while (msg := link.try_recv()) is not None:
                            self._on_msg(msg)
                        while self.reuse_slots and self.inflight and self.inflight[0] <= k - num_slots:
                            self._on_msg(link.recv(f"ack bucket {self.inflight[0]}"))  # slot must be free
                    self.alive()
            if k % every == 0 and not self._vote():
                return False
            slot, in_place = prepared if prepared is not None else self._prepare(k)
            prepared = None
            work = dist.broadcast(slot, src=bucket.owner, group=ps.group, async_op=True)
            if not self.reuse_slots and k + 1 < len(buckets) and buckets[k + 1].owner == ps.rank:
                prepared = self._prepare(k + 1)  # the host copy of bucket k+1 overlaps the broadcast of k
            work.wait()
            if slot.is_cuda:  # the receiver reads it from another process/stream
                torch.cuda.current_stream(slot.device).synchronize()
            if link is not None and self.failure is None:
                with self._capturing():
                    link.post(
                        BucketMsg.of(
                            k,
                            self.offsets[k],
                            bucket.items,
                            source=in_place[0] if in_place else None,
                            source_offset=in_place[1] if in_place else 0,
                        )
                    )
                    self.inflight.append(k)
        self._mark("broadcast")
        # phase 1 of the commit: every receiver has staged (or, in direct mode, loaded) every bucket
        if self.failure is None:
            with self._capturing():
                if link is not None:
                    link.bucket = None
                    while self.inflight:
                        self._on_msg(link.recv(f"ack bucket {self.inflight[0]}"))
                self.alive()
        if not self._vote():
            return False
        self._mark("last_acks")
        return True

    def commit(self) -> bool:
        """Phase 2: the receiver applies its staged tensors and runs its post-load hook (a
        failure here is kind `commit_*`); then protect the receive arena its weights may view.
        False when a rank failed."""
        link = self.link
        if link is not None:
            self.committed = False
            with self._capturing(prefix="commit_"):
                link.send(CommitMsg())
                msg = link.recv("finish the commit")
                if not isinstance(msg, DoneReply):
                    raise self._fail("server_error", f"expected 'done' after commit, got {msg.op!r}")
                self.committed = True
                link.views_buffer = msg.views_buffer
        ok = self._vote()
        self._mark("commit")
        if self.zero_copy and self.committed and link is not None and link.views_buffer:
            # the receiver may now hold views of this arena (even when another rank's
            # commit failed): never overwrite it. A receiver that copied (direct mode)
            # may still view the arena of an earlier update, which stays protected
            self.ps._live_arena = self.arena_idx
        elif self.zero_copy and self.committed is False:
            self.ps._drop_receive_arenas()  # a half-done commit may view either arena
        return ok

    def finish(self) -> UpdateStats:
        """The update's stats (also kept as `ParameterServer.last_stats`)."""
        if self.req is not None:
            self.req.join(self.timeout_s)
            if self.req.error is not None:
                log.warning("req_func raised after a successful update of %r:\n%s", self.name, self.req.error)
        plan = self.plan
        stats = UpdateStats(
            checkpoint=self.name,
            seconds=time.perf_counter() - self.t0,
            nbytes=sum(m.nbytes for m in plan.metas),
            num_buckets=len(plan.buckets),
            bucket_bytes=plan.bucket_bytes,
            phases={b[0]: b[1] - a[1] for a, b in zip(self.marks, self.marks[1:])},
        )
        if self.h2d_events:  # every event has completed: the stream was synchronised per bucket
            stats.h2d_s = sum(a.elapsed_time(b) for a, b, _ in self.h2d_events) / 1e3
            stats.h2d_bytes = sum(n for _, _, n in self.h2d_events)
        self.ps.last_stats = stats
        return stats

    def abort(self) -> NoReturn:
        """Tell this rank's receiver to drop the update, all-gather every rank's failure report
        and raise the same `UpdateError` on every rank."""
        ps, link, failure = self.ps, self.link, self.failure
        # what this rank's receiver applied: nothing when staged; when direct, what its error reply
        # said, or unknown (None) until it answers the abort; unknown for a commit that failed
        applied: list[str] | None = [] if link is None or link.staged else link.error_applied
        if link is not None and failure is not None and failure.kind.startswith("commit_"):
            applied = None
        if link is not None:
            if failure is not None and failure.kind.removeprefix("commit_") in ("worker_died", "timeout"):
                link.abort(failure.message, wait_s=None)  # dead or hung: tell it, do not wait
            else:
                reason = "another rank failed" if failure is None else f"rank {ps.rank}: {failure.message}"
                reply = link.abort(reason, wait_s=ps.config.abort_timeout_s)
                if reply is not None:
                    applied = reply.applied
        reports = ps._all_gather((failure, applied))
        failures = [f for f, _ in reports if f is not None]
        if not failures:
            failures = [RankFailure(rank=ps.rank, kind="server_error", message="update aborted")]
        raise UpdateError(self.name, failures, {r: a for r, (_, a) in enumerate(reports) if a != []})

    def close(self) -> None:
        if self.link is not None:
            self.link.close()

    # ---- per bucket ----

    def _on_msg(self, msg: object) -> None:
        if isinstance(msg, AckReply):
            if not self.inflight or self.inflight[0] != msg.bucket:
                raise self._fail(
                    "server_error",
                    f"ack for bucket {msg.bucket}, expected {list(self.inflight)[:1]}",
                    bucket=msg.bucket,
                )
            self.inflight.popleft()
            if self.link is not None:
                self.link.last_acked = msg.bucket

    def _prepare(self, k: int) -> tuple[torch.Tensor, tuple[int, int] | None]:
        """The bytes to broadcast for bucket k: the owner fills its place in the buffer (H2D on
        CUDA), or on CPU broadcasts in place from its shared registration arena, which its
        own receiver maps copy-on-write (so it can never write into the trainer's copy).
        Once this rank failed it still takes part in the broadcasts until the next vote, but
        into scratch memory: its receiver, late or hung, may still read the reused slots."""
        ps, buckets = self.ps, self.plan.buckets
        bucket = buckets[k]
        if self.failure is not None and self.reuse_slots:
            if self.scratch is None:
                self.scratch = torch.empty(
                    max(b.nbytes for b in buckets), dtype=torch.uint8, device=ps.device
                )
            slot = self.scratch[: bucket.nbytes]
        else:
            assert self.buf is not None  # allocated, or this rank failed and the first vote stopped it
            slot = self.buf.data[self.offsets[k] : self.offsets[k] + bucket.nbytes]
        if ps.rank != bucket.owner:
            return slot, None
        in_place = self.ckpt.in_place_source(bucket.items)
        if in_place is not None:
            arena, base = in_place
            return self.ckpt.arenas[arena].data[base : base + bucket.nbytes], in_place
        timed = ps.config.time_h2d and slot.is_cuda
        if timed:  # CUDA events on the copy stream: the pipeline's own H2D rate, no extra sync
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        for it in bucket.items:
            src = self.ckpt.bytes_by_name[it.name][it.chunk_start : it.chunk_start + it.nbytes]
            slot[it.buf_offset : it.buf_offset + it.nbytes].copy_(src, non_blocking=True)
        if timed:
            end.record()
            self.h2d_events.append((start, end, bucket.nbytes))
        return slot, None


__all__ = ["ParameterServer", "ServerConfig", "UpdateStats", "CkptError"]

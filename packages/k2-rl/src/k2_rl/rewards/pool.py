"""RewardPool: compute a batch of rewards in worker processes, robust to hangs and crashes.

Why processes: rewards are CPU bound (sympy, sandboxes), and math-verify's timeouts use
``signal.alarm``, which only works on a process's main thread. A
``concurrent.futures.ProcessPoolExecutor`` runs every task on its worker's main thread.

Design:

* **Reward by name or callable.** ``reward`` is a registry name / import spec (resolved, and
  cached, inside each worker by :func:`~k2_rl.rewards.base.get_reward`) or a picklable callable
  ``fn(prompt, response, task)`` (module-level functions pickle by reference).
* **Per-item timeout measured from the item's real start.** Workers report ``(item, pid,
  start time)`` on a queue as they begin an item, and the parent keeps at most ``max_workers``
  items in flight, so an item's clock never includes time it waited behind others. An item
  still running after ``timeout_s`` scores 0.0 with an error "timeout ...": the parent
  SIGKILLs its worker (a hung C extension cannot be interrupted any other way), replaces the
  executor, and resubmits the other in-flight items (they did not fail; they lose only the
  work done so far).
* **Exceptions** raised by the reward are caught in the worker: 0.0 plus the error text.
  A non-finite reward is also 0.0 with an error.
* **Crashed workers** (segfault, ``os._exit``, OOM kill) break the executor. It is replaced;
  items that had started are *suspects* and are re-run one at a time, so a suspect that
  crashes alone is the culprit (0.0, "worker crashed") and innocent ones finish normally;
  items that had not started are simply resubmitted.
* **Tied to the parent.** The workers (and multiprocessing's resource tracker) are recorded
  with this process's watchdog (``k2_data.lifetime``) as they start: they die with it, SIGKILL
  included.

The caller gets rewards in input order, per-item errors and seconds, and the batch wall time.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from k2_data import lifetime

from k2_rl.rewards.base import RewardFn, get_reward

__all__ = ["PoolResult", "RewardPool"]

RewardItem = tuple[str, str, dict]
"""One item to score: ``(prompt, response, task)``."""

# --- worker side ---------------------------------------------------------------------------

_START_QUEUE: Any = None
_REWARD_CACHE: dict[str, Any] = {}


def _init_worker(start_queue: Any, preload: tuple[str, ...]) -> None:
    global _START_QUEUE
    _START_QUEUE = start_queue
    for name in preload:
        try:
            _REWARD_CACHE[name] = get_reward(name)
        except Exception:
            pass  # reported per item by _run_item, which resolves the name again


def _ping(delay: float) -> int:
    time.sleep(delay)
    return os.getpid()


def _resolve(reward: str | RewardFn) -> RewardFn:
    if not isinstance(reward, str):
        return reward
    fn = _REWARD_CACHE.get(reward)
    if fn is None:
        fn = _REWARD_CACHE[reward] = get_reward(reward)
    return fn


def _run_item(sub_id: int, reward: str | RewardFn, item: RewardItem) -> tuple[float, str | None, float]:
    """Score one item on the worker's main thread; never raises for reward errors.

    The reward is resolved (imported) before the item's clock starts: importing is one-off
    worker set-up, bounded by ``start_grace_s``, not by the per-item timeout.
    """
    try:
        fn: RewardFn | None = _resolve(reward)
        setup_error = None
    except Exception as exc:
        fn, setup_error = None, f"error: {type(exc).__name__}: {exc}"
    if _START_QUEUE is not None:  # a SimpleQueue: written synchronously, survives an os._exit
        _START_QUEUE.put((sub_id, os.getpid(), time.time()))
    t0 = time.perf_counter()
    if fn is None:
        return 0.0, setup_error, 0.0
    try:
        prompt, response, task = item
        value = float(fn(prompt, response, task))
        if not math.isfinite(value):
            return 0.0, f"error: non-finite reward {value}", time.perf_counter() - t0
        return value, None, time.perf_counter() - t0
    except Exception as exc:
        return 0.0, f"error: {type(exc).__name__}: {exc}", time.perf_counter() - t0


# --- parent side ---------------------------------------------------------------------------


@dataclass
class PoolResult:
    """Rewards of one batch, in input order."""

    rewards: list[float]
    errors: list[str | None]
    """``None`` for a clean item, else a reason starting "timeout", "error:" or "worker crashed"."""
    seconds: list[float]
    """Per-item compute time (the timeout for a timed-out item)."""
    wall_s: float
    """Wall time of the whole batch."""
    restarts: int = 0
    """How many times the executor was replaced (timeouts and crashes)."""

    @property
    def timed_out(self) -> list[int]:
        return [i for i, e in enumerate(self.errors) if e is not None and e.startswith("timeout")]

    @property
    def failed(self) -> list[int]:
        return [i for i, e in enumerate(self.errors) if e is not None]


@dataclass
class _Inflight:
    index: int
    sub_id: int
    submitted: float
    started: float | None = None
    pid: int | None = None
    isolated: bool = False


@dataclass
class _Batch:
    reward: str | RewardFn
    items: Sequence[RewardItem]
    timeout_s: float
    rewards: list[float]
    errors: list[str | None]
    seconds: list[float]
    pending: deque[int]
    suspects: deque[int] = field(default_factory=deque)
    inflight: dict[Future, _Inflight] = field(default_factory=dict)
    crashes: dict[int, int] = field(default_factory=dict)


class RewardPool:
    """A process pool that scores ``(prompt, response, task)`` items with one reward.

    Args:
        max_workers: worker processes (default: CPU count, at most 16).
        timeout_s: per-item limit; a slower item scores 0.0 and is reported.
        mp_context: ``"spawn"`` (default) or ``"forkserver"``; ``"fork"`` is refused (forking a
            process that holds torch/CUDA or threads is unsafe).
        preload: reward names each worker resolves at start-up (keeps import time, e.g. sympy's,
            out of the first item's clock).
        start_grace_s: how long an item may wait for a worker to pick it up and resolve the
            reward (process start-up, imports) before it counts as hung.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        max_workers: int | None = None,
        *,
        timeout_s: float = 10.0,
        mp_context: str = "spawn",
        preload: Sequence[str] = (),
        start_grace_s: float = 60.0,
    ) -> None:
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(f"RewardPool: mp_context must be 'spawn' or 'forkserver', got {mp_context!r}")
        if timeout_s <= 0:
            raise ValueError(f"RewardPool: timeout_s must be > 0, got {timeout_s}")
        self.max_workers = max_workers or min(os.cpu_count() or 1, 16)
        self.timeout_s = float(timeout_s)
        self.start_grace_s = float(start_grace_s)
        self.preload = tuple(preload)
        self._ctx = mp.get_context(mp_context)
        self._start_queue: Any = None
        self._executor: ProcessPoolExecutor | None = None
        self._sub_id = 0
        self._tied = 0  # the executor's processes the watchdog was told about
        self.restarts = 0

    # -- executor lifecycle --

    def _get_executor(self) -> ProcessPoolExecutor:
        if self._executor is None:
            # A fresh start queue per executor: a worker killed mid-write cannot leave a held
            # lock or a torn message behind for the next one.
            self._start_queue = self._ctx.SimpleQueue()
            self._executor = ProcessPoolExecutor(
                max_workers=self.max_workers,
                mp_context=self._ctx,
                initializer=_init_worker,
                initargs=(self._start_queue, self.preload),
            )
        return self._executor

    def _tie(self, executor: ProcessPoolExecutor) -> None:
        # the executor starts workers on demand: tell the watchdog whenever their number changed
        n = len(getattr(executor, "_processes", None) or {})
        if n != self._tied:
            lifetime.adopt()
            self._tied = n

    def _kill_executor(self) -> None:
        executor, self._executor = self._executor, None
        self._tied = 0
        if executor is None:
            return
        processes = dict(getattr(executor, "_processes", None) or {})
        for proc in processes.values():
            if proc.is_alive():
                proc.kill()
        executor.shutdown(wait=False, cancel_futures=True)
        for proc in processes.values():
            proc.join(timeout=5)
        self._start_queue.close()
        self._start_queue = None

    def warmup(self) -> None:
        """Start every worker now (and run ``preload``) so the first batch doesn't pay for it."""
        executor = self._get_executor()
        futures = [executor.submit(_ping, 0.05) for _ in range(self.max_workers)]
        self._tie(executor)
        for f in futures:
            f.result()

    def close(self) -> None:
        """Stop the workers (killing any still busy)."""
        self._kill_executor()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- scoring --

    def compute(
        self, reward: str | RewardFn, items: Sequence[RewardItem], *, timeout_s: float | None = None
    ) -> PoolResult:
        """Score every ``(prompt, response, task)`` item; rewards come back in input order.

        ``timeout_s`` overrides the pool's per-item limit for this batch.
        """
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        if timeout <= 0:
            raise ValueError(f"RewardPool.compute: timeout_s must be > 0, got {timeout_s}")
        t0 = time.perf_counter()
        n = len(items)
        batch = _Batch(reward, items, timeout, [0.0] * n, [None] * n, [0.0] * n, deque(range(n)))
        restarts0 = self.restarts
        try:
            while batch.pending or batch.suspects or batch.inflight:
                self._dispatch(batch)
                self._step(batch)
        except BaseException:
            self._kill_executor()  # never leave workers busy on an abandoned batch
            raise
        return PoolResult(
            batch.rewards, batch.errors, batch.seconds, time.perf_counter() - t0, self.restarts - restarts0
        )

    def _dispatch(self, batch: _Batch) -> None:
        executor = self._get_executor()
        if any(info.isolated for info in batch.inflight.values()):
            return
        if batch.suspects:
            # A suspect of a crash runs alone, so a crash then identifies it.
            if not batch.inflight:
                self._submit(executor, batch, batch.suspects, batch.suspects.popleft(), isolated=True)
            return
        while batch.pending and len(batch.inflight) < self.max_workers:
            if not self._submit(executor, batch, batch.pending, batch.pending.popleft()):
                return

    def _submit(
        self,
        executor: ProcessPoolExecutor,
        batch: _Batch,
        origin: deque[int],
        index: int,
        isolated: bool = False,
    ) -> bool:
        self._sub_id += 1
        try:
            future = executor.submit(_run_item, self._sub_id, batch.reward, batch.items[index])
        except BrokenProcessPool:  # a worker died between two steps
            origin.appendleft(index)
            self._on_crash(batch)
            return False
        batch.inflight[future] = _Inflight(index, self._sub_id, time.time(), isolated=isolated)
        self._tie(executor)
        return True

    def _drain_starts(self, batch: _Batch) -> None:
        by_sub = {info.sub_id: info for info in batch.inflight.values()}
        while self._start_queue is not None and not self._start_queue.empty():
            sub_id, pid, started = self._start_queue.get()
            info = by_sub.get(sub_id)  # None: a stale message from an earlier submission
            if info is not None:
                info.started, info.pid = started, pid

    def _deadline(self, batch: _Batch, info: _Inflight) -> float:
        if info.started is None:
            return info.submitted + self.start_grace_s + batch.timeout_s
        return info.started + batch.timeout_s

    def _step(self, batch: _Batch) -> None:
        self._drain_starts(batch)
        if not batch.inflight:
            return
        now = time.time()
        next_deadline = min(self._deadline(batch, i) for i in batch.inflight.values())
        done, _ = wait(
            list(batch.inflight),
            timeout=max(0.0, min(next_deadline - now, 0.05)),
            return_when=FIRST_COMPLETED,
        )
        broken = False
        for future in done:
            info = batch.inflight.pop(future)
            try:
                value, error, seconds = future.result()
            except BrokenProcessPool:
                batch.inflight[future] = info
                broken = True
                continue
            batch.rewards[info.index], batch.errors[info.index], batch.seconds[info.index] = (
                value,
                error,
                seconds,
            )
        if broken:
            self._drain_starts(batch)
            self._on_crash(batch)
            return
        self._drain_starts(batch)
        now = time.time()
        expired = [(f, i) for f, i in batch.inflight.items() if now >= self._deadline(batch, i)]
        if expired:
            self._on_timeout(batch, expired)

    def _on_timeout(self, batch: _Batch, expired: list[tuple[Future, _Inflight]]) -> None:
        for future, info in expired:
            del batch.inflight[future]
            where = "" if info.started is not None else " (never started)"
            batch.rewards[info.index] = 0.0
            batch.errors[info.index] = f"timeout after {batch.timeout_s:g}s{where}"
            batch.seconds[info.index] = batch.timeout_s
            if info.pid is not None:
                try:
                    os.kill(info.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        # The executor is broken by the kill; the other in-flight items are innocent.
        for info in batch.inflight.values():
            batch.pending.appendleft(info.index)
        batch.inflight.clear()
        self._kill_executor()
        self.restarts += 1

    def _on_crash(self, batch: _Batch) -> None:
        for info in batch.inflight.values():
            crashes = batch.crashes[info.index] = batch.crashes.get(info.index, 0) + 1
            if (info.isolated and info.started is not None) or crashes >= 3:
                batch.rewards[info.index] = 0.0
                batch.errors[info.index] = "worker crashed (the worker process died while scoring this item)"
            elif info.started is not None:
                batch.suspects.append(info.index)
            else:
                batch.pending.appendleft(info.index)
        batch.inflight.clear()
        self._kill_executor()
        self.restarts += 1

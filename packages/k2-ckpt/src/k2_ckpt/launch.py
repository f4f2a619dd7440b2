"""Run a function on N local gloo ranks (spawned processes) and collect what each returns.

Used by the tests and `k2 ckpt bench`; a real deployment uses torchrun instead.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, out: mp.Queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
            # free what cycles kept of the group (its gloo threads) now, not in static destructors
            # at exit, where one aborted a rank now and then ("terminate called without an active
            # exception"; docs/training.md)
            gc.collect()
        out.put((rank, True, result))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def run_world(
    world_size: int, fn: Callable[..., Any], args: tuple = (), timeout_s: float = 120.0
) -> list[Any]:
    """Call `fn(rank, world_size, *args)` in `world_size` gloo processes; return results by rank.

    `fn` must be importable (a module-level function). Raises RuntimeError with the failing
    ranks' tracebacks, or TimeoutError (after killing every rank) past `timeout_s`.
    """
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, out), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(results))} did not finish "
                    f"within {timeout_s:.0f}s"
                )
            try:
                rank, ok, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RuntimeError(
                        f"rank(s) {dead} exited with codes "
                        f"{[procs[r].exitcode for r in dead]} before reporting"
                    ) from None
                continue
            results[rank] = (ok, value)
            if not ok:
                break  # the others may be stuck in a collective with the dead rank
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world_size else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    failed = {r: v for r, (ok, v) in results.items() if not ok}
    if failed:
        raise RuntimeError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items())))
    return [results[r][1] for r in range(world_size)]

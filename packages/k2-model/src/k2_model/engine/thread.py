"""EngineThread: drive an Engine from a background thread and stream each request's outputs.

A server submits requests from any thread (or an asyncio loop, via `loop.run_in_executor` or by
polling) and reads `StepOutput`s from the request's queue (a queue class with a `batch_key`
attribute and a `put_batch([(queue, output), ...])` classmethod gets all of a step's outputs for
queues of one key in one call: an asyncio server wakes its loop once per step, not once per stream); a request with `n` samples puts the
outputs of all of them (`StepOutput.index`) on one queue, the last of each has `finished=True`.
The thread sleeps while there is nothing to do.
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from k2_model.engine.engine import Engine
from k2_model.engine.sampling import SamplingParams


class EngineThread:
    """Owns the stepping of one Engine; `submit` returns a queue of that request's StepOutputs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._queues: dict[str, Any] = {}  # request id -> its output queue
        self._unfinished: dict[str, int] = {}  # samples of each request still running
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="k2-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        out: Any = None,
    ) -> tuple[str, Any]:
        """Queue a request; its StepOutputs (or the engine's exception) go to `out` (anything with
        `put(item)`, called on the engine thread; default a new queue.Queue), which is returned."""
        q = queue.Queue() if out is None else out
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        if rid in self._queues:
            raise ValueError(f"EngineThread.submit: request_id {rid!r} is already running")
        self._queues[rid] = q  # before the engine can step it
        self._unfinished[rid] = params.n if params is not None else 1
        try:
            self.engine.add_request(prompt_token_ids, params, rid)
        except BaseException:
            self._queues.pop(rid, None)
            self._unfinished.pop(rid, None)
            raise
        with self._wake:
            self._wake.notify()
        return rid, q

    def abort(self, request_id: str) -> None:
        with self._wake:
            self.engine.abort(request_id)
            self._wake.notify()

    def call_between_steps(self, fn: Callable[[], Any]) -> Future:
        """See `Engine.call_between_steps`."""
        with self._wake:
            fut = self.engine.call_between_steps(fn)
            self._wake.notify()
        return fut

    def close(self, timeout: float | None = 10.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self.engine.has_unfinished():
                    self._wake.wait()
                if self._stop:
                    return
            try:
                outs = self.engine.step()
            except BaseException as e:
                for q in list(self._queues.values()):
                    q.put(e)
                self._queues.clear()
                self._unfinished.clear()
                raise
            batches: dict[Any, list] = {}  # queues that take a step's outputs in one hand-off
            for out in outs:
                q = self._queues.get(out.request_id)
                if q is not None:
                    key = getattr(q, "batch_key", None)
                    if key is None:
                        q.put(out)
                    else:
                        batches.setdefault(key, []).append((q, out))
                    if out.finished:
                        self._unfinished[out.request_id] -= 1
                        if self._unfinished[out.request_id] == 0:
                            self._queues.pop(out.request_id, None)
                            self._unfinished.pop(out.request_id, None)
            for items in batches.values():
                type(items[0][0]).put_batch(items)

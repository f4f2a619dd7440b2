"""A stateful, rank-sharded batch loader over a `PackedDataset`.

Legend: B = per-rank batch size, W = world size, S = sequence length.

Step t's global batch is samples [t*W*B, (t+1)*W*B) of the dataset's sample sequence; rank r gets
the contiguous slice [(t*W + r)*B, (t*W + r + 1)*B). So a 1-process run with batch W*B sees the
same samples per step as W processes with batch B, and the state is one number (the next step):
`load_state_dict` resumes at exactly the next sample. Workers (threads) only prefetch future
steps; which samples a step holds never depends on their number.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from k2_data.packing import PackedDataset

STATE_VERSION = 1


class StatefulLoader:
    """Yields `{"input_ids": LongTensor[B, S], "shift_labels": LongTensor[B, S]}` (plus
    `position_ids` and `document_ids` when the dataset has `document_mask=True`), forever or for
    `num_steps` steps. `shift_labels` are the next tokens already (see `k2_data.packing`), and the
    keys are `K2ForCausalLM.forward`'s arguments: `model(**batch).loss` is the training loss."""

    def __init__(
        self,
        dataset: PackedDataset,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        prefetch: int = 2,
        num_steps: int | None = None,
        pin_memory: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.dataset = dataset
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.num_workers, self.prefetch, self.num_steps = num_workers, max(1, prefetch), num_steps
        self.pin_memory = pin_memory
        self.step = 0  # the next step to yield
        self._pool: ThreadPoolExecutor | None = None
        self._queue: deque[tuple[int, Future]] = deque()
        self.wait_s = 0.0  # time the consumer spent inside __next__
        self.batches = 0

    # -- which samples a step holds

    def sample_indices(self, step: int) -> range:
        first = (step * self.world_size + self.rank) * self.batch_size
        return range(first, first + self.batch_size)

    @property
    def steps_per_epoch(self) -> float:
        return len(self.dataset) / (self.batch_size * self.world_size)

    def make_batch(self, step: int) -> dict[str, torch.Tensor]:
        samples = [self.dataset[g] for g in self.sample_indices(step)]
        batch = {k: torch.from_numpy(np.stack([s[k] for s in samples]).astype(np.int64)) for k in samples[0]}
        if self.pin_memory:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return batch

    # -- iteration with prefetch

    def __iter__(self) -> StatefulLoader:
        return self

    def _fill(self) -> None:
        if self._pool is None:
            return
        depth = self.num_workers * self.prefetch
        nxt = self._queue[-1][0] + 1 if self._queue else self.step
        while len(self._queue) < depth and (self.num_steps is None or nxt < self.num_steps):
            self._queue.append((nxt, self._pool.submit(self.make_batch, nxt)))
            nxt += 1

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.num_steps is not None and self.step >= self.num_steps:
            raise StopIteration
        t0 = time.perf_counter()
        if self.num_workers > 0:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="k2-loader")
            self._fill()
            step, fut = self._queue.popleft()
            assert step == self.step, (step, self.step)
            batch = fut.result()
            self._fill()
        else:
            batch = self.make_batch(self.step)
        self.step += 1
        self.wait_s += time.perf_counter() - t0
        self.batches += 1
        return batch

    def close(self) -> None:
        for _, fut in self._queue:
            fut.cancel()
        self._queue.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- state

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "step": self.step,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "dataset": self.dataset.fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue at `state["step"]`; the dataset and the global batch must be the same."""
        for key in ("step", "batch_size", "world_size", "dataset"):
            if key not in state:
                raise ValueError(f"loader state has no field {key!r}")
        accepted = getattr(self.dataset, "fingerprints", lambda: {self.dataset.fingerprint()})()
        if state["dataset"] not in accepted:
            raise ValueError(
                f"loader state is for dataset {state['dataset']}, this loader reads {self.dataset.fingerprint()} "
                "(different data, seq_len, seed or split)"
            )
        if state["batch_size"] * state["world_size"] != self.batch_size * self.world_size:
            raise ValueError(
                f"loader state has global batch {state['batch_size']}x{state['world_size']}, "
                f"this loader {self.batch_size}x{self.world_size}"
            )
        self.close()
        self.step = int(state["step"])

    def stats(self) -> dict:
        """Time the training loop spent waiting for batches."""
        return {
            "batches": self.batches,
            "wait_s": self.wait_s,
            "wait_ms_per_batch": 1000.0 * self.wait_s / max(self.batches, 1),
        }

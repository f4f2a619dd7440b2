"""The generation engine: continuous batching over the MLA cache.

Requests wait in a queue; each `step()` (1) drops aborted requests, (2) admits waiting requests
into free cache slots and prefills them together (packed, expanded attention), which yields
their first token, (3) runs one absorbed decode step for every request that was already
running, and (4) samples one token for every row of both, checks stop conditions and frees the
slots of finished requests. So requests join and leave between decode steps, and every running
request advances by exactly one token per step.

Finish reasons: "stop" (a stop token id, the eos ids unless ignore_eos, or a stop string),
"length" (max_tokens, or the model's context is full), "abort". A stop token stays in
`token_ids` (and its logprobs: RL scores it) but not in `text`; a stop string is cut from `text`
(unless include_stop_str_in_output); `stop_reason` says which one ended it.

`add_request` and `abort` are thread-safe (a server thread may call them while another thread
runs `step()`); `step()` itself must be driven by one thread.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from k2_model.engine.cache import MLACache
from k2_model.engine.forward import DECODE_ATTENTION, decode, prefill
from k2_model.engine.sampling import SamplingParams, sample
from k2_model.model import K2ForCausalLM


@dataclass
class Completion:
    """A request and everything generated for it so far."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # raw distribution
    sampled_logprobs: list[float] = field(default_factory=list)  # the processed distribution sampled
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepOutput:
    """What one step produced for one request (a streaming delta)."""

    request_id: str
    token_ids: list[int]  # 0 or 1 tokens
    logprobs: list[float]
    sampled_logprobs: list[float]
    text_delta: str
    finished: bool
    finish_reason: str | None
    completion: Completion


@dataclass
class _Running:
    completion: Completion
    generator: torch.Generator | None
    emitted_chars: int = 0  # text already streamed

    @property
    def length(self) -> int:
        """Tokens in the sequence (prompt + generated); the last generated one is not cached yet."""
        return len(self.completion.prompt_token_ids) + len(self.completion.token_ids)


class Engine:
    """Batched generation with a compressed MLA KV cache.

    `detokenize(ids) -> str` is needed for stop strings and `text` (without it `text` stays "").
    `eos_token_ids` defaults to the config's `eos_token_id`. `max_model_len` (prompt + generated
    tokens) defaults to the config's `max_position_embeddings`. `max_prefill_tokens` bounds the
    prompt tokens admitted in one step (at least one request is always admitted). `attention`
    "expanded" decodes with per-head keys and values rebuilt from the cache (the reference form,
    for tests). The model is put in eval mode; the cache takes its dtype and device.
    """

    def __init__(
        self,
        model: K2ForCausalLM,
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        eos_token_ids: Sequence[int] | None = None,
        max_prefill_tokens: int = 8192,
        attention: str = "absorbed",
        seed: int = 0,
    ) -> None:
        if attention not in DECODE_ATTENTION:
            raise ValueError(
                f"Engine: attention must be one of {sorted(DECODE_ATTENTION)}, got {attention!r}"
            )
        if max_batch_size < 1:
            raise ValueError(f"Engine: max_batch_size must be >= 1, got {max_batch_size}")
        cfg = model.config
        self.model = model.eval()
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.detokenize = detokenize
        if eos_token_ids is None:
            eos_token_ids = [] if cfg.eos_token_id is None else [cfg.eos_token_id]
        self.eos_token_ids = set(eos_token_ids)
        self.attention = attention
        weight = model.lm_head.weight
        self.cache = MLACache(
            cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype=weight.dtype,
            device=weight.device, max_slots=max_batch_size, max_len=self.max_model_len,
        )  # fmt: skip
        self._running: list[_Running] = []  # index = cache slot
        self._waiting: deque[_Running] = deque()
        self._aborts: set[str] = set()
        self._between_steps: deque[tuple[Callable[[], Any], Future]] = deque()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(seed)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; it joins the batch at the next step. Returns its id."""
        params = params or SamplingParams()
        ids = [int(t) for t in prompt_token_ids]
        vocab = self.model.config.vocab_size
        if not ids:
            raise ValueError("Engine.add_request: prompt_token_ids is empty")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(
                f"Engine.add_request: prompt_token_ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"Engine.add_request: prompt of {len(ids)} tokens leaves no room in max_model_len={self.max_model_len}"
            )
        if params.stop and self.detokenize is None:
            raise ValueError("Engine.add_request: SamplingParams.stop needs an Engine built with detokenize=")
        with self._lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            seed = (
                params.seed
                if params.seed is not None
                else int(torch.randint(2**62, (1,), generator=self._seeds))
            )
            gen = None if params.greedy else torch.Generator().manual_seed(seed)
            self._waiting.append(_Running(Completion(rid, ids, params), gen))
        return rid

    def abort(self, request_id: str) -> None:
        """Finish a waiting or running request with reason "abort" at the next step."""
        with self._lock:
            self._aborts.add(request_id)

    def call_between_steps(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` (under no_grad) on the stepping thread before the next step's work (e.g. loading new weights
        from k2-ckpt while serving); thread-safe. The returned Future holds its result or error.
        Running requests keep their cache (computed with the old weights), as in vLLM."""
        fut: Future = Future()
        with self._lock:
            self._between_steps.append((fn, fut))
        return fut

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._running or self._waiting or self._between_steps)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def cache_bytes_per_token(self) -> int:
        return self.cache.bytes_per_token()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StepOutput]:
        """Run the queued between-step calls, then one step of generation; outputs of this step."""
        with self._lock:
            calls, self._between_steps = self._between_steps, deque()
        for fn, fut in calls:  # no_grad, not inference mode: loaded weights stay ordinary tensors
            if fut.set_running_or_notify_cancel():
                try:
                    with torch.no_grad():
                        fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)
        return self._step()

    @torch.inference_mode()
    def _step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            kept = deque()
            for r in self._waiting:
                if r.completion.request_id in aborts:
                    outputs.append(self._finish_output(r, "abort", None))
                else:
                    kept.append(r)
            self._waiting = kept
            admitted: list[_Running] = []
            budget = self.max_prefill_tokens
            while self._waiting and len(self._running) + len(admitted) < self.max_batch_size:
                S = len(self._waiting[0].completion.prompt_token_ids)
                if admitted and S > budget:
                    break
                budget -= S
                admitted.append(self._waiting.popleft())
        for slot in reversed(range(len(self._running))):
            if self._running[slot].completion.request_id in aborts:
                outputs.append(self._finish_output(self._running[slot], "abort", None))
                self._release(slot)

        decoding = list(self._running)
        rows, logits = [], []
        if decoding:
            pos_n = torch.tensor([r.length - 1 for r in decoding], device=self.cache.device)
            tokens_n = torch.tensor([r.completion.token_ids[-1] for r in decoding], device=self.cache.device)
            self.cache.ensure(len(decoding), int(pos_n.max()) + 1)
            logits.append(decode(self.model, self.cache, tokens_n, pos_n, self.attention))
            rows += decoding
        if admitted:
            slots = list(range(len(self._running), len(self._running) + len(admitted)))
            prompts = [r.completion.prompt_token_ids for r in admitted]
            self.cache.ensure(slots[-1] + 1, max(len(p) for p in prompts))
            logits.append(prefill(self.model, self.cache, prompts, slots))
            self._running += admitted
            rows += admitted
        if not rows:
            return outputs
        res = sample(torch.cat(logits), [r.completion.params for r in rows], [r.generator for r in rows])
        tokens, lps, slps = res.tokens_n.tolist(), res.logprob_n.tolist(), res.sampled_logprob_n.tolist()
        finished_slots = []
        for i, r in enumerate(rows):
            c = r.completion
            c.token_ids.append(tokens[i])
            c.logprobs.append(lps[i])
            c.sampled_logprobs.append(slps[i])
            if c.params.top_logprobs:
                c.top_logprobs.append(dict(zip(res.top_ids[i], res.top_logprobs[i])))
            reason, stop_reason, delta = self._check_stop(r)
            if reason is not None:
                c.finish_reason, c.stop_reason = reason, stop_reason
                finished_slots.append(i)  # rows are in slot order
            outputs.append(
                StepOutput(
                    c.request_id, [tokens[i]], [lps[i]], [slps[i]], delta, reason is not None, reason, c
                )
            )
        for slot in reversed(finished_slots):
            self._release(slot)
        return outputs

    def _check_stop(self, r: _Running) -> tuple[str | None, int | str | None, str]:
        """Finish reason, stop reason and the text delta to stream after the newest token."""
        c = r.completion
        p = c.params
        tok = c.token_ids[-1]
        reason: str | None = None
        stop_reason: int | str | None = None
        text_ids = c.token_ids
        if tok in p.stop_token_ids or (tok in self.eos_token_ids and not p.ignore_eos):
            reason, stop_reason, text_ids = "stop", tok, c.token_ids[:-1]
        if self.detokenize is not None:
            c.text = self.detokenize(text_ids)
            if reason is None and p.stop:
                # only the tail can hold a newly completed stop string
                start = max(0, r.emitted_chars - max(len(s) for s in p.stop))
                hits = [(c.text.find(s, start), s) for s in p.stop]
                hits = [(j, s) for j, s in hits if j >= 0]
                if hits:
                    j, s = min(hits)
                    c.text = c.text[: j + len(s)] if p.include_stop_str_in_output else c.text[:j]
                    reason, stop_reason = "stop", s
        if reason is None and len(c.token_ids) >= p.max_tokens:
            reason = "length"
        if reason is None and r.length >= self.max_model_len:
            reason = "length"
        if reason is not None:
            end = len(c.text)
        else:  # hold back what may still become a stop string or an incomplete character
            end = len(c.text) - (max((len(s) for s in p.stop), default=1) - 1)
            while end > r.emitted_chars and c.text[end - 1] == "\ufffd":
                end -= 1
        end = max(end, r.emitted_chars)
        delta, r.emitted_chars = c.text[r.emitted_chars : end], end
        return reason, stop_reason, delta

    def _finish_output(self, r: _Running, reason: str, stop_reason: int | str | None) -> StepOutput:
        c = r.completion
        c.finish_reason, c.stop_reason = reason, stop_reason
        delta = c.text[r.emitted_chars :]
        r.emitted_chars = len(c.text)
        return StepOutput(c.request_id, [], [], [], delta, True, reason, c)

    def _release(self, slot: int) -> None:
        """Free a slot, keeping slots dense: the last running sequence moves into it."""
        last = len(self._running) - 1
        if slot != last:
            moved = self._running[last]
            self.cache.move(last, slot, moved.length - 1)  # its newest token is not cached yet
            self._running[slot] = moved
        self._running.pop()

    # ------------------------------------------------------------------ convenience
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run the given prompts to completion (batched); completions in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"Engine.generate: {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        wanted, done = set(ids), {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out.completion
        return [done[i] for i in ids]

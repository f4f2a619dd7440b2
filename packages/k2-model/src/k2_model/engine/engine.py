"""The generation engine: continuous batching over the paged MLA cache, with prefix caching.

Requests wait in a queue; each `step()` (1) drops aborted requests, (2) admits waiting requests
while the batch and the KV budget allow, reusing the longest cached prefix of each prompt, and
prefills only their new tokens together (packed, expanded attention), which yields their first
token, (3) runs one absorbed decode step for every sequence that was already running, and
(4) applies each row's logits processors, samples one token per row, checks stop conditions and
releases the blocks of finished sequences. So requests join and leave between decode steps, and
every running sequence advances by exactly one token per step.

A request with `n > 1` samples is prefilled once; its samples fork from the prefill (sharing the
prompt's full blocks, each with a copy of the partial last block) and sample i draws with the seed
`sample_seed(seed, i)`, so it equals a single request with that seed.

Admission control: a sequence may need `blocks_for(min(prompt + max_tokens, max_model_len))`
blocks; a request is admitted only when the worst case of every running sequence and of it fits
in the cache's budget (`kv_cache_tokens`), so a burst of long requests queues (first come, first
served) and nothing is ever preempted.

Finish reasons: "stop" (a stop token id, the eos ids unless ignore_eos, or a stop string),
"length" (max_tokens, or the model's context is full), "abort". A stop token stays in
`token_ids` (and its logprobs: RL scores it) but not in `text`; a stop string is cut from `text`
(unless include_stop_str_in_output); `stop_reason` says which one ended it.

`add_request` and `abort` are thread-safe (a server thread may call them while another thread
runs `step()`); `step()` itself must be driven by one thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from k2_model.engine.cache import MLACache, block_key
from k2_model.engine.forward import DECODE_ATTENTION, decode, prefill
from k2_model.engine.sampling import SamplingParams, fork_processor, sample, sample_seed
from k2_model.model import K2ForCausalLM

log = logging.getLogger(__name__)


@dataclass
class Completion:
    """One sample of a request and everything generated for it so far."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the distribution after logits processors
    sampled_logprobs: list[float] = field(default_factory=list)  # the processed distribution sampled
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    index: int = 0  # the sample's index among the request's n
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # why a logits processor aborted it
    # Engine(record_routes=True): the experts each forwarded position (prompt, then every generated
    # token but the last) was routed to, int16 [positions, MoE layers, K]; set when it finishes
    routed_experts: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepOutput:
    """What one step produced for one sample of a request (a streaming delta)."""

    request_id: str
    token_ids: list[int]  # 0 or 1 tokens
    logprobs: list[float]
    sampled_logprobs: list[float]
    text_delta: str
    finished: bool
    finish_reason: str | None
    completion: Completion
    index: int = 0
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per token, when requested


@dataclass
class EngineStats:
    """Counters since the engine started (the server's /metrics reads them)."""

    prompt_tokens: int = 0  # of admitted requests, once per request (not per sample)
    prefilled_tokens: int = 0  # run through prefill: prompt tokens minus the cached prefix
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    generated_tokens: int = 0
    requests_admitted: int = 0
    samples_finished: int = 0


@dataclass
class _Seq:
    """One running sample: its completion, its block table and the keys of its full blocks."""

    completion: Completion
    generator: torch.Generator | None
    processors: list[Callable]
    table: list[int]
    keys: list[bytes]
    max_blocks: int
    emitted_chars: int = 0  # text already streamed
    decoded: int = 0  # token_ids already detokenised into completion.text
    prefilled: int = 0  # prompt tokens in the cache (chunked prefill: < prompt length for a while)
    request: _Pending | None = None  # while prefilling: the request (its samples fork when it is done)

    @property
    def prefilling(self) -> bool:
        return self.request is not None

    @property
    def samples(self) -> int:
        """Batch rows this sequence stands for: a request still prefilling counts all its samples."""
        return self.request.params.n if self.request is not None else 1

    @property
    def length(self) -> int:
        """Tokens in the sequence (prompt + generated); the last generated one is not cached yet."""
        return len(self.completion.prompt_token_ids) + len(self.completion.token_ids)


@dataclass
class _Pending:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    keys: list[bytes]  # prefix-index keys of the prompt's full blocks
    need_blocks: int  # worst case for all n samples (prompt blocks shared)
    max_blocks: int  # worst case per sample


class Engine:
    """Batched generation with a paged, prefix-cached MLA KV cache.

    `detokenize(ids) -> str` is needed for stop strings and `text` (without it `text` stays "").
    `eos_token_ids` defaults to the config's `eos_token_id`. `max_model_len` (prompt + generated
    tokens) defaults to the config's `max_position_embeddings`. `max_prefill_tokens` bounds the
    prompt tokens prefilled in one step: a longer prompt is prefilled in chunks over several steps
    (chunked prefill) while the running sequences keep decoding one token per step.
    `kv_cache_tokens` is the KV memory budget in tokens (default: `max_batch_size` full-length
    sequences); `block_size` tokens per cache block; `enable_prefix_caching` reuses cached prompt
    prefixes across requests. `attention` "expanded" decodes with per-head keys and values rebuilt
    from the cache (the reference form, for tests). The model is put in eval mode; the cache takes
    its dtype and device. `record_routes` keeps the experts every token was routed to beside its
    cache rows and returns them with each finished sample (`Completion.routed_experts`), for RL's
    routing replay.
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
        kv_cache_tokens: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        record_routes: bool = False,
    ) -> None:
        if attention not in DECODE_ATTENTION:
            raise ValueError(
                f"Engine: attention must be one of {sorted(DECODE_ATTENTION)}, got {attention!r}"
            )
        if max_batch_size < 1:
            raise ValueError(f"Engine: max_batch_size must be >= 1, got {max_batch_size}")
        if max_prefill_tokens < 1:
            raise ValueError(f"Engine: max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if block_size < 1:
            raise ValueError(f"Engine: block_size must be >= 1, got {block_size}")
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
        self.enable_prefix_caching = enable_prefix_caching
        per_seq = -(-self.max_model_len // block_size)
        max_blocks = (
            max_batch_size * per_seq if kv_cache_tokens is None else -(-kv_cache_tokens // block_size)
        )
        if max_blocks < 1:
            raise ValueError(f"Engine: kv_cache_tokens must be >= 1, got {kv_cache_tokens}")
        weight = model.lm_head.weight
        self.cache = MLACache(
            cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype=weight.dtype,
            device=weight.device, block_size=block_size, max_blocks=max_blocks,
            routes=(len(model.moe_routers()), cfg.num_experts_per_tok) if record_routes else None,
        )  # fmt: skip
        self.stats = EngineStats()
        self._running: list[_Seq] = []
        self._waiting: deque[_Pending] = deque()
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
        """Queue a request (its `params.n` samples); it joins the batch at a later step. Returns its id."""
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
        if params.n > self.max_batch_size:
            raise ValueError(
                f"Engine.add_request: SamplingParams.n={params.n} exceeds max_batch_size={self.max_batch_size}"
            )
        B = self.cache.block_size
        max_blocks = self.cache.blocks_for(min(len(ids) + params.max_tokens, self.max_model_len))
        shared = len(ids) // B
        need = shared + params.n * (max_blocks - shared)
        if need > self.cache.max_blocks:
            raise ValueError(
                f"Engine.add_request: needs up to {need * B} KV cache tokens (prompt {len(ids)}, max_tokens "
                f"{params.max_tokens}, n {params.n}), over kv_cache_tokens={self.cache.max_blocks * B}"
            )
        keys: list[bytes] = []
        for k in range(shared):  # hashed here, off the stepping thread
            keys.append(block_key(keys[-1] if keys else None, ids[k * B : (k + 1) * B]))
        with self._lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            seed = (
                params.seed
                if params.seed is not None
                else int(torch.randint(2**62, (1,), generator=self._seeds))
            )
            self._waiting.append(_Pending(rid, ids, params, seed, keys, need, max_blocks))
        return rid

    def abort(self, request_id: str) -> None:
        """Finish every sample of a waiting or running request with reason "abort" at the next step."""
        with self._lock:
            self._aborts.add(request_id)

    def call_between_steps(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` (under no_grad) on the stepping thread before the next step's work (e.g. loading new weights
        from k2-ckpt while serving); thread-safe. The returned Future holds its result or error.
        Running requests keep their cache (computed with the old weights), as in vLLM; the prefix cache is
        flushed after the call, so no later request reuses rows of the old weights."""
        fut: Future = Future()
        with self._lock:
            self._between_steps.append((fn, fut))
        return fut

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._running or self._waiting or self._between_steps)

    @property
    def num_running(self) -> int:
        """Sequences (samples) in the batch."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission."""
        return len(self._waiting)

    def cache_bytes_per_token(self) -> int:
        return self.cache.bytes_per_token()

    def cache_usage(self) -> float:
        """Fraction of the KV budget's blocks referenced by running sequences."""
        return self.cache.num_used() / self.cache.max_blocks

    def free_cache_memory(self) -> int:
        """Release the KV pool while no request is queued or running (engine switching: an RL
        trainer on the same device uses the memory during its update); returns the bytes freed.
        The next request regrows it. Call it from the thread that steps the engine (or through
        `call_between_steps`)."""
        with self._lock:
            busy = bool(self._running or self._waiting)
        if busy:
            raise RuntimeError("Engine.free_cache_memory: requests are still queued or running")
        return self.cache.free_memory()

    def flush_prefix_cache(self) -> None:
        """Forget cached prefixes (call on the stepping thread, e.g. inside `call_between_steps`)."""
        self.cache.flush_prefix()

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
        if calls:  # weights may have changed: cached prefixes are stale
            self.cache.flush_prefix()
        return self._step()

    def _reserved(self) -> int:
        """Blocks the running sequences may still allocate (their worst case)."""
        # a request still prefilling holds only its first sample's table: the worst case of its
        # samples to come (need_blocks, prompt blocks shared) stays reserved too
        return sum(
            max((s.request.need_blocks if s.request is not None else s.max_blocks) - len(s.table), 0)
            for s in self._running
        )

    def _admit(self, r: _Pending) -> tuple[_Seq, int]:
        """Give a request's first sample its blocks (cached prefix retained, the rest allocated); (seq, cached tokens)."""
        B, P = self.cache.block_size, len(r.prompt)
        hits = self.cache.lookup(r.keys) if self.enable_prefix_caching else []
        hits = hits[: (P - 1) // B]  # at least one token is prefilled: its logits start the decode
        for b in hits:
            self.cache.retain(b)
        table = hits + [self.cache.allocate() for _ in range(self.cache.blocks_for(P) - len(hits))]
        c = Completion(r.request_id, r.prompt, r.params, num_cached_tokens=len(hits) * B)
        gen = None if r.params.greedy else torch.Generator().manual_seed(r.seed)
        seq = _Seq(c, gen, list(r.params.logits_processors), table, list(r.keys), r.max_blocks)
        seq.prefilled, seq.request = len(hits) * B, r
        return seq, len(hits) * B

    def _fork(self, parent: _Seq, r: _Pending, index: int) -> _Seq:
        """Sample `index` of a prefilled request: the prompt's full blocks shared, the partial one copied."""
        B, P = self.cache.block_size, len(r.prompt)
        table = parent.table[: P // B]
        for b in table:
            self.cache.retain(b)
        if P % B:
            table = table + [self.cache.allocate()]
            self.cache.copy_block(parent.table[P // B], table[-1], P % B)
        c = Completion(
            r.request_id,
            r.prompt,
            r.params,
            index=index,
            num_cached_tokens=parent.completion.num_cached_tokens,
        )
        gen = None if r.params.greedy else torch.Generator().manual_seed(sample_seed(r.seed, index))
        procs = [fork_processor(p) for p in r.params.logits_processors]
        return _Seq(c, gen, procs, table, list(parent.keys), r.max_blocks)

    @torch.inference_mode()
    def _step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            kept = deque()
            for r in self._waiting:
                if r.request_id in aborts:
                    for i in range(r.params.n):
                        c = Completion(r.request_id, r.prompt, r.params, index=i)
                        c.finish_reason = "abort"
                        outputs.append(StepOutput(r.request_id, [], [], [], "", True, "abort", c, i))
                else:
                    kept.append(r)
            self._waiting = kept
        if aborts:
            for s in [s for s in self._running if s.completion.request_id in aborts]:
                if s.request is not None:  # still prefilling: its other samples were never forked
                    for i in range(1, s.request.params.n):
                        c = Completion(s.request.request_id, s.request.prompt, s.request.params, index=i)
                        c.finish_reason = "abort"
                        outputs.append(StepOutput(c.request_id, [], [], [], "", True, "abort", c, i))
                outputs.append(self._finish_output(s, "abort", None))
                self._release(s)

        decoding = [s for s in self._running if not s.prefilling]
        # the prefill budget goes first to prompts already being prefilled (oldest first), then to
        # new requests; a prompt longer than what is left is prefilled in chunks over the next steps
        budget = self.max_prefill_tokens
        chunks: list[tuple[_Seq, int, int]] = []  # (sequence, first, end) prompt tokens this step
        for s in self._running:
            if s.prefilling and budget > 0:
                end = min(len(s.completion.prompt_token_ids), s.prefilled + budget)
                chunks.append((s, s.prefilled, end))
                budget -= end - s.prefilled
        with self._lock:  # admission: batch size, prefill budget, KV budget (worst case), in arrival order
            seqs = sum(s.samples for s in self._running)
            while self._waiting and budget > 0:
                r = self._waiting[0]
                if seqs + r.params.n > self.max_batch_size:
                    break
                if r.need_blocks > self.cache.num_available() - self._reserved():
                    break
                self._waiting.popleft()
                seq, cached = self._admit(r)
                self._running.append(seq)  # counted in _reserved from now on
                end = min(len(r.prompt), cached + budget)
                chunks.append((seq, cached, end))
                budget -= end - cached
                seqs += r.params.n
                self.stats.requests_admitted += 1
                self.stats.prompt_tokens += len(r.prompt)
                self.stats.cached_tokens += cached

        rows: list[_Seq] = []
        logits = []
        B = self.cache.block_size
        if decoding:
            for s in decoding:  # a sequence entering a new block gets it now
                if (s.length - 1) // B == len(s.table):
                    s.table.append(self.cache.allocate())
            dev = self.cache.device
            pos_n = torch.tensor([s.length - 1 for s in decoding], device=dev)
            tokens_n = torch.tensor([s.completion.token_ids[-1] for s in decoding], device=dev)
            logits.append(
                decode(self.model, self.cache, tokens_n, pos_n, [s.table for s in decoding], self.attention)
            )
            rows += decoding
            for s in decoding:  # index blocks that just filled up
                pos = s.length - 1
                if self.enable_prefix_caching and (pos + 1) % B == 0 and len(s.keys) == pos // B:
                    ids = s.completion.prompt_token_ids + s.completion.token_ids
                    s.keys.append(block_key(s.keys[-1] if s.keys else None, ids[pos + 1 - B : pos + 1]))
                    self.cache.register(s.table[pos // B], s.keys[-1])
        if chunks:
            pre = prefill(
                self.model,
                self.cache,
                [s.completion.prompt_token_ids[a:b] for s, a, b in chunks],
                [a for _, a, _ in chunks],
                [s.table for s, _, _ in chunks],
            )
            for i, (seq, a, b) in enumerate(chunks):
                self.stats.prefilled_tokens += b - a
                seq.prefilled = b
                if b < len(seq.completion.prompt_token_ids):
                    continue  # more chunks to come: nothing to sample yet
                r, seq.request = seq.request, None
                if self.enable_prefix_caching:
                    for k, key in enumerate(r.keys):
                        self.cache.register(seq.table[k], key)
                forks = [self._fork(seq, r, j) for j in range(1, r.params.n)]
                self._running += forks
                rows += [seq, *forks]
                logits.append(pre[i : i + 1].expand(r.params.n, -1))
        if not rows:
            return outputs
        logits_nN = torch.cat(logits)
        failed: dict[int, str] = {}
        for i, s in enumerate(rows):
            for proc in s.processors:
                try:
                    logits_nN[i] = proc(list(s.completion.token_ids), logits_nN[i])
                except Exception as e:  # one request's processor must not take the batch down
                    log.warning("logits processor of %s failed: %r", s.completion.request_id, e)
                    failed[i] = f"logits processor failed: {e!r}"
                    logits_nN[i] = 0.0
                    break
        res = sample(logits_nN, [s.completion.params for s in rows], [s.generator for s in rows])
        tokens, lps, slps = res.tokens_n.tolist(), res.logprob_n.tolist(), res.sampled_logprob_n.tolist()
        for i, s in enumerate(rows):
            c = s.completion
            if i in failed:
                c.error = failed[i]
                outputs.append(self._finish_output(s, "abort", None))
                self._release(s)
                continue
            c.token_ids.append(tokens[i])
            c.logprobs.append(lps[i])
            c.sampled_logprobs.append(slps[i])
            self.stats.generated_tokens += 1
            top = [dict(zip(res.top_ids[i], res.top_logprobs[i]))] if c.params.top_logprobs else []
            c.top_logprobs += top
            reason, stop_reason, delta = self._check_stop(s)
            if reason is not None:
                c.finish_reason, c.stop_reason = reason, stop_reason
                self._release(s)
            outputs.append(
                StepOutput(
                    c.request_id,
                    [tokens[i]],
                    [lps[i]],
                    [slps[i]],
                    delta,
                    reason is not None,
                    reason,
                    c,
                    c.index,
                    top,
                )
            )
        return outputs

    def _detokenize(self, r: _Seq, upto: int, final: bool) -> None:
        """Append the text of token_ids[r.decoded:upto] to completion.text (incremental: one step costs
        the few pending tokens, not the whole output). Pending tokens whose text ends in an incomplete
        character wait for the next token unless `final`; cutting only after a complete character
        keeps `text` equal to detokenising all the tokens at once (byte-level tokenizers)."""
        c = r.completion
        if self.detokenize is None or upto <= r.decoded:
            return
        piece = self.detokenize(c.token_ids[r.decoded : upto])
        # 8 pending tokens cover any UTF-8 character (<= 4 bytes); a reply that ends in a lone
        # U+FFFD on purpose must not keep the window growing
        if final or not piece.endswith("\ufffd") or upto - r.decoded >= 8:
            c.text += piece
            r.decoded = upto

    def _check_stop(self, r: _Seq) -> tuple[str | None, int | str | None, str]:
        """Finish reason, stop reason and the text delta to stream after the newest token."""
        c = r.completion
        p = c.params
        tok = c.token_ids[-1]
        reason: str | None = None
        stop_reason: int | str | None = None
        upto = len(c.token_ids)
        if tok in p.stop_token_ids or (tok in self.eos_token_ids and not p.ignore_eos):
            reason, stop_reason, upto = "stop", tok, upto - 1  # the stop token is not in the text
        at_length = len(c.token_ids) >= p.max_tokens or r.length >= self.max_model_len
        before = len(c.text)
        self._detokenize(r, upto, final=reason is not None or at_length)
        if reason is None and p.stop and len(c.text) > before:
            # only the tail can hold a newly completed stop string
            start = max(0, before - max(len(s) for s in p.stop) + 1)
            hits = [(c.text.find(s, start), s) for s in p.stop]
            hits = [(j, s) for j, s in hits if j >= 0]
            if hits:
                j, s = min(hits)
                c.text = c.text[: j + len(s)] if p.include_stop_str_in_output else c.text[:j]
                reason, stop_reason = "stop", s
        if reason is None and at_length:
            reason = "length"
        if reason is not None:
            end = len(c.text)
        else:  # hold back what may still become a stop string
            end = len(c.text) - (max((len(s) for s in p.stop), default=1) - 1)
        end = max(end, r.emitted_chars)
        delta, r.emitted_chars = c.text[r.emitted_chars : end], end
        return reason, stop_reason, delta

    def _finish_output(self, r: _Seq, reason: str, stop_reason: int | str | None) -> StepOutput:
        c = r.completion
        c.finish_reason, c.stop_reason = reason, stop_reason
        self._detokenize(r, len(c.token_ids), final=True)
        delta = c.text[r.emitted_chars :]
        r.emitted_chars = len(c.text)
        return StepOutput(c.request_id, [], [], [], delta, True, reason, c, c.index)

    def _release(self, s: _Seq) -> None:
        """A sequence leaves the batch: its blocks go back (indexed ones stay cached until evicted)."""
        self.stats.samples_finished += 1
        if self.cache.routes_BbLK is not None and s.table:
            forwarded = s.prefilled if s.prefilling else s.length - 1
            s.completion.routed_experts = self.cache.read_routes(s.table, forwarded)
        self._running.remove(s)
        self.cache.release_all(s.table)
        s.table = []

    # ------------------------------------------------------------------ convenience
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run the given prompts to completion (batched); completions in prompt order, a prompt's n samples
        consecutive (by index)."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"Engine.generate: {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        wanted = {(rid, i) for rid, sp in zip(ids, params) for i in range(sp.n)}
        done: dict[tuple[str, int], Completion] = {}
        while len(done) < len(wanted):
            for out in self.step():
                if out.finished and (out.request_id, out.index) in wanted:
                    done[(out.request_id, out.index)] = out.completion
        return [done[(rid, i)] for rid, sp in zip(ids, params) for i in range(sp.n)]

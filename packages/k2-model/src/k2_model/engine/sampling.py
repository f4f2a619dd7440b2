"""Sampling parameters and batched sampling with per-request generators and both logprobs.

Shape legend: n rows (requests in the step), N vocabulary.

Logits processors (vLLM's per-request form): `proc(token_ids, logits_N) -> logits_N`, called in
the batched step with the tokens generated so far and the row's raw logits (masking with -inf is
how structured decoding constrains a request); a stateful processor implements `fork()` so each
of a request's `n` samples gets its own state. Logprobs are those of the processed logits.

Each row is drawn with its request's own `torch.Generator` (Gumbel-max over the processed
log-probabilities: argmax(logp - log(-log u)), u ~ U(0, 1) from that generator), so a seeded
request gets the same tokens whatever else is in the batch. Processing order (as vLLM): temperature,
then top-k, then top-p over what top-k kept. Two log-probabilities per sampled token:
  * `logprob`: under the raw model distribution, log_softmax(logits);
  * `sampled_logprob`: under the distribution actually sampled (temperature-scaled, then
    top-k / top-p truncated and renormalised); 0.0 for greedy rows (a point mass).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    """Per-request generation settings (OpenAI / vLLM meanings)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 (or -1) = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings (need a detokenizer)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # do not stop on the engine's eos ids
    include_stop_str_in_output: bool = False
    top_logprobs: int = 0  # also return this many most likely tokens (raw logprobs) per step
    n: int = 1  # samples of the prompt: prefilled once, decoded as n streams sharing its cache
    # per-request logits processors, applied in the batched step before sampling (see LogitsProcessor)
    logits_processors: list[Callable[[list[int], Tensor], Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field when a value is out of range."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"SamplingParams.temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be an int >= -1 (0 or -1: off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}"
            )
        if (
            isinstance(self.top_logprobs, bool)
            or not isinstance(self.top_logprobs, int)
            or self.top_logprobs < 0
        ):
            raise ValueError(f"SamplingParams.top_logprobs must be an int >= 0, got {self.top_logprobs!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if not all(callable(p) for p in self.logits_processors):
            raise ValueError(
                "SamplingParams.logits_processors must be callables (token_ids, logits_N) -> logits_N"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed`: sample 0 keeps the seed (so n = 1 and the
    first of n agree), the others get a 62-bit hash of (seed, index)."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def fork_processor(proc: Any) -> Any:
    """A processor for another sample of the same request: `proc.fork()` when it keeps state, else itself."""
    fork = getattr(proc, "fork", None)
    return fork() if callable(fork) else proc


def process_logits(logits_nN: Tensor, temperature_n: Tensor, top_k_n: Tensor, top_p_n: Tensor) -> Tensor:
    """Temperature-scaled, top-k then top-p masked logits (masked = -inf); fp32 [n, N].

    Rows with temperature 0 are returned unscaled (the caller takes their argmax). top_k <= 0
    and top_p >= 1 mean off. Ties at the top-k threshold are all kept; top-p keeps the smallest
    prefix of the sorted distribution whose mass reaches top_p (always at least one token).
    """
    x_nN = logits_nN.float() / torch.where(temperature_n > 0, temperature_n, 1.0).unsqueeze(1)
    N = x_nN.shape[1]
    k_n = torch.where((top_k_n > 0) & (top_k_n < N), top_k_n, N)
    need_k, need_p = bool((k_n < N).any()), bool((top_p_n < 1.0).any())
    if not (need_k or need_p):
        return x_nN
    sorted_nN, order_nN = x_nN.sort(dim=-1, descending=True)
    if need_k:
        kth_n1 = sorted_nN.gather(1, (k_n - 1).unsqueeze(1))
        x_nN = x_nN.masked_fill(x_nN < kth_n1, float("-inf"))
        sorted_nN = sorted_nN.masked_fill(sorted_nN < kth_n1, float("-inf"))
    if need_p:
        probs_nN = sorted_nN.softmax(dim=-1)
        mass_before_nN = probs_nN.cumsum(dim=-1) - probs_nN
        drop_sorted_nN = mass_before_nN >= top_p_n.unsqueeze(1)
        drop_sorted_nN[:, 0] = False
        drop_nN = torch.zeros_like(drop_sorted_nN).scatter_(1, order_nN, drop_sorted_nN)
        x_nN = x_nN.masked_fill(drop_nN, float("-inf"))
    return x_nN


@dataclass
class SampleResult:
    tokens_n: Tensor  # int64 [n]
    logprob_n: Tensor  # raw distribution
    sampled_logprob_n: Tensor  # the processed distribution that was sampled (0 for greedy)
    top_ids: list[list[int]]  # per row, the top_logprobs most likely token ids (raw)
    top_logprobs: list[list[float]]


def sample(
    logits_nN: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> SampleResult:
    """One token per row. `generators[i]` draws row i (None only for greedy rows)."""
    n, N = logits_nN.shape
    device = logits_nN.device
    logits_nN = logits_nN.float()
    raw_logp_nN = torch.log_softmax(logits_nN, dim=-1)
    greedy = [p.greedy for p in params]
    if all(greedy):
        tokens_n = logits_nN.argmax(dim=-1)
        sampled_lp_n = torch.zeros(n, device=device)
    else:
        temp_n = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        topk_n = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
        topp_n = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        proc_logp_nN = torch.log_softmax(process_logits(logits_nN, temp_n, topk_n, topp_n), dim=-1)
        gumbel_nN = torch.zeros_like(proc_logp_nN)
        for i, g in enumerate(generators):
            if not greedy[i]:
                u_N = torch.rand(N, generator=g, device=g.device if g is not None else device)
                gumbel_nN[i] = -torch.log(-torch.log(u_N.clamp_min(1e-20)).to(device))
        tokens_n = torch.where(
            torch.tensor(greedy, device=device),
            logits_nN.argmax(dim=-1),
            (proc_logp_nN + gumbel_nN).argmax(dim=-1),
        )
        sampled_lp_n = proc_logp_nN.gather(1, tokens_n.unsqueeze(1)).squeeze(1)
        sampled_lp_n = torch.where(torch.tensor(greedy, device=device), 0.0, sampled_lp_n)
    logprob_n = raw_logp_nN.gather(1, tokens_n.unsqueeze(1)).squeeze(1)
    top_ids: list[list[int]] = [[] for _ in range(n)]
    top_lps: list[list[float]] = [[] for _ in range(n)]
    k_max = max((p.top_logprobs for p in params), default=0)
    if k_max > 0:
        vals_nk, idx_nk = raw_logp_nN.topk(min(k_max, N), dim=-1)
        for i, p in enumerate(params):
            top_ids[i] = idx_nk[i, : p.top_logprobs].tolist()
            top_lps[i] = vals_nk[i, : p.top_logprobs].tolist()
    return SampleResult(tokens_n, logprob_n, sampled_lp_n, top_ids, top_lps)

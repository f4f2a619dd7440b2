"""/v1/completions as pure translation: request -> `CompletionPlan` (one prompt, token ids or a batch
of them, `n` choices each, their sampling parameters), then engine pieces of every prompt ->
OpenAI's response body (`completion_response`) or its SSE stream (`completion_events`). Choice
`k` is prompt `k // n`, sample `k % n`. No server needed: tests feed pieces directly.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from k2_model.engine import SamplingParams

from k2_stack.serve.common import Piece, ServeContext, finish_reason, sse, usage, usage_chunk
from k2_stack.serve.protocol import APIError, CompletionRequest

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class CompletionPlan:
    req: CompletionRequest
    prompts: list[list[int]]
    params: list[SamplingParams]  # one per prompt
    echo: list[str]  # the prompt text to echo per prompt ("" when not echoed)
    rid: str
    created: int

    @property
    def n_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts)

    @property
    def n_choices(self) -> int:
        return len(self.prompts) * self.req.n


def plan_completion(ctx: ServeContext, req: CompletionRequest) -> CompletionPlan:
    """Validate `req` (an `APIError` names the field) and tokenize its prompts."""
    ctx.check_model(req.model)
    ctx.check_supported(req)
    p = req.prompt
    batch = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not batch:
        raise APIError(400, "prompt is empty", "prompt")
    if req.logprobs is not None and not 0 <= req.logprobs <= 5:
        raise APIError(400, "logprobs must be in [0, 5]", "logprobs")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs (prompt logprobs) is not supported", "echo")
    prompts: list[list[int]] = []
    for i, one in enumerate(batch):
        ids = ctx.tokenizer.encode(one) if isinstance(one, str) else list(one)
        if not ids:
            raise APIError(400, f"prompt[{i}] is empty", "prompt")
        if min(ids) < 0 or max(ids) >= ctx.vocab_size:
            raise APIError(400, f"prompt[{i}]: token ids must be in [0, {ctx.vocab_size})", "prompt")
        prompts.append(ids)
    max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS
    return CompletionPlan(
        req=req,
        prompts=prompts,
        params=[ctx.sampling(req, len(ids), max_tokens, req.logprobs or 0) for ids in prompts],
        echo=[one if req.echo and isinstance(one, str) else "" for one in batch],
        rid=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
    )


def _lp_block(ctx: ServeContext, p: Piece, offset: int) -> dict[str, Any]:
    toks = [ctx.token_str(t) for t in p.token_ids]
    offs, o = [], offset
    for s in toks:
        offs.append(o)
        o += len(s)
    return {
        "tokens": toks,
        "token_logprobs": p.logprobs,
        "top_logprobs": [{ctx.token_str(a): b for a, b in top.items()} for top in p.top],
        "text_offset": offs,
    }


def _body(
    ctx: ServeContext, plan: CompletionPlan, k: int, text: str, finish: str | None, lps: Any = None
) -> dict:
    return {
        "id": plan.rid,
        "object": "text_completion",
        "created": plan.created,
        "model": ctx.model_name,
        "choices": [{"index": k, "text": text, "logprobs": lps, "finish_reason": finish}],
    }


async def completion_events(
    ctx: ServeContext, plan: CompletionPlan, pieces: AsyncIterator[tuple[int, Piece]]
) -> AsyncIterator[str]:
    """The SSE stream: echoed prompts first, then text pieces (with logprobs) as they arrive, usage."""
    req, n = plan.req, plan.req.n
    n_out, offsets = 0, [len(plan.echo[k // n]) for k in range(plan.n_choices)]
    for k in range(plan.n_choices):
        if plan.echo[k // n]:
            yield sse(_body(ctx, plan, k, plan.echo[k // n], None))
    async with aclosing(pieces):
        async for i, piece in pieces:
            k = i * n + piece.index
            n_out += piece.n_tokens
            lps = _lp_block(ctx, piece, offsets[k]) if req.logprobs is not None else None
            offsets[k] += sum(len(ctx.token_str(t)) for t in piece.token_ids)
            if piece.text or piece.finish or piece.token_ids:
                yield sse(
                    _body(
                        ctx, plan, k, piece.text, finish_reason(piece.finish) if piece.finish else None, lps
                    )
                )
    if req.stream_options and req.stream_options.include_usage:
        yield sse(
            usage_chunk(
                "text_completion", plan.rid, plan.created, ctx.model_name, plan.n_prompt_tokens, n_out
            )
        )
    yield sse("[DONE]")


async def completion_response(
    ctx: ServeContext, plan: CompletionPlan, pieces: AsyncIterator[tuple[int, Piece]]
) -> dict[str, Any]:
    """The body of a non-streaming request: every choice's text (after its echo), logprobs, usage."""
    req, n, total = plan.req, plan.req.n, plan.n_choices
    texts = [plan.echo[k // n] for k in range(total)]
    reasons: list[str | None] = [None] * total
    lps: list[dict[str, list] | None] = [
        {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if req.logprobs is not None
        else None
        for _ in range(total)
    ]
    n_out = 0
    async for i, piece in pieces:
        k = i * n + piece.index
        n_out += piece.n_tokens
        if lps[k] is not None:
            for key, vals in _lp_block(ctx, piece, len(texts[k])).items():
                lps[k][key] += vals
        texts[k] += piece.text
        reasons[k] = piece.finish or reasons[k]
    return {
        "id": plan.rid,
        "object": "text_completion",
        "created": plan.created,
        "model": ctx.model_name,
        "choices": [
            _body(ctx, plan, k, texts[k], finish_reason(reasons[k]), lps[k])["choices"][0]
            for k in range(total)
        ],
        "usage": usage(plan.n_prompt_tokens, n_out),
    }


__all__ = ["CompletionPlan", "completion_events", "completion_response", "plan_completion"]

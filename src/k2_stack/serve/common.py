"""What the chat and completions translators share: the server's context, engine output as `Piece`s,
request -> `SamplingParams`, and the small OpenAI shapes (SSE lines, usage, finish reasons).

Nothing here needs a running server: `ServeContext` is plain data plus two processor factories, so
the translators (`chat.py`, `completions.py`) are unit-tested by feeding them pieces.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from k2_model.engine import SamplingParams, StepOutput

from k2_stack.serve.protocol import APIError, _Sampling, unsupported_fields

MAX_TOP_LOGPROBS = 20


@dataclass
class ServeContext:
    """What a request translator needs to know about the server (built from the bridge)."""

    model_name: str
    tokenizer: Any
    max_model_len: int
    max_batch_size: int
    vocab_size: int
    created: int
    json_processor: Callable[[Any, bool], Any]  # (schema, strict) -> logits processor
    tool_call_processor: Callable[[list[dict], str | None, int], Any]  # (tools, name, index) -> processor
    chat_template: str = "k2"  # a k2_data.chat template name
    normalize_ids: bool = True  # tool-call ids renamed to functions.NAME:IDX before rendering

    @classmethod
    def from_bridge(cls, bridge: Any, created: int) -> ServeContext:
        return cls(
            model_name=bridge.config.served_model_name,
            tokenizer=bridge.tokenizer,
            max_model_len=bridge.max_model_len,
            max_batch_size=bridge.engine.max_batch_size,
            vocab_size=bridge.model.config.vocab_size,
            created=created,
            json_processor=bridge.json_processor,
            tool_call_processor=bridge.tool_call_processor,
            chat_template=bridge.config.chat_template,
            normalize_ids=bridge.config.normalize_ids,
        )

    def token_str(self, t: int) -> str:
        return self.tokenizer.decode([t])

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist (this server serves `{self.model_name}`).",
                "model",
                "model_not_found",
            )

    def check_supported(self, req: _Sampling) -> None:
        bad = unsupported_fields(req)
        if bad:
            raise APIError(400, bad[1], bad[0], "unsupported_parameter")
        if req.n < 1 or req.n > self.max_batch_size:
            raise APIError(400, f"n must be in [1, {self.max_batch_size}], got {req.n}", "n")

    def sampling(
        self,
        req: _Sampling,
        prompt_len: int,
        max_tokens: int | None,
        top_logprobs: int = 0,
        processors: list | None = None,
    ) -> SamplingParams:
        """The engine's sampling parameters for `req`; a context overflow is OpenAI's 400."""
        room = self.max_model_len - prompt_len
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + (max_tokens or 0)} tokens ({prompt_len} in the messages, "
                f"{max_tokens or 0} in the completion).",
                "messages",
                "context_length_exceeded",
            )
        kw: dict[str, Any] = {"max_tokens": room if max_tokens is None else max_tokens, "n": req.n}
        for f in ("temperature", "top_p", "top_k", "seed", "stop_token_ids"):
            if getattr(req, f) is not None:
                kw[f] = getattr(req, f)
        if req.stop:
            kw["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        try:
            return SamplingParams(
                **kw, ignore_eos=req.ignore_eos, top_logprobs=top_logprobs, logits_processors=processors or []
            )
        except ValueError as e:
            f = str(e).split(" ", 1)[0].removeprefix("SamplingParams.")
            raise APIError(400, str(e), f) from None


@dataclass
class Piece:
    """What one engine step added to one sample: text, tokens (with logprobs) and the finish reason."""

    index: int
    text: str
    n_tokens: int
    finish: str | None
    token_ids: list[int] = field(default_factory=list)  # those shown with logprobs (not a stop token)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)


def piece_of(out: StepOutput) -> Piece:
    c = out.completion
    ids, lps = list(out.token_ids), list(out.logprobs)
    top = list(out.top_logprobs) or [{} for _ in ids]
    if out.finished and out.finish_reason == "stop" and isinstance(c.stop_reason, int) and ids:
        ids, lps, top = [], [], []  # the stop token is not part of the text
    fin = out.finish_reason if out.finished else None
    return Piece(out.index, out.text_delta, len(out.token_ids), fin, ids, lps, top)


async def engine_pieces(bridge: Any, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Piece]:
    """One `Piece` per engine step and sample of one request."""
    async with aclosing(bridge.generate(prompt_ids, params)) as outs:
        async for out in outs:
            yield piece_of(out)


def sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def usage_chunk(obj: str, rid: str, created: int, model: str, prompt: int, completion: int) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt, completion),
    }


def finish_reason(reason: str | None, tools_called: bool = False) -> str:
    """OpenAI's finish_reason: a reply cut by max_tokens is "length" even when it holds complete calls."""
    if reason == "length":
        return "length"
    return "tool_calls" if tools_called else "stop"


__all__ = [
    "MAX_TOP_LOGPROBS",
    "Piece",
    "ServeContext",
    "engine_pieces",
    "finish_reason",
    "piece_of",
    "sse",
    "usage",
    "usage_chunk",
]

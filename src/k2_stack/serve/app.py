"""The FastAPI app: /health, /v1/models, /v1/chat/completions, /v1/completions (OpenAI shapes).

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 404 for an unknown
model, 400 for malformed bodies or messages, a context that is too long, and invalid sampling values.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from k2_data.chat import ToolCallStreamParser, parse_tool_calls, render_ids
from k2_model.engine import SamplingParams

from k2_stack.serve.bridge import EngineBridge
from k2_stack.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, _Sampling, error_body


def _sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def create_app(bridge: EngineBridge, ckpt_rank: int | None = 0) -> FastAPI:
    """The OpenAI-compatible app over one shared engine bridge; with `ckpt_rank` set, k2-ckpt's weight
    receiver is mounted at /ckpt (device id from that rank; see `k2_stack.serve.ckpt`)."""
    app = FastAPI(title="k2 serve")
    app.state.bridge = bridge
    if ckpt_rank is not None:
        from k2_stack.serve.ckpt import mount_receiver

        app.state.ckpt_device_id = mount_receiver(app, bridge, ckpt_rank)
    name = bridge.config.served_model_name
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(x) for x in err.get("loc", ())[1:]) or None
        return JSONResponse(
            error_body(f"{loc or 'body'}: {err.get('msg', 'invalid request')}", param=loc), 400
        )

    def check_model(model: str) -> None:
        if model != name:
            raise APIError(
                404,
                f"The model `{model}` does not exist (this server serves `{name}`).",
                "model",
                "model_not_found",
            )

    def sampling(req: _Sampling, prompt_len: int, max_tokens: int | None) -> SamplingParams:
        if req.n != 1:
            raise APIError(400, f"n must be 1 (got {req.n})", "n")
        room = bridge.max_model_len - prompt_len
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            raise APIError(
                400,
                f"This model's maximum context length is {bridge.max_model_len} tokens. However, "
                f"you requested {prompt_len + (max_tokens or 0)} tokens ({prompt_len} in the messages, "
                f"{max_tokens or 0} in the completion).",
                "messages",
                "context_length_exceeded",
            )
        kw: dict[str, Any] = {"max_tokens": room if max_tokens is None else max_tokens}
        for field in ("temperature", "top_p", "top_k", "seed"):
            if getattr(req, field) is not None:
                kw[field] = getattr(req, field)
        if req.stop:
            kw["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            field = str(e).split(" ", 1)[0].removeprefix("SamplingParams.")
            raise APIError(400, str(e), field) from None

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "k2",
                    "max_model_len": bridge.max_model_len,
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> Any:
        check_model(req.model)
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice or ("auto" if tools else "none")
        named = choice.function.get("name") if not isinstance(choice, str) else None
        if choice != "none" and choice != "auto" and not tools:
            raise APIError(400, "tool_choice requires tools", "tool_choice")
        if not isinstance(choice, str) and not isinstance(named, str):
            raise APIError(400, "tool_choice.function.name must be a string", "tool_choice")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        for m in messages:
            if m["role"] == "developer":
                m["role"] = "system"
        try:
            prompt_ids = render_ids(
                bridge.tokenizer,
                messages,
                tools=tools if choice != "none" else None,
                add_generation_prompt=True,
            )
        except (ValueError, TypeError, KeyError) as e:
            raise APIError(400, f"messages: {e}", "messages") from None
        params = sampling(req, len(prompt_ids), req.max_completion_tokens or req.max_tokens)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        parse_tools = choice != "none"
        if choice == "required" or named is not None:
            index = sum(len(m.get("tool_calls") or []) for m in messages)
            try:
                call = bridge.guided_call(
                    prompt_ids, tools, named, index, params.max_tokens, params.temperature, params.seed
                )
            except ValueError as e:
                raise APIError(
                    400, str(e), "tools" if str(e).startswith("tools:") else "tool_choice"
                ) from None
            pieces = _guided_pieces(bridge, call)
        else:
            pieces = _engine_pieces(bridge, prompt_ids, params)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": now,
                "model": name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def events() -> AsyncIterator[str]:
                parser = ToolCallStreamParser() if parse_tools else None
                yield _sse(chunk({"role": "assistant", "content": ""}))
                n_out, reason = 0, None
                async with aclosing(pieces):  # a client gone mid-stream aborts its request now, not at GC
                    async for text, n_new, fin in pieces:
                        n_out += n_new
                        for d in parser.feed(text) if parser else ([{"content": text}] if text else []):
                            yield _sse(chunk(d))
                        if fin is not None:
                            reason = fin
                tools_called = False
                if parser:
                    end = parser.finish()
                    for d in end.deltas:
                        yield _sse(chunk(d))
                    tools_called = end.tools_called
                yield _sse(chunk({}, "tool_calls" if tools_called else _finish(reason)))
                if include_usage:
                    yield _sse(
                        {
                            "id": rid,
                            "object": "chat.completion.chunk",
                            "created": now,
                            "model": name,
                            "choices": [],
                            "usage": _usage(len(prompt_ids), n_out),
                        }
                    )
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")

        text, n_out, reason = "", 0, None
        async for piece, n_new, fin in pieces:
            text, n_out = text + piece, n_out + n_new
            reason = fin or reason
        content, calls = parse_tool_calls(text) if parse_tools else (text, [])
        message = {"role": "assistant", "content": content or None, "tool_calls": calls or None}
        return {
            "id": rid,
            "object": "chat.completion",
            "created": now,
            "model": name,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": "tool_calls" if calls else _finish(reason),
                }
            ],
            "usage": _usage(len(prompt_ids), n_out),
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        check_model(req.model)
        p = req.prompt
        # one prompt (a string or token ids) or a batch of them: one choice each, generated concurrently
        batch = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not batch:
            raise APIError(400, "prompt is empty", "prompt")
        vocab = bridge.model.config.vocab_size
        prompts: list[list[int]] = []
        for i, one in enumerate(batch):
            ids = bridge.tokenizer.encode(one) if isinstance(one, str) else list(one)
            if not ids:
                raise APIError(400, f"prompt[{i}] is empty", "prompt")
            if min(ids) < 0 or max(ids) >= vocab:
                raise APIError(400, f"prompt[{i}]: token ids must be in [0, {vocab})", "prompt")
            prompts.append(ids)
        max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's default here
        params = [sampling(req, len(ids), max_tokens) for ids in prompts]
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo = [one if req.echo and isinstance(one, str) else "" for one in batch]
        n_prompt = sum(len(ids) for ids in prompts)

        def body(i: int, text: str, finish: str | None) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": now,
                "model": name,
                "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}],
            }

        if req.stream:

            async def events() -> AsyncIterator[str]:
                n_out = 0
                for i, e in enumerate(echo):
                    if e:
                        yield _sse(body(i, e, None))
                merged = _merge([_engine_pieces(bridge, ids, sp) for ids, sp in zip(prompts, params)])
                async with aclosing(merged):
                    async for i, (text, n_new, fin) in merged:
                        n_out += n_new
                        if text or fin:
                            yield _sse(body(i, text, _finish(fin) if fin else None))
                if req.stream_options and req.stream_options.include_usage:
                    yield _sse(
                        {
                            "id": rid,
                            "object": "text_completion",
                            "created": now,
                            "model": name,
                            "choices": [],
                            "usage": _usage(n_prompt, n_out),
                        }
                    )
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")

        async def collect(i: int) -> tuple[str, int, str | None]:
            text, n_out, reason = echo[i], 0, None
            async for piece, n_new, fin in _engine_pieces(bridge, prompts[i], params[i]):
                text, n_out, reason = text + piece, n_out + n_new, fin or reason
            return text, n_out, reason

        results = await asyncio.gather(*(collect(i) for i in range(len(prompts))))
        return {
            "id": rid,
            "object": "text_completion",
            "created": now,
            "model": name,
            "choices": [
                body(i, text, _finish(reason))["choices"][0] for i, (text, _, reason) in enumerate(results)
            ],
            "usage": _usage(n_prompt, sum(n for _, n, _ in results)),
        }

    return app


async def _merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Items of several async iterators as they arrive, tagged with the iterator's index."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[Any]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except Exception as e:
            await queue.put((i, e))
        else:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _engine_pieces(
    bridge: EngineBridge, prompt_ids: list[int], params: SamplingParams
) -> AsyncIterator[tuple[str, int, str | None]]:
    """(text delta, new tokens, finish reason or None) per engine step of one request."""
    async with aclosing(bridge.generate(prompt_ids, params)) as outs:
        async for out in outs:
            yield out.text_delta, len(out.token_ids), out.finish_reason if out.finished else None


async def _guided_pieces(bridge: EngineBridge, call: Any) -> AsyncIterator[tuple[str, int, str | None]]:
    """The same for a forced tool call: decoded with markers kept, held back while a character is incomplete."""
    emitted = 0
    async for _ in bridge.run_guided(call):  # nothing to abort: the next step simply never comes
        text = bridge.tokenizer.decode(call.generated)
        end = len(text) if call.finished else len(text.rstrip("\ufffd"))
        yield text[emitted:end], 0, call.finish_reason
        emitted = max(emitted, end)
    yield "", len(call.generated), None

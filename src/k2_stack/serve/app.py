"""The FastAPI app: /health, /v1/models, /v1/chat/completions, /v1/completions (OpenAI shapes), /metrics.

Every 4xx/5xx uses OpenAI's shape `{"error": {"message", "type", "param", "code"}}` with `param` naming
a request field or null: 404 for an unknown model or route, 400 for malformed JSON (param null, the
position in the message), non-UTF-8 bodies, invalid or unsupported fields, a context that is too long.

`n` samples of one request are one engine request (its prompt prefilled once); their choices stream
interleaved, tagged by `index`. Structured output (`response_format`, forced `tool_choice`) is a
logits processor of the request, batched with everything else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from k2_data.chat import ToolCallStreamParser, parse_tool_calls, render_ids
from k2_model.engine import SamplingParams, StepOutput
from starlette.exceptions import HTTPException as StarletteHTTPException

from k2_stack.serve.bridge import EngineBridge
from k2_stack.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    _Sampling,
    error_body,
    unsupported_fields,
)

log = logging.getLogger("k2.serve")
MAX_TOP_LOGPROBS = 20


def _sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


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


def _piece(out: StepOutput) -> Piece:
    c = out.completion
    ids, lps = list(out.token_ids), list(out.logprobs)
    top = list(out.top_logprobs) or [{} for _ in ids]
    if out.finished and out.finish_reason == "stop" and isinstance(c.stop_reason, int) and ids:
        ids, lps, top = [], [], []  # the stop token is not part of the text
    fin = out.finish_reason if out.finished else None
    return Piece(out.index, out.text_delta, len(out.token_ids), fin, ids, lps, top)


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
    tok = bridge.tokenizer
    _install_error_handlers(app)

    def check_model(model: str) -> None:
        if model != name:
            raise APIError(
                404,
                f"The model `{model}` does not exist (this server serves `{name}`).",
                "model",
                "model_not_found",
            )

    def check_supported(req: _Sampling) -> None:
        bad = unsupported_fields(req)
        if bad:
            raise APIError(400, bad[1], bad[0], "unsupported_parameter")
        if req.n < 1 or req.n > bridge.engine.max_batch_size:
            raise APIError(400, f"n must be in [1, {bridge.engine.max_batch_size}], got {req.n}", "n")

    def sampling(
        req: _Sampling,
        prompt_len: int,
        max_tokens: int | None,
        top_logprobs: int = 0,
        processors: list | None = None,
    ) -> SamplingParams:
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

    def token_str(t: int) -> str:
        return tok.decode([t])

    def chat_logprobs(p: Piece) -> list[dict[str, Any]]:
        def entry(t: int, lp: float) -> dict[str, Any]:
            s = token_str(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return [
            entry(t, lp) | {"top_logprobs": [entry(a, b) for a, b in top.items()]}
            for t, lp, top in zip(p.token_ids, p.logprobs, p.top)
        ]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(bridge.metrics.render(bridge.engine), media_type="text/plain; version=0.0.4")

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

    def response_format_processor(req: ChatCompletionRequest) -> Any:
        rf = req.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            schema, strict, param = {"type": "object"}, False, "response_format"
        else:
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(
                    400, "response_format.json_schema.schema is required", "response_format.json_schema"
                )
            schema, strict = rf.json_schema.schema_, bool(rf.json_schema.strict)
            param = "response_format.json_schema.schema"
        try:
            return bridge.json_processor(schema, strict)
        except ValueError as e:
            raise APIError(400, f"{param}: invalid JSON schema: {e}", param) from None

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> Any:
        check_model(req.model)
        check_supported(req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice or ("auto" if tools else "none")
        named = choice.function.get("name") if not isinstance(choice, str) else None
        if choice != "none" and choice != "auto" and not tools:
            raise APIError(400, "tool_choice requires tools", "tool_choice")
        if not isinstance(choice, str) and not isinstance(named, str):
            raise APIError(400, "tool_choice.function.name must be a string", "tool_choice")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs: true", "top_logprobs")
        forced = choice == "required" or named is not None
        if forced and req.response_format is not None and req.response_format.type != "text":
            raise APIError(
                400, "response_format cannot be combined with a forced tool_choice", "response_format"
            )
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        for m in messages:
            if m["role"] == "developer":
                m["role"] = "system"
        try:
            prompt_ids = render_ids(
                tok, messages, tools=tools if choice != "none" else None, add_generation_prompt=True
            )
        except (ValueError, TypeError, KeyError) as e:
            raise APIError(400, f"messages: {e}", "messages") from None
        processor = response_format_processor(req)
        if forced:
            index = sum(len(m.get("tool_calls") or []) for m in messages)
            try:
                processor = bridge.tool_call_processor(tools, named, index)
            except ValueError as e:
                raise APIError(
                    400, str(e), "tools" if str(e).startswith("tools:") else "tool_choice"
                ) from None
        params = sampling(
            req,
            len(prompt_ids),
            req.max_completion_tokens or req.max_tokens,
            (req.top_logprobs or 0) if req.logprobs else 0,
            [processor] if processor is not None else None,
        )
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        parse_tools = choice != "none"
        single_call = req.parallel_tool_calls is False
        pieces = _engine_pieces(bridge, prompt_ids, params)

        def chunk(
            index: int, delta: dict[str, Any], finish: str | None = None, lps: Any = None
        ) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": now,
                "model": name,
                "choices": [{"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}],
            }

        def keep(d: dict[str, Any]) -> dict[str, Any] | None:
            """parallel_tool_calls false: only the first call is shown."""
            if single_call and "tool_calls" in d:
                calls = [c for c in d["tool_calls"] if c.get("index", 0) == 0]
                return {**d, "tool_calls": calls} if calls else None
            return d

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def events() -> AsyncIterator[str]:
                parsers = [ToolCallStreamParser() if parse_tools else None for _ in range(req.n)]
                for i in range(req.n):
                    yield _sse(chunk(i, {"role": "assistant", "content": ""}))
                n_out = 0
                async with aclosing(pieces):  # a client gone mid-stream aborts its request now, not at GC
                    async for p in pieces:
                        n_out += p.n_tokens
                        parser = parsers[p.index]
                        deltas = parser.feed(p.text) if parser else ([{"content": p.text}] if p.text else [])
                        lps = {"content": chat_logprobs(p)} if req.logprobs and p.token_ids else None
                        if lps is not None and not deltas:
                            deltas = [{"content": ""}]
                        for k, d in enumerate(deltas):
                            d = keep(d)
                            if d is not None:
                                yield _sse(chunk(p.index, d, lps=lps if k == 0 else None))
                        if p.finish is None:
                            continue
                        called = False
                        if parser:
                            end = parser.finish()
                            for d in end.deltas:
                                d = keep(d)
                                if d is not None:
                                    yield _sse(chunk(p.index, d))
                            called = end.tools_called
                        yield _sse(chunk(p.index, {}, "tool_calls" if called else _finish(p.finish)))
                if include_usage:
                    usage = _usage(len(prompt_ids), n_out)
                    yield _sse(
                        {
                            "id": rid,
                            "object": "chat.completion.chunk",
                            "created": now,
                            "model": name,
                            "choices": [],
                            "usage": usage,
                        }
                    )
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")

        texts, n_out = [""] * req.n, 0
        reasons: list[str | None] = [None] * req.n
        lp_content: list[list[dict[str, Any]]] = [[] for _ in range(req.n)]
        async for p in pieces:
            texts[p.index] += p.text
            n_out += p.n_tokens
            reasons[p.index] = p.finish or reasons[p.index]
            if req.logprobs:
                lp_content[p.index] += chat_logprobs(p)
        choices = []
        for i in range(req.n):
            content, calls = parse_tool_calls(texts[i]) if parse_tools else (texts[i], [])
            calls = calls[:1] if single_call else calls
            message = {"role": "assistant", "content": content or None, "tool_calls": calls or None}
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": {"content": lp_content[i]} if req.logprobs else None,
                    "finish_reason": "tool_calls" if calls else _finish(reasons[i]),
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": now,
            "model": name,
            "choices": choices,
            "usage": _usage(len(prompt_ids), n_out),
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        check_model(req.model)
        check_supported(req)
        p = req.prompt
        # one prompt (a string or token ids) or a batch of them: n choices each, generated concurrently
        batch = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not batch:
            raise APIError(400, "prompt is empty", "prompt")
        if req.logprobs is not None and not 0 <= req.logprobs <= 5:
            raise APIError(400, "logprobs must be in [0, 5]", "logprobs")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported", "echo")
        vocab = bridge.model.config.vocab_size
        prompts: list[list[int]] = []
        for i, one in enumerate(batch):
            ids = tok.encode(one) if isinstance(one, str) else list(one)
            if not ids:
                raise APIError(400, f"prompt[{i}] is empty", "prompt")
            if min(ids) < 0 or max(ids) >= vocab:
                raise APIError(400, f"prompt[{i}]: token ids must be in [0, {vocab})", "prompt")
            prompts.append(ids)
        max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's default here
        params = [sampling(req, len(ids), max_tokens, req.logprobs or 0) for ids in prompts]
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo = [one if req.echo and isinstance(one, str) else "" for one in batch]
        n_prompt = sum(len(ids) for ids in prompts)
        n = req.n

        def lp_block(p: Piece, offset: int) -> dict[str, Any]:
            toks = [token_str(t) for t in p.token_ids]
            offs, o = [], offset
            for s in toks:
                offs.append(o)
                o += len(s)
            return {
                "tokens": toks,
                "token_logprobs": p.logprobs,
                "top_logprobs": [{token_str(a): b for a, b in top.items()} for top in p.top],
                "text_offset": offs,
            }

        def body(i: int, text: str, finish: str | None, lps: Any = None) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": now,
                "model": name,
                "choices": [{"index": i, "text": text, "logprobs": lps, "finish_reason": finish}],
            }

        def streams() -> AsyncIterator[tuple[int, Piece]]:
            return _merge([_engine_pieces(bridge, ids, sp) for ids, sp in zip(prompts, params)])

        if req.stream:

            async def events() -> AsyncIterator[str]:
                n_out, offsets = 0, [len(echo[k // n]) for k in range(len(prompts) * n)]
                for k in range(len(prompts) * n):
                    if echo[k // n]:
                        yield _sse(body(k, echo[k // n], None))
                merged = streams()
                async with aclosing(merged):
                    async for i, piece in merged:
                        k = i * n + piece.index
                        n_out += piece.n_tokens
                        lps = lp_block(piece, offsets[k]) if req.logprobs is not None else None
                        offsets[k] += sum(len(token_str(t)) for t in piece.token_ids)
                        if piece.text or piece.finish or piece.token_ids:
                            yield _sse(
                                body(k, piece.text, _finish(piece.finish) if piece.finish else None, lps)
                            )
                if req.stream_options and req.stream_options.include_usage:
                    usage = _usage(n_prompt, n_out)
                    yield _sse(
                        {
                            "id": rid,
                            "object": "text_completion",
                            "created": now,
                            "model": name,
                            "choices": [],
                            "usage": usage,
                        }
                    )
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")

        total = len(prompts) * n
        texts = [echo[k // n] for k in range(total)]
        reasons: list[str | None] = [None] * total
        lps: list[dict[str, list] | None] = [
            {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if req.logprobs is not None
            else None
            for _ in range(total)
        ]
        n_out = 0
        async for i, piece in streams():
            k = i * n + piece.index
            n_out += piece.n_tokens
            if lps[k] is not None:
                for key, vals in lp_block(piece, len(texts[k])).items():
                    lps[k][key] += vals
            texts[k] += piece.text
            reasons[k] = piece.finish or reasons[k]
        return {
            "id": rid,
            "object": "text_completion",
            "created": now,
            "model": name,
            "choices": [body(k, texts[k], _finish(reasons[k]), lps[k])["choices"][0] for k in range(total)],
            "usage": _usage(n_prompt, n_out),
        }

    return app


def _install_error_handlers(app: FastAPI) -> None:
    """OpenAI's error shape for every error the app or Starlette raises."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        if err.get("type") == "json_invalid":  # loc is ("body", char offset): a position, not a field
            where = err.get("loc", ("body", None))[-1]
            ctx = (err.get("ctx") or {}).get("error", "")
            return JSONResponse(
                error_body(f"malformed JSON body at character {where}: {ctx}".rstrip(": ")), 400
            )
        loc = ".".join(str(x) for x in err.get("loc", ())[1:]) or None
        return JSONResponse(
            error_body(f"{loc or 'body'}: {err.get('msg', 'invalid request')}", param=loc), 400
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            msg, code = f"Unknown route: {request.method} {request.url.path}", "not_found"
        elif e.status_code == 405:
            msg, code = f"Method {request.method} not allowed on {request.url.path}", "method_not_allowed"
        elif e.status_code == 400 and "parsing the body" in str(e.detail):
            msg, code = "The request body is not valid UTF-8 JSON", None
        else:
            msg, code = str(e.detail), None
        return JSONResponse(error_body(msg, code=code), e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")
        return JSONResponse(error_body(f"internal error: {e!r}", "server_error"), 500)


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
) -> AsyncIterator[Piece]:
    """One `Piece` per engine step and sample of one request."""
    async with aclosing(bridge.generate(prompt_ids, params)) as outs:
        async for out in outs:
            yield _piece(out)

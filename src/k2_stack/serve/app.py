"""The FastAPI app: routing only. /health, /v1/models, /v1/chat/completions, /v1/completions (OpenAI
shapes), /metrics, and k2-ckpt's weight receiver at /ckpt. Translation of requests and engine output
lives in `chat.py` and `completions.py` (pure, unit-tested without a server).

Every 4xx/5xx uses OpenAI's shape `{"error": {"message", "type", "param", "code"}}` with `param` naming
a request field or null: 404 for an unknown model or route, 400 for malformed JSON (param null, the
position in the message), non-UTF-8 bodies, invalid or unsupported fields, a context that is too long.

`n` samples of one request are one engine request (its prompt prefilled once); their choices stream
interleaved, tagged by `index`. Structured output (`response_format`, forced `tool_choice`) is a
logits processor of the request, batched with everything else.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k2_stack.serve.bridge import EngineBridge
from k2_stack.serve.chat import chat_events, chat_response, plan_chat
from k2_stack.serve.common import ServeContext, engine_pieces
from k2_stack.serve.completions import completion_events, completion_response, plan_completion
from k2_stack.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body

log = logging.getLogger("k2.serve")


def create_app(bridge: EngineBridge, ckpt_rank: int | None = 0) -> FastAPI:
    """The OpenAI-compatible app over one shared engine bridge; with `ckpt_rank` set, k2-ckpt's weight
    receiver is mounted at /ckpt (device id from that rank; see `k2_stack.serve.ckpt`)."""
    app = FastAPI(title="k2 serve")
    app.state.bridge = bridge
    if ckpt_rank is not None:
        from k2_stack.serve.ckpt import mount_receiver

        app.state.ckpt_device_id = mount_receiver(app, bridge, ckpt_rank)
    ctx = ServeContext.from_bridge(bridge, created=int(time.time()))
    _install_error_handlers(app)

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
                    "id": ctx.model_name,
                    "object": "model",
                    "created": ctx.created,
                    "owned_by": "k2",
                    "max_model_len": ctx.max_model_len,
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> Any:
        plan = plan_chat(ctx, req)
        pieces = engine_pieces(bridge, plan.prompt_ids, plan.params)
        if req.stream:
            return StreamingResponse(chat_events(ctx, plan, pieces), media_type="text/event-stream")
        return await chat_response(ctx, plan, pieces)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        plan = plan_completion(ctx, req)
        pieces = _merge([engine_pieces(bridge, ids, sp) for ids, sp in zip(plan.prompts, plan.params)])
        if req.stream:
            return StreamingResponse(completion_events(ctx, plan, pieces), media_type="text/event-stream")
        return await completion_response(ctx, plan, pieces)

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

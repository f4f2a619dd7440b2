"""/v1/chat/completions as pure translation: request -> `ChatPlan` (validation, the Kimi-format prompt,
tool_choice, structured output, sampling parameters), then engine pieces -> OpenAI's response body
(`chat_response`) or its SSE stream (`chat_events`). No server needed: tests feed pieces directly.

Tool calls in the generated text are parsed in the Kimi format (`k2_data.chat`, lenient: a malformed
call is dropped, no markup reaches content), streamed as OpenAI deltas; `finish_reason` is "tool_calls"
when a choice called one, "length" when max_tokens cut it (a cut call is not returned). Tool-call ids
in the request are renamed to `functions.NAME:IDX` first (`normalize_ids`), and every tool message must
answer an earlier call. With a thinking template the reply's `<think>...</think>` is returned as
`reasoning_content` (message and deltas); `chat_template_kwargs: {"thinking": false}` prefills an empty
reasoning block. `parallel_tool_calls:
false` shows only a choice's first call. Forced `tool_choice` ("required" or a named function) is
a structured-decoding logits processor, as is `response_format`.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from k2_data.chat import (
    ToolCallStreamParser,
    normalize_tool_call_ids,
    parse_tool_calls,
    render_ids,
    segments_to_ids,
)
from k2_data.chat.markers import THINK_BEGIN, THINK_END
from k2_data.chat.reasoning import ReasoningSplitter, split_reasoning
from k2_model.engine import SamplingParams

from k2_stack.serve.common import (
    MAX_TOP_LOGPROBS,
    Piece,
    ServeContext,
    finish_reason,
    sse,
    usage,
    usage_chunk,
)
from k2_stack.serve.protocol import APIError, ChatCompletionRequest


@dataclass
class ChatPlan:
    """A validated chat request, ready for the engine, and how its output is rendered."""

    req: ChatCompletionRequest
    prompt_ids: list[int]
    params: SamplingParams
    parse_tools: bool  # tool_choice != "none": parse Kimi tool-call markup in the output
    single_call: bool  # parallel_tool_calls false
    rid: str
    created: int
    tools: list[dict[str, Any]] | None = None  # for bare-counter call ids in the output
    reasoning: bool = False  # a thinking template: the reply opens with <think>...</think>


THINKING_TEMPLATE = "kimi-k2-thinking"
_WHERE = re.compile(r"(messages\[\d+\](?:\.tool_calls\[\d+\])?)(?:: field '([^']+)')?")
CHAT_TEMPLATE_KWARGS = {"thinking": bool}  # the chat_template_kwargs k2 serve knows


def check_tool_call_ids(messages: list[dict[str, Any]]) -> None:
    """Every tool message answers a call of an earlier assistant message (400 naming the field)."""
    seen: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.get("tool_calls") or []:
            seen.add(call.get("id"))
        if m["role"] == "tool":
            call_id = m.get("tool_call_id")
            if not call_id:
                raise APIError(400, f"messages[{i}].tool_call_id is required", f"messages[{i}].tool_call_id")
            if call_id not in seen:
                raise APIError(
                    400,
                    f"messages[{i}].tool_call_id {call_id!r} matches no tool call of an earlier assistant message",
                    f"messages[{i}].tool_call_id",
                )


def thinking_enabled(req: ChatCompletionRequest) -> bool:
    """`chat_template_kwargs.thinking` (default true); other keys are a 400 naming them."""
    kwargs = req.chat_template_kwargs or {}
    for key, value in kwargs.items():
        if key not in CHAT_TEMPLATE_KWARGS:
            raise APIError(
                400,
                f"chat_template_kwargs.{key} is not supported (known: {', '.join(CHAT_TEMPLATE_KWARGS)})",
                f"chat_template_kwargs.{key}",
            )
        if not isinstance(value, CHAT_TEMPLATE_KWARGS[key]):
            raise APIError(
                400, f"chat_template_kwargs.{key} must be a boolean", f"chat_template_kwargs.{key}"
            )
    return kwargs.get("thinking", True)


def response_format_processor(ctx: ServeContext, req: ChatCompletionRequest) -> Any:
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
        return ctx.json_processor(schema, strict)
    except ValueError as e:
        raise APIError(400, f"{param}: invalid JSON schema: {e}", param) from None


def plan_chat(ctx: ServeContext, req: ChatCompletionRequest) -> ChatPlan:
    """Validate `req` and build its prompt and sampling parameters; an `APIError` names the field."""
    ctx.check_model(req.model)
    ctx.check_supported(req)
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
        raise APIError(400, "response_format cannot be combined with a forced tool_choice", "response_format")
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    for m in messages:
        if m["role"] == "developer":
            m["role"] = "system"
    check_tool_call_ids(messages)
    thinking = thinking_enabled(req)
    if ctx.normalize_ids:
        messages = normalize_tool_call_ids(messages)
    try:
        prompt_ids = render_ids(
            ctx.tokenizer,
            messages,
            tools=tools if choice != "none" else None,
            add_generation_prompt=True,
            template=ctx.chat_template,
        )
    except (ValueError, TypeError, KeyError) as e:
        # the renderer's errors start with where: `messages[3].tool_calls[0]: field ...`
        where = _WHERE.match(str(e))
        param = "messages" if where is None else ".".join(p for p in where.groups() if p)
        raise APIError(400, f"messages: {e}", param) from None
    reasoning = ctx.chat_template == THINKING_TEMPLATE
    if reasoning and not thinking:  # an empty reasoning block: the model answers at once
        prompt_ids += segments_to_ids(ctx.tokenizer, [(THINK_BEGIN, True), (THINK_END, True)])
        reasoning = False
    processor = response_format_processor(ctx, req)
    if forced:
        index = sum(len(m.get("tool_calls") or []) for m in messages)
        try:
            processor = ctx.tool_call_processor(tools, named, index)
        except ValueError as e:
            raise APIError(400, str(e), "tools" if str(e).startswith("tools:") else "tool_choice") from None
    params = ctx.sampling(
        req,
        len(prompt_ids),
        req.max_completion_tokens or req.max_tokens,
        (req.top_logprobs or 0) if req.logprobs else 0,
        [processor] if processor is not None else None,
    )
    return ChatPlan(
        req=req,
        prompt_ids=prompt_ids,
        params=params,
        parse_tools=choice != "none",
        single_call=req.parallel_tool_calls is False,
        rid=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        tools=tools or None,
        reasoning=reasoning,
    )


def chat_logprobs(ctx: ServeContext, p: Piece) -> list[dict[str, Any]]:
    def entry(t: int, lp: float) -> dict[str, Any]:
        s = ctx.token_str(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return [
        entry(t, lp) | {"top_logprobs": [entry(a, b) for a, b in top.items()]}
        for t, lp, top in zip(p.token_ids, p.logprobs, p.top)
    ]


def _chunk(
    ctx: ServeContext,
    plan: ChatPlan,
    index: int,
    delta: dict[str, Any],
    finish: str | None = None,
    lps: Any = None,
) -> dict[str, Any]:
    return {
        "id": plan.rid,
        "object": "chat.completion.chunk",
        "created": plan.created,
        "model": ctx.model_name,
        "choices": [{"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}],
    }


def _keep(plan: ChatPlan, d: dict[str, Any]) -> dict[str, Any] | None:
    """parallel_tool_calls false: only the first call is shown."""
    if plan.single_call and "tool_calls" in d:
        calls = [c for c in d["tool_calls"] if c.get("index", 0) == 0]
        return {**d, "tool_calls": calls} if calls else None
    return d


async def chat_events(ctx: ServeContext, plan: ChatPlan, pieces: AsyncIterator[Piece]) -> AsyncIterator[str]:
    """The SSE stream of a `stream: true` request: role, content / tool-call deltas, finish, usage."""
    req = plan.req
    parsers = [ToolCallStreamParser(tools=plan.tools) if plan.parse_tools else None for _ in range(req.n)]
    splitters = [ReasoningSplitter() if plan.reasoning else None for _ in range(req.n)]

    def answer(index: int, text: str) -> list[dict[str, Any]]:
        parser = parsers[index]
        return parser.feed(text) if parser else ([{"content": text}] if text else [])

    def split(index: int, text: str, final: bool) -> list[dict[str, Any]]:
        splitter = splitters[index]
        if splitter is None:
            return answer(index, text)
        out: list[dict[str, Any]] = []
        for kind, part in splitter.feed(text) + (splitter.finish() if final else []):
            out += [{"reasoning_content": part}] if kind == "reasoning_content" else answer(index, part)
        return out

    for i in range(req.n):
        yield sse(_chunk(ctx, plan, i, {"role": "assistant", "content": ""}))
    n_out = 0
    async with aclosing(pieces):  # a client gone mid-stream aborts its request now, not at GC
        async for p in pieces:
            n_out += p.n_tokens
            parser = parsers[p.index]
            deltas = split(p.index, p.text, p.finish is not None)
            lps = {"content": chat_logprobs(ctx, p)} if req.logprobs and p.token_ids else None
            if lps is not None and not deltas:
                deltas = [{"content": ""}]
            for k, d in enumerate(deltas):
                d = _keep(plan, d)
                if d is not None:
                    yield sse(_chunk(ctx, plan, p.index, d, lps=lps if k == 0 else None))
            if p.finish is None:
                continue
            called = False
            if parser:
                end = parser.finish()
                for d in end.deltas:
                    d = _keep(plan, d)
                    if d is not None:
                        yield sse(_chunk(ctx, plan, p.index, d))
                called = end.tools_called
            yield sse(_chunk(ctx, plan, p.index, {}, finish_reason(p.finish, called)))
    if req.stream_options and req.stream_options.include_usage:
        yield sse(
            usage_chunk(
                "chat.completion.chunk", plan.rid, plan.created, ctx.model_name, len(plan.prompt_ids), n_out
            )
        )
    yield sse("[DONE]")


async def chat_response(ctx: ServeContext, plan: ChatPlan, pieces: AsyncIterator[Piece]) -> dict[str, Any]:
    """The body of a non-streaming request: every choice's message (tool calls parsed), usage."""
    req = plan.req
    texts, n_out = [""] * req.n, 0
    reasons: list[str | None] = [None] * req.n
    lp_content: list[list[dict[str, Any]]] = [[] for _ in range(req.n)]
    async for p in pieces:
        texts[p.index] += p.text
        n_out += p.n_tokens
        reasons[p.index] = p.finish or reasons[p.index]
        if req.logprobs:
            lp_content[p.index] += chat_logprobs(ctx, p)
    choices = []
    for i in range(req.n):
        reasoning, text = split_reasoning(texts[i]) if plan.reasoning else ("", texts[i])
        content, calls = parse_tool_calls(text, tools=plan.tools) if plan.parse_tools else (text, [])
        calls = calls[:1] if plan.single_call else calls
        message = {"role": "assistant", "content": content or None, "tool_calls": calls or None}
        if plan.reasoning:
            message["reasoning_content"] = reasoning or None
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": {"content": lp_content[i]} if req.logprobs else None,
                "finish_reason": finish_reason(reasons[i], bool(calls)),
            }
        )
    return {
        "id": plan.rid,
        "object": "chat.completion",
        "created": plan.created,
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage(len(plan.prompt_ids), n_out),
    }


__all__ = [
    "ChatPlan",
    "chat_events",
    "chat_logprobs",
    "chat_response",
    "plan_chat",
    "response_format_processor",
]

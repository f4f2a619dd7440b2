"""The K2 tool-call loop: ask the model, run the tools it calls, send back the results, repeat.

    agent = Agent("http://127.0.0.1:8000/v1", tools=[get_weather], model="k2-tiny", max_steps=8)
    result = agent.run("Weather in Paris?")
    result.content, result.stop_reason, result.messages

One step is one chat-completions call. After it the assistant message is appended; when it carries tool
calls (and the turn was not cut by `length`), each call is run in order and answered by a
`{"role": "tool", "tool_call_id", "name", "content"}` message, and the loop asks again. It stops when a
turn has no calls (`stop_reason` is the turn's `finish_reason`, e.g. "stop" or "length") or after
`max_steps` calls (`stop_reason="max_steps"`; the last turn's tools still ran, so every call has its
result and `agent.run(result.messages)` resumes).

Tool failures never raise: an unknown tool name, arguments that are not a JSON object, arguments that do
not fit the function's signature, and any `Exception` the tool raises are sent back as the tool result
(`"Error: ..."`) so the model can correct itself; they are also listed in `result.tool_errors`.
Endpoint failures (HTTP errors, timeouts, a malformed response) do raise `EndpointError`.

A server without a K2 tool parser returns the calls as raw `<|tool_calls_section_begin|>...` text; those
are parsed with `k2_data.chat.parse_tool_calls` (`parse_text_tool_calls=True`, the default).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from k2_data.agent.client import (
    AsyncChatClient,
    AsyncHTTPChatClient,
    ChatClient,
    EndpointError,
    HTTPChatClient,
)
from k2_data.agent.tools import Tool, as_tool
from k2_data.chat.markers import SECTION_BEGIN
from k2_data.chat.parse import parse_tool_calls

Message = dict[str, Any]
Messages = str | Sequence[Message]


@dataclass
class ToolError:
    """A tool call that failed; its `message` is what the model was sent."""

    call_id: str
    name: str
    message: str


@dataclass
class AgentResult:
    messages: list[Message]  # the whole conversation: the input, then every appended turn
    stop_reason: str  # the last turn's finish_reason ("stop", "length", ...) or "max_steps"
    steps: int  # chat-completions calls made
    responses: list[dict[str, Any]] = field(default_factory=list)  # the raw responses, one per step
    tool_errors: list[ToolError] = field(default_factory=list)
    tool_calls: int = 0  # calls run (including failed ones)

    @property
    def final(self) -> Message:
        """The last assistant message."""
        return next(m for m in reversed(self.messages) if m.get("role") == "assistant")

    @property
    def content(self) -> str | None:
        return self.final.get("content")

    @property
    def usage(self) -> dict[str, int]:
        """Token usage summed over the steps (the keys the endpoint reported)."""
        total: dict[str, int] = {}
        for r in self.responses:
            for k, v in (r.get("usage") or {}).items():
                if isinstance(v, int):
                    total[k] = total.get(k, 0) + v
        return total


def format_result(value: Any) -> str:
    """A tool's return value as message content: strings verbatim, everything else as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


class _Core:
    """What the sync and async loops share: building requests, reading turns, checking calls."""

    def __init__(
        self,
        tools: Iterable[Tool | Callable[..., Any]],
        model: str,
        max_steps: int,
        params: dict[str, Any] | None,
        parse_text_tool_calls: bool,
        on_message: Callable[[Message], None] | None,
    ):
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.tools: dict[str, Tool] = {}
        for t in map(as_tool, tools):
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t
        self.model, self.max_steps = model, max_steps
        self.params = dict(params or {})
        for reserved in ("model", "messages", "tools", "stream"):
            if reserved in self.params:
                raise ValueError(f"params must not set {reserved!r}: the agent sets it")
        self.parse_text_tool_calls = parse_text_tool_calls
        self.on_message = on_message

    def request(self, messages: list[Message]) -> dict[str, Any]:
        req: dict[str, Any] = {"model": self.model, "messages": messages, **self.params}
        if self.tools:
            req["tools"] = [t.spec() for t in self.tools.values()]
        return req

    @staticmethod
    def start(messages: Messages) -> list[Message]:
        if isinstance(messages, str):
            return [{"role": "user", "content": messages}]
        return [dict(m) for m in messages]  # never mutate the caller's list

    def append(self, messages: list[Message], message: Message) -> None:
        messages.append(message)
        if self.on_message is not None:
            self.on_message(message)

    def assistant_turn(self, response: dict[str, Any], messages: list[Message]) -> tuple[Message, str]:
        """The assistant message to append (calls normalised) and the turn's finish_reason."""
        choice = response["choices"][0]
        msg = choice.get("message") or {}
        finish = choice.get("finish_reason") or "stop"
        content = msg.get("content")
        calls = list(msg.get("tool_calls") or [])
        if not calls and self.parse_text_tool_calls and isinstance(content, str) and SECTION_BEGIN in content:
            content, calls = parse_tool_calls(content)
            content = content or None
            if calls and finish == "stop":
                finish = "tool_calls"
        seen = sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")
        out: Message = {"role": "assistant", "content": content}
        if msg.get("reasoning_content"):  # thinking models want their reasoning sent back
            out["reasoning_content"] = msg["reasoning_content"]
        if calls:
            out["tool_calls"] = [self._normalise(c, seen + i) for i, c in enumerate(calls)]
        return out, finish

    @staticmethod
    def _normalise(call: dict[str, Any], index: int) -> dict[str, Any]:
        fn = call.get("function") or {}
        name = str(fn.get("name") or "")
        args = fn.get("arguments")
        if args is None:
            args = ""
        elif not isinstance(args, str):  # some servers send an object; the wire format is a string
            args = json.dumps(args, ensure_ascii=False)
        # K2 was trained on ids `functions.NAME:IDX` counted over the conversation
        call_id = call.get("id") or f"functions.{name}:{index}"
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}

    def prepare(self, call: dict[str, Any]) -> tuple[Tool, dict[str, Any]] | str:
        """The tool and its keyword arguments, or the error message to send back instead."""
        name, raw = call["function"]["name"], call["function"]["arguments"]
        t = self.tools.get(name)
        if t is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return f"Error: unknown tool {name!r}; available tools: {known}"
        try:
            args = json.loads(raw) if raw.strip() else {}  # no arguments at all means {}
        except json.JSONDecodeError as e:
            return f"Error: arguments of {name} are not valid JSON ({e}); send one JSON object"
        if not isinstance(args, dict):
            return f"Error: arguments of {name} must be a JSON object, got a JSON {type(args).__name__}"
        try:
            inspect.signature(t.fn).bind(**args)
        except TypeError as e:
            return f"Error: bad arguments for {name}: {e}"
        return t, args

    @staticmethod
    def failure(name: str, e: Exception) -> str:
        return f"Error: tool {name} raised {type(e).__name__}: {e}"

    def answer(
        self, messages: list[Message], result: AgentResult, call: dict[str, Any], content: str, failed: bool
    ) -> None:
        name = call["function"]["name"]
        result.tool_calls += 1
        if failed:
            result.tool_errors.append(ToolError(call["id"], name, content))
        self.append(messages, {"role": "tool", "tool_call_id": call["id"], "name": name, "content": content})


def _continue(turn: Message, finish: str) -> bool:
    # a turn cut by max_tokens may hold a half-written call: stop rather than run it
    return bool(turn.get("tool_calls")) and finish != "length"


class Agent(_Core):
    """The tool-call loop over a chat-completions client.

    `client` is a base URL (`http://host:8000/v1`; an `HTTPChatClient` is made with `api_key` and
    `client_options`) or any callable `request dict -> response dict`. `params` go into every request
    (`temperature`, `max_tokens`, `tool_choice`, ...). `on_message` sees each appended message.
    """

    def __init__(
        self,
        client: str | ChatClient,
        tools: Iterable[Tool | Callable[..., Any]] = (),
        *,
        model: str,
        max_steps: int = 10,
        params: dict[str, Any] | None = None,
        api_key: str | None = None,
        client_options: dict[str, Any] | None = None,
        parse_text_tool_calls: bool = True,
        on_message: Callable[[Message], None] | None = None,
    ):
        super().__init__(tools, model, max_steps, params, parse_text_tool_calls, on_message)
        if isinstance(client, str):
            self.client: ChatClient = HTTPChatClient(client, api_key, **(client_options or {}))
            self._owns_client = True
        elif callable(client):
            self.client, self._owns_client = client, False
        else:
            raise TypeError(f"client must be a base URL or a callable, got {type(client).__name__}")

    def run(self, messages: Messages) -> AgentResult:
        convo = self.start(messages)
        result = AgentResult(messages=convo, stop_reason="max_steps", steps=0)
        while result.steps < self.max_steps:
            response = self.client(self.request(convo))
            result.steps += 1
            result.responses.append(response)
            turn, finish = self.assistant_turn(response, convo)
            self.append(convo, turn)
            if not _continue(turn, finish):
                result.stop_reason = finish
                return result
            for call in turn["tool_calls"]:
                prepared = self.prepare(call)
                if isinstance(prepared, str):
                    self.answer(convo, result, call, prepared, failed=True)
                    continue
                t, args = prepared
                try:
                    value = t.fn(**args)
                    if inspect.isawaitable(value):
                        value = asyncio.run(_awaited(value))
                except Exception as e:  # sent to the model, not raised
                    self.answer(convo, result, call, self.failure(t.name, e), failed=True)
                else:
                    self.answer(convo, result, call, format_result(value), failed=False)
        return result

    def close(self) -> None:
        if self._owns_client:
            self.client.close()  # type: ignore[attr-defined]

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _awaited(aw: Any) -> Any:
    return await aw


class AsyncAgent(_Core):
    """The asyncio loop: `await agent.run(messages)`. Tools may be sync or async; the calls of one turn
    run concurrently (their results are appended in call order). `client` is a base URL or an async
    callable `request -> response`."""

    def __init__(
        self,
        client: str | AsyncChatClient,
        tools: Iterable[Tool | Callable[..., Any]] = (),
        *,
        model: str,
        max_steps: int = 10,
        params: dict[str, Any] | None = None,
        api_key: str | None = None,
        client_options: dict[str, Any] | None = None,
        parse_text_tool_calls: bool = True,
        on_message: Callable[[Message], None] | None = None,
    ):
        super().__init__(tools, model, max_steps, params, parse_text_tool_calls, on_message)
        if isinstance(client, str):
            self.client: AsyncChatClient = AsyncHTTPChatClient(client, api_key, **(client_options or {}))
            self._owns_client = True
        elif callable(client):
            self.client, self._owns_client = client, False
        else:
            raise TypeError(f"client must be a base URL or an async callable, got {type(client).__name__}")

    async def _run_call(self, call: dict[str, Any]) -> tuple[str, bool]:
        prepared = self.prepare(call)
        if isinstance(prepared, str):
            return prepared, True
        t, args = prepared
        try:
            if t.is_async:
                value = await t.fn(**args)
            else:  # a blocking tool must not stall the event loop
                value = await asyncio.to_thread(t.fn, **args)
        except Exception as e:
            return self.failure(t.name, e), True
        return format_result(value), False

    async def run(self, messages: Messages) -> AgentResult:
        convo = self.start(messages)
        result = AgentResult(messages=convo, stop_reason="max_steps", steps=0)
        while result.steps < self.max_steps:
            response = await self.client(self.request(convo))
            result.steps += 1
            result.responses.append(response)
            turn, finish = self.assistant_turn(response, convo)
            self.append(convo, turn)
            if not _continue(turn, finish):
                result.stop_reason = finish
                return result
            outcomes = await asyncio.gather(*(self._run_call(c) for c in turn["tool_calls"]))
            for call, (content, failed) in zip(turn["tool_calls"], outcomes):
                self.answer(convo, result, call, content, failed)
        return result

    async def aclose(self) -> None:
        if self._owns_client:
            await self.client.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> AsyncAgent:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def run_agent(
    client: str | ChatClient,
    messages: Messages,
    tools: Iterable[Tool | Callable[..., Any]] = (),
    *,
    model: str,
    max_steps: int = 10,
    **kwargs: Any,
) -> AgentResult:
    """One-shot `Agent(client, tools, model=..., max_steps=..., **kwargs).run(messages)`."""
    with Agent(client, tools, model=model, max_steps=max_steps, **kwargs) as agent:
        return agent.run(messages)


__all__ = ["Agent", "AgentResult", "AsyncAgent", "EndpointError", "ToolError", "format_result", "run_agent"]

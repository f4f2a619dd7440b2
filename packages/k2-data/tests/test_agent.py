"""The K2 tool-call loop against a real HTTP server on loopback that plays a scripted model.

The fake model reads the conversation it is sent (the tool results included) and decides its next turn
from it, so a final answer of 20 for "(2+3)*4" proves the tool results made the round trip."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

import pytest
from k2_data.agent import Agent, AsyncAgent, EndpointError, HTTPChatClient, run_agent, tool
from k2_data.chat import render

Responder = Callable[[dict[str, Any]], "tuple[int, Any] | tuple[int, Any, dict[str, str]]"]


class FakeOpenAI:
    """`POST /v1/chat/completions` answered by `responder(request) -> (status, body[, headers])`."""

    def __init__(self) -> None:
        self.responder: Responder = lambda req: (500, {"error": {"message": "no responder"}})
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                fake.headers.append(dict(self.headers))
                if self.path != "/v1/chat/completions":
                    out: tuple = (404, b"Not Found")
                else:
                    out = fake.responder(body)
                status, payload, headers = (*out, {}) if len(out) == 2 else out
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out first
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05})
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def fake():
    pytest.importorskip("httpx")  # the `agent` extra; the injected-client tests run without it
    server = FakeOpenAI()
    yield server
    server.close()


def completion(
    content: str | None = None,
    calls: list[tuple[str, Any]] | None = None,
    finish: str | None = None,
    ids: list[str] | None = None,
) -> tuple[int, dict]:
    """A chat.completion body; `calls` are (name, arguments) with arguments a JSON string or an object."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [
            {
                "id": ids[i] if ids else f"call_{i}",
                "type": "function",
                "function": {"name": n, "arguments": a if isinstance(a, str) else json.dumps(a)},
            }
            for i, (n, a) in enumerate(calls)
        ]
    finish = finish or ("tool_calls" if calls else "stop")
    return 200, {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "fake",
        "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


def tool_results(req: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool messages after the last assistant turn."""
    out = []
    for m in reversed(req["messages"]):
        if m["role"] != "tool":
            break
        out.append(m)
    return out[::-1]


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    a: the first addend
    b: the second addend
    """
    return a + b


@tool
def mul(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


@tool
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


def calculator_model(req: dict[str, Any]) -> tuple[int, dict]:
    """(2+3)*4 in two tool steps, each argument taken from the previous tool result."""
    assistant_turns = sum(m["role"] == "assistant" for m in req["messages"])
    if assistant_turns == 0:
        return completion("Adding first.", [("add", {"a": 2, "b": 3})])
    if assistant_turns == 1:
        (res,) = tool_results(req)
        return completion(None, [("mul", {"a": json.loads(res["content"]), "b": 4})])
    (res,) = tool_results(req)
    return completion(f"The answer is {json.loads(res['content']):g}")


def test_multi_step_tool_loop(fake):
    fake.responder = calculator_model
    seen: list[dict] = []
    with Agent(
        fake.base_url, [add, mul], model="k2-tiny", params={"temperature": 0.0}, on_message=seen.append
    ) as agent:
        result = agent.run([{"role": "user", "content": "What is (2+3)*4?"}])
    assert result.content == "The answer is 20"
    assert (result.steps, result.stop_reason, result.tool_calls, result.tool_errors) == (3, "stop", 2, [])
    assert result.usage == {"prompt_tokens": 30, "completion_tokens": 15, "total_tokens": 45}
    assert [m["role"] for m in result.messages] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert seen == result.messages[1:]
    # what went over the wire: the model, params and tool schemas every time; results keyed by call id
    assert len(fake.requests) == 3
    r0, r1, r2 = fake.requests
    assert r0["model"] == "k2-tiny" and r0["temperature"] == 0.0 and "stream" not in r0
    assert r0["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "a": {"type": "integer", "description": "the first addend"},
                        "b": {"type": "integer", "description": "the second addend"},
                    },
                    "required": ["a", "b"],
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "mul",
                "description": "Multiply two numbers.",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                    "required": ["a", "b"],
                },
            },
        },
    ]
    assert r1["messages"][1] == {
        "role": "assistant",
        "content": "Adding first.",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        ],
    }
    assert r1["messages"][2] == {"role": "tool", "tool_call_id": "call_0", "name": "add", "content": "5"}
    assert r2["messages"][4] == {"role": "tool", "tool_call_id": "call_0", "name": "mul", "content": "20"}
    # the transcript is a valid K2 conversation: it renders in the chat format
    text = render(result.messages, tools=r0["tools"])
    assert text.count("<|tool_call_begin|>") == 2 and "The answer is 20" in text


def test_several_calls_in_one_turn(fake):
    def model(req):
        if len(req["messages"]) == 1:
            return completion(
                None,
                [("add", '{"a": 1, "b": 2}'), ("mul", '{"a": 3, "b": 4}'), ("add", '{"a": 10, "b": -4}')],
                ids=["x", "y", "z"],
            )
        by_id = {m["tool_call_id"]: json.loads(m["content"]) for m in tool_results(req)}
        return completion(f"{by_id['x']},{by_id['y']:g},{by_id['z']}")

    fake.responder = model
    result = run_agent(fake.base_url, "three sums", [add, mul], model="m")
    assert result.content == "3,12,6"
    tools = result.messages[2:5]
    assert [(m["tool_call_id"], m["name"], m["content"]) for m in tools] == [
        ("x", "add", "3"),
        ("y", "mul", "12"),
        ("z", "add", "6"),
    ]
    assert result.steps == 2 and result.tool_calls == 3


def test_tool_errors_go_back_to_the_model(fake):
    """A raising tool, an unknown tool, bad JSON, a non-object, and a missing argument: all answered."""

    def model(req):
        if len(req["messages"]) == 1:
            return completion(
                None,
                [
                    ("divide", {"a": 1.0, "b": 0.0}),
                    ("search_web", {"q": "x"}),
                    ("add", '{"a": 1, "b": '),
                    ("add", "[1, 2]"),
                    ("add", {"a": 1}),
                    ("add", {"a": 1, "b": 2, "c": 3}),
                ],
            )
        # the model sees every error and retries the division correctly
        if sum(m["role"] == "assistant" for m in req["messages"]) == 1:
            return completion(None, [("divide", {"a": 1, "b": 4})], ids=["retry"])
        return completion("quotient " + tool_results(req)[0]["content"])

    fake.responder = model
    result = run_agent(fake.base_url, "go", [add, divide], model="m")
    assert result.content == "quotient 0.25"
    errors = [m["content"] for m in fake.requests[1]["messages"][2:]]
    assert errors[0] == "Error: tool divide raised ZeroDivisionError: float division by zero"
    assert errors[1] == "Error: unknown tool 'search_web'; available tools: add, divide"
    assert errors[2].startswith(
        "Error: arguments of add are not valid JSON (Expecting value: line 1 column 15"
    )
    assert errors[3] == "Error: arguments of add must be a JSON object, got a JSON list"
    assert errors[4] == "Error: bad arguments for add: missing a required argument: 'b'"
    assert errors[5] == "Error: bad arguments for add: got an unexpected keyword argument 'c'"
    assert [(e.call_id, e.name) for e in result.tool_errors] == [
        ("call_0", "divide"),
        ("call_1", "search_web"),
        ("call_2", "add"),
        ("call_3", "add"),
        ("call_4", "add"),
        ("call_5", "add"),
    ]
    assert [e.message for e in result.tool_errors] == errors
    assert result.tool_calls == 7


def test_step_limit_stops_and_can_resume(fake):
    def model(req):  # always wants one more call until it has seen 5 results
        results = [m for m in req["messages"] if m["role"] == "tool"]
        if len(results) < 5:
            return completion(
                None, [("add", {"a": len(results), "b": 1})], ids=[f"functions.add:{len(results)}"]
            )
        return completion(f"counted to {results[-1]['content']}")

    fake.responder = model
    with Agent(fake.base_url, [add], model="m", max_steps=3) as agent:
        first = agent.run("count")
        assert (first.stop_reason, first.steps, first.tool_calls) == ("max_steps", 3, 3)
        assert len(fake.requests) == 3
        assert first.messages[-1] == {
            "role": "tool",
            "tool_call_id": "functions.add:2",
            "name": "add",
            "content": "3",
        }
        second = agent.run(first.messages)  # every call has its result, so the loop resumes
    assert (second.stop_reason, second.steps, second.content) == ("stop", 3, "counted to 5")
    assert len(fake.requests) == 6
    with pytest.raises(ValueError, match="max_steps must be >= 1"):
        Agent(fake.base_url, [add], model="m", max_steps=0)


def test_length_cut_calls_are_not_run(fake):
    fake.responder = lambda req: completion("partial", [("add", '{"a": 1')], finish="length")
    result = run_agent(fake.base_url, "x", [add], model="m")
    assert (result.stop_reason, result.steps, result.tool_calls) == ("length", 1, 0)
    assert result.messages[-1]["role"] == "assistant"


def test_raw_k2_tool_call_text_is_parsed(fake):
    """A server without a K2 tool parser sends the section as text; the loop parses and runs it."""
    section = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
        '{"a": 40, "b": 2}<|tool_call_end|><|tool_calls_section_end|>'
    )

    def model(req):
        if len(req["messages"]) == 1:
            return completion("Let me add." + section, finish="stop")
        return completion("got " + tool_results(req)[0]["content"])

    fake.responder = model
    result = run_agent(fake.base_url, "x", [add], model="m")
    assert result.content == "got 42"
    assert result.messages[1] == {
        "role": "assistant",
        "content": "Let me add.",
        "tool_calls": [
            {
                "id": "functions.add:0",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 40, "b": 2}'},
            }
        ],
    }
    assert result.messages[2]["tool_call_id"] == "functions.add:0"


def test_http_errors_name_the_endpoint(fake):
    url = fake.base_url + "/chat/completions"
    fake.responder = lambda req: (
        400,
        {"error": {"message": "unknown model 'nope'", "type": "invalid_request_error"}},
    )
    with pytest.raises(EndpointError) as e:
        run_agent(fake.base_url, "x", [add], model="nope")
    assert (e.value.status, e.value.url, e.value.message) == (400, url, "unknown model 'nope'")
    assert str(e.value) == f"{url}: HTTP 400: unknown model 'nope'"
    assert len(fake.requests) == 1  # a 4xx is not retried

    fake.requests.clear()
    fake.responder = lambda req: (500, b"<html>boom</html>")
    client_options = {"max_retries": 2, "backoff_s": 0.01}
    with pytest.raises(EndpointError, match=r"HTTP 500: <html>boom</html>"):
        run_agent(fake.base_url, "x", [add], model="m", client_options=client_options)
    assert len(fake.requests) == 3  # retried twice

    with pytest.raises(EndpointError, match=r"/v2/chat/completions: HTTP 404: Not Found"):
        run_agent(fake.base_url.replace("/v1", "/v2"), "x", model="m")

    fake.responder = lambda req: (200, b"not json")
    with pytest.raises(EndpointError, match="HTTP 200: response is not JSON"):
        run_agent(fake.base_url, "x", model="m")
    fake.responder = lambda req: (200, {"choices": []})
    with pytest.raises(EndpointError, match="response has no choices"):
        run_agent(fake.base_url, "x", model="m")


def test_retry_after_then_success_and_api_key(fake):
    state = {"n": 0}

    def flaky(req):
        state["n"] += 1
        if state["n"] == 1:
            return 429, {"error": {"message": "slow down"}}, {"Retry-After": "0.05"}
        return completion("ok")

    fake.responder = flaky
    result = run_agent(fake.base_url, "x", model="m", api_key="sk-test", client_options={"max_retries": 1})
    assert result.content == "ok" and state["n"] == 2
    assert all(h["Authorization"] == "Bearer sk-test" for h in fake.headers)


def test_timeout_and_refused_connection(fake):
    def slow(req):
        time.sleep(1.0)
        return completion("late")

    fake.responder = slow
    with pytest.raises(EndpointError) as e:
        run_agent(fake.base_url, "x", model="m", client_options={"timeout_s": 0.2, "max_retries": 0})
    assert e.value.status is None and "timed out" in str(e.value) and fake.base_url in str(e.value)

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(
        EndpointError, match=rf"127.0.0.1:{port}/v1/chat/completions: no response: request failed"
    ):
        run_agent(f"http://127.0.0.1:{port}/v1", "x", model="m", client_options={"max_retries": 0})


def test_injected_client_without_a_server():
    sent: list[dict] = []

    def client(req):
        sent.append(json.loads(json.dumps(req)))  # the request must be JSON-serialisable
        return calculator_model(req)[1]

    messages = [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "(2+3)*4"},
    ]
    result = Agent(client, [add, mul], model="m").run(messages)
    assert result.content == "The answer is 20" and len(sent) == 3
    assert len(messages) == 2  # the caller's list is not mutated


def test_async_agent_runs_one_turns_calls_concurrently(fake):
    @tool
    async def slow_add(a: int, b: int) -> int:
        """Add, slowly."""
        await asyncio.sleep(0.2)
        return a + b

    def model(req):
        if len(req["messages"]) == 1:
            return completion(
                None, [("slow_add", {"a": i, "b": i}) for i in range(5)] + [("divide", {"a": 1.0, "b": 0.0})]
            )
        return completion(",".join(m["content"] for m in tool_results(req)))

    async def main():
        async with AsyncAgent(fake.base_url, [slow_add, divide], model="m") as agent:
            t0 = time.perf_counter()
            result = await agent.run("go")
            return result, time.perf_counter() - t0

    fake.responder = model
    result, elapsed = asyncio.run(main())
    assert result.content == "0,2,4,6,8,Error: tool divide raised ZeroDivisionError: float division by zero"
    assert elapsed < 0.2 * 5  # five 0.2 s calls overlapped (sequential would take >= 1 s)
    assert len(result.tool_errors) == 1


def test_schema_from_type_hints():
    @tool(name="lookup", description="Find things.")
    def f(
        query: str,
        kind: Literal["a", "b"] = "a",
        limit: int | None = None,
        tags: list[str] | None = None,
        weights: dict[str, float] | None = None,
        exact: bool = False,
    ) -> list:
        return []

    assert f.spec() == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Find things.",
            "parameters": {
                "type": "object",
                "required": ["query"],
                "properties": {
                    "query": {"type": "string"},
                    "kind": {"type": "string", "enum": ["a", "b"]},
                    "limit": {"type": "integer"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "weights": {"type": "object", "additionalProperties": {"type": "number"}},
                    "exact": {"type": "boolean"},
                },
            },
        },
    }
    with pytest.raises(TypeError, match=r"tool g, parameter 'x': cannot derive a JSON schema"):

        @tool
        def g(x: HTTPChatClient) -> None:
            pass

    with pytest.raises(TypeError, match="must be passable by keyword"):

        @tool
        def h(*args: int) -> None:
            pass

    with pytest.raises(ValueError, match="two tools are named 'add'"):
        Agent(lambda r: {}, [add, add], model="m")


def test_result_formatting_and_arguments_as_objects():
    @tool
    def weather(city: str) -> dict:
        """Weather for a city."""
        return {"city": city, "temp_c": 21.5, "sky": "clear ☀"}

    def client(req):
        if len(req["messages"]) == 1:  # some servers send arguments as an object, and no call id
            msg = {
                "role": "assistant",
                "content": None,
                "reasoning_content": "need weather",
                "tool_calls": [
                    {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
                ],
            }
            return {"choices": [{"message": msg, "finish_reason": "tool_calls"}]}
        return {
            "choices": [
                {
                    "message": {"role": "assistant", "content": tool_results(req)[0]["content"]},
                    "finish_reason": "stop",
                }
            ]
        }

    result = run_agent(client, "weather?", [weather], model="m")
    assert result.content == '{"city": "Paris", "temp_c": 21.5, "sky": "clear ☀"}'
    assert result.messages[1] == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "need weather",
        "tool_calls": [
            {
                "id": "functions.weather:0",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }


def test_import_is_light_and_missing_httpx_is_named(monkeypatch):
    import subprocess
    import sys

    code = "import sys, k2_data, k2_data.agent; print('httpx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    monkeypatch.setitem(sys.modules, "httpx", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'k2-data\[agent\]'"):
        HTTPChatClient("http://127.0.0.1:1/v1")
    with pytest.raises(ValueError, match="base_url must start with http"):
        HTTPChatClient("127.0.0.1:8000/v1")


def test_sync_agent_awaits_an_async_tool():
    @tool
    async def add_async(a: int, b: int) -> int:
        """Add, asynchronously."""
        await asyncio.sleep(0)
        return a + b

    def client(req):
        if len(req["messages"]) == 1:
            return completion(None, [("add_async", {"a": 20, "b": 22})])[1]
        return completion("sum " + tool_results(req)[0]["content"])[1]

    assert run_agent(client, "x", [add_async], model="m").content == "sum 42"

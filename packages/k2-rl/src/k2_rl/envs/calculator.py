"""`calculator`: arithmetic tasks answered with the shipped calculator MCP server, called for real.

One live server (`python -m k2_data.agentic.servers.calculator`, stdio, through k2-data's
`MCPSession`) serves every episode of the run: the server is stateless, so sharing it changes no
answer, and a start per episode (about a second of CPU) would cost more than the episodes. Its tools
(`calculate`, `statistics`) are listed from the server itself. The server is tied to this process
(`k2_data.lifetime`): it dies with the run, SIGKILL included.

A task: `{"messages": [...], "answer": "391"}`. Score parts: `answer` (the last number in the final
answer equals the expected one), `calls` (the fraction of calls that succeeded, 0 with no calls);
success = the answer is right.
"""

from __future__ import annotations

import asyncio
import random
import re
import threading
from concurrent.futures import Future
from typing import Any

from k2_rl.envs.base import Score, Step, call_score, combine, run_calls, task_weights

WEIGHTS = {"answer": 0.7, "calls": 0.3}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class LiveServer:
    """One started MCP server on an event loop of its own (a daemon thread); `call` is synchronous.
    Calls run one at a time in the server's task (the SDK's scopes are entered and left by one task)."""

    def __init__(self, name: str, timeout_s: float = 30.0) -> None:
        from k2_data.agentic.mcp_import import server_spec

        self.spec, self.timeout_s = server_spec(name), timeout_s
        self.loop = asyncio.new_event_loop()
        self.ready: Future = Future()
        self.queue: asyncio.Queue | None = None
        self.thread = threading.Thread(target=self._run, name=f"mcp-{name}", daemon=True)
        self.thread.start()
        self.specs: list[dict] = self.ready.result(timeout=timeout_s)

    def _run(self) -> None:
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        from k2_data.agentic.mcp_import import MCPSession

        self.queue = asyncio.Queue()
        try:
            session = await MCPSession(self.spec, read_timeout_s=self.timeout_s).__aenter__()
        except Exception as e:
            self.ready.set_exception(e)
            return
        self.ready.set_result(session.specs())
        try:
            while (item := await self.queue.get()) is not None:
                fut, name, args = item
                try:
                    fut.set_result(await session.call(name, args))
                except Exception as e:
                    fut.set_exception(e)
        finally:
            await session.__aexit__(None, None, None)

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        fut: Future = Future()
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (fut, name, arguments))
        return fut.result(timeout=self.timeout_s)

    def close(self) -> None:
        if self.thread.is_alive() and self.queue is not None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, None)
            self.thread.join(timeout=10)


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text or "")
    return found[-1] if found else None


def same_number(a: str | None, b: str) -> bool:
    if a is None:
        return False
    try:
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))
    except ValueError:
        return False


class CalculatorEnv:
    def __init__(self, server: LiveServer) -> None:
        self.server, self.task, self.made = server, {}, []

    def reset(self, task: dict) -> tuple[list[dict], list[dict]]:
        if "answer" not in task:
            raise ValueError("calculator task: no field 'answer'")
        self.task, self.made = task, []
        return list(task["messages"]), self.server.specs

    def step(self, tool_calls: list[dict]) -> Step:
        from k2_data.agentic.mcp_import import MCPToolError

        return Step(run_calls(tool_calls, self.server.call, (MCPToolError,), self.made))

    def score(self, answer: str) -> Score:
        right = same_number(last_number(answer), str(self.task["answer"]))
        parts = {"answer": float(right), "calls": call_score(self.made, self.task.get("expected_calls"))}
        return Score(combine(parts, task_weights(self.task, WEIGHTS)), right, parts)

    def close(self) -> None:
        pass


def make_task(rng: random.Random) -> dict:
    a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(1, 50)
    expr = f"{a} * {b} + {c}"
    return {
        "messages": [
            {"role": "user", "content": f"What is {expr}? Use the calculator, then give the number."}
        ],
        "answer": str(a * b + c),
        "expected_calls": [{"name": "calculate", "arguments": {"expression": expr}}],
        "expert_answer": str(a * b + c),
    }


class CalculatorMaker:
    name = "calculator"

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.server: LiveServer | None = None

    def __call__(self) -> CalculatorEnv:
        if self.server is None:  # started on the first episode, shared by the rest
            self.server = LiveServer("calculator", self.timeout_s)
        return CalculatorEnv(self.server)

    def tasks(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        return [make_task(rng) for _ in range(n)]

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

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

import random
import re

from k2_rl.envs.base import Score, Step, call_score, combine, run_calls, task_weights
from k2_rl.envs.live import LiveServer, SharedServerMaker

WEIGHTS = {"answer": 0.7, "calls": 0.3}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


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


class CalculatorMaker(SharedServerMaker):
    name = "calculator"
    server_name = "calculator"

    def __call__(self) -> CalculatorEnv:
        return CalculatorEnv(self.live())

    def tasks(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        return [make_task(rng) for _ in range(n)]

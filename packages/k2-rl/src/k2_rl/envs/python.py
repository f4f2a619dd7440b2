"""`python`: code tasks with k2-data's sandbox as the tool and unit tests as the reward.

The policy may call `run_python(code)` (k2_data.sandbox.run_python: a private work dir, CPU, memory
and output limits, no network) to try its code; its final answer's last fenced code block is scored
against the task's `tests` (plain asserts) by k2-rl's code reward (`k2_data.unit_tests`: 1 only when
every assert ran). Score parts: `tests` (0 or 1), `calls` (the fraction of runs that exited 0, 0 with
no calls); success = the tests passed.
"""

from __future__ import annotations

import random

from k2_rl.envs.base import Score, Step, call_score, combine, function_call, task_weights

WEIGHTS = {"tests": 0.8, "calls": 0.2}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": "Run a Python program in a sandbox; returns its exit code, stdout and stderr.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
    }
]


class PythonEnv:
    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s, self.task, self.made = timeout_s, {}, []

    def reset(self, task: dict) -> tuple[list[dict], list[dict]]:
        if "tests" not in task:
            raise ValueError("python task: no field 'tests'")
        self.task, self.made = task, []
        return list(task["messages"]), TOOLS

    def step(self, tool_calls: list[dict]) -> Step:
        from k2_data.sandbox import run_python

        results = []
        for call in tool_calls:
            try:
                name, args = function_call(call)
                if name != "run_python" or not isinstance(args.get("code"), str):
                    raise ValueError(f"unknown tool {name!r} or no string 'code'")
            except ValueError as e:
                self.made.append((str((call.get("function") or {}).get("name")), None, False))
                results.append(f"Error: {e}")
                continue
            res = run_python(args["code"], timeout_s=self.timeout_s, memory_mb=256)
            self.made.append((name, args, res.returncode == 0 and res.killed_reason is None))
            results.append(
                f"exit code {res.returncode}\nstdout:\n{res.stdout[-800:]}\nstderr:\n{res.stderr[-800:]}"
            )
        return Step(results)

    def score(self, answer: str) -> Score:
        from k2_rl.rewards.code import code_reward, extract_program

        passed = code_reward(extract_program(answer), self.task["tests"], timeout_s=self.timeout_s) >= 1.0
        parts = {"tests": float(passed), "calls": call_score(self.made, self.task.get("expected_calls"))}
        return Score(combine(parts, task_weights(self.task, WEIGHTS)), passed, parts)

    def close(self) -> None:
        pass


_FUNCS = [
    (
        "add",
        "returns the sum of a and b",
        "def add(a, b):\n    return a + b",
        "assert add(2, 3) == 5\nassert add(-1, 1) == 0",
    ),
    (
        "double",
        "returns twice x",
        "def double(x):\n    return 2 * x",
        "assert double(4) == 8\nassert double(0) == 0",
    ),
    (
        "last",
        "returns the last item of a list",
        "def last(xs):\n    return xs[-1]",
        "assert last([1, 2, 3]) == 3",
    ),
    (
        "is_even",
        "tells whether n is even",
        "def is_even(n):\n    return n % 2 == 0",
        "assert is_even(4)\nassert not is_even(3)",
    ),
]


class PythonMaker:
    name = "python"

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s

    def __call__(self) -> PythonEnv:
        return PythonEnv(self.timeout_s)

    def tasks(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            name, what, solution, tests = rng.choice(_FUNCS)
            out.append(
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": f"Write a Python function {name} that {what}. You may test it with "
                            "run_python; answer with the function in a ```python block.",
                        }
                    ],
                    "tests": tests,
                    "solution": solution,
                    "expert_calls": [
                        {"name": "run_python", "arguments": {"code": f"{solution}\n{tests}\nprint('ok')"}}
                    ],
                    "expert_answer": f"```python\n{solution}\n```",
                }
            )
        return out

    def close(self) -> None:
        pass

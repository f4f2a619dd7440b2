"""A code-execution tool whose calls run for real in `k2_data.sandbox`, never in the tool simulator.

`k2 data agentic --code-tool` puts `run_python` into the repository (source `sandbox`, domain
`sandbox/python`); an agent whose sampled tool set holds it gets tasks that involve computing, and every
call in a trajectory runs the program in the sandbox (no network, a private temporary directory, its own
uid, wall-clock / CPU / memory / output limits), so the tool result the judge and the SFT data see is what
Python printed, not an LLM's guess:

    ex = CodeExecutor(timeout_s=10, memory_mb=256)
    tool = ex.tool()                       # a k2_data.agent Tool named run_python
    await tool.fn(code="print(6 * 7)")     # "42\\n"

A program that exits non-zero, times out, runs out of memory or prints past the cap is a tool error the
agent sees (`Error: ...`, with the exit status and the tail of stderr). Each call is recorded in
`ex.calls` (a trajectory's `code_calls`). Calls are not LLM requests: they never touch the request
cache, and a trajectory replayed on resume runs its programs again (same program, same output for the
deterministic ones the tasks ask for).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from k2_data.agent.tools import Tool, tool_from_spec

CODE_TOOL_NAME = "run_python"
CODE_TOOL_SPEC: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": CODE_TOOL_NAME,
        "description": (
            "Run a Python 3 program in an isolated sandbox (no network, a private temporary directory, "
            "standard library only) and return what it prints. Use print() for every value you need."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the whole program"}},
            "required": ["code"],
        },
    },
}
CODE_SOURCE, CODE_CATEGORY, CODE_DOMAIN = "sandbox", "code", "sandbox/python"
_TAIL = 2000  # characters of stderr (or stdout) an error message keeps


class CodeExecError(RuntimeError):
    """A sandboxed program failed; the message is what the agent sees."""


class CodeExecutor:
    def __init__(
        self,
        *,
        timeout_s: float = 10.0,
        memory_mb: int = 256,
        max_output_bytes: int = 16_000,
        counters: Counter | None = None,
    ) -> None:
        self.timeout_s, self.memory_mb, self.max_output_bytes = timeout_s, memory_mb, max_output_bytes
        self.counters = counters if counters is not None else Counter()
        self.calls: list[dict[str, Any]] = []  # {"tool", "code", "ok", "result"} in call order

    def tool(self) -> Tool:
        async def run_python(code: str) -> str:
            return await self.run(code)

        return tool_from_spec(CODE_TOOL_SPEC, run_python)

    async def run(self, code: str) -> str:
        from k2_data.sandbox import SandboxError, run_python

        self.counters["code_calls"] += 1
        try:
            # the sandbox blocks on its child: keep the event loop (other trajectories) running
            res = await asyncio.to_thread(
                run_python,
                code,
                timeout_s=self.timeout_s,
                memory_mb=self.memory_mb,
                max_output_bytes=self.max_output_bytes,
            )
        except SandboxError as e:
            return self._fail(code, f"the sandbox is unavailable here: {e}")
        if res.killed_reason == "timeout" or res.timed_out:
            return self._fail(code, f"the program ran past the {self.timeout_s:g} s limit and was killed")
        if res.killed_reason == "cpu":
            return self._fail(code, f"the program used more than {self.timeout_s:g} s of CPU and was killed")
        if res.killed_reason == "memory":
            return self._fail(code, f"the program went over the {self.memory_mb} MB memory limit")
        if res.killed_reason == "output":
            return self._fail(code, f"the program printed more than {self.max_output_bytes} bytes")
        if res.killed_reason is not None:
            return self._fail(code, f"the sandbox failed ({res.killed_reason}): {res.stderr[-_TAIL:]}")
        if res.returncode != 0:
            return self._fail(code, f"exit status {res.returncode}\n{(res.stderr or res.stdout)[-_TAIL:]}")
        out = res.stdout if res.stdout.strip() else "(the program printed nothing)"
        if res.stderr.strip():
            out += f"\n[stderr]\n{res.stderr[-_TAIL:]}"
        self.calls.append({"tool": CODE_TOOL_NAME, "code": code, "ok": True, "result": out[:_TAIL]})
        return out

    def _fail(self, code: str, message: str) -> str:
        self.counters["code_errors"] += 1
        self.calls.append({"tool": CODE_TOOL_NAME, "code": code, "ok": False, "result": message[:_TAIL]})
        raise CodeExecError(message)


__all__ = ["CODE_TOOL_NAME", "CODE_TOOL_SPEC", "CodeExecError", "CodeExecutor"]

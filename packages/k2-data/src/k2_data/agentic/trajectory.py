"""One multi-turn trajectory: the user simulator, the agent (`AsyncAgent` on any OpenAI-compatible
endpoint) and the stateful tool simulator, bounded in user turns, agent steps and tokens. Tools that came
from an MCP server run for real on a live server of their own (`execute.MCPExecutor`) when the rollout is
given the servers (`mcp_servers`: server name -> ServerSpec, `servers_of`: tool name -> server name), and
the code tool `run_python` runs in `k2_data.sandbox` when the rollout is given a `code` executor
(`code_tool.CodeExecutor`; its calls are the trajectory's `code_calls`).

Stop reasons: `user_done` (the user simulator said [DONE]), `max_turns`, `max_steps` (the agent kept
calling tools), `length` (a reply cut by max_tokens), `token_budget` (the conversation passed
`max_total_tokens`, as reported by the endpoint's usage).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from k2_data.agent.loop import AsyncAgent
from k2_data.agentic.simulator import ToolSimulator
from k2_data.agentic.user import draw_user, next_user_message


@dataclass
class Limits:
    max_turns: int = 4  # user messages, the first included
    max_steps: int = 6  # agent chat-completion calls per user turn
    max_tokens: int = 512  # per agent reply
    max_total_tokens: int = 8192  # conversation size (prompt + completion of the last call)
    temperature: float = 0.7
    edge_rate: float = 0.05  # share of simulated tool calls that fail transiently
    sim_max_tokens: int = 512  # per user-simulator and tool-simulator reply


async def rollout(
    client: Any,
    model: str,
    agent: dict[str, Any],
    task: dict[str, Any],
    seed: int,
    limits: Limits,
    counters: Counter,
    user_model: str | None = None,
    tool_model: str | None = None,
    mcp_servers: dict[str, Any] | None = None,
    servers_of: dict[str, str] | None = None,
    mcp_timeout_s: float = 30.0,
    code: Any = None,
) -> dict[str, Any]:
    executor = None
    if mcp_servers and servers_of:
        from k2_data.agentic.execute import MCPExecutor

        executor = MCPExecutor(mcp_servers, timeout_s=mcp_timeout_s, counters=counters)
    try:
        return await _rollout(
            client,
            model,
            agent,
            task,
            seed,
            limits,
            counters,
            user_model,
            tool_model,
            executor,
            servers_of,
            code,
        )
    finally:
        if executor is not None:
            await executor.aclose()


async def _rollout(
    client: Any,
    model: str,
    agent: dict[str, Any],
    task: dict[str, Any],
    seed: int,
    limits: Limits,
    counters: Counter,
    user_model: str | None,
    tool_model: str | None,
    executor: Any,
    servers_of: dict[str, str] | None,
    code: Any = None,
) -> dict[str, Any]:
    sim = ToolSimulator(
        client,
        tool_model or model,
        seed=seed,
        edge_rate=limits.edge_rate,
        counters=counters,
        max_tokens=limits.sim_max_tokens,
    )
    tools = sim.tools(agent["tools"])
    if executor is not None:  # real MCP tools replace their simulated twins, in the same order
        real = {t.name: t for t in executor.tools(agent["tools"], servers_of or {})}
        tools = [real.get(t.name, t) for t in tools]
    if code is not None:  # the code tool runs in the sandbox (unless an MCP server of that name owns it)
        from k2_data.agentic.code_tool import CODE_TOOL_NAME

        owned = set(servers_of or {}) if executor is not None else set()
        if CODE_TOOL_NAME not in owned:
            tools = [code.tool() if t.name == CODE_TOOL_NAME else t for t in tools]
    user = draw_user(random.Random(seed))
    params = {"temperature": limits.temperature, "max_tokens": limits.max_tokens, "seed": seed}
    looper = AsyncAgent(client, tools, model=model, max_steps=limits.max_steps, params=params)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": agent["system_prompt"]},
        {"role": "user", "content": task["user_request"]},
    ]
    turns, steps, tool_calls, errors, tokens = 1, 0, 0, [], 0
    stop = "max_turns"
    while True:
        result = await looper.run(messages)
        messages = result.messages
        steps += result.steps
        tool_calls += result.tool_calls
        errors += [e.message for e in result.tool_errors]
        last = (result.responses[-1].get("usage") or {}) if result.responses else {}
        tokens = max(tokens, int(last.get("prompt_tokens") or 0) + int(last.get("completion_tokens") or 0))
        if result.stop_reason in ("max_steps", "length"):
            stop = result.stop_reason
            break
        if tokens >= limits.max_total_tokens:
            stop = "token_budget"
            break
        if turns >= limits.max_turns:
            break
        reply = await next_user_message(
            client,
            user_model or model,
            user,
            task["goal"],
            messages,
            seed=seed * 100 + turns,
            max_tokens=limits.sim_max_tokens,
        )
        if reply is None:
            stop = "user_done"
            break
        messages.append({"role": "user", "content": reply})
        turns += 1
    counters[f"stop_{stop}"] += 1
    return {
        "id": task["id"],
        "agent_id": agent["id"],
        "user": user,
        "messages": messages,
        "tools": agent["tools"],
        "stop_reason": stop,
        "turns": turns,
        "steps": steps,
        "tool_calls": tool_calls,
        "tool_errors": errors,
        "tokens": tokens,
        "state": sim.state.snapshot(),
        "mcp_calls": list(executor.calls) if executor is not None else [],
        "code_calls": list(code.calls) if code is not None else [],
    }

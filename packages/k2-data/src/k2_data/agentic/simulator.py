"""The stateful tool simulator: a world model the agent's tool calls run against.

`ToolSimulator.call(name, arguments)` for a tool of the sampled set:
1. the arguments are validated against the tool's JSON schema (`jsonschema`); invalid ones are an error
   the agent sees (`invalid arguments for NAME: ...`), as a strict real API would answer;
2. CRUD-named tools run on the deterministic `StateStore` (create-then-read returns what was created,
   a read after a delete is an error);
3. every other tool is simulated by the LLM through the shared client, given the tool's spec, the
   arguments and the current state; it answers `{"ok": bool, "result": ..., "state_updates": {...}}`
   and is told to return realistic successes, partial failures and edge cases;
4. with `edge_rate` > 0 a deterministic share of calls (by hash of seed, tool and call index) fails
   transiently (`503 temporarily unavailable`), so trajectories include recovery.

`tools(specs)` gives `Tool`s for `AsyncAgent` whose function runs `call`. Failures raise `ToolSimError`;
the agent loop sends them to the model as the tool's result.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any

from k2_data.agent.tools import Tool, tool_from_spec
from k2_data.agentic.llm import ask_json
from k2_data.agentic.state import StateError, StateStore, classify

SYSTEM = (
    "You simulate a software tool's backend. Given the tool's specification, the call's arguments and the "
    'current world state, answer with one JSON object: {"ok": true|false, "result": <what the tool '
    'returns, or the error message>, "state_updates": {<collection>: {<id>: <record or null>}}}. Be '
    "realistic and consistent with the state: mostly successes, sometimes partial results or edge cases "
    "(empty results, limits, ambiguous input). Answer with the JSON object only."
)


class ToolSimError(RuntimeError):
    """A simulated tool call failed; the message is the tool's error text."""


def _validator(schema: dict[str, Any]) -> Any:
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


class ToolSimulator:
    def __init__(
        self,
        client: Any,
        model: str,
        *,
        seed: int = 0,
        edge_rate: float = 0.0,
        counters: Counter | None = None,
        max_tokens: int = 512,
    ):
        self.client, self.model, self.seed, self.edge_rate = client, model, seed, edge_rate
        self.state = StateStore()
        self.counters = counters if counters is not None else Counter()
        self.max_tokens = max_tokens
        self.calls = 0
        self._specs: dict[str, dict[str, Any]] = {}
        self._validators: dict[str, Any] = {}

    def tools(self, specs: list[dict[str, Any]]) -> list[Tool]:
        out = []
        for spec in specs:
            t = tool_from_spec(spec)
            self._specs[t.name] = t.spec()["function"]
            self._validators[t.name] = _validator(t.parameters)

            def bind(name: str) -> Any:
                async def fn(**arguments: Any) -> str:
                    return await self.call(name, arguments)

                fn.__name__ = name
                return fn

            out.append(tool_from_spec(spec, fn=bind(t.name)))
        return out

    def _edge(self, name: str, index: int) -> bool:
        if self.edge_rate <= 0:
            return False
        h = hashlib.sha256(f"{self.seed}:{name}:{index}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64 < self.edge_rate

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        index = self.calls
        self.calls += 1
        self.counters["tool_calls"] += 1
        if name not in self._specs:
            raise ToolSimError(f"unknown tool {name!r}")
        errors = sorted(self._validators[name].iter_errors(arguments), key=lambda e: list(e.path))
        if errors:
            self.counters["tool_invalid_arguments"] += 1
            where = "/".join(map(str, errors[0].path)) or "arguments"
            raise ToolSimError(f"invalid arguments for {name}: {where}: {errors[0].message}")
        if self._edge(name, index):
            self.counters["tool_edge_failures"] += 1
            raise ToolSimError("503 temporarily unavailable; try again")
        kind = classify(name)
        if kind is not None and (kind[0] == "create" or self.state.knows(kind[1])):
            self.counters["tool_state_calls"] += 1
            try:
                return json.dumps(self.state.apply(kind[0], kind[1], arguments), ensure_ascii=False)
            except StateError as e:
                self.counters["tool_state_errors"] += 1
                raise ToolSimError(str(e)) from None
        return await self._simulate(name, arguments, index)

    async def _simulate(self, name: str, arguments: dict[str, Any], index: int) -> str:
        self.counters["tool_llm_calls"] += 1
        prompt = json.dumps(
            {"tool": self._specs[name], "arguments": arguments, "state": self.state.snapshot()},
            ensure_ascii=False,
            sort_keys=True,
        )
        answer = await ask_json(
            self.client,
            self.model,
            "tool",
            SYSTEM,
            prompt,
            seed=self.seed * 1000 + index,
            counters=self.counters,
            max_tokens=self.max_tokens,
        )
        if answer is None:  # the backend "crashed": a tool error the agent must handle
            self.counters["tool_llm_fallbacks"] += 1
            raise ToolSimError(f"{name}: internal error (the backend returned no usable answer)")
        self.state.merge(answer.get("state_updates"))
        result = answer.get("result")
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
        if answer.get("ok") is False:
            self.counters["tool_llm_errors"] += 1
            raise ToolSimError(text)
        return text

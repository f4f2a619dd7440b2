"""JSON-answering LLM calls through the one synthesis client (`AsyncHTTPChatClient`: cache, retries).

Every stage's system prompt starts with a tag (`[k2-agentic/judge]`, ...) so a scripted test server, a
log reader or the cache can tell the stages apart. A reply that holds no JSON object is re-asked with the
next seed (a different request, so a cached bad answer is not returned again), `attempts` times in all.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

TAGS = {
    "agent": "[k2-agentic/agent-profile]",
    "tasks": "[k2-agentic/tasks]",
    "user": "[k2-agentic/user-simulator]",
    "tool": "[k2-agentic/tool-simulator]",
    "judge": "[k2-agentic/judge]",
    "domains": "[k2-agentic/domains]",
    "tools": "[k2-agentic/synthetic-tools]",
}
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)


def extract_json(text: str) -> Any:
    """The first JSON object in `text` (inside a ``` fence or bare), or None."""
    candidates = [m.group(1) for m in _FENCE.finditer(text)] + [text]
    decoder = json.JSONDecoder()
    for cand in candidates:
        for i, ch in enumerate(cand):
            if ch == "{":
                try:
                    obj, _ = decoder.raw_decode(cand, i)
                except json.JSONDecodeError:
                    continue
                if isinstance(obj, dict):
                    return obj
    return None


def content_of(response: dict[str, Any]) -> str:
    msg = response["choices"][0].get("message") or {}
    return msg.get("content") or ""


async def ask_text(
    client: Any,
    model: str,
    stage: str,
    system: str,
    user: str,
    *,
    seed: int,
    temperature: float = 0.7,
    max_tokens: int = 512,
) -> str:
    request = {
        "model": model,
        "messages": [
            {"role": "system", "content": f"{TAGS[stage]} {system}"},
            {"role": "user", "content": user},
        ],
        "temperature": temperature,
        "max_tokens": max_tokens,
        "seed": seed,
    }
    return content_of(await client(request))


async def ask_json(
    client: Any,
    model: str,
    stage: str,
    system: str,
    user: str,
    *,
    seed: int,
    counters: Counter | None = None,
    attempts: int = 2,
    temperature: float = 0.7,
    max_tokens: int = 1024,
) -> dict[str, Any] | None:
    """The JSON object the model answers with, or None after `attempts` answers without one (counted as
    `{stage}_unparsable` in `counters`)."""
    for a in range(attempts):
        text = await ask_text(
            client, model, stage, system, user, seed=seed + a, temperature=temperature, max_tokens=max_tokens
        )
        obj = extract_json(text)
        if obj is not None:
            return obj
        if counters is not None:
            counters[f"{stage}_unparsable"] += 1
    return None

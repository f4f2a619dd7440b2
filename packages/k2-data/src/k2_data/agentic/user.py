"""The user simulator: a persona with a communication style pursuing the task's goal over several turns.

The simulator sees the conversation as a transcript (its own turns and the assistant's visible replies,
tool traffic summarised) and writes the user's next message, or `[DONE]` when the goal is met or the
assistant cannot help. Personas and styles are drawn per trajectory from fixed lists by seed.
"""

from __future__ import annotations

import random
from typing import Any

from k2_data.agentic.llm import ask_text

PERSONAS = (
    "a busy small-business owner",
    "a graduate student",
    "a retired engineer who likes precision",
    "a first-time user unsure what the assistant can do",
    "a project manager coordinating a team",
    "a software developer",
    "a teacher preparing a lesson",
    "a traveller on a tight schedule",
)
STYLES = (
    "terse: short messages, no pleasantries",
    "verbose and friendly",
    "gives details only when asked",
    "changes one requirement midway",
    "impatient; asks for the result directly",
    "formal and precise",
)
DONE = "[DONE]"
SYSTEM = (
    "You play the USER talking to an AI assistant; never act as the assistant. You are {persona}; your style "
    "is {style}. Your goal: {goal}. Write only your next message to the assistant. If your goal is met, or "
    "the assistant clearly cannot help, answer exactly " + DONE + "."
)


def draw_user(rng: random.Random) -> dict[str, str]:
    return {"persona": rng.choice(PERSONAS), "style": rng.choice(STYLES)}


def transcript(messages: list[dict[str, Any]]) -> str:
    lines = []
    for m in messages:
        role = m.get("role")
        if role == "user":
            lines.append(f"USER: {m.get('content')}")
        elif role == "assistant":
            if m.get("content"):
                lines.append(f"ASSISTANT: {m['content']}")
            for c in m.get("tool_calls") or []:
                lines.append(f"(assistant called {c['function']['name']})")
    return "\n".join(lines)


async def next_user_message(
    client: Any,
    model: str,
    user: dict[str, str],
    goal: str,
    messages: list[dict[str, Any]],
    seed: int,
    max_tokens: int = 256,
) -> str | None:
    """The user's next message, or None when the user is done (or has nothing to say)."""
    text = await ask_text(
        client,
        model,
        "user",
        SYSTEM.format(goal=goal, **user),
        f"The conversation so far:\n{transcript(messages)}\n\nYour next message:",
        seed=seed,
        max_tokens=max_tokens,
    )
    text = text.strip()
    if not text or DONE in text:
        return None
    return text

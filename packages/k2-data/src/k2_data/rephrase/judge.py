"""The optional LLM judge: one extra request per accepted chunk asking for PASS or FAIL.

Run only after the exact checks and the similarity pass (it costs as much as the rewrite). A verdict
that is neither PASS nor FAIL counts as FAIL: an unsure judge must not let a rewrite through.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

SYSTEM = (
    "You check rewrites for fidelity. Compare the SOURCE passage with its REWRITE. The rewrite may change "
    "style, order and wording{translation}. It must keep every fact, number, formula and name of the "
    "source, and add no fact, number or name that the source does not state. Reply with one line: PASS, "
    "or FAIL followed by a colon and the first problem you found."
)


def request(model: str, source: str, rewrite: str, kind: str = "knowledge", seed: int = 0) -> dict[str, Any]:
    """The judge's chat request (temperature 0, short answer)."""
    translation = " and, for a translation, the language" if kind == "translate" else ""
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": SYSTEM.format(translation=translation)},
            {"role": "user", "content": f"SOURCE:\n{source}\n\nREWRITE:\n{rewrite}"},
        ],
        "temperature": 0.0,
        "max_tokens": 64,
        "seed": seed,
    }


def parse_verdict(text: str) -> tuple[bool, str]:
    """(passed, the verdict line); anything but a leading PASS is a failure."""
    line = next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "")
    m = re.match(r"[\W_]*(PASS|FAIL)\b", line, re.IGNORECASE)
    if m is None:
        return False, f"no verdict: {line[:200]!r}"
    return m.group(1).upper() == "PASS", line[:300]


async def judge(
    client: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],
    model: str,
    source: str,
    rewrite: str,
    kind: str = "knowledge",
    seed: int = 0,
) -> tuple[bool, str]:
    response = await client(request(model, source, rewrite, kind, seed))
    content = response["choices"][0].get("message", {}).get("content") or ""
    return parse_verdict(content)

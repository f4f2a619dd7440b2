"""Tool-call id normalisation: rename ids to the `functions.NAME:IDX` shape Kimi K2 was trained on.

The released templates print ids as given (`call_abc123`, `search:0`, nothing), but the models saw
`functions.NAME:IDX` (IDX counting calls across the conversation) during training, and Moonshot's API
and llama.cpp's fixed templates rename ids before rendering. This is that step, kept out of `render` so
that a released template stays byte-exact and the renaming is a visible choice: `k2 data sft` and
`k2 serve` apply it by default (`--no-normalize-ids` turns it off). k2's own rendering (`template="k2"`)
has always renamed the same way, so for it this step changes nothing.

Rules: a call whose id is already `functions.NAME:IDX` for its own function keeps it; any other call
(another function's K2 id, an OpenAI id, a bare counter, no id) gets `functions.NAME:IDX`. A tool
message's `tool_call_id` follows the rename of the latest call that had that id; one that matches no
call is left as it is (validation names it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

K2_CALL_ID = re.compile(r"functions\.(?P<name>.+):(?P<index>\d+)", re.DOTALL)


def k2_call_id(name: str, index: int) -> str:
    return f"functions.{name}:{index}"


def normalize_tool_call_ids(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A copy of `messages` with tool-call ids renamed (see the module docstring); the input is unchanged.

    Messages that are not objects, and calls without a usable `function.name`, are copied as they are:
    rendering or validation reports them by field.
    """
    out: list[dict[str, Any]] = []
    renamed: dict[str, str] = {}  # an id as the client sent it -> the K2 id of the latest call with it
    count = 0
    for msg in messages:
        if not isinstance(msg, Mapping):
            out.append(msg)  # type: ignore[arg-type]
            continue
        msg = dict(msg)
        calls = msg.get("tool_calls") if msg.get("role") == "assistant" else None
        if isinstance(calls, list) and calls:
            new_calls = []
            for call in calls:
                fn = call.get("function") if isinstance(call, Mapping) else None
                name = fn.get("name") if isinstance(fn, Mapping) else None
                if not isinstance(name, str) or not name:
                    new_calls.append(call)
                    count += 1
                    continue
                orig = call.get("id")
                m = K2_CALL_ID.fullmatch(orig) if isinstance(orig, str) else None
                new_id = orig if m is not None and m.group("name") == name else k2_call_id(name, count)
                if isinstance(orig, str) and orig:
                    renamed[orig] = new_id
                renamed[new_id] = new_id
                new_calls.append({**call, "id": new_id})
                count += 1
            msg["tool_calls"] = new_calls
        elif msg.get("role") == "tool":
            call_id = msg.get("tool_call_id")
            if isinstance(call_id, str) and call_id in renamed:
                msg["tool_call_id"] = renamed[call_id]
        out.append(msg)
    return out

"""Checks that a conversation is fit to train on (SFT), beyond what rendering needs.

`render` accepts anything it can lay out; a training record must also be consistent: every tool call
answered by a later tool message, every tool message answering an earlier call, arguments that are a JSON
object, calls only to functions declared in the record's tools, and at least one assistant turn to learn from.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from k2_data.chat.ids import K2_CALL_ID
from k2_data.chat.render import render_segments


def _declared_names(tools: Sequence[Mapping[str, Any]]) -> set[str]:
    names: set[str] = set()
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{k}]: field 'function.name' must be a non-empty string")
        names.add(name)
    return names


def validate_conversation(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> None:
    """Raise ValueError naming the field (`messages[3].tool_calls[0].function.arguments`, ...) when the
    conversation cannot be trained on; return None when it can.

    Checks, after everything `render` checks (message shapes, roles, content types): each assistant tool
    call is answered by a later tool message with its `tool_call_id` (the call's own id, or the
    `functions.NAME:IDX` id it is rendered with), each tool message answers an earlier unanswered call, call
    arguments are a JSON object (or a JSON string holding one), called functions are declared in `tools`
    (a record with tool calls and no tools is refused), and there is at least one assistant turn.
    """
    render_segments(messages, tools)  # structure: roles, fields, content parts
    declared = _declared_names(tools) if tools else None
    pending: dict[str, str] = {}  # an id a tool message may use -> where the call is
    aliases: dict[str, list[str]] = {}  # where the call is -> all ids it answers to
    call_count = 0
    assistant_turns = 0
    for i, msg in enumerate(messages):
        role = msg["role"]
        if role == "assistant":
            assistant_turns += 1
            for j, call in enumerate(msg.get("tool_calls") or []):
                where = f"messages[{i}].tool_calls[{j}]"
                fn = call["function"]
                name, args = fn["name"], fn["arguments"]
                if declared is None:
                    raise ValueError(
                        f"{where}: field 'function.name' calls {name!r}, but the record declares no tools "
                        "(field 'tools'): a model cannot learn to call a function it was never shown"
                    )
                if name not in declared:
                    raise ValueError(
                        f"{where}: field 'function.name' calls {name!r}, which is not declared in tools "
                        f"(declared: {', '.join(sorted(declared))})"
                    )
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError as e:
                        raise ValueError(
                            f"{where}: field 'function.arguments' is not valid JSON ({e})"
                        ) from None
                if not isinstance(args, Mapping):
                    raise ValueError(
                        f"{where}: field 'function.arguments' must be a JSON object, got {type(args).__name__}"
                    )
                orig = call.get("id")
                m = K2_CALL_ID.fullmatch(orig) if isinstance(orig, str) else None
                k2_id = (
                    orig if m is not None and m.group("name") == name else f"functions.{name}:{call_count}"
                )
                call_count += 1
                ids = [k2_id] + ([orig] if isinstance(orig, str) and orig and orig != k2_id else [])
                for call_id in ids:
                    if call_id in pending:
                        raise ValueError(
                            f"{where}: field 'id' {call_id!r} is already used by {pending[call_id]}"
                        )
                    pending[call_id] = where
                aliases[where] = ids
        elif role == "tool":
            call_id = msg["tool_call_id"]
            if call_id not in pending:
                raise ValueError(
                    f"messages[{i}]: field 'tool_call_id' {call_id!r} answers no earlier unanswered tool call"
                )
            for alias in aliases.pop(pending[call_id]):
                del pending[alias]
    if aliases:
        where, ids = next(iter(aliases.items()))
        raise ValueError(
            f"{where}: tool call {ids[-1]!r} has no later tool message answering it (by tool_call_id)"
        )
    if assistant_turns == 0:
        raise ValueError("messages: no assistant turn (nothing to train on)")

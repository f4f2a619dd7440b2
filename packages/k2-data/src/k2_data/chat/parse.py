"""Parse Kimi K2 tool calls out of generated text into OpenAI-shaped calls.

    text = 'Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
           '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
    parse_tool_calls(text)
    -> ('Let me check.', [{'id': 'functions.get_weather:0', 'type': 'function',
                           'function': {'name': 'get_weather', 'arguments': '{"city": "Paris"}'}}])

Arguments are the model's JSON text kept verbatim (only surrounding whitespace stripped), after checking
that it parses to a JSON object: re-rendering a parsed turn gives back the same tokens. A section that is
malformed (unterminated, a call without its argument marker or end marker, arguments that are not a JSON
object, a bad `NAME:IDX` header, stray text between calls) never raises: its raw text stays in the
content, it contributes no calls, and a warning goes to the `k2_data.chat` logger. Text before and after
sections is content.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from k2_data.chat.markers import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END

logger = logging.getLogger("k2_data.chat")

ToolCall = dict[str, Any]

# `functions.NAME:IDX` as K2 emits it; vLLM also accepts a bare `NAME:IDX`, and so do we
_HEADER = re.compile(r"(?:functions\.)?(?P<name>[^\s<|>]+?):(?P<index>\d+)")


class MalformedSection(ValueError):
    """Why a tool-call section could not be parsed (caught internally; never escapes the public API)."""


def parse_header(header: str) -> tuple[str, str]:
    call_id = header.strip()
    m = _HEADER.fullmatch(call_id)
    if m is None:
        raise MalformedSection(f"call header {call_id!r} is not 'functions.NAME:IDX'")
    return call_id, m.group("name")


def check_arguments(call_id: str, arguments: str) -> None:
    """Raise MalformedSection unless `arguments` is one JSON object."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as e:
        raise MalformedSection(f"arguments of {call_id} are not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise MalformedSection(f"arguments of {call_id} are a JSON {type(value).__name__}, not an object")


def parse_section_spans(body: str) -> list[tuple[str, str, int, int]]:
    """Calls in a section body (the text between the section markers) as `(id, name, args_start, args_end)`,
    where `body[args_start:args_end]` is the verbatim JSON arguments. Raises MalformedSection."""
    # structure is checked marker by marker; a marker string inside the JSON arguments is text (it renders
    # and re-parses as text), a marker anywhere else is stray text and makes the section malformed
    calls = []
    pos = 0
    while True:
        begin = body.find(CALL_BEGIN, pos)
        if begin < 0:
            if body[pos:].strip():
                raise MalformedSection(f"text {body[pos : pos + 40]!r} outside a call")
            break
        if body[pos:begin].strip():
            raise MalformedSection(f"text {body[pos:begin][:40]!r} between calls")
        start = begin + len(CALL_BEGIN)
        end = body.find(CALL_END, start)
        if end < 0:
            raise MalformedSection("a call without <|tool_call_end|>")
        call = body[start:end]
        if CALL_BEGIN in call:
            raise MalformedSection("a call without <|tool_call_end|> before the next <|tool_call_begin|>")
        arg = call.find(ARGUMENT_BEGIN)
        if arg < 0:
            raise MalformedSection("a call without <|tool_call_argument_begin|>")
        if ARGUMENT_BEGIN in call[arg + len(ARGUMENT_BEGIN) :]:
            raise MalformedSection("two <|tool_call_argument_begin|> in one call")
        call_id, name = parse_header(call[:arg])
        a0 = start + arg + len(ARGUMENT_BEGIN)
        raw = body[a0:end]
        a0 += len(raw) - len(raw.lstrip())
        a1 = a0 + len(raw.strip())
        check_arguments(call_id, body[a0:a1])
        calls.append((call_id, name, a0, a1))
        pos = end + len(CALL_END)
    if not calls:
        raise MalformedSection("a section with no calls")
    return calls


def make_call(call_id: str, name: str, arguments: str) -> ToolCall:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_section(body: str) -> list[ToolCall]:
    """OpenAI-shaped calls of one section body; raises MalformedSection."""
    return [make_call(cid, name, body[a0:a1]) for cid, name, a0, a1 in parse_section_spans(body)]


def warn_malformed(reason: object, raw: str) -> None:
    preview = raw if len(raw) <= 200 else raw[:200] + "..."
    logger.warning("malformed tool-call section kept as content (%s): %r", reason, preview)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """`(content, tool_calls)` of a generated assistant turn; `tool_calls` is [] when there are none.

    `content` is all text outside well-formed sections ("" when there is none); never raises on model output.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_tool_calls expects the generated text as a str, got {type(text).__name__}")
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while True:
        begin = text.find(SECTION_BEGIN, pos)
        if begin < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:begin])
        body_start = begin + len(SECTION_BEGIN)
        end = text.find(SECTION_END, body_start)
        if end < 0:
            warn_malformed("unterminated section: no <|tool_calls_section_end|>", text[begin:])
            content.append(text[begin:])
            break
        try:
            calls += parse_section(text[body_start:end])
        except MalformedSection as e:
            warn_malformed(e, text[begin : end + len(SECTION_END)])
            content.append(text[begin : end + len(SECTION_END)])
        pos = end + len(SECTION_END)
    return "".join(content), calls

"""Parse Kimi K2 tool calls out of generated text into OpenAI-shaped calls.

    text = 'Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
           '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
    parse_tool_calls(text)
    -> ('Let me check.', [{'id': 'functions.get_weather:0', 'type': 'function',
                           'function': {'name': 'get_weather', 'arguments': '{"city": "Paris"}'}}])

Arguments are the model's JSON text kept verbatim (only surrounding whitespace stripped), after checking
that it parses to a JSON object: re-rendering a parsed turn gives back the same tokens. Nothing raises on
model output; what is malformed is logged to the `k2_data.chat` logger and handled by mode:

- default (`strict=False`, what serving wants, as vLLM's and SGLang's kimi_k2 parsers): each call of a
  section stands alone; a malformed one (no argument or end marker, a bad header, arguments that are not
  a JSON object) is dropped and the valid calls around it are kept; noise between calls is ignored; a
  section cut off before its end marker (max_tokens) keeps its complete calls. Section markup never
  reaches `content`, nor does a stray tool-call marker outside a section. A bare-counter header (`0`)
  names no function: with `tools` it resolves to the only tool, or to the one tool whose parameters
  cover the call's argument keys; otherwise the call is dropped.
- `strict=True` (validating training data): all or nothing per section; a malformed or unterminated
  section contributes no calls and its raw text stays in `content`.

Text before and after sections is content.
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
_BARE_COUNTER = re.compile(r"\d+")
TOOL_MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
_ANY_MARKER = re.compile("|".join(re.escape(m) for m in TOOL_MARKERS))


class MalformedSection(ValueError):
    """Why a tool-call section could not be parsed (caught internally; never escapes the public API)."""


def parse_header(header: str, tools: Any = None, arguments: str | None = None) -> tuple[str, str]:
    """`(id, function name)` of a call header; a bare counter resolves against `tools` (see the module)."""
    call_id = header.strip()
    m = _HEADER.fullmatch(call_id)
    if m is not None:
        return call_id, m.group("name")
    if _BARE_COUNTER.fullmatch(call_id) and tools:
        return call_id, _resolve_counter(call_id, tools, arguments)
    raise MalformedSection(f"call header {call_id!r} is not 'functions.NAME:IDX'")


def _tool_signatures(tools: Any) -> list[tuple[str, set[str]]]:
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
            props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
            out.append((fn["name"], set(props)))
    return out


def _resolve_counter(call_id: str, tools: Any, arguments: str | None) -> str:
    sigs = _tool_signatures(tools)
    if len(sigs) == 1:
        return sigs[0][0]
    try:
        args = json.loads(arguments) if arguments is not None else None
    except json.JSONDecodeError:
        args = None
    if not isinstance(args, dict):
        raise MalformedSection(f"call {call_id!r} names no function and its arguments do not tell which")
    fits = [name for name, props in sigs if set(args) <= props]
    if len(fits) != 1:
        raise MalformedSection(
            f"call {call_id!r} names no function; its argument keys fit {len(fits)} of the tools"
        )
    return fits[0]


def check_arguments(call_id: str, arguments: str) -> None:
    """Raise MalformedSection unless `arguments` is one JSON object."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as e:
        raise MalformedSection(f"arguments of {call_id} are not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise MalformedSection(f"arguments of {call_id} are a JSON {type(value).__name__}, not an object")


def parse_section_spans(body: str, tools: Any = None) -> list[tuple[str, str, int, int]]:
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
        calls.append(_call_span(body, start, arg, end, tools))
        pos = end + len(CALL_END)
    if not calls:
        raise MalformedSection("a section with no calls")
    return calls


def _call_span(body: str, start: int, arg: int, end: int, tools: Any) -> tuple[str, str, int, int]:
    """One call whose header is `body[start:start+arg]` and arguments run to `end`; raises MalformedSection."""
    a0 = start + arg + len(ARGUMENT_BEGIN)
    raw = body[a0:end]
    a0 += len(raw) - len(raw.lstrip())
    a1 = a0 + len(raw.strip())
    call_id, name = parse_header(body[start : start + arg], tools, body[a0:a1])
    check_arguments(call_id, body[a0:a1])
    return call_id, name, a0, a1


def lenient_section_spans(
    body: str, tools: Any = None, complete: bool = True
) -> list[tuple[str, str, int, int]]:
    """The valid calls of a section body, each judged alone (malformed ones logged and dropped); noise
    between calls is ignored. `complete=False`: the section was cut off, its last call may be partial."""
    calls = []
    begin = body.find(CALL_BEGIN)
    while begin >= 0:
        start = begin + len(CALL_BEGIN)
        nxt = body.find(CALL_BEGIN, start)
        end = body.find(CALL_END, start)
        if end < 0 or (0 <= nxt < end):
            if end >= 0 or nxt >= 0 or complete:
                warn_dropped("a call without <|tool_call_end|>", body[begin : nxt if nxt >= 0 else len(body)])
            begin = nxt
            continue
        call = body[start:end]
        arg = call.find(ARGUMENT_BEGIN)
        try:
            if arg < 0:
                raise MalformedSection("a call without <|tool_call_argument_begin|>")
            if ARGUMENT_BEGIN in call[arg + len(ARGUMENT_BEGIN) :]:
                raise MalformedSection("two <|tool_call_argument_begin|> in one call")
            calls.append(_call_span(body, start, arg, end, tools))
        except MalformedSection as e:
            warn_dropped(e, body[begin : end + len(CALL_END)])
        begin = body.find(CALL_BEGIN, end + len(CALL_END))
    return calls


def strip_markers(text: str) -> str:
    """`text` without tool-call marker strings (stray ones outside a section, in lenient mode); one
    left-to-right pass, so a stream that never splits a marker strips exactly what the whole text does."""
    return _ANY_MARKER.sub("", text) if "<|tool_call" in text else text


def make_call(call_id: str, name: str, arguments: str) -> ToolCall:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_section(body: str, tools: Any = None) -> list[ToolCall]:
    """OpenAI-shaped calls of one section body; raises MalformedSection."""
    return [make_call(cid, name, body[a0:a1]) for cid, name, a0, a1 in parse_section_spans(body, tools)]


def _preview(raw: str) -> str:
    return raw if len(raw) <= 200 else raw[:200] + "..."


def warn_malformed(reason: object, raw: str) -> None:
    logger.warning("malformed tool-call section kept as content (%s): %r", reason, _preview(raw))


def warn_dropped(reason: object, raw: str) -> None:
    logger.warning("malformed tool call dropped (%s): %r", reason, _preview(raw))


def parse_tool_calls(text: str, tools: Any = None, strict: bool = False) -> tuple[str, list[ToolCall]]:
    """`(content, tool_calls)` of a generated assistant turn; `tool_calls` is [] when there are none.

    `tools`: the request's OpenAI tools, for calls whose header is a bare counter. `strict`: all-or-nothing
    sections (see the module docstring). `content` is "" when there is none; never raises on model output.
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
        if not strict:
            body = text[body_start:] if end < 0 else text[body_start:end]
            if end < 0:
                logger.warning(
                    "unterminated tool-call section: its complete calls are kept, the rest dropped"
                )
            calls += [
                make_call(c, n, body[a0:a1]) for c, n, a0, a1 in lenient_section_spans(body, tools, end >= 0)
            ]
            if end < 0:
                break
        elif end < 0:
            warn_malformed("unterminated section: no <|tool_calls_section_end|>", text[begin:])
            content.append(text[begin:])
            break
        else:
            try:
                calls += parse_section(text[body_start:end], tools)
            except MalformedSection as e:
                warn_malformed(e, text[begin : end + len(SECTION_END)])
                content.append(text[begin : end + len(SECTION_END)])
        pos = end + len(SECTION_END)
    if not strict:
        content = [strip_markers(piece) for piece in content]
    return "".join(content), calls

"""Moonshot's released Kimi K2 chat templates, rendered in Python as `(text, is_marker, trainable)` segments.

Two named variants, each byte-identical to the template file in `templates/` rendered by transformers'
`apply_chat_template` (its `tojson` is `json.dumps(ensure_ascii=False)` with default separators, loop
controls on, trim_blocks / lstrip_blocks) after Moonshot's tokenizer has sorted the tools' keys
recursively (`sort_tools`, as `deep_sort_dict` in its `tokenization_kimi.py`):

- `kimi-k2-instruct-0905`: a `tool_declare` turn `\\n  # Tools\\n  {tools JSON}`, the default system prompt
  when messages[0] is not a system turn, `<|im_{role}|>{name or role}<|im_middle|>...<|im_end|>` per
  message, tool calls with their ids as given, tool results `## Return of {id}\\n    {content}`.
- `kimi-k2-thinking`: the same turns without the `# Tools` header; every assistant turn opens with
  `<think>{reasoning_content}</think>`, where the reasoning of every message up to and including the last
  assistant message without tool calls is dropped (`<think></think>`); tool results
  `## Return of {id}\\n{content}`.

What the templates print for odd input is what we print (a tool call without `id` prints nothing, a
`None` prints `None`, content parts on a tool message print as a Python list), so that a prompt built here
is the prompt a released checkpoint is served with. Ids are rendered as given: renaming them to the
`functions.NAME:IDX` shape the models were trained on is `k2_data.chat.ids.normalize_tool_call_ids`.
What we refuse that the templates would render: a message that is not an object, a role outside
system/user/assistant/tool, a tool call without `function.name` or `function.arguments` (where the
templates raise or print Jinja's undefined).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from k2_data.chat.markers import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    DEFAULT_SYSTEM_PROMPT,
    IM_ASSISTANT,
    IM_END,
    IM_MIDDLE,
    IM_SYSTEM,
    IM_USER,
    MEDIA_CONTENT,
    MEDIA_END,
    MEDIA_PAD,
    MEDIA_START,
    SECTION_BEGIN,
    SECTION_END,
    THINK_BEGIN,
    THINK_END,
    TOOL_DECLARE,
)

TaggedSegment = tuple[str, bool, bool]  # (text, is_marker, trainable)

INSTRUCT_0905 = "kimi-k2-instruct-0905"
THINKING = "kimi-k2-thinking"
RELEASED_TEMPLATES = (INSTRUCT_0905, THINKING)

_ROLES = ("system", "user", "assistant", "tool")


def sort_tools(value: Any) -> Any:
    """Moonshot's recursive key sort of the tools (objects sorted by key at every depth, lists kept)."""
    if isinstance(value, Mapping):
        return {k: sort_tools(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [sort_tools(v) for v in value]
    return value


def _tojson(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _show(value: Any) -> str:
    # what Jinja's `{{ value }}` prints: str() of the value; a missing key is undefined and prints nothing
    return "" if value is _MISSING else str(value)


_MISSING = object()


def _get(obj: Any, key: str) -> Any:
    return obj.get(key, _MISSING) if isinstance(obj, Mapping) else _MISSING


def _parts(content: Any, where: str) -> list[tuple[str, bool]]:
    """A content list as the templates print it: text parts' `text`, image parts as the media markers."""
    if isinstance(content, (str, bytes)) or not isinstance(content, Sequence):
        raise ValueError(
            f"{where}: field 'content' must be a string, null or a list of content parts, "
            f"got {type(content).__name__}"
        )
    out: list[tuple[str, bool]] = []
    for part in content:
        # `'image' in part` is a key test on an object and a substring test on a string, as in Jinja
        if _get(part, "type") == "image" or "image" in part or "image_url" in part:
            out += [(MEDIA_START, True), ("image", False), (MEDIA_CONTENT, True)]
            out += [(MEDIA_PAD, True), (MEDIA_END, True), ("\n", False)]
        else:
            text = _show(_get(part, "text"))
            if text:
                out.append((text, False))
    return out


def _content(msg: Mapping[str, Any], where: str) -> list[tuple[str, bool]]:
    c = msg.get("content")
    if isinstance(c, str):
        return [(c, False)] if c else []
    if c is None:
        return []
    return _parts(c, where)


def _calls(msg: Mapping[str, Any], where: str) -> list[tuple[str, bool]]:
    calls = msg["tool_calls"]
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
        raise ValueError(f"{where}: field 'tool_calls' must be a list")
    out: list[tuple[str, bool]] = [(SECTION_BEGIN, True)]
    for j, call in enumerate(calls):
        cwhere = f"{where}.tool_calls[{j}]"
        fn = _get(call, "function")
        if not isinstance(fn, Mapping) or "arguments" not in fn:
            raise ValueError(f"{cwhere}: field 'function' must be an object with 'name' and 'arguments'")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{cwhere}: field 'function.name' must be a non-empty string")
        args = fn["arguments"]
        call_id = _show(_get(call, "id"))
        out.append((CALL_BEGIN, True))
        if call_id:
            out.append((call_id, False))
        out.append((ARGUMENT_BEGIN, True))
        text = args if isinstance(args, str) else _tojson(args)
        if text:
            out.append((text, False))
        out.append((CALL_END, True))
    out.append((SECTION_END, True))
    return out


def _header(msg: Mapping[str, Any]) -> list[TaggedSegment]:
    role = msg["role"]
    marker = {"user": IM_USER, "assistant": IM_ASSISTANT}.get(role, IM_SYSTEM)
    name = msg.get("name") or role
    return [(marker, True, False), (str(name), False, False), (IM_MIDDLE, True, False)]


def _tagged(segs: list[tuple[str, bool]], trainable: bool) -> list[TaggedSegment]:
    return [(text, is_marker, trainable) for text, is_marker in segs]


def _check(messages: Any, tools: Any) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of message objects, got {type(messages).__name__}")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be an object, got {type(msg).__name__}")
        if msg.get("role") not in _ROLES:
            raise ValueError(
                f"messages[{i}]: field 'role' must be one of {sorted(_ROLES)}, got {msg.get('role')!r}"
            )
    if tools and (isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence)):
        raise ValueError(f"tools must be a list of tool objects, got {type(tools).__name__}")


def _prelude(
    messages: Sequence[Mapping[str, Any]], tools: Any, header: str, system_if_empty: bool
) -> list[TaggedSegment]:
    segs: list[TaggedSegment] = []
    if tools:
        body = header + _tojson(sort_tools(list(tools)))
        segs += [(IM_SYSTEM, True, False), (TOOL_DECLARE, False, False), (IM_MIDDLE, True, False)]
        segs += [(body, False, False), (IM_END, True, False)]
    # 0905 adds it inside its message loop (so not for an empty list), Thinking before the loop
    if (len(messages) == 0 and system_if_empty) or (len(messages) > 0 and messages[0]["role"] != "system"):
        segs += [(IM_SYSTEM, True, False), ("system", False, False), (IM_MIDDLE, True, False)]
        segs += [(DEFAULT_SYSTEM_PROMPT, False, False), (IM_END, True, False)]
    return segs


def instruct_0905_segments(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> list[TaggedSegment]:
    """`kimi-k2-instruct-0905`; assistant bodies and their `<|im_end|>` are marked trainable."""
    _check(messages, tools)
    segs = _prelude(messages, tools, "\n  # Tools\n  ", system_if_empty=False)
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = msg["role"]
        segs += _header(msg)
        body: list[tuple[str, bool]] = []
        if role == "assistant" and msg.get("tool_calls"):
            content = msg.get("content")
            if content:
                body.append((str(content), False))
            body += _calls(msg, where)
        elif role == "tool":
            text = f"## Return of {_show(_get(msg, 'tool_call_id'))}\n    {_show(_get(msg, 'content'))}"
            body.append((text, False))
        else:
            body += _content(msg, where)
        train = role == "assistant"
        segs += _tagged(body, train) + [(IM_END, True, train)]
    if add_generation_prompt:
        segs += [(IM_ASSISTANT, True, False), ("assistant", False, False), (IM_MIDDLE, True, False)]
    return segs


def _last_final_answer(messages: Sequence[Mapping[str, Any]]) -> int:
    for idx in range(len(messages) - 1, -1, -1):
        if messages[idx]["role"] == "assistant" and not messages[idx].get("tool_calls"):
            return idx
    return -1


# the names transformers' apply_chat_template accepts for the reasoning (it copies the first non-null one
# to `reasoning_content`, the field the template reads)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _reasoning(msg: Mapping[str, Any]) -> str:
    for key in REASONING_FIELDS:
        if msg.get(key) is not None:
            return str(msg[key])
    return _show(msg.get("reasoning_content", ""))  # a null reasoning_content prints as `None`, as there


def _thinking_turn(msg: Mapping[str, Any], where: str, keep_reasoning: bool) -> list[tuple[str, bool]]:
    role = msg["role"]
    body: list[tuple[str, bool]] = []
    if role == "assistant":
        reasoning = _reasoning(msg) if keep_reasoning else ""
        body.append((THINK_BEGIN, True))
        if reasoning:
            body.append((reasoning, False))
        body.append((THINK_END, True))
        body += _content(msg, where)
        if msg.get("tool_calls"):
            body += _calls(msg, where)
    elif role == "tool":
        body.append((f"## Return of {_show(_get(msg, 'tool_call_id'))}\n", False))
        body += _content(msg, where)
    else:
        body += _content(msg, where)
    return body


def thinking_segments(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> list[TaggedSegment]:
    """`kimi-k2-thinking`; assistant turns rendered with their reasoning (the suffix) are marked trainable."""
    _check(messages, tools)
    split = _last_final_answer(messages)
    segs = _prelude(messages, tools, "", system_if_empty=True)
    for i, msg in enumerate(messages):
        keep = i > split
        train = keep and msg["role"] == "assistant"
        segs += _header(msg)
        segs += _tagged(_thinking_turn(msg, f"messages[{i}]", keep), train) + [(IM_END, True, train)]
    if add_generation_prompt:
        segs += [(IM_ASSISTANT, True, False), ("assistant", False, False), (IM_MIDDLE, True, False)]
    return segs


def thinking_sft_segments(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[TaggedSegment]:
    """The thinking variant's SFT layout: `render(messages[:-1], add_generation_prompt=True)` + the target.

    The template is not prefix-stable (rendering the whole conversation would drop the final answer's
    reasoning), so the target turn (the last message, an assistant turn) is appended to the generation
    prompt with its reasoning, as the model produces it. Trained: the target and the earlier assistant
    turns that the prompt renders with their reasoning (the tool-call steps since the last final answer),
    each exactly as the model generated it.
    """
    _check(messages, tools)
    if len(messages) == 0 or messages[-1]["role"] != "assistant":
        raise ValueError(
            f"messages: the last message must be an assistant turn (the SFT target) for template {THINKING!r}"
        )
    segs = thinking_segments(messages[:-1], tools, add_generation_prompt=True)
    where = f"messages[{len(messages) - 1}]"
    segs += _tagged(_thinking_turn(messages[-1], where, True), True) + [(IM_END, True, True)]
    return segs

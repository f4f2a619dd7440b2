"""Render OpenAI-style chat messages in the Kimi K2 format, as text or as token ids.

`template="k2"` (the default) is k2's own variant, described here; it is what the shipped presets, SFT
sets and demo models were made with. `"kimi-k2-instruct-0905"` and `"kimi-k2-thinking"` are Moonshot's
released templates byte for byte (`k2_data.chat.released`). k2's variant follows the July 2025
Kimi-K2-Instruct layout:

    [<|im_system|>tool_declare<|im_middle|>{tools JSON}<|im_end|>]        only when tools are given
    [<|im_system|>system<|im_middle|>{default system prompt}<|im_end|>]   when messages[0] is not system
    <|im_{role}|>{name or role}<|im_middle|>{content}<|im_end|>           one per message
    [<|im_assistant|>assistant<|im_middle|>]                              add_generation_prompt

An assistant turn with tool calls carries its content, then one section:
`<|tool_calls_section_begin|>` + per call `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
{arguments}<|tool_call_end|>` + `<|tool_calls_section_end|>`. A tool result is a system-marker turn named
after the function: `<|im_system|>{name}<|im_middle|>## Return of {tool_call_id}\\n{content}<|im_end|>`.

Rendering works on segments `(text, is_marker)` so that `render_ids` can map markers to their special ids and
encode everything else as plain text: a message that contains the string `<|im_end|>` cannot end its turn.
Internally each segment also says whether it is trained on in SFT (`render_ids_with_mask`): the body of an
assistant turn (content and tool-call section) and its closing `<|im_end|>`; everything else, including the
assistant header `<|im_assistant|>assistant<|im_middle|>`, is context. The flag changes only at markers, so no
run of text (one BPE encode) ever straddles trained and untrained tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from k2_data.chat.ids import K2_CALL_ID  # the id shape K2 was trained on
from k2_data.chat.markers import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    DEFAULT_SYSTEM_PROMPT,
    IM_ASSISTANT,
    IM_END,
    IM_MIDDLE,
    IM_SYSTEM,
    OPTIONAL_MARKERS,
    ROLE_MARKERS,
    SECTION_BEGIN,
    SECTION_END,
    TOOL_DECLARE,
)
from k2_data.chat.released import (
    INSTRUCT_0905,
    RELEASED_TEMPLATES,
    THINKING,
    instruct_0905_segments,
    thinking_segments,
    thinking_sft_segments,
)

# k2's own rendering (this module) is the default; the released templates are opt-in by name
K2_TEMPLATE = "k2"
TEMPLATES = (K2_TEMPLATE, *RELEASED_TEMPLATES)

Segment = tuple[str, bool]  # (text, is_marker): a marker is exactly one special token
TaggedSegment = tuple[str, bool, bool]  # (text, is_marker, trainable)


def tools_json(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool_declare payload: the OpenAI `tools` list, keys sorted, compact separators."""
    return json.dumps(list(tools), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of OpenAI content parts (text parts joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        out = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
                continue
            if not isinstance(part, Mapping):
                raise ValueError(
                    f"{where}: field 'content[{j}]' must be an object or a string, got {type(part).__name__}"
                )
            kind = part.get("type", "text")
            if kind != "text":
                raise ValueError(
                    f"{where}: field 'content[{j}].type' is {kind!r}; only 'text' parts can be rendered"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}: field 'content[{j}].text' must be a string")
            out.append(text)
        return "".join(out)
    raise ValueError(
        f"{where}: field 'content' must be a string or a list of content parts, got {type(content).__name__}"
    )


def _arguments_text(arguments: Any, where: str) -> str:
    # a string is what the model produced (or will produce): keep it verbatim; an object is serialised
    # the way the released template's `tojson` does (default separators, key order kept)
    if isinstance(arguments, str):
        return arguments
    if isinstance(arguments, (Mapping, list)):
        return json.dumps(arguments, ensure_ascii=False)
    raise ValueError(f"{where}: field 'function.arguments' must be a JSON string or an object")


def _turn(marker: str, name: str, body: list[Segment], trainable: bool = False) -> list[TaggedSegment]:
    # the header (role marker, name, <|im_middle|>) is never trained; the body and <|im_end|> are when asked
    head = [(marker, True, False), (name, False, False), (IM_MIDDLE, True, False)]
    return head + [(text, is_marker, trainable) for text, is_marker in body] + [(IM_END, True, trainable)]


def check_template(template: str) -> str:
    """`template` if it names a chat template, else ValueError listing the names."""
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {', '.join(TEMPLATES)}; got {template!r}")
    return template


def render_segments(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    template: str = K2_TEMPLATE,
) -> list[Segment]:
    """The rendered conversation as `(text, is_marker)` segments; see the module docstring."""
    tagged = _tagged_segments(messages, tools, add_generation_prompt, template)
    return [(text, is_marker) for text, is_marker, _ in tagged]


def _tagged_segments(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    template: str = K2_TEMPLATE,
) -> list[TaggedSegment]:
    """`render_segments` with a third field per segment: whether SFT trains on it (assistant bodies)."""
    if check_template(template) == INSTRUCT_0905:
        return instruct_0905_segments(messages, tools, add_generation_prompt)
    if template == THINKING:
        return thinking_segments(messages, tools, add_generation_prompt)
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of message objects, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages must not be empty")
    segs: list[TaggedSegment] = []
    if tools:
        if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
            raise ValueError(f"tools must be a list of tool objects, got {type(tools).__name__}")
        for k, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise ValueError(f"tools[{k}] must be an object, got {type(tool).__name__}")
        segs += _turn(IM_SYSTEM, TOOL_DECLARE, [(tools_json(tools), False)])

    call_count = 0  # calls rendered so far: the IDX of ids we have to make up
    id_map: dict[str, str] = {}  # a client's call id -> the K2-shaped id it was rendered as
    name_of: dict[str, str] = {}  # call id (either form) -> function name, for tool-result turns
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ValueError(f"{where} must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLE_MARKERS:
            raise ValueError(f"{where}: field 'role' must be one of {sorted(ROLE_MARKERS)}, got {role!r}")
        if i == 0 and role != "system":
            segs += _turn(IM_SYSTEM, "system", [(DEFAULT_SYSTEM_PROMPT, False)])
        name = msg.get("name")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"{where}: field 'name' must be a non-empty string when given")
        tool_calls = msg.get("tool_calls") if role == "assistant" else None
        if role != "assistant" and msg.get("tool_calls"):
            raise ValueError(
                f"{where}: field 'tool_calls' is only allowed on assistant messages (role is {role!r})"
            )
        content = msg.get("content")
        if content is None and role != "assistant":
            # an assistant turn without content renders empty, as in the released templates (a reply
            # that was only a call cut off by max_tokens comes back that way)
            raise ValueError(f"{where}: field 'content' is missing (only an assistant message may omit it)")
        text = "" if content is None else _content_text(content, where)

        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(
                    f"{where}: a tool message needs field 'tool_call_id' (the id of the call it answers)"
                )
            # the released template names the turn `name or role`; we fall back to the called function's
            # name before 'tool', since OpenAI clients rarely send `name` on tool messages
            turn_name = name or name_of.get(call_id, "tool")
            body = f"## Return of {id_map.get(call_id, call_id)}\n{text}"
            segs += _turn(IM_SYSTEM, turn_name, [(body, False)])
            continue

        body_segs: list[Segment] = [(text, False)] if text else []
        if tool_calls:
            if isinstance(tool_calls, (str, bytes, Mapping)) or not isinstance(tool_calls, Sequence):
                raise ValueError(f"{where}: field 'tool_calls' must be a list")
            body_segs.append((SECTION_BEGIN, True))
            for j, call in enumerate(tool_calls):
                cwhere = f"{where}.tool_calls[{j}]"
                if not isinstance(call, Mapping):
                    raise ValueError(f"{cwhere} must be an object")
                if call.get("type", "function") != "function":
                    raise ValueError(f"{cwhere}: field 'type' must be 'function', got {call.get('type')!r}")
                fn = call.get("function")
                if not isinstance(fn, Mapping):
                    raise ValueError(
                        f"{cwhere}: field 'function' must be an object with 'name' and 'arguments'"
                    )
                fname = fn.get("name")
                if not isinstance(fname, str) or not fname:
                    raise ValueError(f"{cwhere}: field 'function.name' must be a non-empty string")
                if "arguments" not in fn:
                    raise ValueError(f"{cwhere}: field 'function.arguments' is missing")
                args = _arguments_text(fn["arguments"], cwhere)
                orig = call.get("id")
                m = K2_CALL_ID.fullmatch(orig) if isinstance(orig, str) else None
                if m is not None and m.group("name") == fname:
                    call_id = orig
                else:
                    call_id = f"functions.{fname}:{call_count}"
                    if isinstance(orig, str) and orig:
                        id_map[orig] = call_id
                        name_of[orig] = fname
                name_of[call_id] = fname
                call_count += 1
                body_segs += [
                    (CALL_BEGIN, True),
                    (call_id, False),
                    (ARGUMENT_BEGIN, True),
                    (args, False),
                    (CALL_END, True),
                ]
            body_segs.append((SECTION_END, True))
        segs += _turn(ROLE_MARKERS[role], name or role, body_segs, trainable=role == "assistant")

    if add_generation_prompt:
        segs += [(IM_ASSISTANT, True, False), ("assistant", False, False), (IM_MIDDLE, True, False)]
    return segs


def render(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    template: str = K2_TEMPLATE,
) -> str:
    """The conversation as one string in the Kimi K2 format. Raises ValueError naming the bad field.

    `template`: "k2" (this module's rendering, the default), "kimi-k2-instruct-0905" or "kimi-k2-thinking"
    (Moonshot's released templates, byte for byte; see `k2_data.chat.released`).
    """
    return "".join(text for text, _ in render_segments(messages, tools, add_generation_prompt, template))


def segments_to_ids(tokenizer: Any, segments: Sequence[Segment]) -> list[int]:
    """Markers become their special ids; runs of plain text are encoded as text (never as specials)."""
    return _tagged_to_ids(tokenizer, [(text, is_marker, False) for text, is_marker in segments])[0]


def _tagged_to_ids(tokenizer: Any, segments: Sequence[TaggedSegment]) -> tuple[list[int], list[int]]:
    """(ids, mask): markers as special ids, text runs encoded as text, each token with its segment's flag."""
    ids: list[int] = []
    mask: list[int] = []
    run: list[str] = []
    run_flag = 0

    def flush() -> None:
        if run:
            piece = tokenizer.encode("".join(run), allow_special=False)
            ids.extend(piece)
            mask.extend([run_flag] * len(piece))
            run.clear()

    for text, is_marker, trainable in segments:
        if is_marker and text in OPTIONAL_MARKERS and not _knows(tokenizer, text):
            is_marker = False  # a marker this vocabulary does not reserve is spelled out as text
        if is_marker:
            flush()
            ids.append(tokenizer.token_to_id(text))
            mask.append(int(trainable))
        elif text:
            # adjacent text pieces are one run, as in the rendered string; a run is encoded as a whole, so
            # it must not mix trained and untrained text (the flag only changes at markers)
            if run and int(trainable) != run_flag:
                raise AssertionError(f"a text run spans a trainable/untrainable boundary at {text[:40]!r}")
            run_flag = int(trainable)
            run.append(text)
    flush()
    return ids, mask


def _knows(tokenizer: Any, marker: str) -> bool:
    try:
        tokenizer.token_to_id(marker)
    except KeyError:
        return False
    return True


def render_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    template: str = K2_TEMPLATE,
) -> list[int]:
    """Token ids of `render(...)`: markers as special ids, everything else encoded as plain text.

    `tokenizer` is a `k2_data.Tokenizer` (or anything with `encode(text, allow_special=...)` and
    `token_to_id(name)`). Equals `tokenizer.encode(render(...), allow_special=True)` unless some content
    holds a marker string, which here stays text.
    """
    return segments_to_ids(tokenizer, render_segments(messages, tools, add_generation_prompt, template))


def render_ids_with_mask(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    template: str = K2_TEMPLATE,
) -> tuple[list[int], list[int]]:
    """`render_ids(tokenizer, messages, tools)` plus a per-token SFT loss mask (0/1, same length).

    1 for every assistant turn's body (content and tool-call section, markers included) and that turn's
    closing `<|im_end|>`; 0 for the tool_declare and system turns, user turns, tool results and the
    assistant header `<|im_assistant|>assistant<|im_middle|>`.

    For "kimi-k2-thinking" the ids are `render(messages[:-1], add_generation_prompt=True)` + the last
    message (an assistant turn, its reasoning included), since that template drops past reasoning;
    see `k2_data.chat.released.thinking_sft_segments` for what is trained.
    """
    if check_template(template) == THINKING:
        return _tagged_to_ids(tokenizer, thinking_sft_segments(messages, tools))
    return _tagged_to_ids(tokenizer, _tagged_segments(messages, tools, template=template))


encode_chat = render_ids
render_chat = render  # the name `k2_data` exports (plain `render` is too generic there)

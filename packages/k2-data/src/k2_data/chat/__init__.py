"""The Kimi K2 chat format: render conversations (text or token ids) and parse tool calls (whole or streamed).

    from k2_data.chat import render, render_ids, parse_tool_calls, ToolCallStreamParser

- `render(messages, tools=None, add_generation_prompt=False, template="k2") -> str`; `template` is "k2" (k2's
  own rendering), "kimi-k2-instruct-0905" or "kimi-k2-thinking" (Moonshot's released files, byte for byte)
- `normalize_tool_call_ids(messages)`: ids renamed to the `functions.NAME:IDX` shape K2 was trained on
- `render_ids(tokenizer, messages, ...) -> list[int]` (alias `encode_chat`)
- `render_ids_with_mask(tokenizer, messages, tools=None) -> (ids, loss_mask)`: SFT ids, 1 on assistant bodies
- `validate_conversation(messages, tools=None)`: ValueError naming the field when it cannot be trained on
- `parse_tool_calls(text, tools=None, strict=False) -> (content, tool_calls)`; malformed calls are dropped
  with a warning (strict: malformed sections stay content)
- `ToolCallStreamParser(tools=None, strict=False).feed(delta) / .finish()`: OpenAI deltas as text arrives
- `k2_data.chat.reasoning.split_reasoning(text)`: a thinking reply's `<think>...</think>` and the rest
"""

from k2_data.chat.ids import normalize_tool_call_ids
from k2_data.chat.markers import DEFAULT_SYSTEM_PROMPT, GENERATION_PROMPT
from k2_data.chat.parse import parse_tool_calls
from k2_data.chat.released import RELEASED_TEMPLATES, sort_tools
from k2_data.chat.render import (
    K2_TEMPLATE,
    TEMPLATES,
    encode_chat,
    render,
    render_chat,
    render_ids,
    render_ids_with_mask,
    render_segments,
    segments_to_ids,
    tools_json,
)
from k2_data.chat.stream import StreamEnd, ToolCallStreamParser, accumulate_deltas
from k2_data.chat.validate import validate_conversation

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "K2_TEMPLATE",
    "RELEASED_TEMPLATES",
    "TEMPLATES",
    "GENERATION_PROMPT",
    "StreamEnd",
    "ToolCallStreamParser",
    "accumulate_deltas",
    "encode_chat",
    "normalize_tool_call_ids",
    "parse_tool_calls",
    "render",
    "render_chat",
    "render_ids",
    "render_ids_with_mask",
    "render_segments",
    "segments_to_ids",
    "sort_tools",
    "tools_json",
    "validate_conversation",
]

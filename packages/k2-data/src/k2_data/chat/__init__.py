"""The Kimi K2 chat format: render conversations (text or token ids) and parse tool calls (whole or streamed).

    from k2_data.chat import render, render_ids, parse_tool_calls, ToolCallStreamParser

- `render(messages, tools=None, add_generation_prompt=False) -> str`
- `render_ids(tokenizer, messages, ...) -> list[int]` (alias `encode_chat`)
- `parse_tool_calls(text) -> (content, tool_calls)`; malformed sections stay content, with a warning
- `ToolCallStreamParser().feed(delta) / .finish()`: OpenAI chat-completion deltas as text arrives
"""

from k2_data.chat.markers import DEFAULT_SYSTEM_PROMPT, GENERATION_PROMPT
from k2_data.chat.parse import parse_tool_calls
from k2_data.chat.render import encode_chat, render, render_chat, render_ids, render_segments, tools_json
from k2_data.chat.stream import StreamEnd, ToolCallStreamParser, accumulate_deltas

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "GENERATION_PROMPT",
    "StreamEnd",
    "ToolCallStreamParser",
    "accumulate_deltas",
    "encode_chat",
    "parse_tool_calls",
    "render",
    "render_chat",
    "render_ids",
    "render_segments",
    "tools_json",
]

"""The Kimi K2 chat format as a Jinja `chat_template`, for `transformers` (and servers built on it).

    from k2_data.chat.template import CHAT_TEMPLATE, write_chat_template
    write_chat_template(hf_dir)   # adds it to hf_dir/tokenizer_config.json and writes hf_dir/chat_template.jinja

`AutoTokenizer.from_pretrained(hf_dir).apply_chat_template(messages, tools=..., add_generation_prompt=...,
tokenize=False)` then equals `k2_data.chat.render(messages, tools, add_generation_prompt)` character for
character (tests/test_chat_template.py), so `transformers serve` prompts a k2 export exactly as `k2 serve` does.
What the template reproduces of `render.py`:

- tools: one `tool_declare` system turn, the list serialised with sorted keys and compact separators
  (`tojson(separators=(',', ':'), sort_keys=True)`; transformers' `tojson` keeps non-ASCII, like
  `ensure_ascii=False`);
- the default system prompt when the first message is not a system message;
- content as a string or a list of text parts (joined with nothing); `name or role` as the turn name;
- assistant tool calls: arguments kept verbatim when a string, `tojson` (default separators, key order kept)
  when an object; a call id of K2's shape `functions.NAME:IDX` naming the called function is kept, any other
  id is rendered as `functions.NAME:IDX` with IDX counting calls across the conversation, and tool results
  refer to it by the rendered id;
- tool results as `<|im_system|>{name}<|im_middle|>## Return of {id}\\n{content}<|im_end|>`, named after
  the message's `name`, else the called function's name, else `tool`.

Validation is lighter than `render`'s (which raises ValueError naming the field): the template raises only
for an unknown role, a non-text content part, and `tool_calls` on a non-assistant message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from k2_data.chat.markers import DEFAULT_SYSTEM_PROMPT, TOOL_DECLARE

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"

# Every tag strips the template's own whitespace (`{%- -%}`), so only the literal markers and the values
# are output; the result does not depend on trim_blocks / lstrip_blocks.
_TEMPLATE = r"""
{%- set default_system = @DEFAULT_SYSTEM@ -%}
{%- set markers = {'system': '<|im_system|>', 'user': '<|im_user|>', 'assistant': '<|im_assistant|>', 'tool': '<|im_system|>'} -%}
{%- macro content_text(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}{{ content }}
    {%- else -%}
        {%- for part in content -%}
            {%- if part is string -%}{{ part }}
            {%- elif part.get('type', 'text') != 'text' -%}
                {{- raise_exception("only 'text' content parts can be rendered, got " ~ part.get('type')) -}}
            {%- else -%}{{ part['text'] }}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
    <|im_system|>@TOOL_DECLARE@<|im_middle|>{{ tools | tojson(separators=(',', ':'), sort_keys=True) }}<|im_end|>
{%- endif -%}
{%- set ns = namespace(count=0, ids=[], names=[], value='') -%}
{%- for message in messages -%}
    {%- set role = message['role'] -%}
    {%- if role not in markers -%}
        {{- raise_exception("role must be one of assistant, system, tool, user, got " ~ role) -}}
    {%- endif -%}
    {%- if loop.first and role != 'system' -%}
        <|im_system|>system<|im_middle|>{{ default_system }}<|im_end|>
    {%- endif -%}
    {%- if role != 'assistant' and message.get('tool_calls') -%}
        {{- raise_exception("tool_calls are only allowed on assistant messages") -}}
    {%- endif -%}
    {%- if role == 'tool' -%}
        {%- set call_id = message.get('tool_call_id') -%}
        {%- set ns.value = 'tool' -%}
        {%- for pair in ns.names -%}{%- if pair[0] == call_id -%}{%- set ns.value = pair[1] -%}{%- endif -%}{%- endfor -%}
        <|im_system|>{{ message.get('name') or ns.value }}<|im_middle|>
        {%- set ns.value = call_id -%}
        {%- for pair in ns.ids -%}{%- if pair[0] == call_id -%}{%- set ns.value = pair[1] -%}{%- endif -%}{%- endfor -%}
        {{- '## Return of ' ~ ns.value ~ '\n' -}}{{ content_text(message.get('content')) }}<|im_end|>
    {%- else -%}
        {{- markers[role] ~ (message.get('name') or role) ~ '<|im_middle|>' -}}{{ content_text(message.get('content')) }}
        {%- set tool_calls = message.get('tool_calls') if role == 'assistant' else none -%}
        {%- if tool_calls -%}
            <|tool_calls_section_begin|>
            {%- for call in tool_calls -%}
                {%- set fn = call['function'] -%}
                {%- set fname = fn['name'] -%}
                {%- set orig = call.get('id') -%}
                {%- set prefix = 'functions.' ~ fname ~ ':' -%}
                {%- if orig is string and orig.startswith(prefix) and orig[prefix | length:] | length > 0 and orig[prefix | length:].isdecimal() -%}
                    {%- set call_id = orig -%}
                {%- else -%}
                    {%- set call_id = prefix ~ ns.count -%}
                    {%- if orig is string and orig -%}
                        {%- set ns.ids = ns.ids + [[orig, call_id]] -%}
                        {%- set ns.names = ns.names + [[orig, fname]] -%}
                    {%- endif -%}
                {%- endif -%}
                {%- set ns.names = ns.names + [[call_id, fname]] -%}
                {%- set ns.count = ns.count + 1 -%}
                <|tool_call_begin|>{{ call_id }}<|tool_call_argument_begin|>
                {%- if fn['arguments'] is string -%}{{ fn['arguments'] }}{%- else -%}{{ fn['arguments'] | tojson }}{%- endif -%}
                <|tool_call_end|>
            {%- endfor -%}
            <|tool_calls_section_end|>
        {%- endif -%}
        <|im_end|>
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""

CHAT_TEMPLATE = (
    _TEMPLATE.strip()
    .replace("@DEFAULT_SYSTEM@", json.dumps(DEFAULT_SYSTEM_PROMPT))
    .replace("@TOOL_DECLARE@", TOOL_DECLARE)
)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def template_source(name: str = "k2") -> str:
    """The Jinja source of a chat template by name: k2's own variant (`CHAT_TEMPLATE`) or one of
    Moonshot's released templates, stored verbatim (`k2_data.chat.templates`)."""
    if name == "k2":
        return CHAT_TEMPLATE
    from k2_data.chat.templates import released_template_text

    return released_template_text(name)


def write_chat_template(directory: str | Path, name: str = "k2") -> Path:
    """Put a Kimi chat template (`name`: "k2", "kimi-k2-instruct-0905", "kimi-k2-thinking") into an
    HF tokenizer directory: `chat_template.jinja` (what transformers 5 reads first) and the
    `chat_template` key of `tokenizer_config.json` (what older readers, vLLM among them, look at;
    created when missing). Returns the directory."""
    d = Path(directory)
    source = template_source(name)
    _atomic_write(d / CHAT_TEMPLATE_FILE, source)
    config_path = d / TOKENIZER_CONFIG
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    config["chat_template"] = source
    _atomic_write(config_path, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return d

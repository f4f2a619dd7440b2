"""The special-token strings of the Kimi K2 chat and tool-call format (names from `special_tokens`)."""

from __future__ import annotations

IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

# markers of the released templates that k2's own tokenizers do not reserve: a tokenizer that declares them
# (the released Kimi tokenizers: ids 163602-163607) encodes each as one id, any other as plain text
MEDIA_START = "<|media_start|>"
MEDIA_CONTENT = "<|media_content|>"
MEDIA_END = "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"
THINK_BEGIN = "<think>"
THINK_END = "</think>"
OPTIONAL_MARKERS = frozenset({MEDIA_START, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, THINK_BEGIN, THINK_END})

ROLE_MARKERS = {"system": IM_SYSTEM, "user": IM_USER, "assistant": IM_ASSISTANT, "tool": IM_SYSTEM}

# what the released template inserts when the conversation does not start with a system turn
DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
TOOL_DECLARE = "tool_declare"
GENERATION_PROMPT = IM_ASSISTANT + "assistant" + IM_MIDDLE

ALL_MARKERS = (
    IM_SYSTEM,
    IM_USER,
    IM_ASSISTANT,
    IM_MIDDLE,
    IM_END,
    SECTION_BEGIN,
    SECTION_END,
    CALL_BEGIN,
    ARGUMENT_BEGIN,
    CALL_END,
)

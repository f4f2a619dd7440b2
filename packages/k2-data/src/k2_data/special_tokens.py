"""Kimi K2's 256 reserved special tokens, laid out after the BPE ids.

K2's tokenizer has 163584 BPE ranks followed by 256 reserved special ids (163584 + i). The small
BPE that k2-data ships uses the same offsets after its own 7936 BPE ids, so chat rendering and the
model code can refer to `[EOS]` or `<|im_end|>` the same way for both tokenizers.
"""

from __future__ import annotations

NUM_RESERVED_SPECIAL_TOKENS = 256

# offset from the first reserved id -> name, as in the released tokenizer_config.json
NAMED_SPECIAL_OFFSETS: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}

BOS, EOS, PAD, UNK = "[BOS]", "[EOS]", "[PAD]", "[UNK]"


def reserved_token_name(token_id: int) -> str:
    """Name of an unnamed reserved slot; like `tokenization_kimi.py`, it uses the absolute id."""
    return f"<|reserved_token_{token_id}|>"


def special_token_table(num_base_tokens: int, overrides: dict[int, str] | None = None) -> dict[str, int]:
    """All 256 reserved specials `{name: id}` for a vocabulary of `num_base_tokens` BPE ids.

    `overrides` maps absolute ids to names (a tokenizer_config.json's `added_tokens_decoder`); where
    it is absent, the K2 names above apply, and every other slot is `<|reserved_token_{id}|>`.
    """
    table: dict[str, int] = {}
    for offset in range(NUM_RESERVED_SPECIAL_TOKENS):
        token_id = num_base_tokens + offset
        if overrides is not None and token_id in overrides:
            name = overrides[token_id]
        else:
            name = NAMED_SPECIAL_OFFSETS.get(offset, reserved_token_name(token_id))
        if name in table:
            raise ValueError(f"special token {name!r} appears twice (ids {table[name]} and {token_id})")
        table[name] = token_id
    return table

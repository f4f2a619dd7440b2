"""Structured decoding as logits processors applied inside the engine's batched step (llguidance masks).

* `json_processor(schema)`: `response_format` `json_object` / `json_schema` — the reply is constrained
  to the schema; when the JSON is complete only EOS is allowed, so the request stops there.
* `tool_call_processor(tools, name, index)`: tool_choice "required" or a named function. The call
  section's markers and header are forced (`<|tool_calls_section_begin|><|tool_call_begin|>functions.`),
  the function name is constrained to the declared names (a regex) or forced (a named function), the
  arguments are constrained to the tool's JSON schema, then `<|tool_call_end|><|tool_calls_section_end|>`
  and EOS are forced. So even a randomly initialised model produces a call `parse_tool_calls` accepts.

A processor is one request's state (an llguidance matcher plus forced tokens): each call consumes the
tokens sampled since the last call, then returns the logits with disallowed tokens at -inf. A
grammar's EOS permission is mapped to the token that ends its phase (`<|tool_calls_argument_begin|>`
after a name, `<|tool_call_end|>` after the arguments). `fork()` copies the state for another sample.

Shape legend: N vocabulary, W bitmask words (ceil(N / 32)).
"""

from __future__ import annotations

import copy
import re
from collections import deque
from collections.abc import Sequence
from typing import Any

import llguidance
import torch
from k2_data.chat.markers import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END


def llg_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """llguidance's view of a k2-data tokenizer (the HF `tokenizers` JSON of the byte-level BPE)."""
    inner = getattr(tokenizer, "_tok", None)
    if inner is None or not hasattr(inner, "to_str"):
        raise TypeError(
            f"structured decoding needs a k2-data BPETokenizer (tokenizer.json), got {type(tokenizer).__name__}"
        )
    return llguidance.LLTokenizer(inner.to_str(), n_vocab=tokenizer.vocab_size, eos_token=tokenizer.eos_id)


def strict_schema(schema: Any) -> Any:
    """A copy where every object schema without `additionalProperties` gets `false` (OpenAI's strict mode):
    llguidance, like JSON Schema, otherwise allows extra keys, and a random model wanders into them."""
    if isinstance(schema, dict):
        out = {k: strict_schema(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict_schema(v) for v in schema]
    return schema


def json_grammar(schema: Any, strict: bool = True) -> str:
    """A compiled-and-checked llguidance grammar for a JSON schema; ValueError when it is invalid."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            strict_schema(schema) if strict else schema, defaults={"whitespace_flexible": False}
        )
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(str(e)) from None
    msg = llguidance.LLMatcher.validate_grammar(grammar)
    if msg and not msg.startswith("WARNING"):
        raise ValueError(msg)
    return grammar


def _matcher(lltok: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(lltok, grammar)
    if m.is_error():
        raise ValueError(f"structured decoding: invalid grammar: {m.get_error()}")
    return m


def _allowed_N(m: llguidance.LLMatcher, vocab: int) -> torch.Tensor:
    """The matcher's token mask as a bool [N] tensor (llguidance: little-endian bits in int32 words)."""
    words_W = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)
    bits_N = ((words_W.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()
    if bits_N.numel() < vocab:  # the model's vocabulary may be padded beyond the tokenizer's
        bits_N = torch.cat((bits_N, torch.zeros(vocab - bits_N.numel(), dtype=torch.bool)))
    return bits_N[:vocab]


class GuidedProcessor:
    """Forced tokens, then a grammar phase whose end maps to `end_token`, then `on_end` (see the module doc)."""

    def __init__(self, lltok: llguidance.LLTokenizer, vocab: int, eos_id: int) -> None:
        self.lltok, self.vocab, self.eos_id = lltok, vocab, eos_id
        self.forced: deque[int] = deque()
        self.matcher: llguidance.LLMatcher | None = None
        self.end_token = eos_id
        self.seen = 0  # generated tokens consumed so far

    def fork(self) -> GuidedProcessor:
        other = copy.copy(self)
        other.forced = deque(self.forced)
        other.matcher = self.matcher.deep_copy() if self.matcher is not None else None
        return other

    def _start(self, grammar: str, end_token: int) -> None:
        self.matcher, self.end_token = _matcher(self.lltok, grammar), end_token

    def _on_end(self) -> None:
        """The grammar phase ended (its end token was sampled); subclasses start the next one."""
        self.matcher = None

    def _consume(self, tok: int) -> None:
        if self.forced:
            want = self.forced.popleft()
            if tok != want:
                raise RuntimeError(f"structured decoding: forced token {want}, got {tok}")
        elif self.matcher is not None and tok == self.end_token and self.matcher.is_accepting():
            self._on_end()
        elif self.matcher is not None:
            if not self.matcher.consume_token(tok):
                raise RuntimeError(
                    f"llguidance rejected token {tok} it had allowed: {self.matcher.get_error()}"
                )
            self._on_token(tok)

    def _on_token(self, tok: int) -> None:
        pass

    def _allowed(self) -> torch.Tensor:
        allowed_N = torch.zeros(self.vocab, dtype=torch.bool)
        if self.forced:
            allowed_N[self.forced[0]] = True
        elif self.matcher is None:
            allowed_N[self.eos_id] = True
        elif self.matcher.is_stopped():
            allowed_N[self.end_token] = True
        else:
            allowed_N = _allowed_N(self.matcher, self.vocab)
            can_end = bool(allowed_N[self.eos_id])
            allowed_N[self.eos_id] = False
            allowed_N[self.end_token] |= can_end
        return allowed_N

    def __call__(self, token_ids: list[int], logits_N: torch.Tensor) -> torch.Tensor:
        for tok in token_ids[self.seen :]:
            self._consume(tok)
        self.seen = len(token_ids)
        return logits_N.masked_fill(~self._allowed().to(logits_N.device), float("-inf"))


class JsonProcessor(GuidedProcessor):
    """The whole reply is one JSON value of the grammar's schema, then EOS."""

    def __init__(self, lltok: llguidance.LLTokenizer, vocab: int, eos_id: int, grammar: str) -> None:
        super().__init__(lltok, vocab, eos_id)
        self._start(grammar, eos_id)


class ToolCallProcessor(GuidedProcessor):
    """One forced tool call (see the module doc); `call_index` numbers it in the conversation."""

    def __init__(
        self,
        lltok: llguidance.LLTokenizer,
        tokenizer: Any,
        vocab: int,
        grammars: dict[str, str],
        name: str | None,
        call_index: int,
    ) -> None:
        super().__init__(lltok, vocab, tokenizer.eos_id)
        self.tok, self.grammars, self.call_index = tokenizer, grammars, call_index
        sp = tokenizer.token_to_id
        self.special = {m: sp(m) for m in (SECTION_BEGIN, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END, SECTION_END)}
        self.forced += [
            self.special[SECTION_BEGIN],
            self.special[CALL_BEGIN],
            *tokenizer.encode("functions."),
        ]
        self.name_tokens: list[int] = []
        if name is None:  # choose among the declared names, then the forced index
            names = "|".join(re.escape(n) for n in sorted(grammars))
            self.phase = "name"
            self._start(
                llguidance.LLMatcher.grammar_from_regex(f"({names}):{call_index}"),
                self.special[ARGUMENT_BEGIN],
            )
        else:
            self.forced += [*tokenizer.encode(f"{name}:{call_index}"), self.special[ARGUMENT_BEGIN]]
            self.phase = "arguments"
            self._start(grammars[name], self.special[CALL_END])

    def fork(self) -> ToolCallProcessor:
        other = super().fork()
        other.name_tokens = list(self.name_tokens)
        return other

    def _on_token(self, tok: int) -> None:
        if self.phase == "name":
            self.name_tokens.append(tok)

    def _on_end(self) -> None:
        if self.phase == "name":
            name = self.tok.decode(self.name_tokens).rsplit(":", 1)[0]
            self.phase = "arguments"
            self._start(self.grammars[name], self.special[CALL_END])
        else:
            self.phase, self.matcher = "done", None
            self.forced += [self.special[SECTION_END], self.eos_id]


def tool_grammars(tools: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Every tool's argument grammar, compiled up front: a bad schema is the request's 400 (ValueError
    starting "tools:"), not the engine thread's error."""
    out = {}
    for t in tools:
        fn = t["function"]["name"]
        try:
            # OpenAI's rule: strict mode (no extra properties) only for a tool that asks for it
            strict = bool(t["function"].get("strict"))
            out[fn] = json_grammar(t["function"].get("parameters") or {"type": "object"}, strict)
        except ValueError as e:
            raise ValueError(f"tools: function {fn!r} parameters: {e}") from None
    return out

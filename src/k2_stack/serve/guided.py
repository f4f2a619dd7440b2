"""Structured decoding of a forced tool call (tool_choice "required" or a named function).

The call section's markers and header are forced (`<|tool_calls_section_begin|><|tool_call_begin|>
functions.`), the function name is constrained to the declared names (a regex, when the choice is
"required") or forced (a named function), and the arguments are constrained to the tool's JSON
schema by llguidance's token masks; then `<|tool_call_end|><|tool_calls_section_end|>` is appended.
So even a randomly initialised model produces a call that `parse_tool_calls` accepts.

A `GuidedCall` keeps its own one-slot MLA cache and advances one token per `step()`; the server
runs each step on the engine thread between two batched steps (`EngineThread.call_between_steps`),
so forced calls interleave with the batch and see weight updates at the same boundaries.

Shape legend: N vocabulary, W bitmask words (ceil(N / 32)).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import llguidance
import torch
from k2_data.chat.markers import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END
from k2_model import K2ForCausalLM
from k2_model.engine.cache import MLACache
from k2_model.engine.forward import decode, prefill


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


def _matcher(lltok: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(lltok, grammar)
    if m.is_error():
        raise ValueError(f"structured decoding: invalid grammar: {m.get_error()}")
    return m


def _allowed_N(m: llguidance.LLMatcher, vocab: int) -> torch.Tensor:
    """The matcher's token mask as a bool [N] tensor (llguidance: little-endian bits in int32 words)."""
    words_W = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)
    bits_N = ((words_W.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    return bits_N[:vocab].bool()


class GuidedCall:
    """One forced tool call, generated token by token under llguidance masks."""

    def __init__(
        self,
        model: K2ForCausalLM,
        tokenizer: Any,
        lltok: llguidance.LLTokenizer,
        prompt_ids: Sequence[int],
        tools: Sequence[dict[str, Any]],
        name: str | None,
        call_index: int,
        max_tokens: int,
        max_model_len: int,
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> None:
        schemas = {
            t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools
        }
        if name is not None and name not in schemas:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools {sorted(schemas)}")
        self.model, self.tok, self.lltok = model, tokenizer, lltok
        # every schema compiled up front: a bad one is the request's error (400), not the engine thread's
        self.grammars: dict[str, str] = {}
        for fn, schema in schemas.items():
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    strict_schema(schema), defaults={"whitespace_flexible": False}
                )
                _matcher(lltok, grammar)
            except (ValueError, TypeError, RuntimeError) as e:
                raise ValueError(f"tools: function {fn!r} parameters: {e}") from None
            self.grammars[fn] = grammar
        self.schemas, self.call_index = schemas, call_index
        self.vocab = model.config.vocab_size
        self.max_tokens, self.max_model_len = max_tokens, max_model_len
        self.temperature = temperature
        self.gen = torch.Generator().manual_seed(
            seed if seed is not None else int(torch.randint(2**62, (1,)))
        )
        self.prompt_ids = list(prompt_ids)
        sp = tokenizer.token_to_id
        self._special = {m: sp(m) for m in (SECTION_BEGIN, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END, SECTION_END)}
        # the call's tokens so far, forced and sampled; `_fed` counts how many of prompt + these are cached
        self.generated: list[int] = [self._special[SECTION_BEGIN], self._special[CALL_BEGIN]]
        self.generated += tokenizer.encode("functions.")
        if name is None:  # choose among the declared names, then the forced index
            names = "|".join(re.escape(n) for n in sorted(schemas))
            self.phase, self.name = "name", None
            self.matcher = _matcher(lltok, llguidance.LLMatcher.grammar_from_regex(f"({names}):{call_index}"))
        else:
            self.generated += tokenizer.encode(f"{name}:{call_index}") + [self._special[ARGUMENT_BEGIN]]
            self._start_arguments(name)
        self._fed = 0  # tokens of prompt + generated already in the cache
        self.cache = MLACache(
            model.config.num_hidden_layers, model.config.kv_lora_rank, model.config.qk_rope_head_dim,
            dtype=model.lm_head.weight.dtype, device=model.lm_head.weight.device, max_slots=1,
            max_len=max_model_len, initial_slots=1,
        )  # fmt: skip
        self.finish_reason: str | None = None

    def _start_arguments(self, name: str) -> None:
        self.phase, self.name = "arguments", name
        self.matcher = _matcher(self.lltok, self.grammars[name])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _logits_N(self) -> torch.Tensor:
        """Feed the tokens not yet cached; logits after the last one."""
        seq = self.prompt_ids + self.generated
        if self._fed == 0:
            self.cache.ensure(1, len(seq))
            logits = prefill(self.model, self.cache, [seq], [0])
        else:
            for pos in range(self._fed, len(seq)):  # forced runs are a few tokens
                self.cache.ensure(1, pos + 1)
                dev = self.cache.device
                logits = decode(
                    self.model,
                    self.cache,
                    torch.tensor([seq[pos]], device=dev),
                    torch.tensor([pos], device=dev),
                )
        self._fed = len(seq)
        return logits[0]

    def _close(self, reason: str) -> None:
        if reason == "stop":
            self.generated += [self._special[CALL_END], self._special[SECTION_END]]
        self.finish_reason = reason

    @torch.no_grad()
    def step(self) -> list[int]:
        """Sample one constrained token (plus any forced ones after it); the new token ids."""
        if self.finished:
            return []
        before = len(self.generated)
        if (
            len(self.generated) >= self.max_tokens
            or len(self.prompt_ids) + len(self.generated) >= self.max_model_len
        ):
            self._close("length")
            return self.generated[before:]
        logits_N = self._logits_N().cpu()  # masks and the per-request generator live on the host
        allowed_N = _allowed_N(self.matcher, self.vocab)
        logits_N = logits_N.masked_fill(~allowed_N, float("-inf"))
        if self.temperature == 0.0:
            token = int(logits_N.argmax())
        else:  # Gumbel-max on the masked, temperature-scaled logits
            u = torch.rand(logits_N.shape, generator=self.gen).clamp_(min=1e-20)
            token = int((logits_N / self.temperature - torch.log(-torch.log(u))).argmax())
        if token == self.tok.eos_id:  # the grammar is complete (llguidance allows EOS only then)
            self.matcher.consume_token(token)
        else:
            if not self.matcher.consume_token(token):
                raise RuntimeError(
                    f"llguidance rejected token {token} it had allowed: {self.matcher.get_error()}"
                )
            self.generated.append(token)
        if self.matcher.is_stopped() or token == self.tok.eos_id:
            if self.phase == "name":
                text = self.tok.decode(self._name_tokens())
                self.generated.append(self._special[ARGUMENT_BEGIN])
                self._start_arguments(text.rsplit(":", 1)[0])
            else:
                self._close("stop")
        return self.generated[before:]

    def _name_tokens(self) -> list[int]:
        """The tokens sampled in the name phase: everything after `functions.`."""
        head = 2 + len(self.tok.encode("functions."))
        return self.generated[head:]

    def arguments_text(self) -> str:
        """The JSON arguments generated so far (for tests and logs)."""
        text = self.tok.decode(self.generated)
        start = text.find(ARGUMENT_BEGIN)
        end = text.find(CALL_END)
        return text[start + len(ARGUMENT_BEGIN) : end if end >= 0 else None] if start >= 0 else ""

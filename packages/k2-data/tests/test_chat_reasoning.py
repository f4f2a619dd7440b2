"""split_reasoning / ReasoningSplitter: a thinking reply's <think>...</think>, whole and streamed."""

from __future__ import annotations

import random

import pytest
from k2_data.chat.reasoning import ReasoningSplitter, split_reasoning

CASES = {
    "reasoning then answer": ("<think>a < b, so</think>b wins", ("a < b, so", "b wins")),
    "empty reasoning": ("<think></think>direct", ("", "direct")),
    "no reasoning block": ("plain <think>not a block</think>", ("", "plain <think>not a block</think>")),
    "cut inside reasoning": ("<think>still thin", ("still thin", "")),
    "partial open marker only": ("<thi", ("", "<thi")),
    "partial close marker at the end": ("<think>x</thi", ("x</thi", "")),
    "tool call after reasoning": (
        "<think>r</think><|tool_calls_section_begin|>",
        ("r", "<|tool_calls_section_begin|>"),
    ),
    "empty": ("", ("", "")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_stream_equals_whole_split(name):
    text, expected = CASES[name]
    assert split_reasoning(text) == expected
    rng = random.Random(name)
    for _ in range(100):
        cuts = (
            sorted(rng.sample(range(1, len(text)), rng.randint(0, max(0, min(6, len(text) - 1)))))
            if len(text) > 1
            else []
        )
        s = ReasoningSplitter()
        bounds = [0, *cuts, len(text)]
        parts = [p for a, b in zip(bounds, bounds[1:]) for p in s.feed(text[a:b])] + s.finish()
        got = (
            "".join(t for k, t in parts if k == "reasoning_content"),
            "".join(t for k, t in parts if k == "content"),
        )
        assert got == expected, cuts
        assert all(t for _, t in parts)  # no empty pieces

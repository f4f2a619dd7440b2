"""vLLM's kimi_k2 tool-parser test cases, stored as data with their commit, against k2's parser.

Each vector holds what vLLM's test asserts (`expect`); where k2 answers differently it also holds k2's
answer (`k2`) and the reason. Both the whole-text parse and the stream (in the vector's own deltas and
one character at a time) must give k2's answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from k2_data.chat import ToolCallStreamParser, accumulate_deltas, parse_tool_calls

DOC = json.loads((Path(__file__).parent / "data" / "kimi_k2_parser_vectors_vllm.json").read_text())
VECTORS = DOC["vectors"]


def check(expect: dict, content: str, calls: list[dict]) -> None:
    assert [c["function"]["name"] for c in calls] == expect["names"]
    for call, args in zip(calls, expect["arguments"]):
        if args is not None:
            assert json.loads(call["function"]["arguments"]) == args
    if expect["content"] is not None:
        assert content == expect["content"]
    if expect["ids"] is not None:
        assert [c["id"] for c in calls] == expect["ids"]
    for marker in ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>"):
        assert marker not in content


def test_source_is_pinned():
    assert DOC["source"]["repo"] == "vllm-project/vllm" and len(DOC["source"]["commit"]) == 40
    assert len(VECTORS) == 29
    # every disagreement is written down with its reason
    assert all(v.get("reason") for v in VECTORS if "k2" in v)
    assert sum("k2" in v for v in VECTORS) == 4


@pytest.mark.parametrize("v", VECTORS, ids=[v["id"] for v in VECTORS])
def test_whole_text(v):
    check(v.get("k2", v["expect"]), *parse_tool_calls(v["text"], tools=v["tools"]))


@pytest.mark.parametrize("v", VECTORS, ids=[v["id"] for v in VECTORS])
def test_stream(v):
    for pieces in (v["deltas"] or [v["text"]], list(v["text"])):
        parser = ToolCallStreamParser(tools=v["tools"])
        deltas = [d for piece in pieces for d in parser.feed(piece)]
        end = parser.finish()
        content, calls = accumulate_deltas(deltas + end.deltas)
        check(v.get("k2", v["expect"]), content, calls)
        assert end.tools_called == bool(calls)

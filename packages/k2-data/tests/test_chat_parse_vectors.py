"""vLLM's and SGLang's kimi_k2 tool-parser test cases, stored as data with their commits, against k2's parser.

Each vector holds what vLLM's test asserts (`expect`); where k2 answers differently it also holds k2's
answer (`k2`) and the reason. Both the whole-text parse and the stream (in the vector's own deltas and
one character at a time) must give k2's answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from k2_data.chat import ToolCallStreamParser, accumulate_deltas, parse_tool_calls

DATA = Path(__file__).parent / "data"
DOCS = {
    name: json.loads((DATA / f"kimi_k2_parser_vectors_{name}.json").read_text())
    for name in ("vllm", "sglang")
}
VECTORS = [dict(v, id=f"{name}:{v['id']}") for name, doc in DOCS.items() for v in doc["vectors"]]


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


def test_sources_are_pinned():
    assert DOCS["vllm"]["source"]["repo"] == "vllm-project/vllm"
    assert DOCS["sglang"]["source"]["repo"] == "sgl-project/sglang"
    assert all(len(doc["source"]["commit"]) == 40 for doc in DOCS.values())
    assert [len(doc["vectors"]) for doc in DOCS.values()] == [29, 7]
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

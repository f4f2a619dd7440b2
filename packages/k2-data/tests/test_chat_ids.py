"""normalize_tool_call_ids: the functions.NAME:IDX renaming, as a step of its own."""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest
from k2_data.chat import normalize_tool_call_ids, render

sys.path.insert(0, str(Path(__file__).parent / "data"))
from chat_corpus import CORPUS, TOOLS, call

ODD = next(c[1] for c in CORPUS if c[0].startswith("odd ids"))


def test_odd_ids_are_renamed_with_a_conversation_wide_counter():
    out = normalize_tool_call_ids(ODD)
    ids = [c["id"] for c in out[1]["tool_calls"]]
    assert ids == [
        "functions.search:0",  # verifier style "search:0"
        "functions.search:1",  # bare counter "1"
        "functions.get_weather:2",  # no id
        "functions.get_weather:3",  # another function's K2 id is not kept
        "functions.search:4",  # None
    ]
    # results follow the rename of the call they answer; one without a matching id stays as it was
    answers = [m.get("tool_call_id", "<none>") for m in out[2:]]
    assert answers == ["functions.search:0", "functions.search:1", "<none>", "functions.get_weather:3", None]


def test_input_unchanged_and_idempotent():
    before = copy.deepcopy(ODD)
    once = normalize_tool_call_ids(ODD)
    assert ODD == before
    assert normalize_tool_call_ids(once) == once


def test_own_k2_ids_are_kept_across_turns():
    msgs = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [call("search", "{}", "functions.search:0")]},
        {"role": "tool", "tool_call_id": "functions.search:0", "content": "a"},
        {"role": "assistant", "tool_calls": [call("search", "{}", "call_9")]},
        {"role": "tool", "tool_call_id": "call_9", "content": "b"},
    ]
    out = normalize_tool_call_ids(msgs)
    assert [out[1]["tool_calls"][0]["id"], out[3]["tool_calls"][0]["id"]] == [
        "functions.search:0",
        "functions.search:1",
    ]
    assert out[4]["tool_call_id"] == "functions.search:1"


def test_a_reused_client_id_answers_the_latest_call():
    # bare counters restart every turn: "0" in turn 2 is turn 2's call
    msgs = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [call("search", "{}", "0")]},
        {"role": "tool", "tool_call_id": "0", "content": "a"},
        {"role": "assistant", "tool_calls": [call("get_weather", "{}", "0")]},
        {"role": "tool", "tool_call_id": "0", "content": "b"},
    ]
    out = normalize_tool_call_ids(msgs)
    assert [out[2]["tool_call_id"], out[4]["tool_call_id"]] == [
        "functions.search:0",
        "functions.get_weather:1",
    ]


def _k2_renders(case) -> bool:
    try:
        render(case[1], case[2], case[3])
    except ValueError:  # conversations k2's own variant refuses (the released templates render them)
        return False
    return True


K2_CASES = [c for c in CORPUS if c[1] and _k2_renders(c)]


@pytest.mark.parametrize("case", K2_CASES, ids=[c[0] for c in K2_CASES])
def test_k2_rendering_already_normalises(case):
    _, messages, tools, gen = case
    assert render(normalize_tool_call_ids(messages), tools, gen) == render(messages, tools, gen)


def test_released_templates_see_only_k2_ids_after_normalising():
    _, messages, tools, gen = next(c for c in CORPUS if c[0].startswith("tools, OpenAI ids"))
    text = render(normalize_tool_call_ids(messages), TOOLS, gen, template="kimi-k2-thinking")
    assert re.findall(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>", text) == [
        "functions.get_weather:0",
        "functions.search:1",
    ]
    assert re.findall(r"## Return of (.*?)\n", text) == ["functions.get_weather:0", "functions.search:1"]

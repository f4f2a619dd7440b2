"""k2_data.chat.parse_tool_calls: OpenAI-shaped calls from K2's tool-call sections; malformed -> content.

Reference: the format in MISSION.md and the behaviour of vLLM's `kimi_k2` tool parser (id kept as emitted,
name = the id without `functions.` and `:IDX`, arguments as the emitted JSON text, text before the section
is content); unlike vLLM, invalid JSON is rejected (kept as content) rather than passed on.
"""

from __future__ import annotations

import json
import logging

import pytest
from k2_data.chat import parse_tool_calls, render

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def call(name: str, idx: int, args: str, prefix: str = "functions.") -> str:
    return f"{CB}{prefix}{name}:{idx}{AB}{args}{CE}"


def test_one_call_with_content_before():
    text = "Let me check." + SB + call("get_weather", 0, '{"city": "Paris"}') + SE
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert calls == [
        {
            "id": "functions.get_weather:0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


def test_several_calls_whitespace_and_trailing_text():
    # newlines between markers (as some templates/servers print them) are allowed; arguments are kept
    # verbatim except for surrounding whitespace; text after the section is content too
    args2 = '{\n  "q": "k2 \\"moe\\"",\n  "n": [1, 2.5, null],\n  "deep": {"x": {"y": true}}\n}'
    text = (
        f'A{SB}\n{CB} functions.search:0 {AB} {{"q":"a"}} {CE}\n'
        f"{CB}functions.search:1{AB}\n{args2}\n{CE}\n{call('get_time', 2, '{}', prefix='')}\n{SE}B"
    )
    content, calls = parse_tool_calls(text)
    assert content == "AB"
    assert [c["id"] for c in calls] == ["functions.search:0", "functions.search:1", "get_time:2"]
    assert [c["function"]["name"] for c in calls] == ["search", "search", "get_time"]
    assert [c["function"]["arguments"] for c in calls] == ['{"q":"a"}', args2, "{}"]
    assert json.loads(calls[1]["function"]["arguments"])["n"] == [1, 2.5, None]


def test_no_section_is_all_content():
    for text in ["", "plain answer", f"mentions {CB} outside a section", f"stray {SE} end"]:
        assert parse_tool_calls(text, strict=True) == (text, [])
    # by default a stray tool-call marker is not shown (vLLM and SGLang drop them too)
    assert parse_tool_calls(f"stray {SE} end") == ("stray  end", [])


MALFORMED = {
    "unterminated section": "pre " + SB + call("f", 0, '{"a": 1}'),
    "invalid JSON": SB + call("f", 0, '{"a": 1,}') + SE,
    "truncated JSON": SB + call("f", 0, '{"a": ') + SE,
    "missing argument marker": SB + f'{CB}functions.f:0{{"a": 1}}{CE}' + SE,
    "missing call end": SB + f'{CB}functions.f:0{AB}{{"a": 1}}' + SE,
    "call end missing before next call": SB + f"{CB}functions.f:0{AB}{{}}" + call("g", 1, "{}") + SE,
    "arguments not an object": SB + call("f", 0, "[1, 2]") + SE,
    "header without index": SB + f"{CB}functions.f{AB}{{}}{CE}" + SE,
    "header with spaces": SB + f"{CB}functions.my tool:0{AB}{{}}{CE}" + SE,
    "text between calls": SB + call("f", 0, "{}") + " and " + call("g", 1, "{}") + SE,
    "empty section": SB + " " + SE,
    "turn marker inside section": SB + call("f", 0, "{}") + "<|im_end|>" + SE,
    "nested section": SB + SB + call("f", 0, "{}") + SE,
}


# what the default (lenient) mode keeps of each: the valid calls, judged one by one
LENIENT_CALLS = {
    "unterminated section": ["f"],  # cut off after a complete call: the call is kept
    "call end missing before next call": ["g"],
    "text between calls": ["f", "g"],
    "turn marker inside section": ["f"],
    "nested section": ["f"],
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_section_strict_is_content_with_warning(name, caplog):
    text = "Sure. " + MALFORMED[name] + " bye"
    with caplog.at_level(logging.WARNING, logger="k2_data.chat"):
        content, calls = parse_tool_calls(text, strict=True)
    assert (content, calls) == (text, [])
    assert any("malformed tool-call section" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_section_default_keeps_valid_calls_and_no_markup(name, caplog):
    text = "Sure. " + MALFORMED[name] + " bye"
    with caplog.at_level(logging.WARNING, logger="k2_data.chat"):
        content, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == LENIENT_CALLS.get(name, [])
    # the section never shows up in content; an unterminated one swallows the rest of the text
    assert content == ("Sure. pre " if name == "unterminated section" else "Sure.  bye")
    noise_only = {"empty section", "nested section", "text between calls", "turn marker inside section"}
    assert bool(caplog.records) == (name not in noise_only)  # a dropped call is logged; ignored noise is not


def test_good_section_after_a_malformed_one():
    # sections are judged one by one: a bad one stays text, a later good one still yields its call
    bad = SB + call("f", 0, "{oops}") + SE
    good = SB + call("g", 1, '{"x": 2}') + SE
    content, calls = parse_tool_calls("a" + bad + "b" + good, strict=True)
    assert content == "a" + bad + "b"
    assert [c["id"] for c in calls] == ["functions.g:1"]
    assert parse_tool_calls("a" + bad + "b" + good) == ("ab", calls)


def test_round_trip_render_then_parse():
    calls = [
        {
            "id": "functions.get_weather:0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "unit": "c"}'},
        },
        {
            "id": "functions.run_code:1",
            "type": "function",
            "function": {
                "name": "run_code",
                "arguments": json.dumps({"src": "print('<|im_middle|>'[:2])\n"}),
            },
        },
    ]
    msg = {"role": "assistant", "content": "Two things first.", "tool_calls": calls}
    text = render([{"role": "system", "content": "s"}, msg])
    body = text.split("<|im_assistant|>assistant<|im_middle|>", 1)[1].removesuffix("<|im_end|>")
    assert parse_tool_calls(body) == ("Two things first.", calls)
    # and back: the parsed turn re-renders to the same text (ids and verbatim arguments preserved)
    content, parsed = parse_tool_calls(body)
    assert (
        render(
            [
                {"role": "system", "content": "s"},
                {"role": "assistant", "content": content, "tool_calls": parsed},
            ]
        )
        == text
    )


def test_round_trip_client_ids_and_object_arguments():
    # an OpenAI client's ids are rendered K2-style; parsing gives those ids and equal argument objects
    msg = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "a", "arguments": {"k": [1, {"z": None}]}},
            },
            {"id": "call_2", "type": "function", "function": {"name": "b", "arguments": "{}"}},
        ],
    }
    text = render([{"role": "user", "content": "u"}, msg])
    body = text.split("<|im_assistant|>assistant<|im_middle|>", 1)[1].removesuffix("<|im_end|>")
    content, calls = parse_tool_calls(body)
    assert content == ""
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("functions.a:0", "a", {"k": [1, {"z": None}]}),
        ("functions.b:1", "b", {}),
    ]


def test_non_string_input_is_a_type_error():
    with pytest.raises(TypeError, match="str"):
        parse_tool_calls(None)  # type: ignore[arg-type]


def test_top_level_exports():
    import k2_data
    from k2_data import chat

    assert k2_data.render_chat is chat.render and k2_data.parse_tool_calls is chat.parse_tool_calls
    assert k2_data.render_ids is chat.render_ids and k2_data.ToolCallStreamParser is chat.ToolCallStreamParser

"""k2_data.chat.ToolCallStreamParser: deltas for any split of the text agree with parse_tool_calls.

Reference: `parse_tool_calls` on the whole text; the deltas are merged the way OpenAI clients merge them
(`accumulate_deltas`), and their shape is checked against OpenAI's streaming format (content deltas; per
tool call first `index`, `id`, `type`, `function.name`, then `function.arguments` fragments).
"""

from __future__ import annotations

import json
import logging
import random

import pytest
from k2_data.chat import ToolCallStreamParser, accumulate_deltas, parse_tool_calls

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def call(name: str, idx: int, args: str) -> str:
    return f"{CB}functions.{name}:{idx}{AB}{args}{CE}"


TEXTS = {
    "content only": "Just an answer, with <|tool_call no section. 你好",
    "one call": "Let me look. " + SB + call("get_weather", 0, '{"city": "Paris", "days": [1, 2]}') + SE,
    "two calls": SB
    + call("a", 0, '{"x": "<|tool_call_end"}')
    + "\n"
    + call("b", 1, '{\n "y": {"z": null}\n}')
    + SE,
    "calls then text": "pre"
    + SB
    + call("f", 0, "{}")
    + SE
    + " post "
    + SB
    + call("g", 1, '{"k": "ü"}')
    + SE
    + "!",
    "partial marker in content": "a <|tool_calls_sect b <|tool_calls_section_begin c",
    "unterminated": "oops " + SB + call("f", 0, '{"a": 1}'),
    "invalid json": "x" + SB + call("f", 0, '{"a": 1') + SE + "y",
    "missing argument marker": SB + f"{CB}functions.f:0{{}}{CE}" + SE,
    "bad then good": SB + call("f", 0, "nope") + SE + SB + call("g", 1, '{"ok": true}') + SE,
    "ends inside marker": "tail " + SB[:10],
}


def stream(
    text: str, cuts: list[int], eager: bool = False, strict: bool | None = None
) -> tuple[list[dict], bool, tuple[int, ...]]:
    parser = ToolCallStreamParser(eager=eager, strict=strict)
    deltas: list[dict] = []
    bounds = [0, *cuts, len(text)]
    for s, t in zip(bounds, bounds[1:]):
        deltas += parser.feed(text[s:t])
    end = parser.finish()
    return deltas + end.deltas, end.tools_called, end.malformed_calls


def check_openai_shape(deltas: list[dict]) -> None:
    seen: set[int] = set()
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}) and len(d.get("tool_calls", [0])) == 1
        if "content" in d:
            assert isinstance(d["content"], str) and d["content"]
            continue
        tc = d["tool_calls"][0]
        if tc["index"] not in seen:  # the first delta of a call names it
            assert (
                tc["index"] == len(seen) and tc["type"] == "function" and tc["id"] and tc["function"]["name"]
            )
            assert tc["function"]["arguments"] == ""
            seen.add(tc["index"])
        else:  # later deltas carry argument text only
            assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            assert tc["function"]["arguments"]


@pytest.mark.parametrize("mode", ["held", "held-strict", "eager"])
@pytest.mark.parametrize("name", sorted(TEXTS))
def test_random_splits_equal_whole_parse(name, mode):
    text = TEXTS[name]
    eager, strict = mode == "eager", mode != "held"
    expected = parse_tool_calls(text, strict=strict)
    rng = random.Random(name)
    splits = [[], list(range(1, len(text)))]  # whole text; one character at a time
    splits += [
        sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1)))) for _ in range(200)
    ]
    for cuts in splits:
        deltas, called, malformed = stream(text, cuts, eager, strict)
        check_openai_shape(deltas)
        content, calls = accumulate_deltas(deltas)
        if not eager:
            assert malformed == () and (content, calls) == expected, cuts
        else:
            # eager mode may have announced calls of a section that later proved malformed: they are
            # reported, and dropping them leaves exactly the whole-text parse
            kept = [c for i, c in enumerate(calls) if i not in malformed]
            assert (content, kept) == expected, cuts
            assert len(calls) == len(kept) + len(malformed)
        assert called == bool(expected[1])


def test_content_streams_live_and_holds_only_a_marker_prefix():
    p = ToolCallStreamParser()
    assert p.feed("Hello") == [{"content": "Hello"}]
    assert p.feed(" wor<|tool_calls") == [{"content": " wor"}]  # "<|tool_calls" may begin a section
    assert p.feed("_x") == [{"content": "<|tool_calls_x"}]  # ...it did not
    assert (
        p.feed("<|tool_calls_section_begin|>" + CB + "functions.f:0" + AB) == []
    )  # held until the section ends
    assert p.feed('{"a": ') == [] and p.feed("1}" + CE) == []
    assert p.feed(SE + "done") == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "functions.f:0",
                    "type": "function",
                    "function": {"name": "f", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]},  # in the pieces they arrived in
        {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
        {"content": "done"},
    ]
    assert p.tools_called
    assert p.finish() == ([], True, ())
    with pytest.raises(RuntimeError, match="after finish"):
        p.feed("x")


def test_malformed_stream_default_drops_markup(caplog):
    p = ToolCallStreamParser()
    assert p.feed("Try: " + SB + call("f", 0, '{"a": ')) == [{"content": "Try: "}]
    with caplog.at_level(logging.WARNING, logger="k2_data.chat"):
        end = p.finish()  # cut off inside the call: nothing of the section is shown
    assert end == ([], False, ())
    p = ToolCallStreamParser()
    text = "x" + SB + call("f", 0, "{'bad'}") + call("g", 1, '{"ok": 1}') + SE + "y" + CE
    deltas = p.feed(text) + p.finish().deltas
    assert accumulate_deltas(deltas) == ("xy", parse_tool_calls(text)[1]) and p.tools_called


def test_malformed_stream_strict_degrades_to_content(caplog):
    p = ToolCallStreamParser(strict=True)
    out = p.feed("Try: " + SB + call("f", 0, '{"a": '))
    assert out == [{"content": "Try: "}]
    with caplog.at_level(logging.WARNING, logger="k2_data.chat"):
        end = p.finish()  # the model stopped inside the section
    assert end.tools_called is False
    assert end.deltas == [{"content": SB + call("f", 0, '{"a": ')}]
    assert any("unterminated section" in r.getMessage() for r in caplog.records)

    p = ToolCallStreamParser(strict=True)
    bad = SB + call("f", 0, "{'single': 'quotes'}") + SE
    with caplog.at_level(logging.WARNING, logger="k2_data.chat"):
        out = p.feed(bad[:30]) + p.feed(bad[30:])
    assert out == [{"content": bad}] and p.finish() == ([], False, ())
    assert any("not valid JSON" in r.getMessage() for r in caplog.records)


def test_stream_of_many_calls_indices_and_arguments():
    args = [json.dumps({"i": i, "s": "x" * i}) for i in range(20)]
    text = "plan" + SB + "".join(call(f"t{i}", i, a) for i, a in enumerate(args)) + SE
    rng = random.Random(0)
    cuts = sorted(rng.sample(range(1, len(text)), 40))
    deltas, called, _ = stream(text, cuts)
    content, calls = accumulate_deltas(deltas)
    assert called and content == "plan"
    assert [c["id"] for c in calls] == [f"functions.t{i}:{i}" for i in range(20)]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"i": i, "s": "x" * i} for i in range(20)
    ]


def test_eager_mode_announces_calls_and_streams_arguments_live():
    p = ToolCallStreamParser(eager=True)
    assert p.feed("ok" + SB + "\n" + CB + "functions.search:0") == [{"content": "ok"}]
    assert p.feed(AB + ' {"q": "mo') == [  # the call is announced at its argument marker
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "functions.search:0",
                    "type": "function",
                    "function": {"name": "search", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"q": "mo'}}]},  # leading space dropped
    ]
    assert p.feed('e"}  <|tool_') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'e"}'}}]}]
    assert p.feed("call_end|>" + CB + "functions.b:1" + AB + "{}" + CE) == [
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "functions.b:1",
                    "type": "function",
                    "function": {"name": "b", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
    ]
    assert not p.tools_called  # not until the section is known to be well-formed
    assert p.feed(SE) == [] and p.tools_called
    assert p.finish() == ([], True, ())


def test_eager_mode_reports_calls_of_a_malformed_section(caplog):
    text = "a" + SB + call("f", 0, '{"x": 1}') + call("g", 1, '{"y": ') + SE + "b"
    p = ToolCallStreamParser(eager=True)
    with caplog.at_level(logging.WARNING, logger="k2_data.chat"):
        deltas = p.feed(text[:60]) + p.feed(text[60:])
        end = p.finish()
    assert end.malformed_calls == (0, 1) and end.tools_called is False
    content, calls = accumulate_deltas(deltas + end.deltas)
    assert content == text and [c["id"] for c in calls] == ["functions.f:0", "functions.g:1"]
    assert any("not valid JSON" in r.getMessage() for r in caplog.records)


def test_fuzzed_texts_agree_in_both_modes():
    # random damage to well-formed output (cut a span, repeat a span, truncate, paste a marker) exercises
    # every malformed path; for each text and split, both modes must agree with the whole-text parse
    base = (
        "Sure."
        + SB
        + "\n"
        + call("a", 0, '{"k": [1, {"s": "x y"}]}')
        + " \n"
        + call("b", 1, "{}")
        + SE
        + " then "
        + SB
        + call("c", 2, '{"z": "<|tool_call_end"}')
        + SE
        + "end"
    )
    markers = [SB, SE, CB, AB, CE]
    rng = random.Random(1234)
    for trial in range(150):
        text = base
        for _ in range(rng.randint(1, 3)):
            i, j = sorted(rng.sample(range(len(text) + 1), 2))
            op = rng.randrange(4)
            if op == 0:
                text = text[:i] + text[j:]
            elif op == 1:
                text = text[:j] + text[i:j] + text[j:]
            elif op == 2:
                text = text[:j]
            else:
                text = text[:i] + rng.choice(markers) + text[i:]
        expected = parse_tool_calls(text, strict=True)
        lenient = parse_tool_calls(text)
        for _ in range(10):
            cuts = (
                sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 15))))
                if len(text) > 1
                else []
            )
            deltas, called, malformed = stream(text, cuts)
            assert accumulate_deltas(deltas) == lenient and called == bool(lenient[1]), (trial, text, cuts)
            deltas, called, malformed = stream(text, cuts, strict=True)
            assert accumulate_deltas(deltas) == expected and called == bool(expected[1]), (trial, text, cuts)
            deltas, called, malformed = stream(text, cuts, eager=True)
            content, calls = accumulate_deltas(deltas)
            assert (content, [c for i, c in enumerate(calls) if i not in malformed]) == expected, (
                trial,
                text,
                cuts,
            )
            assert called == bool(expected[1])

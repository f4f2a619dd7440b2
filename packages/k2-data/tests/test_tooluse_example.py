"""The generated tool-use SFT set: determinism, valid conversations, computed results, held-out disjointness.

References: Python's own `eval` for the arithmetic, conversion factors typed in here from their definitions
(1 mi = 1.609344 km, 1 lb = 0.45359237 kg, 1 ft = 0.3048 m, 1 US gal = 3.785411784 l, F = C * 9/5 + 32).
"""

from __future__ import annotations

import json

import pytest
from k2_data.chat import validate_conversation
from k2_data.examples import tooluse
from k2_data.examples.tooluse import TOOLS, write_tooluse_dataset

FACTORS = {("mi", "km"): 1.609344, ("lb", "kg"): 0.45359237, ("ft", "m"): 0.3048, ("gal", "l"): 3.785411784}


def _convert(value, src, dst):
    if (src, dst) == ("c", "f"):
        return value * 9 / 5 + 32
    if (src, dst) == ("f", "c"):
        return (value - 32) * 5 / 9
    if (src, dst) in FACTORS:
        return value * FACTORS[src, dst]
    return value / FACTORS[dst, src]


def _read(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    out = tmp_path_factory.mktemp("tooluse")
    counts = write_tooluse_dataset(out, n_train=600, n_heldout=150, seed=0)
    return out, counts, _read(out / "train.jsonl"), _read(out / "heldout.jsonl")


def test_same_seed_same_bytes(example, tmp_path):
    out, counts, _, _ = example
    again = write_tooluse_dataset(tmp_path / "a", n_train=600, n_heldout=150, seed=0)
    assert again == counts
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (out / name).read_bytes()
    write_tooluse_dataset(tmp_path / "b", n_train=600, n_heldout=150, seed=1)
    assert (tmp_path / "b" / "train.jsonl").read_bytes() != (out / "train.jsonl").read_bytes()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "heldout.jsonl",
        "train.jsonl",
    ]  # no temp files


def test_counts_tools_and_templates(example):
    _, counts, train, heldout = example
    assert counts["train"] == len(train) == 600 and counts["heldout"] == len(heldout) == 150
    assert counts["train_no_tool"] == sum(len(r["messages"]) == 3 for r in train)
    assert 0.15 < counts["train_no_tool"] / 600 < 0.25 and 0.1 < counts["heldout_no_tool"] / 150 < 0.3
    assert sum(counts["train_by_tool"].values()) + counts["train_no_tool"] == 600
    assert all(n > 80 for n in counts["train_by_tool"].values())
    names = [t["function"]["name"] for t in TOOLS]
    assert names == ["calculator", "convert_units", "get_weather", "get_time"]
    for tool in TOOLS:
        params = tool["function"]["parameters"]
        assert tool["type"] == "function" and params["type"] == "object"
        assert set(params["required"]) == set(params["properties"]) and all(
            "type" in p for p in params["properties"].values()
        )
    for templates in (
        tooluse.CALC_TEMPLATES,
        tooluse.CONVERT_TEMPLATES,
        tooluse.WEATHER_TEMPLATES,
        tooluse.TIME_TEMPLATES,
    ):
        assert len(set(templates)) >= 10
    # phrasings actually used: the user messages of weather records, with the city taken out
    weather_phrasings = {
        r["messages"][1]["content"].replace(
            json.loads(r["messages"][2]["tool_calls"][0]["function"]["arguments"])["city"], "{city}"
        )
        for r in train
        if len(r["messages"]) == 5 and r["messages"][2]["tool_calls"][0]["function"]["name"] == "get_weather"
    }
    assert weather_phrasings == set(tooluse.WEATHER_TEMPLATES)


def test_train_records_are_valid_and_results_computed(example):
    _, _, train, _ = example
    for rec in train:
        msgs = rec["messages"]
        validate_conversation(msgs, rec["tools"])
        assert rec["tools"] == TOOLS and msgs[0] == {"role": "system", "content": tooluse.SYSTEM_PROMPT}
        user, answer = msgs[1]["content"], msgs[-1]["content"]
        assert msgs[1]["role"] == "user" and msgs[-1]["role"] == "assistant" and "tool_calls" not in msgs[-1]
        if len(msgs) == 3:
            assert any(user.endswith(q) and a == answer for q, a in tooluse.CHAT)
            continue
        call = msgs[2]["tool_calls"][0]
        name, raw = call["function"]["name"], call["function"]["arguments"]
        args = json.loads(raw)
        assert raw == json.dumps(args, separators=(",", ":"))  # canonical compact form
        assert call["id"] == msgs[3]["tool_call_id"] == f"functions.{name}:0" and msgs[3]["name"] == name
        result = json.loads(msgs[3]["content"])
        if name == "calculator":
            assert list(args) == ["expression"] and args["expression"] in user
            assert result["result"] == pytest.approx(round(eval(args["expression"]), 2), abs=1e-9)
            assert tooluse.fmt_number(result["result"]) in answer
        elif name == "convert_units":
            assert list(args) == ["value", "from_unit", "to_unit"]
            assert json.dumps(args["value"]) in user
            assert any(w in user for w in tooluse.UNIT_WORDS[args["from_unit"]])
            assert any(w in user for w in tooluse.UNIT_WORDS[args["to_unit"]])
            want = _convert(args["value"], args["from_unit"], args["to_unit"])
            assert result == {"value": pytest.approx(round(want, 2), abs=1e-9), "unit": args["to_unit"]}
            assert (
                f"{json.dumps(args['value'])} " in answer
                and f" is about {tooluse.fmt_number(want)} " in answer
            )
        else:
            assert list(args) == ["city"] and args["city"] in user and args["city"] in tooluse.CITIES
            fake = (
                tooluse.weather(args["city"]) if name == "get_weather" else tooluse.local_time(args["city"])
            )
            assert result == fake and args["city"] in answer
            assert (str(fake["temperature_c"]) if name == "get_weather" else fake["time"]) in answer


def test_unit_words_name_one_unit_each():
    words = [w for ws in tooluse.UNIT_WORDS.values() for w in ws]
    assert len(words) == len(set(words))
    assert (
        tooluse.fmt_number(3.0) == "3"
        and tooluse.fmt_number(0.125) == "0.12"
        and tooluse.fmt_number(-0.001) == "0"
    )
    assert tooluse.evaluate("12 + 3 * 4") == 24 and tooluse.evaluate("7 / 2") == 3.5
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        tooluse.evaluate("__import__('os')")


def test_heldout_is_prompt_only_and_disjoint(example):
    _, _, train, heldout = example
    train_users = {r["messages"][1]["content"] for r in train}
    train_calls = {
        (c["function"]["name"], c["function"]["arguments"])
        for r in train
        if len(r["messages"]) == 5
        for c in r["messages"][2]["tool_calls"]
    }
    weather_train = {json.loads(a)["city"] for n, a in train_calls if n == "get_weather"}
    for rec in heldout:
        msgs, ref = rec["messages"], rec["reference"]
        assert [m["role"] for m in msgs] == ["system", "user"] and rec["tools"] == TOOLS
        user = msgs[1]["content"]
        assert user not in train_users
        if ref is None:
            assert any(user.endswith(q) for q, _ in tooluse.CHAT)
            continue
        assert set(ref) == {"name", "arguments"} and isinstance(ref["arguments"], dict)
        assert (
            ref["name"],
            tooluse.canonical_arguments(ref["arguments"]),
        ) not in train_calls  # fresh arguments
        if ref["name"] in ("get_weather", "get_time"):
            assert ref["arguments"]["city"] in user
        if ref["name"] == "get_weather":
            assert ref["arguments"]["city"] not in weather_train
    assert {r["reference"]["name"] for r in heldout if r["reference"]} == {
        t["function"]["name"] for t in TOOLS
    }


def test_bad_sizes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="n_train and n_heldout must be >= 0"):
        write_tooluse_dataset(tmp_path, n_train=-1)


def test_score_tool_call_needs_name_and_arguments():
    from k2_data.examples.tooluse import score_tool_call

    ref = {"name": "convert_units", "arguments": {"value": 12, "from_unit": "km", "to_unit": "mi"}}

    def call(name: str, args: str) -> dict:
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "x", "type": "function", "function": {"name": name, "arguments": args}}],
        }

    assert score_tool_call(ref, call("convert_units", '{"to_unit":"mi","value":12.0,"from_unit":"km"}'))
    assert not score_tool_call(ref, call("convert_units", '{"value":13,"from_unit":"km","to_unit":"mi"}'))
    assert not score_tool_call(ref, call("calculator", '{"value":12,"from_unit":"km","to_unit":"mi"}'))
    assert not score_tool_call(ref, call("convert_units", '{"value":12,'))  # not JSON
    assert not score_tool_call(ref, {"role": "assistant", "content": "12 km is 7.46 mi"})
    two = call("convert_units", '{"value":12,"from_unit":"km","to_unit":"mi"}')
    two["tool_calls"] = two["tool_calls"] * 2
    assert not score_tool_call(ref, two)
    assert score_tool_call(None, {"role": "assistant", "content": "Hello!", "tool_calls": []})
    assert not score_tool_call(None, call("get_time", '{"city":"Oslo"}'))

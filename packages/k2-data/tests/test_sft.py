"""SFT data: conversation validation, chat records -> shards with a loss mask, and `k2 data sft`.

References: `render_ids_with_mask` (itself checked by hand in test_chat_render.py) for every row's ids and
mask, the line numbers of hand-written bad records, and a plain-Python stream for the packed labels.
"""

from __future__ import annotations

import argparse
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from k2_data import IGNORE_INDEX, BadRecordError, PackedDataset, load_manifest, load_tokenizer
from k2_data.chat import normalize_tool_call_ids, render_ids, render_ids_with_mask, validate_conversation
from k2_data.sft import ChatTokenizeConfig, tokenize_chat

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "You add numbers."}


def _call(call_id="call_1", name="add", arguments='{"a":2,"b":3}'):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_use(arguments='{"a":2,"b":3}', name="add", answer_id="call_1"):
    return [
        SYSTEM,
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": None, "tool_calls": [_call(name=name, arguments=arguments)]},
        {"role": "tool", "tool_call_id": answer_id, "content": "5"},
        {"role": "assistant", "content": "2 + 3 = 5."},
    ]


GOOD = _tool_use()
PLAIN = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi! How can I help?"}]


# ----------------------------------------------------------------------------- validation


def test_valid_conversations_pass():
    validate_conversation(GOOD, TOOLS)
    validate_conversation(PLAIN)
    with pytest.raises(
        ValueError, match=r"messages\[2\].tool_calls\[0\]: .*'add', but the record declares no tools"
    ):
        validate_conversation(GOOD)  # calls without tools: the model never saw the function
    # a tool message may answer with the K2-shaped id the call is rendered as
    validate_conversation(_tool_use(answer_id="functions.add:0"), TOOLS)
    # arguments as an object (not a string) are fine
    validate_conversation(_tool_use(arguments={"a": 1, "b": 2}), TOOLS)


@pytest.mark.parametrize(
    "messages, tools, match",
    [
        ([{"role": "robot", "content": "x"}], None, r"messages\[0\]: field 'role' must be one of"),
        (
            GOOD[:3] + GOOD[4:],
            TOOLS,
            r"messages\[2\].tool_calls\[0\]: tool call 'call_1' has no later tool message",
        ),
        (
            [
                SYSTEM,
                {"role": "user", "content": "q"},
                {"role": "tool", "tool_call_id": "call_9", "content": "5"},
                {"role": "assistant", "content": "a"},
            ],
            TOOLS,
            r"messages\[2\]: field 'tool_call_id' 'call_9' answers no earlier",
        ),
        # the answer comes before the call
        (
            [SYSTEM, {"role": "user", "content": "q"}, GOOD[3], GOOD[2], GOOD[4]],
            TOOLS,
            r"messages\[2\]: field 'tool_call_id'",
        ),
        # answered twice
        (
            [*GOOD[:4], GOOD[3], GOOD[4]],
            TOOLS,
            r"messages\[4\]: field 'tool_call_id' 'call_1' answers no earlier unanswered",
        ),
        (
            _tool_use(arguments='{"a": 2,'),
            TOOLS,
            r"messages\[2\].tool_calls\[0\]: field 'function.arguments' is not valid JSON",
        ),
        (
            _tool_use(arguments="[2, 3]"),
            TOOLS,
            r"messages\[2\].tool_calls\[0\]: field 'function.arguments' must be a JSON object, got list",
        ),
        (
            _tool_use(name="mul"),
            TOOLS,
            r"messages\[2\].tool_calls\[0\]: field 'function.name' calls 'mul', which is not declared in tools \(declared: add\)",
        ),
        (
            [SYSTEM, {"role": "user", "content": "q"}],
            TOOLS,
            r"messages: no assistant turn \(nothing to train on\)",
        ),
        (PLAIN, [{"type": "function", "function": {"parameters": {}}}], r"tools\[0\]: field 'function.name'"),
    ],
)
def test_invalid_conversations_name_the_field(messages, tools, match):
    with pytest.raises(ValueError, match=match):
        validate_conversation(messages, tools)


# ----------------------------------------------------------------------------- tokenizing chat records

# (line, JSONL text, expected skip reason or None for a good record)
LINES = [
    (1, json.dumps({"messages": GOOD, "tools": TOOLS}), None),
    (2, '{"messages": [', r"invalid JSON"),
    (3, json.dumps({"conversation": PLAIN}), r"no field 'messages' in the record"),
    (
        4,
        json.dumps({"messages": [{"role": "robot", "content": "x"}, PLAIN[1]]}),
        r"messages\[0\]: field 'role' must be one of",
    ),
    (
        5,
        json.dumps({"messages": GOOD[:3] + GOOD[4:], "tools": TOOLS}),
        r"messages\[2\].tool_calls\[0\]: tool call 'call_1' has no later tool message",
    ),
    (
        6,
        json.dumps({"messages": [PLAIN[0], {"role": "tool", "tool_call_id": "x", "content": "r"}, PLAIN[1]]}),
        r"messages\[1\]: field 'tool_call_id' 'x' answers no earlier",
    ),
    (
        7,
        json.dumps({"messages": _tool_use(arguments='{"a":'), "tools": TOOLS}),
        r"messages\[2\].tool_calls\[0\]: field 'function.arguments' is not valid JSON",
    ),
    (
        8,
        json.dumps({"messages": _tool_use(name="sub"), "tools": TOOLS}),
        r"field 'function.name' calls 'sub', which is not declared",
    ),
    (9, json.dumps({"messages": [PLAIN[0]]}), r"messages: no assistant turn"),
    (10, json.dumps({"messages": PLAIN}), None),
    (
        11,
        json.dumps({"messages": _tool_use(arguments="[1]"), "tools": TOOLS}),
        r"must be a JSON object, got list",
    ),
    (12, "", None),  # a blank line is not a record
    (
        13,
        json.dumps({"messages": json.dumps(GOOD), "tools": json.dumps(TOOLS)}),
        None,
    ),  # lists stored as JSON text
    (14, json.dumps(["not", "an", "object"]), r"the record is a JSON list"),
]


@pytest.fixture()
def chat_jsonl(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(text for _, text, _ in LINES) + "\n", encoding="utf-8")
    return path


def _rows(directory):
    m = load_manifest(directory)
    rows = []
    for shard in m["shards"]:
        path = directory / shard["file"]
        table = (
            pa.ipc.open_file(pa.memory_map(str(path))).read_all()
            if m["format"] == "arrow"
            else pq.read_table(path)
        )
        rows += table.to_pylist()
    return rows


def test_jsonl_rows_masks_and_every_bad_record(chat_jsonl, tmp_path):
    out = tmp_path / "sft"
    m = tokenize_chat([chat_jsonl], out)  # on_error="skip" is the default
    tok = load_tokenizer()
    good = {1: (GOOD, TOOLS), 10: (PLAIN, None), 13: (GOOD, TOOLS)}
    rows = _rows(out)
    assert [r["source"] for r in rows] == [f"{chat_jsonl}:{line}" for line in good]
    for row, (messages, tools) in zip(rows, good.values()):
        ids, mask = render_ids_with_mask(tok, messages, tools)
        assert row["input_ids"] == ids == render_ids(tok, messages, tools)
        assert row["loss_mask"] == mask
    assert len({r["doc_id"] for r in rows}) == 3
    assert m["kind"] == "chat" and m["num_docs"] == 3
    assert m["num_tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert m["num_trained_tokens"] == sum(sum(r["loss_mask"]) for r in rows) > 0
    assert m["schema"]["loss_mask"] == "list<item: uint8>"
    bad = [(line, reason) for line, _, reason in LINES if reason is not None]
    assert [(s["file"], s["where"]) for s in m["skipped"]] == [
        (str(chat_jsonl), str(line)) for line, _ in bad
    ]
    for skipped, (_, reason) in zip(m["skipped"], bad):
        assert re.search(reason, skipped["reason"]), (skipped, reason)
    assert m["num_skipped"] == 10


def test_on_error_fail_names_file_and_line(chat_jsonl, tmp_path):
    with pytest.raises(BadRecordError, match=rf"{chat_jsonl}:2: invalid JSON"):
        tokenize_chat([chat_jsonl], tmp_path / "a", config=ChatTokenizeConfig(on_error="fail"))
    lines = chat_jsonl.read_text().splitlines()
    chat_jsonl.write_text(
        "\n".join(lines[:1] + lines[4:5]) + "\n"
    )  # good, then the unanswered call on line 2
    with pytest.raises(
        BadRecordError, match=rf"{chat_jsonl}:2: messages\[2\].tool_calls\[0\]: tool call 'call_1' has no"
    ):
        tokenize_chat([chat_jsonl], tmp_path / "b", config=ChatTokenizeConfig(on_error="fail"))
    text_file = tmp_path / "notes.txt"
    text_file.write_text("hello")
    with pytest.raises(ValueError, match=r"notes.txt: chat records must be JSONL"):
        tokenize_chat([text_file], tmp_path / "c")


@pytest.mark.parametrize("template", ["kimi-k2-instruct-0905", "kimi-k2-thinking"])
def test_released_template_and_id_normalisation(template, tmp_path):
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"messages": GOOD, "tools": TOOLS}) + "\n")
    tok = load_tokenizer()
    m = tokenize_chat([src], tmp_path / "on", config=ChatTokenizeConfig(template=template))
    assert m["chat_template"] == template and m["normalize_ids"] is True
    [row] = _rows(tmp_path / "on")
    ids, mask = render_ids_with_mask(tok, normalize_tool_call_ids(GOOD), TOOLS, template=template)
    assert (row["input_ids"], row["loss_mask"]) == (ids, mask)
    assert "functions.add:0" in tok.decode(row["input_ids"]) and "call_1" not in tok.decode(row["input_ids"])
    # --no-normalize-ids: the released template prints the record's own id
    tokenize_chat([src], tmp_path / "off", config=ChatTokenizeConfig(template=template, normalize_ids=False))
    [row] = _rows(tmp_path / "off")
    assert row["input_ids"] == render_ids_with_mask(tok, GOOD, TOOLS, template=template)[0]
    assert "call_1" in tok.decode(row["input_ids"])


def test_reasoning_content_is_trained_with_the_thinking_template(tmp_path):
    msgs = [dict(m) for m in GOOD]
    msgs[2]["reasoning_content"] = "I need the add tool."
    msgs[4]["reasoning_content"] = "The tool said 5."
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"messages": msgs, "tools": TOOLS}) + "\n")
    tokenize_chat([src], tmp_path / "out", config=ChatTokenizeConfig(template="kimi-k2-thinking"))
    [row] = _rows(tmp_path / "out")
    tok = load_tokenizer()
    trained = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    # both turns are after the last final answer of the prompt: trained with their reasoning
    assert trained.startswith("<think>I need the add tool.</think><|tool_calls_section_begin|>")
    assert trained.endswith("<think>The tool said 5.</think>2 + 3 = 5.<|im_end|>")


def test_parquet_structs_and_arrow_json_strings(tmp_path):
    tok = load_tokenizer()
    records = [{"conv": GOOD, "fns": TOOLS}, {"conv": PLAIN, "fns": None}, {"conv": [PLAIN[0]], "fns": None}]
    pqf = tmp_path / "in" / "chat.parquet"
    pqf.parent.mkdir()
    table = pa.Table.from_pylist(records)  # messages as list<struct>: missing keys become nulls
    assert pa.types.is_list(table.schema.field("conv").type)
    pq.write_table(table, pqf)
    arf = tmp_path / "in" / "chat.arrow"
    strings = pa.table(
        {"conv": [json.dumps(r["conv"]) for r in records], "fns": [json.dumps(r["fns"]) for r in records]}
    )
    with pa.OSFile(str(arf), "wb") as sink, pa.ipc.new_file(sink, strings.schema) as w:
        w.write_table(strings)
    cfg = ChatTokenizeConfig(messages_field="conv", tools_field="fns", format="parquet")
    m = tokenize_chat([pqf, arf], tmp_path / "out", config=cfg)
    rows = _rows(tmp_path / "out")
    assert [r["source"] for r in rows] == [f"{pqf}#0", f"{pqf}#1", f"{arf}#0", f"{arf}#1"]
    for row, (messages, tools) in zip(rows, [(GOOD, TOOLS), (PLAIN, None)] * 2):
        assert (row["input_ids"], row["loss_mask"]) == tuple(render_ids_with_mask(tok, messages, tools))
    assert [(s["file"], s["where"]) for s in m["skipped"]] == [(str(pqf), "row 2"), (str(arf), "row 2")]
    assert all("no assistant turn" in s["reason"] for s in m["skipped"])
    with pytest.raises(
        ValueError, match=r"chat.parquet: no column 'messages' \(columns: conv, fns\); set --messages-field"
    ):
        tokenize_chat([pqf], tmp_path / "out2")


def _tooluse_jsonl(tmp_path, n=40):
    from k2_data.examples.tooluse import write_tooluse_dataset

    write_tooluse_dataset(tmp_path / "ex", n_train=n, n_heldout=0, seed=3)
    return tmp_path / "ex" / "train.jsonl"


def test_workers_and_resume_give_the_same_shards(tmp_path):
    src = _tooluse_jsonl(tmp_path)
    one = tokenize_chat([src], tmp_path / "one", config=ChatTokenizeConfig(shard_bytes=8000))
    two = tokenize_chat([src], tmp_path / "two", config=ChatTokenizeConfig(shard_bytes=8000, workers=2))
    assert len(one["shards"]) >= 3 and one["shards"] == two["shards"]
    assert _rows(tmp_path / "one") == _rows(tmp_path / "two")
    again = tokenize_chat([src], tmp_path / "one", config=ChatTokenizeConfig(shard_bytes=8000))
    assert (
        again["resumed_shards"] == len(one["shards"])
        and again["num_trained_tokens"] == one["num_trained_tokens"]
    )
    with pytest.raises(ValueError, match="different run"):  # a text run into a chat directory is refused
        from k2_data import tokenize_corpus

        tokenize_corpus([src], tmp_path / "one")


def test_stream_packing_ignores_untrained_targets(tmp_path):
    src = _tooluse_jsonl(tmp_path, n=12)
    tokenize_chat([src], tmp_path / "d")
    rows = _rows(tmp_path / "d")
    ds = PackedDataset(tmp_path / "d", seq_len=128, shuffle=False, document_mask=True)
    stream = [t for r in rows for t in r["input_ids"] + [ds.eos_id]]
    mask = [b for r in rows for b in r["loss_mask"] + [0]]  # the appended EOS is not trained
    owner = [i for i, r in enumerate(rows) for _ in range(len(r["input_ids"]) + 1)]
    assert len(ds) == (len(stream) - 1) // 128
    trained = 0
    for g in range(len(ds)):
        s = ds[g]
        lo = g * 128
        assert s["input_ids"].tolist() == stream[lo : lo + 128]
        want = [
            stream[t + 1] if mask[t + 1] and owner[t + 1] == owner[t] else IGNORE_INDEX
            for t in range(lo, lo + 128)
        ]
        assert s["shift_labels"].tolist() == want
        trained += sum(w != IGNORE_INDEX for w in want)
    assert trained == sum(mask[1 : len(ds) * 128 + 1]) > 0


# ----------------------------------------------------------------------------- the CLI


def _cli(argv, capsys):
    data = pytest.importorskip("k2_stack.commands.data")
    parser = argparse.ArgumentParser(prog="k2")
    data.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_sft_lists_skipped_records(chat_jsonl, tmp_path, capsys):
    code, out, err = _cli(
        ["data", "sft", str(chat_jsonl), "--out", str(tmp_path / "a"), "--workers", "1"], capsys
    )
    assert code == 0 and f"wrote {tmp_path / 'a'}" in out
    m = load_manifest(tmp_path / "a")
    assert (
        f"{m['num_docs']} conversations, {m['num_tokens']} tokens, {m['num_trained_tokens']} trained, 10 skipped"
        in out
    )
    assert (
        f"skipped {chat_jsonl}:2: invalid JSON" in err
        and f"skipped {chat_jsonl}:9: messages: no assistant turn" in err
    )
    shown = [line.split(": ")[0] for line in err.splitlines() if line.startswith("skipped ")]
    assert (
        shown == [f"skipped {chat_jsonl}:{line}" for line, _, reason in LINES if reason]
        and "more skipped" not in err
    )
    code, out, err = _cli(
        ["data", "sft", str(chat_jsonl), "--out", str(tmp_path / "b"), "--on-error", "fail"], capsys
    )
    assert code == 1 and err.strip().splitlines()[-1].startswith(f"error: {chat_jsonl}:2: invalid JSON")


def test_cli_sft_chat_template_and_ids_flags(tmp_path, capsys):
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"messages": GOOD, "tools": TOOLS}) + "\n")
    argv = ["data", "sft", str(src), "--out", str(tmp_path / "t"), "--workers", "1"]
    code, _, _ = _cli([*argv, "--chat-template", "kimi-k2-thinking", "--no-normalize-ids"], capsys)
    m = load_manifest(tmp_path / "t")
    assert code == 0 and (m["chat_template"], m["normalize_ids"]) == ("kimi-k2-thinking", False)
    [row] = _rows(tmp_path / "t")
    assert (
        row["input_ids"]
        == render_ids_with_mask(load_tokenizer(), GOOD, TOOLS, template="kimi-k2-thinking")[0]
    )


def test_cli_sft_shows_only_ten_skipped(tmp_path, capsys):
    path = tmp_path / "many.jsonl"
    path.write_text(
        "".join(json.dumps({"messages": [PLAIN[0]]}) + "\n" for _ in range(13))
        + json.dumps({"messages": PLAIN})
        + "\n"
    )
    code, out, err = _cli(
        [
            "data",
            "sft",
            str(path),
            "--out",
            str(tmp_path / "o"),
            "--messages-field",
            "messages",
            "--tools-field",
            "tools",
        ],
        capsys,
    )
    shown = [line for line in err.splitlines() if line.startswith("skipped ")]
    assert code == 0 and shown[0] == f"skipped {path}:1: messages: no assistant turn (nothing to train on)"
    assert len(shown) == 10 and shown[-1].startswith(f"skipped {path}:10: ")
    assert err.splitlines()[-1] == "... 3 more skipped records in manifest.json"
    assert "1 conversations" in out and "13 skipped" in out


def test_cli_tooluse_example_then_sft(tmp_path, capsys):
    code, out, _ = _cli(
        [
            "data",
            "tooluse-example",
            "--out",
            str(tmp_path / "ex"),
            "--n-train",
            "30",
            "--n-heldout",
            "5",
            "--seed",
            "1",
        ],
        capsys,
    )
    assert code == 0 and "train 30, heldout 5" in out
    assert len((tmp_path / "ex" / "train.jsonl").read_text().splitlines()) == 30
    code, out, _ = _cli(
        ["data", "sft", str(tmp_path / "ex" / "train.jsonl"), "--out", str(tmp_path / "d")], capsys
    )
    assert code == 0 and "30 conversations" in out and "0 skipped" in out
    assert load_manifest(tmp_path / "d")["num_docs"] == 30

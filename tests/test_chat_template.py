"""`k2 export` writes the Kimi chat template: transformers' `apply_chat_template` on the exported tokenizer
renders every conversation exactly as `k2_data.chat.render` (text) and `render_ids` (token ids)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from k2_data import load_tokenizer
from k2_data.chat import render, render_ids
from k2_data.chat.template import CHAT_TEMPLATE, CHAT_TEMPLATE_FILE, write_chat_template

transformers = pytest.importorskip("transformers")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'Météo du jour — 今日の天気 ("quoted", back\\slash)',
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {  # keys deliberately out of order: the tool_declare JSON sorts them
    "function": {
        "parameters": {"type": "object", "required": ["q"], "properties": {"q": {"type": "string"}}},
        "name": "search",
    },
    "type": "function",
}
TOOLS = [WEATHER, SEARCH]

TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris and Tokyo, and search for news?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            # an OpenAI-style id (rendered as functions.get_weather:0), arguments as an object: key order kept
            {
                "id": "call_abc",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "note": "été"}},
            },
            # a K2-shaped id naming the called function is kept, string arguments verbatim
            {
                "id": "functions.get_weather:5",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Tokyo"}'},
            },
            # a K2-shaped id of another function's name is re-numbered
            {
                "id": "functions.get_weather:9",
                "type": "function",
                "function": {"name": "search", "arguments": '{"q": "news"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 21C"},
    {
        "role": "tool",
        "tool_call_id": "functions.get_weather:5",
        "content": [{"type": "text", "text": "rain"}],
    },
    {"role": "tool", "tool_call_id": "functions.get_weather:9", "content": "no news\nat all"},
    {"role": "assistant", "content": "Paris is sunny; Tokyo has rain."},
]

CONVERSATIONS = {
    "plain": ([{"role": "user", "content": "Hello"}], None),
    "system": (
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"}],
        None,
    ),
    "multi_turn": (
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Bonjour !"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "How are "}, {"type": "text", "text": "you?"}],
            },
            {"role": "assistant", "content": "Très bien,\n  merci.\n"},
            {"role": "user", "content": "  spaces  and\ttabs \n"},
        ],
        None,
    ),
    "names": (
        [
            {"role": "user", "name": "alice", "content": "I am Alice."},
            {"role": "assistant", "name": "kimi", "content": "Hi Alice."},
            {"role": "user", "content": "中文和 emoji 🙂"},
        ],
        None,
    ),
    "tools_declared": ([{"role": "user", "content": "What can you do?"}], TOOLS),
    "tools_with_system": ([{"role": "system", "content": "Use tools."}, *TOOL_TURNS], TOOLS),
    "tool_calls": (TOOL_TURNS, TOOLS),
    "tool_calls_no_content": (
        [
            {"role": "user", "content": "Search twice."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "search", "arguments": {"q": "x"}}},
                    {"id": "b", "type": "function", "function": {"name": "search", "arguments": {"q": "y"}}},
                ],
            },
            {"role": "tool", "tool_call_id": "b", "content": "second"},
            {"role": "tool", "tool_call_id": "a", "name": "search_tool", "content": "first"},
            {"role": "tool", "tool_call_id": "unknown", "content": "orphan"},
            {"role": "user", "content": "And once more."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "search", "arguments": "{}"}},
                    {
                        "id": "functions.search:",  # not K2's shape (no index): re-numbered
                        "type": "function",
                        "function": {"name": "search", "arguments": "{}"},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "newest a"},
        ],
        TOOLS,
    ),
    "tools_empty_list": ([{"role": "user", "content": "No tools."}], []),
}

CASES = [(name, agp) for name in CONVERSATIONS for agp in (False, True)]


@pytest.fixture(scope="module")
def shipped_dir(tmp_path_factory) -> Path:
    """The shipped tokenizer as saved into an HF dir, with the template written as `k2 export` does."""
    d = tmp_path_factory.mktemp("tok")
    load_tokenizer().save(d)
    return write_chat_template(d)


@pytest.fixture(scope="module")
def exported_dir(tmp_path_factory) -> Path:
    """A real `k2 export` of a 1-step pretraining run of a small model."""
    from k2_model.testing import SMALL_OVERRIDES
    from k2_train import PretrainConfig, run_training

    from k2_stack.cli import main

    root = tmp_path_factory.mktemp("export")
    corpus = root / "corpus"
    corpus.mkdir()
    lines = Path(textwrap.__file__).read_text().splitlines()
    for i in range(8):
        (corpus / f"doc{i}.py").write_text("\n".join(lines[i * 40 : i * 40 + 40]) + "\n")
    cfg = PretrainConfig.flat(
        model_overrides=SMALL_OVERRIDES, steps=1, batch=2, micro_batch=2, seq_len=32, data=str(corpus),
        val_fraction=0.2, eval_every=0, save_every=0, threads=1, out=str(root / "run"), warmup_steps=0,
    )  # fmt: skip
    result = run_training(cfg, log=lambda _msg: None)
    out = root / "hf"
    assert main(["export", str(result.run_dir), "--out", str(out)]) == 0
    return out


def test_export_writes_the_template(exported_dir):
    assert (exported_dir / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8") == CHAT_TEMPLATE
    config = json.loads((exported_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["added_tokens_decoder"]  # the tokenizer's own config is kept, the template added to it
    hf = transformers.AutoTokenizer.from_pretrained(str(exported_dir))
    assert hf.chat_template == CHAT_TEMPLATE
    msgs, tools = CONVERSATIONS["tool_calls"]
    text = hf.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text == render(msgs, tools, add_generation_prompt=True)
    ids = hf.apply_chat_template(
        msgs, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(ids) == render_ids(load_tokenizer(exported_dir), msgs, tools, add_generation_prompt=True)


@pytest.mark.parametrize("name,add_generation_prompt", CASES)
def test_apply_chat_template_equals_render(shipped_dir, name, add_generation_prompt):
    hf = transformers.AutoTokenizer.from_pretrained(str(shipped_dir))
    tok = load_tokenizer(shipped_dir)
    msgs, tools = CONVERSATIONS[name]
    want = render(msgs, tools, add_generation_prompt=add_generation_prompt)
    got = hf.apply_chat_template(
        msgs, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert got == want
    ids = hf.apply_chat_template(
        msgs, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert list(ids) == render_ids(tok, msgs, tools, add_generation_prompt=add_generation_prompt)


def test_template_details(shipped_dir):
    hf = transformers.AutoTokenizer.from_pretrained(str(shipped_dir))
    msgs, tools = CONVERSATIONS["tool_calls"]
    text = hf.apply_chat_template(msgs, tools=tools, tokenize=False)
    # Kimi's tool_declare: sorted keys, compact separators, non-ASCII kept
    declared = json.dumps(TOOLS, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert text.startswith(f"<|im_system|>tool_declare<|im_middle|>{declared}<|im_end|>")
    assert "Météo" in text and "今日" in text
    # object arguments: default separators, key order kept; ids re-numbered across the conversation
    assert '{"city": "Paris", "days": 2, "note": "été"}' in text
    assert "<|tool_call_begin|>functions.search:2<|tool_call_argument_begin|>" in text
    assert (
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\nsunny, 21C<|im_end|>"
        in text
    )
    # the default system prompt only when the first message is not a system message
    assert "You are Kimi" in hf.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    sys_first = [{"role": "system", "content": "S"}, {"role": "user", "content": "x"}]
    assert "You are Kimi" not in hf.apply_chat_template(sys_first, tokenize=False)


def test_template_refuses_what_render_refuses(shipped_dir):
    hf = transformers.AutoTokenizer.from_pretrained(str(shipped_dir))
    bad = [
        [{"role": "robot", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}],
    ]
    for msgs in bad:
        with pytest.raises(ValueError):
            render(msgs)
        with pytest.raises(Exception, match="role|content parts|tool_calls"):
            hf.apply_chat_template(msgs, tokenize=False)

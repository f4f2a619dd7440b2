"""The released Kimi templates: k2's Python rendering equals Moonshot's files rendered by transformers."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
from k2_data.chat import render, render_ids, render_ids_with_mask
from k2_data.chat.released import RELEASED_TEMPLATES, sort_tools
from k2_data.chat.templates import released_template_text, template_provenance

sys.path.insert(0, str(Path(__file__).parent / "data"))
from chat_corpus import CORPUS

chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")


def reference(template: str, messages, tools, add_generation_prompt: bool) -> str:
    """transformers' own Jinja rendering of the stored file, tools sorted as Moonshot's tokenizer does."""
    out, _ = chat_template_utils.render_jinja_template(
        conversations=[messages],
        tools=sort_tools(tools) if tools is not None else None,
        chat_template=released_template_text(template),
        add_generation_prompt=add_generation_prompt,
    )
    return out[0]


@pytest.mark.parametrize("template", RELEASED_TEMPLATES)
@pytest.mark.parametrize("case", CORPUS, ids=[c[0] for c in CORPUS])
def test_render_is_byte_exact(template, case):
    _, messages, tools, gen = case
    assert render(messages, tools, add_generation_prompt=gen, template=template) == reference(
        template, messages, tools, gen
    )


def test_the_reference_has_the_released_features():
    # what the byte-exact tests compare against, spelled out once: ids as given, the 0905 tools header
    # and tool-result indent, the Thinking template's stripped history
    _, messages, tools, gen = next(c for c in CORPUS if c[0].startswith("tools, OpenAI ids"))
    inst = reference("kimi-k2-instruct-0905", messages, tools, gen)
    assert inst.startswith(
        '<|im_system|>tool_declare<|im_middle|>\n  # Tools\n  [{"function": {"description"'
    )
    assert "<|tool_call_begin|>call_abc123<|tool_call_argument_begin|>" in inst
    assert '<|im_system|>tool<|im_middle|>## Return of call_abc123\n    {"temp": 21}<|im_end|>' in inst
    assert "<|im_system|>search<|im_middle|>## Return of call_def456" in inst
    think = reference("kimi-k2-thinking", messages, tools, gen)
    assert '## Return of call_abc123\n{"temp": 21}' in think
    assert think.endswith(
        "<|im_assistant|>assistant<|im_middle|><think></think>21 °C, nothing new.<|im_end|>"
    )
    # and k2's own rendering differs exactly there (renamed ids), which is why it has its own name
    assert "call_abc123" not in render(messages, tools, gen)


def test_stored_files_match_their_provenance():
    prov = template_provenance()
    assert set(prov) == set(RELEASED_TEMPLATES)
    for name, entry in prov.items():
        assert len(entry["commit"]) == 40 and entry["repo"] and entry["path"]
        digest = hashlib.sha256(released_template_text(name).encode("utf-8")).hexdigest()
        assert digest == entry["sha256"], name


def test_tools_are_sorted_recursively_lists_kept():
    tools = [{"b": {"z": 1, "a": [{"y": 0, "x": 1}]}, "a": 0}]
    assert json.dumps(sort_tools(tools)) == '[{"a": 0, "b": {"a": [{"x": 1, "y": 0}], "z": 1}}]'
    assert tools[0]["b"]["z"] == 1 and list(tools[0]) == ["b", "a"]  # the input is not modified


def test_unknown_template_is_named():
    with pytest.raises(
        ValueError, match="template must be one of k2, kimi-k2-instruct-0905, kimi-k2-thinking"
    ):
        render([{"role": "user", "content": "x"}], template="kimi-k3")


def test_bad_messages_are_refused_by_field():
    with pytest.raises(ValueError, match=r"messages\[1\]: field 'role'"):
        render([{"role": "user", "content": "x"}, {"role": "robot"}], template="kimi-k2-thinking")
    bad_call = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "a"}]}]
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\]: field 'function'"):
        render(bad_call, template="kimi-k2-instruct-0905")


def test_render_ids_marks_think_only_where_the_vocabulary_has_it(k2_tokenizer):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "reasoning_content": "r", "content": "a"}]
    text = render(msgs, template="kimi-k2-thinking")
    ids = render_ids(k2_tokenizer, msgs, template="kimi-k2-thinking")
    # k2's small BPE reserves no <think>: it is spelled as text, and the ids decode to the rendered string
    assert k2_tokenizer.decode(ids) == text


def test_thinking_sft_trains_reasoning_of_the_target_and_open_steps(k2_tokenizer):
    _, messages, tools, _ = next(c for c in CORPUS if c[0].startswith("reasoning: history"))
    ids, mask = render_ids_with_mask(k2_tokenizer, messages, tools, template="kimi-k2-thinking")
    prompt = render(messages[:-1], tools, add_generation_prompt=True, template="kimi-k2-thinking")
    expected = prompt + "<think>It is 18.</think>18 °C in Lima.<|im_end|>"
    assert k2_tokenizer.decode(ids) == expected
    trained = k2_tokenizer.decode([t for t, m in zip(ids, mask) if m])
    # the open tool-call step (after the last final answer) and the target, each with its reasoning;
    # the earlier answer, whose reasoning the template drops, is context
    step = "<think>I should call the tool.</think><|tool_calls_section_begin|><|tool_call_begin|>"
    assert trained.startswith(step)
    assert trained.endswith("<think>It is 18.</think>18 °C in Lima.<|im_end|>")
    assert "first answer" not in trained and "old thoughts" not in k2_tokenizer.decode(ids)


def test_thinking_sft_needs_an_assistant_target(k2_tokenizer):
    with pytest.raises(ValueError, match="last message must be an assistant turn"):
        render_ids_with_mask(k2_tokenizer, [{"role": "user", "content": "x"}], template="kimi-k2-thinking")


@pytest.fixture(scope="module")
def k2_tokenizer():
    from k2_data import load_tokenizer

    return load_tokenizer()


def _random_conversation(rng):
    texts = ["", "hi", "日本語 ✓", "a\nb", '{"k": 1}', "<|im_end|>", "None", "  spaced  "]
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": rng.choice(texts)})
    for _ in range(rng.randint(0, 6)):
        role = rng.choice(["user", "assistant", "assistant", "tool", "system"])
        m = {"role": role}
        if rng.random() < 0.85:
            m["content"] = rng.choice([*texts, None, [{"type": "text", "text": "part"}]])
        if rng.random() < 0.2:
            m["name"] = rng.choice(["bob", "search", ""])
        if role == "assistant":
            if rng.random() < 0.5:
                m["reasoning_content"] = rng.choice(["think", "", None, "多 step"])
            if rng.random() < 0.5:
                calls = []
                for k in range(rng.randint(1, 3)):
                    args = rng.choice(['{"q": "x"}', {"q": "ü", "n": [1, 2.5]}, "raw", {}])
                    c = {
                        "type": "function",
                        "function": {"name": rng.choice(["search", "get_weather"]), "arguments": args},
                    }
                    if rng.random() < 0.8:
                        c["id"] = rng.choice([f"call_{k}", f"functions.search:{k}", str(k), None])
                    calls.append(c)
                m["tool_calls"] = calls
                if rng.random() < 0.5 and isinstance(m.get("content"), list):
                    m["content"] = "text"  # list content beside calls prints a Python list in 0905
        if role == "tool" and rng.random() < 0.9:
            m["tool_call_id"] = rng.choice(["call_0", "functions.search:1", "0"])
        msgs.append(m)
    return msgs


@pytest.mark.parametrize("template", RELEASED_TEMPLATES)
def test_random_conversations_are_byte_exact(template):
    import random

    rng = random.Random(template)
    for _ in range(300):
        msgs = _random_conversation(rng)
        tools = TOOLS_FOR_FUZZ if rng.random() < 0.5 else None
        gen = rng.random() < 0.5
        assert render(msgs, tools, gen, template=template) == reference(template, msgs, tools, gen), msgs


TOOLS_FOR_FUZZ = [
    {
        "type": "function",
        "function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {}}}},
    },
    {"function": {"description": "Wetter °C", "name": "get_weather"}, "type": "function"},
]

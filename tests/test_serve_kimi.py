"""k2 serve against the released Kimi formats: truncated calls, id normalisation and checks, thinking
templates (reasoning_content in and out, chat_template_kwargs), strict tool schemas only on request."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from k2_data import load_tokenizer
from k2_data.chat import normalize_tool_call_ids, render_ids

from k2_stack.serve.chat import chat_events, chat_response, plan_chat
from k2_stack.serve.common import Piece, ServeContext
from k2_stack.serve.protocol import APIError, ChatCompletionRequest

MARKERS = (
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call",
)
CALL = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>'
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
HISTORY = [
    {"role": "user", "content": "weather?"},
    {
        "role": "assistant",
        "reasoning_content": "call it",
        "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_abc", "content": "3 C"},
]


@pytest.fixture(scope="module")
def ctx() -> ServeContext:
    return ServeContext(
        model_name="m",
        tokenizer=load_tokenizer(),
        max_model_len=512,
        max_batch_size=4,
        vocab_size=8192,
        created=0,
        json_processor=lambda schema, strict: None,
        tool_call_processor=lambda tools, name, index: None,
    )


def _pieces(*items: Piece):
    async def gen():
        for p in items:
            yield p

    return gen()


def _events(ctx, plan, parts) -> list[dict]:
    async def run():
        return [x async for x in chat_events(ctx, plan, _pieces(*parts))]

    return [json.loads(line[6:]) for line in asyncio.run(run())[:-1]]


def _req(messages=None, **kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=messages or [{"role": "user", "content": "x"}], **kw)


def test_forced_call_cut_by_max_tokens_returns_the_text_before_it(ctx):
    plan = plan_chat(ctx, _req(tools=TOOLS, tool_choice="required", max_tokens=12))
    parts = [Piece(0, "Sure. ", 2, None), Piece(0, CALL[:70], 5, None), Piece(0, CALL[70:90], 5, "length")]
    (choice,) = asyncio.run(chat_response(ctx, plan, _pieces(*parts)))["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "Sure. " and choice["message"]["tool_calls"] is None
    events = _events(ctx, plan, parts)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Sure. " and not any(m in content for m in MARKERS)
    assert not any("tool_calls" in d for d in deltas)
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]] == [
        "length"
    ]


def test_a_complete_call_then_the_limit_is_still_length(ctx):
    plan = plan_chat(ctx, _req(tools=TOOLS))
    (choice,) = asyncio.run(chat_response(ctx, plan, _pieces(Piece(0, CALL, 9, "length"))))["choices"]
    assert choice["finish_reason"] == "length" and len(choice["message"]["tool_calls"]) == 1


def test_ids_are_normalised_before_rendering_unless_turned_off(ctx):
    for template in ("k2", "kimi-k2-instruct-0905"):
        c = dataclasses.replace(ctx, chat_template=template)
        plan = plan_chat(c, _req(HISTORY, tools=TOOLS))
        expected = normalize_tool_call_ids(HISTORY)
        ids = render_ids(c.tokenizer, expected, TOOLS, add_generation_prompt=True, template=template)
        assert plan.prompt_ids == ids
        assert "call_abc" not in c.tokenizer.decode(plan.prompt_ids)
    raw = dataclasses.replace(ctx, chat_template="kimi-k2-instruct-0905", normalize_ids=False)
    assert "call_abc" in raw.tokenizer.decode(plan_chat(raw, _req(HISTORY, tools=TOOLS)).prompt_ids)


def test_tool_message_answering_no_call_is_named(ctx):
    bad = HISTORY[:2] + [{"role": "tool", "tool_call_id": "call_zzz", "content": "?"}]
    with pytest.raises(APIError) as e:
        plan_chat(ctx, _req(bad, tools=TOOLS))
    assert (e.value.status, e.value.param) == (400, "messages[2].tool_call_id")
    assert "'call_zzz' matches no tool call" in str(e.value)
    orphan = [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "a", "content": "?"}]
    with pytest.raises(APIError) as e:
        plan_chat(ctx, _req(orphan))
    assert e.value.param == "messages[1].tool_call_id"


def test_chat_template_kwargs(ctx):
    think = dataclasses.replace(ctx, chat_template="kimi-k2-thinking")
    on = plan_chat(think, _req())
    off = plan_chat(think, _req(chat_template_kwargs={"thinking": False}))
    assert on.reasoning and not off.reasoning
    assert ctx.tokenizer.decode(off.prompt_ids) == ctx.tokenizer.decode(on.prompt_ids) + "<think></think>"
    assert (
        plan_chat(ctx, _req(chat_template_kwargs={"thinking": False})).prompt_ids
        == plan_chat(ctx, _req()).prompt_ids
    )
    for kwargs, param in [
        ({"foo": 1}, "chat_template_kwargs.foo"),
        ({"thinking": "no"}, "chat_template_kwargs.thinking"),
    ]:
        with pytest.raises(APIError) as e:
            plan_chat(ctx, _req(chat_template_kwargs=kwargs))
        assert (e.value.status, e.value.param) == (400, param)


def test_reasoning_content_in_the_prompt_and_out_of_the_reply(ctx):
    think = dataclasses.replace(ctx, chat_template="kimi-k2-thinking")
    plan = plan_chat(think, _req(HISTORY, tools=TOOLS))
    assert "<think>call it</think>" in think.tokenizer.decode(plan.prompt_ids)  # an open tool-call step
    reply = "<think>It is 3 C.</think>Cold: 3 C."
    parts = [Piece(0, reply[:4], 1, None), Piece(0, reply[4:20], 3, None), Piece(0, reply[20:], 3, "stop")]
    (choice,) = asyncio.run(chat_response(think, plan, _pieces(*parts)))["choices"]
    assert choice["message"]["reasoning_content"] == "It is 3 C."
    assert choice["message"]["content"] == "Cold: 3 C." and choice["finish_reason"] == "stop"
    deltas = [e["choices"][0]["delta"] for e in _events(think, plan, parts) if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "It is 3 C."
    assert "".join(d.get("content") or "" for d in deltas) == "Cold: 3 C."
    # a thinking reply that calls a tool after reasoning
    parts = [Piece(0, "<think>need data</think>" + CALL, 9, "stop")]
    (choice,) = asyncio.run(chat_response(think, plan, _pieces(*parts)))["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "need data"
    # k2's own template has no reasoning field
    (choice,) = asyncio.run(chat_response(ctx, plan_chat(ctx, _req()), _pieces(Piece(0, "hi", 1, "stop"))))[
        "choices"
    ]
    assert "reasoning_content" not in choice["message"]


def test_tool_schemas_are_strict_only_when_asked():
    pytest.importorskip("llguidance")
    from k2_stack.serve.guided import tool_grammars

    # valid JSON Schema: `required` names a property the schema does not declare (allowed unless strict)
    params = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    assert "f" in tool_grammars([tool])
    with pytest.raises(ValueError, match="tools: function 'f' parameters"):
        tool_grammars([{"type": "function", "function": {"name": "f", "parameters": params, "strict": True}}])


def test_a_malformed_message_is_named_with_its_index(ctx):
    bad = [{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "audio"}]}]
    with pytest.raises(APIError) as e:
        plan_chat(ctx, _req(bad))
    assert (e.value.status, e.value.param) == (400, "messages[1].content[0].type")
    bad = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": ""}}]},
    ]
    with pytest.raises(APIError) as e:
        plan_chat(ctx, _req(bad))
    assert e.value.param == "messages[1].tool_calls[0].function.name"

"""k2 serve's request translators without a server: chat and completions plans from requests,
and response bodies / SSE streams from engine pieces fed by hand."""

from __future__ import annotations

import asyncio
import json

import pytest
from k2_data import load_tokenizer
from k2_data.chat import render_ids

from k2_stack.serve.chat import chat_events, chat_response, plan_chat
from k2_stack.serve.common import Piece, ServeContext
from k2_stack.serve.completions import completion_events, completion_response, plan_completion
from k2_stack.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest

CALL = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Oslo"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1'
    '<|tool_call_argument_begin|>{"city": "Bergen"}<|tool_call_end|><|tool_calls_section_end|>'
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


class _Processor:
    """A stand-in logits processor that remembers what built it."""

    def __init__(self, *tag) -> None:
        self.tag = tag

    def __call__(self, token_ids, logits):
        return logits


@pytest.fixture(scope="module")
def ctx() -> ServeContext:
    return ServeContext(
        model_name="m",
        tokenizer=load_tokenizer(),
        max_model_len=256,
        max_batch_size=4,
        vocab_size=8192,
        created=0,
        json_processor=lambda schema, strict: _Processor("json", schema, strict),
        tool_call_processor=lambda tools, name, index: _Processor("tool", name, index),
    )


def _pieces(*items: Piece):
    async def gen():
        for p in items:
            yield p

    return gen()


def _collect(agen) -> list[str]:
    async def run():
        return [x async for x in agen]

    return asyncio.run(run())


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "weather?"}], **kw)


def test_chat_plan_renders_the_kimi_prompt_and_names_bad_fields(ctx):
    plan = plan_chat(ctx, _chat(tools=TOOLS, max_tokens=8))
    msgs = [{"role": "user", "content": "weather?"}]
    assert plan.prompt_ids == render_ids(ctx.tokenizer, msgs, tools=TOOLS, add_generation_prompt=True)
    assert plan.params.max_tokens == 8 and plan.parse_tools
    forced = plan_chat(
        ctx, _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    assert [p.tag for p in forced.params.logits_processors] == [("tool", "get_weather", 0)]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = plan_chat(ctx, _chat(response_format={"type": "json_schema", "json_schema": {"schema": schema}}))
    assert [p.tag for p in rf.params.logits_processors] == [("json", schema, False)]
    cases = [
        (dict(model="other"), 404, "model"),
        (dict(tool_choice="required"), 400, "tool_choice"),
        (dict(max_tokens=10_000), 400, "messages"),
        (dict(top_logprobs=3), 400, "top_logprobs"),
        (dict(n=9), 400, "n"),
    ]
    for kw, status, param in cases:
        req = ChatCompletionRequest(**{"model": "m", "messages": [{"role": "user", "content": "x"}], **kw})
        with pytest.raises(APIError) as e:
            plan_chat(ctx, req)
        assert (e.value.status, e.value.param) == (status, param), kw


def test_chat_response_and_stream_agree_on_tool_calls(ctx):
    plan = plan_chat(ctx, _chat(tools=TOOLS, stream_options={"include_usage": True}))
    parts = [Piece(0, "Checking. ", 2, None), Piece(0, CALL[:40], 3, None), Piece(0, CALL[40:], 5, "stop")]
    body = asyncio.run(chat_response(ctx, plan, _pieces(*parts)))
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking. "
    calls = choice["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"}, {"city": "Bergen"}]
    assert body["usage"] == {
        "prompt_tokens": len(plan.prompt_ids),
        "completion_tokens": 10,
        "total_tokens": len(plan.prompt_ids) + 10,
    }

    lines = _collect(chat_events(ctx, plan, _pieces(*parts)))
    assert lines[-1] == "data: [DONE]\n\n"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content") or "" for d in deltas) == "Checking. "
    streamed = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            entry = streamed.setdefault(c["index"], {"name": "", "arguments": ""})
            entry["name"] += c.get("function", {}).get("name") or ""
            entry["arguments"] += c.get("function", {}).get("arguments") or ""
    assert [json.loads(streamed[i]["arguments"]) for i in sorted(streamed)] == [
        {"city": "Oslo"},
        {"city": "Bergen"},
    ]
    finishes = [
        e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]
    ]
    assert finishes == ["tool_calls"]
    assert events[-1]["usage"]["completion_tokens"] == 10  # include_usage: a last chunk without choices


def test_parallel_tool_calls_false_shows_the_first_call_only(ctx):
    plan = plan_chat(ctx, _chat(tools=TOOLS, parallel_tool_calls=False))
    body = asyncio.run(chat_response(ctx, plan, _pieces(Piece(0, CALL, 7, "stop"))))
    assert [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    plan = plan_chat(ctx, _chat(tools=TOOLS, tool_choice="none"))  # no parsing: the text as it came
    body = asyncio.run(chat_response(ctx, plan, _pieces(Piece(0, "plain", 1, "length"))))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "plain", "tool_calls": None}
    assert body["choices"][0]["finish_reason"] == "length"


def test_completions_order_choices_by_prompt_then_sample_and_echo(ctx):
    req = CompletionRequest(model="m", prompt=["ab", "cd"], n=2, echo=True, max_tokens=4)
    plan = plan_completion(ctx, req)
    assert plan.prompts == [ctx.tokenizer.encode("ab"), ctx.tokenizer.encode("cd")] and plan.n_choices == 4
    pieces = [(1, Piece(0, "X", 1, None)), (0, Piece(1, "Y", 1, "length")), (1, Piece(0, "Z", 1, "stop"))]

    async def merged():
        for item in pieces:
            yield item

    body = asyncio.run(completion_response(ctx, plan, merged()))
    assert [c["text"] for c in body["choices"]] == ["ab", "abY", "cdXZ", "cd"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length", "stop", "stop"]
    lines = _collect(completion_events(ctx, plan, merged()))
    texts = [json.loads(x[6:])["choices"][0] for x in lines[:-1]]
    assert [(c["index"], c["text"]) for c in texts[:4]] == [
        (0, "ab"),
        (1, "ab"),
        (2, "cd"),
        (3, "cd"),
    ]  # echoes first
    assert [(c["index"], c["text"]) for c in texts[4:]] == [(2, "X"), (1, "Y"), (2, "Z")]
    with pytest.raises(APIError) as e:
        plan_completion(ctx, CompletionRequest(model="m", prompt=[[1, 99999]]))
    assert e.value.param == "prompt"

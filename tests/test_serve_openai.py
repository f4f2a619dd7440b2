"""`k2 serve`'s OpenAI fields (n, logprobs, seed, response_format, stop, max_completion_tokens,
parallel_tool_calls), unsupported fields, error shapes, /metrics, prefix caching across turns and
`k2 serve`'s argument errors — with the official `openai` client on loopback.

References: the model's forward (log_softmax) for logprobs, single seeded requests for the samples
of an `n` request, JSON schemas for structured output.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
import torch
from k2_data.chat import render_ids
from k2_model.engine import sample_seed

from k2_stack.serve import build_bridge

USER = [{"role": "user", "content": "Tell me a story about a cat."}]
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 999},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "population", "coastal"],
}


@pytest.fixture(scope="module")
def server(serving):
    torch.set_num_threads(1)
    bridge = build_bridge(None, "tiny", max_model_len=512, seed=0, block_size=16, log_stats_interval=0)
    try:
        with serving(bridge, ckpt_rank=None) as (client, url):
            yield bridge, client, url
    finally:
        bridge.close()


def _chat(client, **kw):
    return client.chat.completions.create(model="tiny", **({"messages": USER} | kw))


def test_n_samples_share_one_prefill_and_equal_single_seeded_requests(server):
    bridge, client, _ = server
    prompt = render_ids(bridge.tokenizer, USER, add_generation_prompt=True)
    before = bridge.engine.stats.prompt_tokens
    r = _chat(client, n=3, seed=11, temperature=1.0, max_tokens=10)
    assert bridge.engine.stats.prompt_tokens - before == len(prompt)  # one request, prefilled once
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 3
    for i, c in enumerate(r.choices):
        alone = _chat(client, seed=sample_seed(11, i), temperature=1.0, max_tokens=10)
        assert alone.choices[0].message.content == c.message.content
    assert r.usage.prompt_tokens == len(prompt)
    # streaming: the same three choices, interleaved by index
    chunks = list(_chat(client, n=3, seed=11, temperature=1.0, max_tokens=10, stream=True))
    texts = ["", "", ""]
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content or "" for c in r.choices]


def test_chat_logprobs_equal_the_forward_and_stream_the_same(server):
    bridge, client, _ = server
    prompt = render_ids(bridge.tokenizer, USER, add_generation_prompt=True)
    r = _chat(client, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3, stop=None)
    content = r.choices[0].logprobs.content
    ids = bridge.tokenizer.encode(r.choices[0].message.content or "")
    n = len(content)
    assert n >= 1
    with torch.no_grad():
        gen = []
        ids_all = list(prompt)
        for _ in range(n):  # greedy reference
            logits = bridge.model(torch.tensor([ids_all])).logits[0, -1]
            lp = torch.log_softmax(logits, -1)
            t = int(lp.argmax())
            gen.append((t, float(lp[t]), lp.topk(3)))
            ids_all.append(t)
    for entry, (t, lp, top) in zip(content, gen):
        assert entry.token == bridge.tokenizer.decode([t])
        assert abs(entry.logprob - lp) < 1e-4
        assert [x.logprob for x in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token
    del ids
    s = list(_chat(client, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3, stream=True))
    streamed = [e.logprob for ch in s for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content], abs=1e-6)
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, top_logprobs=3)
    assert e.value.body["param"] == "top_logprobs"


def test_completions_logprobs_and_n(server):
    bridge, client, _ = server
    ids = bridge.tokenizer.encode("The weather today is")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens) == r.choices[0].text
    with torch.no_grad():
        toks = bridge.tokenizer.encode(r.choices[0].text)
        logits = bridge.model(torch.tensor([ids + toks])).logits[0, len(ids) - 1 : -1]
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(toks)[:, None])[:, 0]
    if len(toks) == len(lp.token_logprobs):  # the text re-tokenises to the same ids (usual for greedy)
        assert lp.token_logprobs == pytest.approx(ref.tolist(), abs=1e-4)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    rb = client.completions.create(
        model="tiny", prompt=["a b c", "x y z"], max_tokens=4, n=2, temperature=1, seed=3
    )
    assert [c.index for c in rb.choices] == [0, 1, 2, 3]


def test_seed_reproducible_and_max_completion_tokens(server):
    _, client, _ = server
    a = _chat(client, seed=5, temperature=1.0, max_completion_tokens=6)
    b = _chat(client, seed=5, temperature=1.0, max_completion_tokens=6)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens <= 6


def test_response_format_json_schema_strict_and_json_object(server):
    _, client, _ = server
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    for seed in range(2):  # a random model: every sample is valid JSON of the schema
        r = _chat(client, response_format=fmt, temperature=1.0, seed=seed, max_tokens=120, n=2)
        for c in r.choices:
            assert c.finish_reason == "stop", c.message.content
            obj = json.loads(c.message.content)
            assert set(obj) == {"city", "population", "coastal"}
            assert obj["city"] in {"Paris", "Tokyo", "Lima"} and isinstance(obj["population"], int)
    r = _chat(client, response_format={"type": "json_object"}, temperature=0.7, seed=1, max_tokens=120)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a JSON object's prefix
        assert r.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError) as e:
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
        _chat(client, response_format=bad)
    assert e.value.body["param"].startswith("response_format")


def test_parallel_tool_calls_and_stop(server):
    _, client, _ = server
    tool = {"type": "function", "function": {"name": "f", "parameters": CITY}}
    r = _chat(client, tools=[tool], tool_choice="required", parallel_tool_calls=False, max_tokens=120, seed=0)
    assert len(r.choices[0].message.tool_calls) == 1
    full = _chat(client, temperature=0, max_tokens=12).choices[0].message.content
    stop = full[4:6]
    r = _chat(client, temperature=0, max_tokens=12, stop=stop)
    assert (
        r.choices[0].finish_reason == "stop"
        and (r.choices[0].message.content or "") == full[: full.find(stop)]
    )


@pytest.mark.parametrize(
    "field,value",
    [
        ("logit_bias", {"5": 10}),
        ("presence_penalty", 0.5),
        ("frequency_penalty", 1.0),
        ("audio", {"voice": "x", "format": "wav"}),
        ("functions", [{"name": "f"}]),
        ("no_such_field", 1),
    ],
)
def test_unsupported_fields_are_400_naming_them(server, field, value):
    _, client, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, max_tokens=2, extra_body={field: value})
    assert e.value.body["param"] == field and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", suffix="y", max_tokens=2)
    assert e.value.body["param"] == "suffix"


def test_error_shapes_for_bad_bodies_and_routes(server):
    _, _, base = server
    keys = {"message", "type", "param", "code"}
    r = httpx.post(
        f"{base}/v1/chat/completions",
        content=b'{"model": "tiny", "messages": [}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and set(r.json()["error"]) == keys
    assert r.json()["error"]["param"] is None and "character" in r.json()["error"]["message"]
    r = httpx.post(
        f"{base}/v1/chat/completions",
        content=b'{"model": "\xff\xfe"}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and set(r.json()["error"]) == keys and r.json()["error"]["param"] is None
    r = httpx.get(f"{base}/v1/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == keys and r.json()["error"]["param"] is None
    r = httpx.get(f"{base}/v1/chat/completions")
    assert r.status_code == 405 and set(r.json()["error"]) == keys
    r = httpx.post(
        f"{base}/v1/chat/completions", json={"model": "tiny", "messages": USER, "temperature": "hot"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_prefix_cache_across_turns_and_metrics(server):
    bridge, client, base = server
    system = {"role": "system", "content": "You are a helpful assistant. " * 20}
    turn1 = [system, {"role": "user", "content": "First question?"}]
    r1 = client.chat.completions.create(model="tiny", messages=turn1, max_tokens=6, temperature=0)
    turn2 = turn1 + [
        {"role": "assistant", "content": r1.choices[0].message.content or ""},
        {"role": "user", "content": "And a second one?"},
    ]
    s = bridge.engine.stats
    before = (s.prompt_tokens, s.prefilled_tokens, s.cached_tokens)
    r2 = client.chat.completions.create(model="tiny", messages=turn2, max_tokens=6, temperature=0)
    prompt2 = render_ids(bridge.tokenizer, turn2, add_generation_prompt=True)
    cached = s.cached_tokens - before[2]
    assert cached >= 160  # the system prompt's blocks at least
    assert s.prefilled_tokens - before[1] == len(prompt2) - cached
    # the answer equals recomputation without any cache
    with torch.no_grad():
        ids = list(prompt2)
        for _ in range(r2.usage.completion_tokens):
            ids.append(int(bridge.model(torch.tensor([ids])).logits[0, -1].argmax()))
    gen = ids[len(prompt2) :]
    stops = bridge.engine.eos_token_ids
    text_ids = gen[:-1] if gen[-1] in stops else gen
    assert (r2.choices[0].message.content or "") == bridge.tokenizer.decode(text_ids)
    text = httpx.get(f"{base}/metrics").text
    for name in (
        "k2:num_requests_running",
        "k2:num_requests_waiting",
        "k2:prompt_tokens_total",
        "k2:generation_tokens_total",
        "k2:time_to_first_token_seconds_bucket",
        "k2:inter_token_latency_seconds_count",
        "k2:kv_cache_usage_perc",
        "k2:prefix_cache_hit_rate",
    ):
        assert f"\n{name}" in "\n" + text, name
    metric = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert metric["k2:prompt_tokens_total"] == s.prompt_tokens
    assert metric["k2:prefix_cache_hit_rate"] == pytest.approx(s.cached_tokens / s.prompt_tokens)
    assert "prefix hit" in bridge.metrics.summary(bridge.engine)


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "k2_stack", "serve", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow  # starts `python -m k2_stack` processes
def test_cli_argument_errors_are_one_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"preset": "tiny"}')
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    for args, needle in (
        (["--model", str(tmp_path / "missing")], "--model"),
        (["--model", str(run)], "k2 export"),
        (["--preset", "huge"], "--preset"),
        (["--preset", "tiny", "--kv-cache-tokens", "0"], "--kv-cache-tokens"),
    ):
        p = _serve(*args)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr, p.stderr

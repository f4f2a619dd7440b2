"""`k2 serve` against the official `openai` client on loopback: a live uvicorn server in a thread.

References: greedy tokens by full recomputation (`model(ids).logits[-1].argmax()` each step) on the
same model, the chat template's `render_ids`, and the tool's JSON schema.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from k2_ckpt.launch import free_port
from k2_data.chat import render_ids

from k2_stack.serve import build_bridge, create_app

MAX_LEN = 512
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "strict": True,  # exactly these keys (without it extra properties are allowed, as in OpenAI)
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                "metric": {"type": "boolean"},
            },
            "required": ["city", "metric"],
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"q": {"type": "string", "maxLength": 10}},
            "required": ["q"],
        },
    },
}


@pytest.fixture(scope="module")
def server(serving):
    torch.set_num_threads(1)  # tiny model on shared cores: OpenMP threads only wait for each other
    bridge = build_bridge(None, "tiny", max_model_len=MAX_LEN, seed=0)
    try:
        with serving(bridge) as (client, url):
            yield bridge, client, url
    finally:
        bridge.close()


def _greedy_reference(model, prompt_ids: list[int], n: int, stop_ids: set[int]) -> list[int]:
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            if tok in stop_ids:
                break
            ids.append(tok)
    return out


def _stop_ids(bridge) -> set[int]:
    return set(bridge.engine.eos_token_ids)


def test_models_and_health(server):
    bridge, client, base = server
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}


def test_chat_greedy_equals_full_recomputation(server):
    bridge, client, _ = server
    messages = [{"role": "user", "content": "Name three colours."}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    prompt = render_ids(bridge.tokenizer, messages, add_generation_prompt=True)
    ref = _greedy_reference(bridge.model, prompt, 12, _stop_ids(bridge))
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(ref)
    text_ids = ref[:-1] if ref[-1] in _stop_ids(bridge) else ref
    assert r.choices[0].message.content == (bridge.tokenizer.decode(text_ids) or None)
    assert r.choices[0].finish_reason == ("stop" if len(text_ids) < len(ref) else "length")
    assert r.choices[0].message.tool_calls is None
    assert r.object == "chat.completion" and r.model == "tiny"


def test_streaming_matches_non_streaming(server):
    bridge, client, _ = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_stop_string_finishes_with_stop(server):
    bridge, client, _ = server
    messages = [{"role": "user", "content": "Count."}]
    text = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    content = text.choices[0].message.content
    stop = content[len(content) // 2 : len(content) // 2 + 2]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == (content[: content.find(stop)] or None)


def test_concurrent_requests_share_the_engine(server):
    bridge, client, _ = server
    prompts = [f"Question number {i}: {'why ' * i}?" for i in range(6)]

    def ask(p: str):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": p}], max_tokens=8, temperature=0
        )

    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(ask, prompts))
    for p, r in zip(prompts, results):
        prompt = render_ids(bridge.tokenizer, [{"role": "user", "content": p}], add_generation_prompt=True)
        ref = _greedy_reference(bridge.model, prompt, 8, _stop_ids(bridge))
        assert r.usage.completion_tokens == len(ref)
        text_ids = ref[:-1] if ref[-1] in _stop_ids(bridge) else ref
        assert r.choices[0].message.content == (bridge.tokenizer.decode(text_ids) or None)


def test_completions_endpoint(server):
    bridge, client, _ = server
    ids = bridge.tokenizer.encode("The capital of France is")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    ref = _greedy_reference(bridge.model, ids, 6, _stop_ids(bridge))
    text_ids = ref[:-1] if ref[-1] in _stop_ids(bridge) else ref
    assert r.choices[0].text == bridge.tokenizer.decode(text_ids)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref)
    s = list(
        client.completions.create(
            model="tiny", prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in s) == r.choices[0].text
    # a batch of prompts: one choice each, generated together, each equal to its own reference
    batch = ["Once upon a time", "1, 2, 3,", "def main():"]
    rb = client.completions.create(model="tiny", prompt=batch, max_tokens=5, temperature=0)
    assert [c.index for c in rb.choices] == [0, 1, 2]
    for p, c in zip(batch, rb.choices):
        ref = _greedy_reference(bridge.model, bridge.tokenizer.encode(p), 5, _stop_ids(bridge))
        assert c.text == bridge.tokenizer.decode(ref[:-1] if ref[-1] in _stop_ids(bridge) else ref)
    sb = list(client.completions.create(model="tiny", prompt=batch, max_tokens=5, temperature=0, stream=True))
    for i, c in enumerate(rb.choices):
        assert "".join(x.choices[0].text for x in sb if x.choices[0].index == i) == c.text


def _check_weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city", "metric"}
    assert args["city"] in {"Paris", "Tokyo", "Lima"} and isinstance(args["metric"], bool)
    return args


def test_tool_loop_required_then_auto(server):
    bridge, client, _ = server
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    tools = [WEATHER, LOOKUP]
    for seed in range(3):  # a random model: every sampled call still parses and fits its schema
        r = client.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=tools,
            tool_choice="required",
            max_tokens=64,
            temperature=1.0,
            seed=seed,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.id == f"functions.{call.function.name}:0" and call.type == "function"
        if call.function.name == "get_weather":
            _check_weather_args(call.function.arguments)
        else:
            assert call.function.name == "lookup"
            q = json.loads(call.function.arguments)
            assert set(q) == {"q"} and len(q["q"]) <= 10
    # the client runs the tool and sends the result; the model continues under "auto"
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"},
    ]
    r2 = client.chat.completions.create(
        model="tiny", messages=messages, tools=tools, tool_choice="auto", max_tokens=8, temperature=0
    )
    assert r2.usage.prompt_tokens == len(
        render_ids(bridge.tokenizer, messages, tools=tools, add_generation_prompt=True)
    )
    assert r2.choices[0].finish_reason in {"stop", "length", "tool_calls"}


def test_named_tool_choice_streaming(server):
    bridge, client, _ = server
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[LOOKUP, WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
        temperature=0.8,
        seed=7,
        stream=True,
    )
    name, args, finish = None, "", None
    for c in stream:
        d = c.choices[0].delta
        for tc in d.tool_calls or []:
            assert tc.index == 0
            name = tc.function.name or name
            args += tc.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    assert name == "get_weather" and finish == "tool_calls"
    _check_weather_args(args)


def test_errors_in_openai_shape(server):
    bridge, client, base = server
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=user)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])
    assert e.value.status_code == 400 and "messages" in e.value.body["param"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=user, max_tokens=MAX_LEN)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "word " * MAX_LEN}]
        )
    assert e.value.body["code"] == "context_length_exceeded"
    for field, value in (("temperature", -1.0), ("top_p", 0.0), ("max_tokens", 0)):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=user, **{field: value})
        assert e.value.body["param"] == field, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny",
            messages=user,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert e.value.body["param"] == "tool_choice"
    bad_schema = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}},
    }
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny", messages=user, tools=[bad_schema], tool_choice="required"
        )
    assert e.value.body["param"] == "tools" and "strin" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=user, n=10**4)
    assert e.value.body["param"] == "n"  # n beyond max_batch_size
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[0, 10**6], max_tokens=2)
    assert e.value.body["param"] == "prompt"
    raw = httpx.post(
        f"{base}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}


def test_weight_update_while_serving(server):
    bridge, client, _ = server
    messages = [{"role": "user", "content": "Say something."}]
    prompt = render_ids(bridge.tokenizer, messages, add_generation_prompt=True)
    old = bridge.model.lm_head.weight.detach().clone()
    try:
        new = torch.randn(old.shape, generator=torch.Generator().manual_seed(5)) * old.std()
        new[bridge.tokenizer.encode("ok")[0]] += 50 * old.std()  # the new weights make one token the argmax
        assert bridge.update_weights({"lm_head.weight": new}) == ["lm_head.weight"]
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
        ref = _greedy_reference(bridge.model, prompt, 4, _stop_ids(bridge))
        assert r.choices[0].message.content == bridge.tokenizer.decode(ref)
        assert r.choices[0].message.content.startswith("ok")
        with pytest.raises(KeyError):
            bridge.update_weights({"no.such.weight": new})
    finally:
        bridge.update_weights({"lm_head.weight": old})


def test_ckpt_update_into_live_server(server):
    """A k2-ckpt ParameterServer (one-rank gloo group) pushes new weights through the receiver mounted at /ckpt."""
    import torch.distributed as dist
    from k2_ckpt import ParameterServer

    bridge, client, base = server
    messages = [{"role": "user", "content": "Weights?"}]
    prompt = render_ids(bridge.tokenizer, messages, add_generation_prompt=True)
    old = {n: p.detach().clone() for n, p in bridge.model.named_parameters() if n.startswith("lm_head")}
    new = {
        n: torch.randn(t.shape, generator=torch.Generator().manual_seed(11)) * t.std() for n, t in old.items()
    }
    created = not dist.is_initialized()  # another test in this process may hold a group already
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ps = ParameterServer()
    try:
        ps.register_checkpoint("v2", named_tensors=new)

        def req_func(zmq_handles: dict[str, str]) -> None:
            r = httpx.post(
                f"{base}/ckpt/v1/update_weights_from_ipc", json={"zmq_handles": zmq_handles}, timeout=60
            )
            r.raise_for_status()

        ps.update("v2", req_func)
        assert all(torch.equal(dict(bridge.model.named_parameters())[n], t) for n, t in new.items())
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
        ref = _greedy_reference(bridge.model, prompt, 5, _stop_ids(bridge))
        assert r.usage.completion_tokens == len(ref)
        text_ids = ref[:-1] if ref[-1] in _stop_ids(bridge) else ref
        assert r.choices[0].message.content == (bridge.tokenizer.decode(text_ids) or None)
    finally:
        ps.close()
        if created:
            dist.destroy_process_group()
        bridge.update_weights(old)


@pytest.mark.slow  # starts `python -m k2_stack` processes
def test_cli_starts_the_server():
    """`k2 serve --preset tiny --port P` (the README's command) answers /health and a chat request."""
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "k2_stack",
            "serve",
            "--preset",
            "tiny",
            "--port",
            str(port),
            "--served-model-name",
            "k2-tiny",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "k2 serve did not start in 60 s"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["k2-tiny"]
        r = client.chat.completions.create(
            model="k2-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert r.usage.completion_tokens <= 3 and r.choices[0].finish_reason in {"stop", "length"}
    finally:
        proc.terminate()
        proc.wait(10)


def test_model_dir_checkpoint(tmp_path):
    """`--model DIR`: an HF-format checkpoint saved by k2-model; served under the directory's name, greedy
    output equal to the saved model's reference."""
    from fastapi.testclient import TestClient
    from k2_model import K2Config, K2ForCausalLM

    torch.manual_seed(3)
    saved = K2ForCausalLM(K2Config.preset("tiny")).eval()
    ckpt = tmp_path / "my-k2"
    saved.save_pretrained(str(ckpt))
    bridge = build_bridge(str(ckpt), None, max_model_len=128, device="cpu")
    try:
        with TestClient(create_app(bridge, ckpt_rank=None)) as http:
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["my-k2"]
            ids = bridge.tokenizer.encode("Hello world")
            r = http.post(
                "/v1/completions", json={"model": "my-k2", "prompt": ids, "max_tokens": 6, "temperature": 0}
            ).json()
        ref = _greedy_reference(saved, ids, 6, _stop_ids(bridge))
        assert r["choices"][0]["text"] == bridge.tokenizer.decode(
            ref[:-1] if ref[-1] in _stop_ids(bridge) else ref
        )
    finally:
        bridge.close()
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_bridge(str(tmp_path), None)


def test_client_disconnect_aborts_the_request(server):
    bridge, client, base = server
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Go on forever."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    aborted = bridge.num_aborted
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert all(not x or x.startswith("data: {") for x in got)
    deadline = time.time() + 10
    while bridge.engine.has_unfinished():  # aborted long before its 400 tokens
        assert time.time() < deadline, "the engine kept generating for a closed stream"
        time.sleep(0.05)
    assert bridge.num_aborted == aborted + 1

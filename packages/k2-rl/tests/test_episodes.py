"""Multi-turn episodes (`k2 rl --env`): the environments' scores, token in/token out with the
trainer's mask, the continuity metric, failing environments, K1.5's length reward, and a run that
is stopped and resumed against an uninterrupted one."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from k2_data import load_tokenizer
from k2_rl.config import RLConfig
from k2_rl.envs import get_env
from k2_rl.envs.base import Score, Step, call_score, combine
from k2_rl.envs.kvstore import state_score
from k2_rl.episodes import EpisodeRunner, episode_batch, first_difference
from k2_rl.rewards.length import add_length_reward, length_coef_at, length_rewards
from k2_rl.rollout import Sample

TOK = load_tokenizer()
IM_END = TOK.token_to_id("<|im_end|>")


def call_text(name: str, args: str, idx: int = 0) -> str:
    return (
        f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:{idx}"
        f"<|tool_call_argument_begin|>{args}<|tool_call_end|><|tool_calls_section_end|>"
    )


IM_ASSISTANT = TOK.token_to_id("<|im_assistant|>")


class ScriptedEngine:
    """`generate` answering with `respond(prompt_text, turn, sample)` (turn from the prompt's assistant
    headers); records the prompts of every call."""

    def __init__(self, respond):
        self.respond = respond
        self.calls: list[list[list[int]]] = []

    def __call__(self, prompts, n, seed, temperature, top_p, max_tokens):
        self.calls.append([list(p) for p in prompts])
        out = []
        for prompt in prompts:
            turn = prompt.count(IM_ASSISTANT) - 1
            text = TOK.decode(prompt)
            group = []
            for k in range(n):
                ids = TOK.encode(self.respond(text, turn, k), allow_special=True)[:max_tokens] + [IM_END]
                # routing as a recording engine reports it: every position but the last sampled
                # one, here expert (position % 4) in one MoE layer (k2_rl.routing)
                pos = torch.arange(len(prompt) + len(ids) - 1, dtype=torch.int16) % 4
                group.append(Sample(ids, [-0.5] * len(ids), "stop", pos.view(-1, 1, 1)))
            out.append(group)
        return out


def scripted(*turns):
    """The same text for every episode at each turn (the last one repeated)."""
    return ScriptedEngine(lambda _text, turn, _k: turns[min(turn, len(turns) - 1)])


def _cfg(**kw) -> RLConfig:
    base = dict(env="kvstore", max_turns=3, max_response_tokens=64, max_episode_tokens=512, env_timeout_s=5.0)
    base.update(kw)
    return RLConfig.flat(**base)


def _kv_tasks():
    return [
        {
            "messages": [{"role": "user", "content": "Store 'blue' under 'color'."}],
            "expected_state": {"kv": {"color": {"key": "color", "value": "blue"}}},
            "expected_calls": [{"name": "kv_set", "arguments": {"key": "color", "value": "blue"}}],
        }
    ]


# ----------------------------------------------------------------------------- scores


def test_combination_rule_and_call_and_state_scores():
    assert combine({"state": 0.5, "calls": 1.0}, {"state": 0.7, "calls": 0.3}) == pytest.approx(0.65)
    with pytest.raises(ValueError, match="tests"):
        combine({"state": 1.0}, {"tests": 1.0})
    want = [{"name": "kv_set", "arguments": {"key": "a", "value": "1"}}]
    # arguments compared parsed (key order, whitespace), failed calls not counted: F1 = 2pr/(p+r)
    made = [
        ("kv_set", '{"value": "1",  "key": "a"}', True),
        ("kv_get", {"key": "a"}, True),
        ("kv_x", None, False),
    ]
    assert call_score(made, want) == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert call_score([], want) == 0.0 and call_score([], []) == 1.0
    assert call_score([("a", {}, True), ("b", {}, False)], None) == 0.5
    rec = {"key": "a", "value": "1"}
    assert state_score({"kv": {"a": rec}}, {"kv": {"a": rec}}) == 1.0
    assert state_score({"kv": {"a": rec, "b": rec}}, {"kv": {"a": rec}}) == 0.5
    assert state_score({}, {}) == 1.0


def test_kvstore_env_runs_the_stateful_simulator_and_scores_the_final_state():
    maker = get_env("kvstore")
    tasks = maker.tasks(12, seed=0)
    assert {t["kind"] for t in tasks} == {"set", "update", "delete", "copy"}
    for task in tasks:
        env = maker()
        env.reset(task)
        for i, c in enumerate(task["expected_calls"]):  # the expert's calls, one per turn
            call = {
                "id": f"functions.{c['name']}:{i}",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            assert not env.step([call]).results[0].startswith("Error")
        sc = env.score("done")
        assert sc.success and sc.reward == 1.0
        idle = maker()
        idle.reset(task)
        assert not idle.score("").success and idle.score("").parts["calls"] == 0.0
    env = maker()
    env.reset(tasks[0])
    bad = env.step(
        [{"id": "functions.kv_get:0", "function": {"name": "kv_get", "arguments": '{"key": "nope"}'}}]
    )
    assert bad.results == ["Error: kv 'nope' not found"]


def _call(i: int, name: str, **args) -> dict:
    return {"id": f"functions.{name}:{i}", "function": {"name": name, "arguments": json.dumps(args)}}


def test_kvstore_mcp_env_runs_the_tasks_on_the_shipped_server_a_namespace_per_episode():
    """The kvstore tasks on the real MCP server: the same scores as the simulator for the expert's
    and a do-nothing agent's episodes; two open episodes never see each other's keys; the policy
    never sees the namespace; closing an episode leaves nothing on the server."""
    from k2_rl.envs.kvstore import TOOLS

    maker, sim = get_env("kvstore-mcp"), get_env("kvstore")
    try:
        tasks = maker.tasks(12, seed=0)
        for task in tasks:
            for m in (maker, sim):
                env = m()
                _, tools = env.reset(task)
                for i, c in enumerate(task["expected_calls"]):
                    assert (
                        not env.step([_call(i, c["name"], **c["arguments"])]).results[0].startswith("Error")
                    )
                sc = env.score("done")
                assert sc.success and sc.reward == 1.0, (m.name, task)
                env.close()
                idle = m()
                idle.reset(task)
                assert not idle.score("").success and idle.score("").parts["calls"] == 0.0
                idle.close()
        # the tools are the server's own, with the simulator's names and parameters
        assert [t["function"]["name"] for t in tools] == [t["function"]["name"] for t in TOOLS]
        a, b = maker(), maker()
        a.reset(
            {"messages": [], "expected_state": {}, "initial_state": {"kv": {"k": {"key": "k", "value": "A"}}}}
        )
        b.reset({"messages": [], "expected_state": {}})
        assert b.step([_call(0, "kv_get", key="k")]).results == [
            "Error: Error executing tool kv_get: no such key: k"
        ]
        assert b.step([_call(1, "kv_set", key="k", value="B")]).results == ["created k"]
        assert a.step([_call(0, "kv_get", key="k"), _call(1, "kv_list")]).results == ["A", "k"]
        assert b.state() == {"kv": {"k": {"key": "k", "value": "B"}}}
        assert b.step([_call(2, "kv_set", key="", value="x")]).results[0].startswith("Error")
        a.close()
        b.close()
        assert maker.server.call("kv_list", {"prefix": ""}) == '{"result": []}'  # nothing left behind
    finally:
        maker.close()


def test_calculator_env_calls_the_shipped_mcp_server():
    maker = get_env("calculator")
    try:
        task = maker.tasks(1, seed=0)[0]
        env = maker()
        _, tools = env.reset(task)
        assert {t["function"]["name"] for t in tools} == {"calculate", "statistics"}  # listed by the server
        expr = task["expected_calls"][0]["arguments"]["expression"]
        res = env.step(
            [
                {
                    "id": "functions.calculate:0",
                    "function": {"name": "calculate", "arguments": json.dumps({"expression": expr})},
                },
                {
                    "id": "functions.calculate:1",
                    "function": {"name": "calculate", "arguments": '{"expression": "1/0"}'},
                },
            ]
        )
        assert res.results[0] == task["answer"] and "division by zero" in res.results[1]
        assert env.score(f"It is {task['answer']}.").success
        assert not env.score("It is 3.").success
    finally:
        maker.close()


def test_python_env_scores_the_final_code_with_unit_tests():
    maker = get_env("python")
    task = maker.tasks(1, seed=0)[0]
    env = maker()
    env.reset(task)
    out = env.step(
        [
            {
                "id": "functions.run_python:0",
                "function": {"name": "run_python", "arguments": '{"code": "print(6*7)"}'},
            }
        ]
    )
    assert out.results[0].startswith("exit code 0") and "42" in out.results[0]
    good = env.score(f"```python\n{task['solution']}\n```")
    assert good.success and good.reward == 1.0
    wrong = env.score("```python\ndef f():\n    pass\n```")
    assert not wrong.success and wrong.reward == pytest.approx(0.2)  # tests 0, calls 1 at 0.8 / 0.2


# ----------------------------------------------------------------------------- token in / token out


def _runner(cfg, maker=None):
    return EpisodeRunner(cfg, TOK, maker or get_env("kvstore"), [TOK.eos_id, IM_END], lambda _m: None)


def test_next_prompt_is_the_previous_ids_plus_sampled_plus_tool_turn_and_only_sampled_ids_train():
    from k2_data.chat import render_ids

    cfg = _cfg()
    engine = scripted(call_text("kv_set", '{"key": "color", "value": "blue"}'), "done")
    eps = _runner(cfg).rollout(engine, _kv_tasks(), 2, temperature=1.0, top_p=1.0, seed=0)
    assert [e.finish for e in eps] == ["answer", "answer"] and all(e.success for e in eps)
    assert [e.turns for e in eps] == [2, 2]
    first = engine.calls[0][0]
    turn1 = TOK.encode(call_text("kv_set", '{"key": "color", "value": "blue"}'), allow_special=True) + [
        IM_END
    ]
    second = engine.calls[1][0]
    assert second[: len(first) + len(turn1)] == first + turn1  # token in, token out
    tool_ids = second[len(first) + len(turn1) :]
    assert TOK.decode(tool_ids).startswith(
        "<|im_system|>kv_set<|im_middle|>## Return of functions.kv_set:0\n"
    )
    assert TOK.decode(tool_ids).endswith("<|im_assistant|>assistant<|im_middle|>")
    # canonical sampled text: the re-rendered conversation is the same ids
    e = eps[0]
    assert e.continuity == [-1]
    assert render_ids(TOK, e.messages[:-1], e.tools, add_generation_prompt=True) == second  # before "done"
    # the trainer's row is exactly prompt + ids, labels on the sampled ids only
    b = episode_batch(eps, [1.0, 1.0], pad_id=0)
    row = b["input_ids"][0].tolist()[: len(e.prompt_ids) + len(e.ids)]
    assert row == e.prompt_ids + e.ids
    labels = b["shift_labels"][0].tolist()
    trained = [row[j + 1] for j, t in enumerate(labels) if t != -100]
    answer = TOK.encode("done", allow_special=True) + [IM_END]
    assert trained == turn1 + answer
    assert sum(t != -100 for t in labels) == e.policy_tokens == len(turn1) + len(answer)


def test_the_episode_row_carries_the_last_turn_s_routing_of_every_position():
    """The last turn's prompt was the whole episode so far, so its record covers every position
    the trainer forwards (tool turns included); the row's last token has none (-1)."""
    engine = scripted(call_text("kv_set", '{"key": "color", "value": "blue"}'), "done")
    eps = _runner(_cfg()).rollout(engine, _kv_tasks(), 2, temperature=1.0, top_p=1.0, seed=0)
    b = episode_batch(eps, [1.0, 1.0], pad_id=0)
    for r, e in enumerate(eps):
        n = len(e.prompt_ids) + len(e.ids)
        routes = b["routed_experts"][r, :, 0, 0]
        assert routes[: n - 1].tolist() == [p % 4 for p in range(n - 1)]
        assert bool((routes[n - 1 :] == -1).all())
    # the second reply cut by the token budget: no record past the row's own tokens
    engine = scripted(call_text("kv_set", '{"key": "color", "value": "blue"}'), "word " * 80)
    (e,) = _runner(_cfg(max_episode_tokens=100)).rollout(
        engine, _kv_tasks(), 1, temperature=1.0, top_p=1.0, seed=0
    )
    assert (e.finish, e.turns, len(e.ids)) == ("tokens", 2, 100)
    assert e.routes.shape[0] == len(e.prompt_ids) + 100 < len(engine.calls[1][0]) + 64  # trimmed


def test_continuity_metric_reports_the_first_differing_position():
    # whitespace around the arguments is stripped by the parser: the re-render differs from what was sampled
    sampled = call_text("kv_set", ' {"key": "color", "value": "blue"} ')
    engine = scripted(sampled, "done")
    (e,) = _runner(_cfg()).rollout(engine, _kv_tasks(), 1, temperature=1.0, top_p=1.0, seed=0)
    assert e.success  # the call still ran
    tito = e.prompt_ids + e.ids[: len(engine.calls[1][0]) - len(e.prompt_ids)]
    from k2_data.chat import render_ids

    canon = render_ids(TOK, e.messages[:-1], e.tools, add_generation_prompt=True)
    assert e.continuity == [first_difference(canon, tito)] and e.continuity[0] > len(e.prompt_ids)
    assert first_difference([1, 2, 3], [1, 2, 3]) == -1 and first_difference([1, 2], [1, 2, 3]) == 2


def test_budgets_cut_episodes_and_the_cut_are_penalised():
    calling = call_text("kv_get", '{"key": "color"}')
    engine = scripted(calling)  # never answers
    runner = _runner(_cfg(max_turns=2))
    (e,) = runner.rollout(engine, _kv_tasks(), 1, temperature=1.0, top_p=1.0, seed=0)
    assert e.finish == "turns" and e.turns == 2 and e.truncated
    engine = scripted("word " * 80)
    eb = _runner(_cfg(max_episode_tokens=20)).iteration(
        engine, _kv_tasks(), 2, temperature=1.0, top_p=1.0, seed=0, iteration=0, pad_id=0
    )
    assert [e.finish for e in eb.episodes] == ["tokens", "tokens"]
    assert all(e.policy_tokens == 20 for e in eb.episodes)
    assert eb.shaped == [pytest.approx(r - 0.5) for r in eb.raw]  # the truncation penalty


def test_a_malformed_call_is_dropped_and_counted_the_valid_one_runs():
    good = '<|tool_call_begin|>functions.kv_set:0<|tool_call_argument_begin|>{"key": "color", "value": "blue"}<|tool_call_end|>'
    bad = '<|tool_call_begin|>functions.kv_set:1{"key": "x"}<|tool_call_end|>'
    engine = scripted(f"<|tool_calls_section_begin|>{good}{bad}<|tool_calls_section_end|>", "done")
    (e,) = _runner(_cfg()).rollout(engine, _kv_tasks(), 1, temperature=1.0, top_p=1.0, seed=0)
    assert e.calls == 1 and e.malformed_calls == 1 and e.success


class _Broken:
    """An environment that fails in the way it is told to, on its first step."""

    name = "broken"

    def __init__(self, how):
        self.how = how

    def __call__(self):
        maker = self

        class Env:
            def reset(self, task):
                if maker.how == "reset":
                    raise RuntimeError("reset exploded")
                if maker.how == "reset_none":
                    return None
                return task["messages"], []

            def step(self, calls):
                if maker.how == "raise":
                    raise RuntimeError("backend exploded")
                if maker.how == "hang":
                    time.sleep(30)
                if maker.how == "malformed":
                    return Step([42])
                return Step(["ok"] * len(calls))

            def score(self, answer):
                if maker.how == "score":
                    return Score(float("nan"), True)
                return Score(1.0, True)

            def close(self):
                pass

        return Env()

    def tasks(self, n, seed):
        return []

    def close(self):
        pass


@pytest.mark.parametrize("how", ["raise", "hang", "malformed", "reset", "reset_none", "score"])
def test_a_failing_environment_ends_its_episode_with_zero_reward(how):
    engine = ScriptedEngine(
        lambda text, turn, _k: (
            call_text("kv_get", '{"key": "a"}')
            if "<|im_user|>user<|im_middle|>a" in text and turn == 0
            else "done"
        )
    )
    tasks = [
        {"messages": [{"role": "user", "content": "a"}]},
        {"messages": [{"role": "user", "content": "b"}]},
    ]
    runner = _runner(_cfg(env_timeout_s=0.5), _Broken(how))
    t0 = time.perf_counter()
    eb = runner.iteration(engine, tasks, 2, temperature=1.0, top_p=1.0, seed=0, iteration=0, pad_id=0)
    assert time.perf_counter() - t0 < 10  # a hung step is given up on, not waited for
    failed = [e for e in eb.episodes if e.finish == "error"]
    n_failed = 4 if how in ("reset", "reset_none", "score") else 2
    assert len(failed) == n_failed and all(e.reward == 0.0 and not e.success for e in failed)
    assert eb.metrics["env_errors"] == n_failed and eb.metrics["env_error_first"]
    assert all(eb.shaped[i] == 0.0 for i, e in enumerate(eb.episodes) if e.finish == "error")
    if how not in ("reset", "reset_none", "score"):
        assert [e.success for e in eb.episodes[2:]] == [True, True]  # the other task's episodes went on


# ----------------------------------------------------------------------------- K1.5 length reward


def test_length_reward_matches_the_k15_formula():
    lengths, correct = [10, 20, 30, 40], [True, False, True, False]
    lam = [0.5 - (n - 10) / (40 - 10) for n in lengths]  # 0.5, 1/6, -1/6, -0.5
    want = [lam[0], min(0.0, lam[1]), lam[2], min(0.0, lam[3])]
    assert length_rewards(lengths, correct) == pytest.approx(want)
    assert length_rewards(lengths, correct) == pytest.approx([0.5, 0.0, -1 / 6, -0.5])
    assert length_rewards([7, 7, 7], [True, False, True]) == [0.0, 0.0, 0.0]  # max == min
    shaped, extra = add_length_reward(
        [1, 0, 1, 0, 1, 1], [10, 20, 30, 40, 5, 9], [1, 0, 1, 0, 1, 1], [0, 0, 0, 0, 1, 1], 0.1
    )
    assert extra == pytest.approx([0.5, 0.0, -1 / 6, -0.5, 0.5, -0.5])
    assert shaped == pytest.approx([1.05, 0.0, 1 - 1 / 60, -0.05, 1.05, 0.95])
    assert [length_coef_at(0.1, 3, i) for i in range(5)] == [0, 0, 0, 0.1, 0.1]
    with pytest.raises(ValueError, match="length_reward_coef"):
        RLConfig.flat(length_reward_coef=-1.0).validate()


def test_length_reward_in_episodes_uses_policy_tokens_and_success():
    def respond(text, turn, k):
        if turn == 0:  # sample 1 says more before its call, and again in its answer
            return ("Sure. " if k == 1 else "") + call_text("kv_set", '{"key": "color", "value": "blue"}')
        return "done and so on and so on" if "Sure." in text else "done"

    runner = _runner(_cfg(length_reward_coef=0.2, length_reward_warmup=1))
    warm = runner.iteration(
        ScriptedEngine(respond), _kv_tasks(), 2, temperature=1.0, top_p=1.0, seed=0, iteration=0, pad_id=0
    )
    assert warm.shaped == warm.raw and "length_reward_mean" not in warm.metrics  # the warm-up
    eb = runner.iteration(
        ScriptedEngine(respond), _kv_tasks(), 2, temperature=1.0, top_p=1.0, seed=0, iteration=1, pad_id=0
    )
    short, long_ = eb.episodes
    assert short.success and long_.success and short.policy_tokens < long_.policy_tokens
    # both correct: the shortest gets lambda = 0.5, the longest 0.5 - 1 = -0.5
    assert eb.shaped == pytest.approx([eb.raw[0] + 0.2 * 0.5, eb.raw[1] - 0.2 * 0.5])
    assert eb.metrics["length_reward_mean"] == pytest.approx(0.0)


# ----------------------------------------------------------------------------- the loop


def _run_cfg(tmp_path: Path, name: str, **kw) -> RLConfig:
    from k2_model.testing import SMALL_OVERRIDES

    base = dict(
        model_overrides=SMALL_OVERRIDES,
        env="kvstore",
        env_tasks=16,
        iterations=3,
        prompts_per_iteration=2,
        samples_per_prompt=4,
        max_response_tokens=12,
        max_episode_tokens=48,
        max_turns=2,
        eval_every=0,
        save_every=0,
        threads=1,
        rollout="inprocess",
        lr=1e-2,
        out=str(tmp_path / name),
    )
    base.update(kw)
    return RLConfig.flat(**base)


def test_env_run_stopped_and_resumed_matches_an_uninterrupted_one(tmp_path):
    def rows(name):
        return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    full = run_rl_quiet(_run_cfg(tmp_path, "full", length_reward_coef=0.1))
    assert full.iterations_done == 3
    its = [r for r in rows("full") if "reward_mean" in r]
    assert [r["iteration"] for r in its] == [1, 2, 3]
    for r in its:
        assert 0 <= r["success_rate"] <= 1 and r["turns_mean"] >= 1 and r["env_errors"] == 0
    eps = [
        json.loads(x)
        for x in (tmp_path / "full" / "episodes" / "iteration-000001.jsonl").read_text().splitlines()
    ]
    assert len(eps) == 8 and all("finish" in e and "continuity_first_diff" in e for e in eps)
    from k2_rl.episodes import iteration_table

    table = iteration_table(tmp_path / "full").splitlines()
    assert len(table) == 2 + 3 and table[0].split()[:3] == ["iter", "reward", "success"]

    part = run_rl_quiet(_run_cfg(tmp_path, "part", stop_at=1, length_reward_coef=0.1))
    assert part.interrupted and part.iterations_done == 1
    run_rl_quiet(_run_cfg(tmp_path, "part", length_reward_coef=0.1), resume=True)

    def key(rs):
        return [(r.get("iteration"), r.get("step"), r.get("loss"), r.get("reward_mean")) for r in rs]

    assert key(rows("part")) == key(rows("full"))
    for it in (1, 2, 3):
        name = f"iteration-{it:06d}.jsonl"
        assert (tmp_path / "part" / "episodes" / name).read_text() == (
            tmp_path / "full" / "episodes" / name
        ).read_text()


def test_env_run_with_the_grpo_objective_and_several_updates(tmp_path):
    """The clipped objective over whole episodes: per-token old log-probs on the masked rows."""
    run_rl_quiet(_run_cfg(tmp_path, "grpo", loss="grpo", updates_per_iteration=2, iterations=1))
    rows = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "reward_mean" not in r]
    assert len(steps) == 2 and all(r["loss"] == r["loss"] for r in steps)


def test_single_turn_run_logs_the_length_reward(tmp_path):
    from k2_model.testing import SMALL_OVERRIDES

    cfg = RLConfig.flat(
        model_overrides=SMALL_OVERRIDES,
        iterations=2,
        prompts_per_iteration=2,
        samples_per_prompt=4,
        max_response_tokens=8,
        eval_every=0,
        save_every=0,
        reward_workers=1,
        threads=1,
        rollout="inprocess",
        length_reward_coef=0.1,
        length_reward_warmup=1,
        out=str(tmp_path / "st"),
    )
    run_rl_quiet(cfg)
    its = [json.loads(x) for x in (tmp_path / "st" / "metrics.jsonl").read_text().splitlines()]
    its = [r for r in its if "reward_mean" in r]
    assert "length_reward_mean" not in its[0] and "length_reward_mean" in its[1]  # after the warm-up


def run_rl_quiet(cfg, resume=False):
    from k2_rl.loop import run_rl

    return run_rl(cfg, resume=resume, log=lambda _m: None)


COUNTER = """
from k2_rl.envs.base import Score, Step

class Counter:
    def reset(self, task):
        self.n, self.task = 0, task
        tools = [{"type": "function", "function": {"name": "bump", "parameters": {"type": "object", "properties": {}}}}]
        return task["messages"], tools
    def step(self, tool_calls):
        self.n += len(tool_calls)
        return Step([str(self.n)] * len(tool_calls), done=False, state=self.n)
    def score(self, answer):
        ok = self.n == self.task["target"]
        return Score(float(ok), ok, {"count": float(ok)})
    def close(self): pass

class CounterMaker:
    name = "counter"
    def __call__(self): return Counter()
    def tasks(self, n, seed): return [{"messages": [{"role": "user", "content": "Bump twice."}], "target": 2}] * n
    def close(self): pass
"""


def test_a_user_environment_from_a_file_runs_episodes(tmp_path):
    """The example environment of docs/rl.md, loaded as `--env FILE.py:NAME`."""
    path = tmp_path / "my_envs.py"
    path.write_text(COUNTER)
    maker = get_env(f"{path}:CounterMaker")
    bump = call_text("bump", "{}")
    engine = scripted(bump, bump, "done")
    eb = _runner(_cfg(env=f"{path}:CounterMaker"), maker).iteration(
        engine, maker.tasks(1, 0), 2, temperature=1.0, top_p=1.0, seed=0, iteration=0, pad_id=0
    )
    assert [(e.turns, e.calls, e.success) for e in eb.episodes] == [(3, 2, True), (3, 2, True)]
    assert eb.metrics["part_count"] == 1.0 and eb.metrics["continuity_turn3"] == 1.0


def test_env_config_errors_name_the_field():
    with pytest.raises(ValueError, match="env='nope'"):
        RLConfig.flat(env="nope").validate()
    with pytest.raises(ValueError, match="max_turns"):
        RLConfig.flat(env="kvstore", max_turns=0).validate()


@pytest.mark.slow  # three real `k2 rl --env calculator` processes, each with the MCP server as a child
def test_sigkill_of_an_env_run_kills_the_mcp_server_and_resumes_exactly(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from k2_data import lifetime
    from k2_train.state import latest_state

    def cfg_file(name: str) -> Path:
        cfg = _run_cfg(tmp_path, name, env="calculator", iterations=3, save_every=1, kl_every=0)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg.to_dict()))
        return path

    def k2(*args: str) -> subprocess.Popen:
        env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
        return subprocess.Popen(
            [sys.executable, "-m", "k2_stack", "rl", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )

    full = k2("--config", str(cfg_file("full")))
    assert full.wait(timeout=600) == 0
    proc = k2("--config", str(cfg_file("part")))
    try:
        deadline = time.monotonic() + 300
        while latest_state(tmp_path / "part") is None:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        tree = lifetime.descendants(proc.pid)
        cmds = [Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode() for p in tree]
        assert any("servers.calculator" in c for c in cmds), cmds
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + lifetime.GRACE_S + 5
        while (
            left := {p: s for p, s in tree.items() if lifetime.alive(p, s)}
        ) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == {}  # the MCP server and the rollout worker died with the run
    finally:
        proc.kill()
        proc.wait()
    resumed = k2("--resume", str(tmp_path / "part"))
    assert resumed.wait(timeout=600) == 0

    def key(name):
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [(r.get("iteration"), r.get("step"), r.get("loss"), r.get("reward_mean")) for r in rows]

    assert key("part") == key("full")
    for it in (1, 2, 3):
        name = f"episodes/iteration-{it:06d}.jsonl"
        assert (tmp_path / "part" / name).read_text() == (tmp_path / "full" / name).read_text()


class LongerAnswerCritic:
    """A consistent critic: the longer final answer wins (both orders), equal lengths tie."""

    def __init__(self):
        from k2_rl.rewards.critic import CriticStats

        self.stats = CriticStats()

    def complete(self, requests):
        out = []
        for req in requests:
            user = req["messages"][-1]["content"]
            a = user.split("[Response A]\n")[1].split("\n[End of Response A]")[0]
            b = user.split("[Response B]\n")[1].split("\n[End of Response B]")[0]
            pick = "tie" if len(a) == len(b) else ("A" if len(a) > len(b) else "B")
            out.append(json.dumps({"reason": "length", "preferred": pick, "violations": {"A": [], "B": []}}))
        return out


def test_open_tasks_add_the_rubric_win_rate_by_the_documented_rule():
    """A task with rubrics: the critic ranks the K episodes' final answers; each episode's reward is
    (env reward + w * win rate) / (1 + w); strict success stays the environment's."""
    from k2_rl.envs.base import with_rubric
    from k2_rl.rewards.rubric import RubricReward

    answers = iter(["done", "done, stored blue under color"] * 3)  # episode 1, episode 2; per iteration

    def respond(_text, turn, _k):
        return call_text("kv_set", '{"key": "color", "value": "blue"}') if turn == 0 else next(answers)

    engine = ScriptedEngine(respond)
    runner = _runner(_cfg())
    task = {**_kv_tasks()[0], "rubrics": ["Say what was stored."], "rubric_weight": 0.5}
    with pytest.raises(ValueError, match="critic"):
        runner.iteration(engine, [task], 2, temperature=1.0, top_p=1.0, seed=0, iteration=0, pad_id=0)
    runner.rubric = RubricReward(LongerAnswerCritic())
    eb = runner.iteration(engine, [task], 2, temperature=1.0, top_p=1.0, seed=0, iteration=0, pad_id=0)
    assert [e.parts["rubric"] for e in eb.episodes] == [0.0, 1.0]
    env_only = [1.0, 1.0]  # both stored the value: state and calls right
    assert eb.raw == [pytest.approx(with_rubric(r, w, 0.5)) for r, w in zip(env_only, [0.0, 1.0])]
    assert eb.raw == [pytest.approx(2 / 3), pytest.approx(1.0)]
    assert all(e.success for e in eb.episodes) and eb.metrics["rubric_tasks"] == 1
    # a task without rubrics is left to its environment
    eb = runner.iteration(engine, _kv_tasks(), 2, temperature=1.0, top_p=1.0, seed=0, iteration=0, pad_id=0)
    assert eb.raw == [1.0, 1.0] and "rubric_tasks" not in eb.metrics

"""Held-out accuracy of any policy: greedy answers to held-out tasks, scored by their rewards.

The same measurement `k2 rl` logs as `heldout_accuracy` (greedy, the response budget, a task
counts when its reward is >= 1; with `--env`, greedy episodes against the environment, a task
counts on strict success), for a policy that did not come out of `k2 rl`: an SFT run, an SFT run
continued as a baseline, an exported HF directory. So RL and its baselines are compared with one
ruler. With `--env`, `--init` may also name a scripted reference policy: `nothing` (answers "done"
without a call) or `frequent-call` (makes the held-out set's most frequent expected call, then
answers "done"): what a held-out set gives to a policy that games it.

    python -m k2_rl.evaluate --init RUN_OR_HF_DIR --heldout heldout.jsonl [--max-response-tokens 64]
    python -m k2_rl.evaluate --init RUN --env kvstore --heldout heldout.jsonl [--max-turns 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from k2_rl.envs.base import canonical_call
from k2_rl.loop import load_tokenizer_for
from k2_rl.rewards.base import is_group_reward
from k2_rl.rollout import Rollout, Sample
from k2_rl.tasks import read_tasks


def load_policy(init: str | Path, device: str | torch.device = "cpu") -> Any:
    """The K2 model of a k2 run (its latest train state) or of an HF-format directory, in eval mode."""
    from k2_model import K2ForCausalLM
    from k2_model.spec import ModelSpec
    from k2_train.builders import load_init_weights, model_config

    model = K2ForCausalLM(model_config(ModelSpec(init=str(init))))
    load_init_weights(model, str(init))
    return model.to(device).eval()


def evaluate_policy(
    init: str | Path,
    heldout: str | Path,
    *,
    max_response_tokens: int = 64,
    reward: str = "math",
    device: str = "cpu",
    reward_workers: int = 2,
    reward_timeout_s: float = 10.0,
) -> dict[str, float]:
    """Greedy held-out accuracy of the policy at `init` on the tasks in `heldout` (group-reward
    tasks, which have no reference answer, are left out as in `k2 rl`)."""
    from k2_data.chat import render_ids

    from k2_rl.rewards.pool import RewardPool

    tok = load_tokenizer_for(str(init))
    tasks = [t for t in read_tasks(heldout, reward) if not is_group_reward(t.get("reward") or reward)]
    if not tasks:
        raise ValueError(f"{heldout}: no held-out task with a verifiable reward")
    stop = sorted({tok.eos_id, tok.token_to_id("<|im_end|>")})
    rollout = Rollout(load_policy(init, device), stop)
    try:
        prompts = [render_ids(tok, t["messages"], add_generation_prompt=True) for t in tasks]
        samples = rollout.generate(prompts, n=1, temperature=0.0, max_tokens=max_response_tokens, seed=0)
    finally:
        rollout.close()
    stop_set = set(stop)
    texts = [tok.decode([i for i in g[0].token_ids if i not in stop_set]) for g in samples]
    names = [t.get("reward") or reward for t in tasks]
    rewards = [0.0] * len(tasks)
    with RewardPool(reward_workers, timeout_s=reward_timeout_s) as pool:
        for name in sorted(set(names)):
            idx = [i for i, n in enumerate(names) if n == name]
            items = [(tasks[i]["messages"][-1]["content"], texts[i], tasks[i]) for i in idx]
            for i, r in zip(idx, pool.compute(name, items).rewards):
                rewards[i] = r
    return {
        "heldout_accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        "heldout_response_tokens": statistics.mean(len(g[0].token_ids) for g in samples),
        "heldout_n": len(rewards),
    }


SCRIPTED = ("nothing", "frequent-call")


def most_frequent_call(tasks: Sequence[dict]) -> dict:
    """The expected call (name and arguments) that the most tasks contain (ties: the first seen)."""
    counts: Counter[str] = Counter()
    first: dict[str, dict] = {}
    for t in tasks:
        calls = {canonical_call(c["name"], c.get("arguments", {})): c for c in t.get("expected_calls") or []}
        for key, call in calls.items():  # a task counts once per distinct call
            counts[key] += 1
            first.setdefault(key, call)
    if not counts:
        raise ValueError("frequent-call: no held-out task has expected_calls")
    return first[counts.most_common(1)[0][0]]


class ScriptedPolicy:
    """A `generate` that ignores the model: the first turn of an episode makes `call` (or answers
    "done" when `call` is None), every later turn answers "done". Its text goes through the same
    tokenizer, parser and environment as a model's."""

    def __init__(self, tok: Any, call: dict | None) -> None:
        from k2_data.chat.markers import (
            ARGUMENT_BEGIN,
            CALL_BEGIN,
            CALL_END,
            IM_END,
            SECTION_BEGIN,
            SECTION_END,
        )

        self.tok, self.call_begin = tok, CALL_BEGIN
        self.stop = tok.token_to_id(IM_END)
        first = "done"
        if call is not None:  # one call in the Kimi K2 format, as a model trained on it writes it
            args = json.dumps(call.get("arguments", {}), ensure_ascii=False)
            first = f"{SECTION_BEGIN}{CALL_BEGIN}functions.{call['name']}:0{ARGUMENT_BEGIN}{args}{CALL_END}{SECTION_END}"
        self.first, self.later = self._ids(first), self._ids("done")

    def _ids(self, text: str) -> list[int]:
        enc = self.tok.encode(text)
        return [*(enc.ids if hasattr(enc, "ids") else enc), self.stop]

    def __call__(self, prompts: Sequence[Sequence[int]], n: int = 1, **_: Any) -> list[list[Sample]]:
        out = []
        for p in prompts:
            # after the first turn the prompt holds the policy's own call markup
            ids = self.later if self.call_begin in self.tok.decode(list(p)) else self.first
            out.append([Sample(list(ids), [0.0] * len(ids), "stop") for _ in range(n)])
        return out


def evaluate_env_policy(
    init: str | Path,
    env: str,
    heldout: str | Path,
    *,
    max_turns: int = 3,
    max_response_tokens: int = 64,
    max_episode_tokens: int = 512,
    device: str = "cpu",
    tokenizer: str | Path | None = None,
) -> dict[str, Any]:
    """Greedy strict success of the policy at `init` (a run, an HF directory, or one of SCRIPTED)
    in episodes against `env` on the tasks in `heldout`, as `k2 rl --env` logs it: overall, per
    task `split` and per task `kind`, with the mean reward, turns, calls and failed calls."""
    from k2_data.tokenizer import load_tokenizer

    from k2_rl.config import RLConfig
    from k2_rl.envs import get_env
    from k2_rl.episodes import EpisodeRunner, episode_metrics, split_success
    from k2_rl.tasks import read_env_tasks

    tasks = read_env_tasks(heldout)
    if not tasks:
        raise ValueError(f"{heldout}: no held-out tasks")
    scripted = str(init) in SCRIPTED
    tok = load_tokenizer(tokenizer) if scripted else load_tokenizer_for(str(init))
    cfg = RLConfig()
    cfg.episodes.env, cfg.episodes.max_turns, cfg.episodes.max_episode_tokens = (
        env,
        max_turns,
        max_episode_tokens,
    )
    cfg.rollouts.max_response_tokens = max_response_tokens
    stop = sorted({tok.eos_id, tok.token_to_id("<|im_end|>")})
    maker = get_env(env)
    rollout = None
    try:
        if scripted:
            generate = ScriptedPolicy(
                tok, most_frequent_call(tasks) if str(init) == "frequent-call" else None
            )
        else:
            rollout = Rollout(load_policy(init, device), stop)
            generate = rollout.generate
        runner = EpisodeRunner(cfg, tok, maker, stop, lambda msg: print(msg, file=sys.stderr))
        eps = runner.rollout(generate, tasks, 1, temperature=0.0, top_p=1.0, seed=0)
    finally:
        if rollout is not None:
            rollout.close()
        maker.close()
    m = episode_metrics(eps)
    kinds: dict[str, list[bool]] = {}
    for e in eps:
        kinds.setdefault(str(tasks[e.task_index].get("kind", "")), []).append(e.success)
    return {
        "heldout_accuracy": m["success_rate"],
        "heldout_reward": m["episode_reward_mean"],
        "heldout_n": len(eps),
        **split_success(eps, tasks),
        "by_kind": {k: sum(v) / len(v) for k, v in sorted(kinds.items()) if k},
        "turns_mean": m["turns_mean"],
        "tool_calls_mean": m["tool_calls_mean"],
        "tool_errors_mean": m["tool_errors_mean"],
        "env_errors": m["env_errors"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k2_rl.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--init",
        required=True,
        help="a k2 run dir (sft, rl), an HF-format model dir, or with --env: nothing | frequent-call",
    )
    ap.add_argument(
        "--heldout",
        required=True,
        help="held-out task JSONL ({messages, answer}; with --env the env's tasks)",
    )
    ap.add_argument("--max-response-tokens", type=int, default=64)
    ap.add_argument("--reward", default="math", help="reward of tasks without a 'reward' field")
    ap.add_argument(
        "--env", default=None, help="run greedy episodes against this environment (as k2 rl --env)"
    )
    ap.add_argument("--max-turns", type=int, default=3, help="with --env: assistant turns per episode")
    ap.add_argument("--max-episode-tokens", type=int, default=512, help="with --env: tokens per episode")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reward-workers", type=int, default=2)
    args = ap.parse_args(argv)
    scripted = args.env is not None and args.init in SCRIPTED
    for what, path in (("--init", None if scripted else args.init), ("--heldout", args.heldout)):
        if path is not None and not Path(path).exists():
            print(f"python -m k2_rl.evaluate: {what} {path}: no such file or directory", file=sys.stderr)
            return 2
    if args.env is not None:
        out = evaluate_env_policy(
            args.init,
            args.env,
            args.heldout,
            max_turns=args.max_turns,
            max_response_tokens=args.max_response_tokens,
            max_episode_tokens=args.max_episode_tokens,
            device=args.device,
        )
    else:
        out = evaluate_policy(
            args.init,
            args.heldout,
            max_response_tokens=args.max_response_tokens,
            reward=args.reward,
            device=args.device,
            reward_workers=args.reward_workers,
        )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Held-out accuracy of any policy: greedy answers to held-out tasks, scored by their rewards.

The same measurement `k2 rl` logs as `heldout_accuracy` (greedy, the response budget, a task
counts when its reward is >= 1), for a policy that did not come out of `k2 rl`: an SFT run, an
SFT run continued as a baseline, an exported HF directory. So RL and its baselines are compared
with one ruler.

    python -m k2_rl.evaluate --init RUN_OR_HF_DIR --heldout heldout.jsonl [--max-response-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from k2_rl.loop import load_tokenizer_for
from k2_rl.rewards.base import is_group_reward
from k2_rl.rollout import Rollout
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k2_rl.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--init", required=True, help="a k2 run dir (sft, rl) or an HF-format model dir")
    ap.add_argument("--heldout", required=True, help="held-out task JSONL ({messages, answer})")
    ap.add_argument("--max-response-tokens", type=int, default=64)
    ap.add_argument("--reward", default="math", help="reward of tasks without a 'reward' field")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reward-workers", type=int, default=2)
    args = ap.parse_args(argv)
    for what, path in (("--init", args.init), ("--heldout", args.heldout)):
        if not Path(path).exists():
            print(f"python -m k2_rl.evaluate: {what} {path}: no such file or directory", file=sys.stderr)
            return 2
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

"""Verifiable rewards for RL: `reward(prompt, response, task) -> float`.

- `math_reward(response, answer)`: the final answer (`\\boxed{}` first) against the reference with
  math-verify; registered as "math" (reads `task["answer"]`).
- `code_reward(program, tests, *, timeout_s)`: the program, then the tests (plain asserts), in
  k2-data's sandbox; 1.0 only when every assert passed (a nonce printed after them proves it).
- `instruction_reward(response, constraints)`: deterministic checkers with a hack-check;
  registered as "instruction" (reads `task["constraints"]`).
- `RubricReward` (registered as "rubric", in `k2_rl.rewards.rubric`): the self-critique rubric reward,
  a *group* reward: a critic (`k2_rl.rewards.critic`) compares a prompt's K responses pairwise
  against core, prescriptive and task rubrics; imported on first use (`get_reward("rubric")`).
- `register_reward(name)` / `get_reward(name)`: the registry users extend; `RewardPool` computes a
  batch in worker processes with per-item timeouts (math-verify's timeouts need a main thread).
"""

from k2_rl.rewards.base import (
    BaseReward,
    GroupReward,
    Reward,
    budget_penalty,
    get_reward,
    is_group_reward,
    list_rewards,
    register_reward,
)
from k2_rl.rewards.code import code_reward
from k2_rl.rewards.instruction import CHECKERS, hack_check, instruction_reward
from k2_rl.rewards.math import math_reward
from k2_rl.rewards.pool import PoolResult, RewardPool

__all__ = [
    "CHECKERS",
    "BaseReward",
    "GroupReward",
    "PoolResult",
    "Reward",
    "RewardPool",
    "budget_penalty",
    "code_reward",
    "get_reward",
    "hack_check",
    "is_group_reward",
    "instruction_reward",
    "list_rewards",
    "math_reward",
    "register_reward",
]

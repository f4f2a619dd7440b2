"""Kimi K1.5's length reward (the K1.5 report, section 2.3.3 "Length Penalty").

Per group (one prompt's K responses, or one task's K episodes), with len_i the response's length in
tokens (for an episode: the policy's own tokens, tool results excluded):

    lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len)
    length_reward_i = lambda_i             if response i is correct
                      min(0, lambda_i)     otherwise

so among correct responses the shortest gains 0.5 and the longest loses 0.5, and an incorrect one is
only ever penalised for being long. A group whose responses are all the same length gets 0 (the
report's formula is 0/0 there). The term is added to the reward with a weight
(`length_reward_coef`) after a warm-up (`length_reward_warmup` iterations without it), as the
report trains first without the penalty and then with a constant one.
"""

from __future__ import annotations

from collections.abc import Sequence


def length_rewards(lengths: Sequence[int], correct: Sequence[bool]) -> list[float]:
    """The K1.5 length reward of one group's responses (see the module)."""
    if len(lengths) != len(correct):
        raise ValueError(f"length_rewards: {len(lengths)} lengths but {len(correct)} correctness flags")
    if not lengths:
        return []
    lo, hi = min(lengths), max(lengths)
    if hi == lo:
        return [0.0] * len(lengths)
    lam = [0.5 - (n - lo) / (hi - lo) for n in lengths]
    return [x if ok else min(0.0, x) for x, ok in zip(lam, correct)]


def length_coef_at(coef: float, warmup: int, iteration: int) -> float:
    """The length reward's weight at `iteration` (0-based): 0 during the warm-up, then `coef`."""
    return 0.0 if iteration < warmup else float(coef)


def add_length_reward(
    rewards: Sequence[float],
    lengths: Sequence[int],
    correct: Sequence[bool],
    groups: Sequence[int],
    coef: float,
) -> tuple[list[float], list[float]]:
    """(rewards + coef * length reward, the length rewards), rows grouped by `groups` ids."""
    by: dict[int, list[int]] = {}
    for r, g in enumerate(groups):
        by.setdefault(g, []).append(r)
    extra = [0.0] * len(rewards)
    for rows in by.values():
        for r, v in zip(rows, length_rewards([lengths[r] for r in rows], [correct[r] for r in rows])):
            extra[r] = v
    return [float(x) + coef * e for x, e in zip(rewards, extra)], extra


__all__ = ["add_length_reward", "length_coef_at", "length_rewards"]

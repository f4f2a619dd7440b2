"""Multi-turn episodes for `k2 rl --env NAME`: the policy against a tool environment, token in and
token out.

Each iteration runs K episodes per task, all of them in lockstep, one engine call per turn:
1. `reset(task)` gives the messages and tools; the first prompt is their Kimi-format rendering
   (`k2_data.chat.render_ids`, with the generation prompt). Turn 1 samples K continuations of each
   task's prompt (one prefill per task); later turns one continuation per open episode.
2. A sampled turn is decoded and parsed (`parse_tool_calls`, lenient, as serving parses). Without a
   call it is the final answer and the episode ends. With calls, the environment runs them
   (`step`); their results become tool turns.
3. Token in, token out: the next prompt is the previous prompt's ids + the ids the engine sampled
   + the ids of the rendered tool turns (and the next generation prompt), never a re-rendering of
   the conversation. The trainer's row is exactly that sequence, with the loss on the sampled ids
   only (tool results, headers and the first prompt are masked).
4. Continuity is measured, not asserted: after every tool turn the messages are re-rendered from
   scratch and compared with the token-in/token-out ids (sampled tokens need not be canonical BPE,
   and the parser strips whitespace around arguments); the rate of equal prompts and the first
   differing position are logged per turn.
5. An episode ends with an answer, when the environment says done, after `max_turns` turns still
   calling (cut), or past `max_episode_tokens` (cut); cut episodes get the truncation penalty.
   `score(answer)` gives the reward (partial credit) and strict success (k2_rl.envs.base).

An environment that raises, hangs past `env_timeout_s` or returns malformed results ends its
episode with reward 0 and the error logged (`env_errors`, `env_error_first`); the loop goes on.
A hung call's thread is left behind (a daemon): Python cannot kill a thread, the episode just stops
waiting for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k2_rl.rewards.base import budget_penalty
from k2_rl.rewards.length import add_length_reward, length_coef_at
from k2_rl.rollout import Sample, derive_seed
from k2_rl.routing import routes_batch

CALL_BEGIN = "<|tool_call_begin|>"


@contextlib.contextmanager
def _quiet_parser():
    log = logging.getLogger("k2_data.chat")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


class EnvFailure(RuntimeError):
    """The environment raised, hung or answered malformed: the episode ends with reward 0."""


def guarded(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """`fn()` in a daemon thread, waited on for `timeout_s`; EnvFailure when it raises or hangs."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # anything the environment throws ends the episode
            box["error"] = e

    t = threading.Thread(target=target, name=f"env-{what}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise EnvFailure(f"{what}: no answer within {timeout_s:g} s")
    if "error" in box:
        raise EnvFailure(f"{what}: {type(box['error']).__name__}: {box['error']}")
    return box.get("value")


@dataclass
class Episode:
    task_index: int
    env: Any
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)  # the first prompt
    ids: list[int] = field(default_factory=list)  # everything after it: sampled and tool tokens
    mask: list[int] = field(default_factory=list)  # 1 on sampled tokens
    logprobs: list[float] = field(default_factory=list)  # the engine's, of the sampled tokens
    routes: torch.Tensor | None = None  # the last turn's record: every position's experts (k2_rl.routing)
    turns: int = 0
    calls: int = 0
    malformed_calls: int = 0  # call markup the parser dropped (no argument marker, bad JSON, ...)
    tool_errors: int = 0  # calls the environment answered with an error (`Error: ...`)
    finish: str = ""  # answer | done | turns | tokens | error ("" while open)
    answer: str = ""
    error: str | None = None
    continuity: list[int] = field(default_factory=list)  # per tool turn: -1 equal, else first diff
    reward: float = 0.0  # partial credit
    success: bool = False
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        return not self.finish

    @property
    def truncated(self) -> bool:
        return self.finish in ("turns", "tokens")

    @property
    def policy_tokens(self) -> int:
        return sum(self.mask)

    def record(self) -> dict[str, Any]:
        return {
            "task": self.task_index,
            "turns": self.turns,
            "calls": self.calls,
            "malformed_calls": self.malformed_calls,
            "tool_errors": self.tool_errors,
            "finish": self.finish,
            "reward": self.reward,
            "success": self.success,
            "parts": self.parts,
            "policy_tokens": self.policy_tokens,
            "tokens": len(self.ids),
            "continuity_first_diff": self.continuity,
            "error": self.error,
            "answer": self.answer[:200],
        }


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first position where `a` and `b` differ (the shorter length when one is a prefix), -1 if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


@dataclass
class EpisodeBatch:
    episodes: list[Episode]
    batch: dict[str, torch.Tensor]
    engine_logp: torch.Tensor
    shaped: list[float]
    raw: list[float]
    metrics: dict[str, Any]


class EpisodeRunner:
    """Runs an iteration's episodes (see the module); one per run, around the run's `EnvMaker`."""

    def __init__(
        self, cfg: Any, tokenizer: Any, maker: Any, stop_ids: Sequence[int], log: Callable[[str], None]
    ):
        self.cfg, self.tok, self.maker, self.log = cfg, tokenizer, maker, log
        self.ep_cfg = cfg.episodes
        self.stop = set(stop_ids)
        self.rubric: Any = None  # the rubric reward (a GroupReward) for open tasks; set by the loop

    # -------------------------------------------------------------- rendering
    def _render(self, messages: list[dict], tools: list[dict], gen: bool) -> list[int]:
        from k2_data.chat import render_ids

        return render_ids(self.tok, messages, tools or None, add_generation_prompt=gen)

    def _fail(self, e: Episode, err: Exception) -> None:
        e.finish, e.error, e.reward, e.success = "error", str(err)[:500], 0.0, False

    # -------------------------------------------------------------- one turn of one episode
    def _take_turn(self, e: Episode, s: Sample, last_turn: bool) -> None:
        from k2_data.chat import parse_tool_calls

        budget = self.ep_cfg.max_episode_tokens
        ids, lps = list(s.token_ids), list(s.logprobs)
        cut = s.finish_reason == "length"
        room = budget - len(e.ids)
        if len(ids) >= room:
            ids, lps, cut = ids[:room], lps[:room], True
        e.ids += ids
        e.mask += [1] * len(ids)
        e.logprobs += lps
        e.turns += 1
        if s.routed_experts is not None:  # this turn's prompt was the whole episode so far
            e.routes = s.routed_experts[: len(e.prompt_ids) + len(e.ids)]  # none past a budget cut
        if cut:
            e.finish = "tokens"
            return
        text = self.tok.decode([t for t in ids if t not in self.stop])
        with _quiet_parser():  # counted per episode instead of a warning per dropped call
            content, calls = parse_tool_calls(text, e.tools)
        e.malformed_calls += max(0, text.count(CALL_BEGIN) - len(calls))
        assistant: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            assistant["tool_calls"] = calls
        e.messages.append(assistant)
        if not calls:
            e.finish, e.answer = "answer", content
            return
        e.calls += len(calls)
        try:
            step = guarded(lambda: e.env.step(calls), self.ep_cfg.env_timeout_s, "step")
            results = list(getattr(step, "results", None) or [])
            if len(results) != len(calls) or not all(isinstance(r, str) for r in results):
                raise EnvFailure(
                    f"step: malformed results (expected {len(calls)} strings, got {getattr(step, 'results', step)!r:.200})"
                )
        except EnvFailure as err:
            self._fail(e, err)
            return
        e.tool_errors += sum(r.startswith("Error:") for r in results)
        cap = self.ep_cfg.max_tool_result_chars
        for call, r in zip(calls, results):
            text = r if len(r) <= cap else r[:cap] + f"\n[... cut at {cap} characters]"
            name = call["function"]["name"]
            e.messages.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": text})
        if step.done:
            e.finish = "done"
            return
        if last_turn:
            e.finish = "turns"
            return
        # the rendered tool turns + the next generation prompt: the suffix of the full rendering after
        # the conversation up to this assistant turn (both start with a marker, so encoding splits there)
        try:
            base = self._render(e.messages[: -len(calls)], e.tools, gen=False)
            full = self._render(e.messages, e.tools, gen=True)
        except ValueError as err:  # e.g. tools from the environment the renderer refuses
            self._fail(e, EnvFailure(f"render: {err}"))
            return
        tool_ids = full[len(base) :]
        if len(e.ids) + len(tool_ids) >= budget:
            e.finish = "tokens"
            return
        e.ids += tool_ids
        e.mask += [0] * len(tool_ids)
        e.continuity.append(first_difference(full, e.prompt_ids + e.ids))

    # -------------------------------------------------------------- an iteration
    def rollout(
        self,
        generate: Callable[..., list[list[Sample]]],
        tasks: Sequence[dict],
        n: int,
        *,
        temperature: float,
        top_p: float,
        seed: int,
    ) -> list[Episode]:
        """`n` episodes per task, scored; in task order, then sample order."""
        eps: list[Episode] = []
        for p, task in enumerate(tasks):
            for _ in range(n):
                e = Episode(p, None)
                try:
                    e.env = guarded(self.maker, self.ep_cfg.env_timeout_s, "make")
                    e.messages, e.tools = guarded(
                        lambda env=e.env, task=task: env.reset(task), self.ep_cfg.env_timeout_s, "reset"
                    )
                    e.messages, e.tools = list(e.messages), list(e.tools or [])
                    e.prompt_ids = self._render(e.messages, e.tools, gen=True)
                except (EnvFailure, ValueError, TypeError) as err:  # TypeError: not (messages, tools)
                    self._fail(e, err)  # still a row of its group (reward 0); its prompt a stand-in
                    e.prompt_ids = self._render([{"role": "user", "content": ""}], [], True)
                eps.append(e)
        max_tokens = min(self.cfg.rollouts.max_response_tokens, self.ep_cfg.max_episode_tokens)
        kw = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens}
        for turn in range(self.ep_cfg.max_turns):
            last = turn == self.ep_cfg.max_turns - 1
            if turn == 0:  # one prefill per task for its n episodes
                out = generate(
                    [eps[p * n].prompt_ids for p in range(len(tasks))], n=n, seed=derive_seed(seed, 0), **kw
                )
                for p, group in enumerate(out):
                    for k, s in enumerate(group):
                        if eps[p * n + k].open:
                            self._take_turn(eps[p * n + k], s, last)
                continue
            active = [e for e in eps if e.open]
            if not active:
                break
            out = generate([e.prompt_ids + e.ids for e in active], n=1, seed=derive_seed(seed, turn), **kw)
            for e, group in zip(active, out):
                self._take_turn(e, group[0], last)
        for e in eps:
            if e.finish != "error":
                try:
                    sc = guarded(
                        lambda env=e.env, a=e.answer: env.score(a), self.ep_cfg.env_timeout_s, "score"
                    )
                    e.reward, e.success, e.parts = float(sc.reward), bool(sc.success), dict(sc.parts)
                    if not (0.0 <= e.reward <= 1.0) or e.reward != e.reward:
                        raise EnvFailure(f"score: reward {e.reward!r} outside [0, 1]")
                    e.success = e.success and e.finish in ("answer", "done")
                except EnvFailure as err:
                    self._fail(e, err)
            if e.env is not None:
                try:
                    guarded(e.env.close, self.ep_cfg.env_timeout_s, "close")
                except EnvFailure as err:
                    self.log(f"env close failed (ignored): {err}")
        return eps

    def score_open_tasks(self, eps: Sequence[Episode], tasks: Sequence[dict], seed: int) -> dict[str, Any]:
        """The rubric reward on open tasks (k2_rl.envs.base): the critic compares the final answers
        of a task's episodes pairwise; each episode's win rate becomes its `rubric` part, combined
        with the environment's reward by `with_rubric`. Episodes that ended in an error keep 0."""
        from k2_rl.envs.base import is_open_task, rubric_weight, with_rubric

        open_idx = [p for p, t in enumerate(tasks) if is_open_task(t)]
        if not open_idx:
            return {}
        if self.rubric is None:
            raise ValueError(
                "tasks with rubrics need the rubric reward's critic: pass --critic-url URL (an "
                "OpenAI-compatible API root) or --critic-url policy"
            )
        groups = [[e for e in eps if e.task_index == p] for p in open_idx]
        scores = self.rubric.score_groups(
            [(tasks[p]["messages"], [e.answer for e in g], tasks[p]) for p, g in zip(open_idx, groups)],
            seed=derive_seed(seed, "rubric"),
        )
        for p, g, rewards in zip(open_idx, groups, scores.rewards):
            w = rubric_weight(tasks[p])
            for e, r in zip(g, rewards):
                if e.finish != "error":
                    e.parts["rubric"] = float(r)
                    e.reward = with_rubric(e.reward, float(r), w)
        return {"rubric_tasks": len(open_idx), **{f"rubric_{k}": v for k, v in scores.stats.items()}}

    def iteration(
        self,
        generate: Callable[..., list[list[Sample]]],
        tasks: Sequence[dict],
        n: int,
        *,
        temperature: float,
        top_p: float,
        seed: int,
        iteration: int,
        pad_id: int,
        out_dir: Path | None = None,
    ) -> EpisodeBatch:
        """Episodes, shaped rewards (truncation penalty, length reward), the trainer's batch, metrics."""
        t0 = time.perf_counter()
        eps = self.rollout(generate, tasks, n, temperature=temperature, top_p=top_p, seed=seed)
        rollout_s = time.perf_counter() - t0
        metrics: dict[str, Any] = self.score_open_tasks(eps, tasks, seed)
        raw = [e.reward for e in eps]
        penalty = self.cfg.rewards.truncation_penalty
        shaped = [0.0 if e.finish == "error" else budget_penalty(e.reward, e.truncated, penalty) for e in eps]
        coef = length_coef_at(
            self.cfg.rewards.length_reward_coef, self.cfg.rewards.length_reward_warmup, iteration
        )
        if coef:
            shaped, extra = add_length_reward(
                shaped,
                [e.policy_tokens for e in eps],
                [e.success for e in eps],
                [e.task_index for e in eps],
                coef,
            )
            metrics["length_reward_mean"] = statistics.mean(extra)
        metrics.update(episode_metrics(eps))
        metrics["episode_rollout_s"] = rollout_s
        for e in eps:
            if e.error:
                self.log(f"episode of task {e.task_index} ended with an environment error: {e.error}")
                break
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / f"iteration-{iteration + 1:06d}.jsonl"
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(e.record()) + "\n" for e in eps))
            tmp.replace(path)
        batch = episode_batch(eps, shaped, pad_id)
        engine_logp = torch.tensor([sum(e.logprobs) for e in eps])
        return EpisodeBatch(eps, batch, engine_logp, shaped, raw, metrics)


def episode_batch(eps: Sequence[Episode], rewards: Sequence[float], pad_id: int) -> dict[str, torch.Tensor]:
    """One row per episode: first prompt + everything after it, `shift_labels` on the sampled
    tokens only (the position before a sampled token predicts it); as `k2_rl.loop.build_batch`."""
    rows = [list(e.prompt_ids) + list(e.ids) for e in eps]
    L = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), L), -100, dtype=torch.long)
    for r, (e, ids) in enumerate(zip(eps, rows)):
        t = torch.tensor(ids, dtype=torch.long)
        input_ids[r, : len(ids)] = t
        P = len(e.prompt_ids)
        m = torch.tensor(e.mask, dtype=torch.bool)
        if len(e.mask):
            labels[r, P - 1 : len(ids) - 1] = torch.where(m, t[P:], torch.full_like(t[P:], -100))
    batch = {
        "input_ids": input_ids,
        "shift_labels": labels,
        "group_ids": torch.tensor([e.task_index for e in eps], dtype=torch.long),
        "prompt_lens": torch.tensor([len(e.prompt_ids) for e in eps], dtype=torch.long),
        "rewards": torch.tensor(list(rewards), dtype=torch.float32),
    }
    routes = routes_batch([e.routes for e in eps], L)
    if routes is not None:
        batch["routed_experts"] = routes
    return batch


def episode_metrics(eps: Sequence[Episode]) -> dict[str, Any]:
    """Reward, strict success, turns, calls, failed calls, finishes, environment errors, score parts and the
    continuity metric per tool turn (rate of equal re-renders; first differing position)."""
    n = len(eps)
    finishes = Counter(e.finish for e in eps)
    errors = [e for e in eps if e.finish == "error"]
    out: dict[str, Any] = {
        "episode_reward_mean": statistics.mean(e.reward for e in eps),
        "success_rate": sum(e.success for e in eps) / n,
        "turns_mean": statistics.mean(e.turns for e in eps),
        "tool_calls_mean": statistics.mean(e.calls for e in eps),
        "malformed_calls_mean": statistics.mean(e.malformed_calls for e in eps),
        "tool_errors_mean": statistics.mean(e.tool_errors for e in eps),
        "policy_tokens_mean": statistics.mean(e.policy_tokens for e in eps),
        "episode_tokens_mean": statistics.mean(len(e.ids) for e in eps),
        "env_errors": len(errors),
        "env_error_first": errors[0].error if errors else None,
        **{f"finish_{k}": finishes.get(k, 0) / n for k in ("answer", "done", "turns", "tokens", "error")},
    }
    for part in sorted({k for e in eps for k in e.parts}):
        out[f"part_{part}"] = statistics.mean(e.parts.get(part, 0.0) for e in eps)
    most = max((len(e.continuity) for e in eps), default=0)
    for t in range(most):
        diffs = [e.continuity[t] for e in eps if len(e.continuity) > t]
        bad = [d for d in diffs if d >= 0]
        out[f"continuity_turn{t + 2}"] = 1 - len(bad) / len(diffs)
        out[f"continuity_first_diff_turn{t + 2}"] = min(bad) if bad else None
    return out


def split_success(eps: Sequence[Episode], tasks: Sequence[dict]) -> dict[str, float]:
    """Strict success per task `split` (e.g. the kvstore held-out columns values, compositions,
    tools) as `heldout_accuracy_<split>`; {} when no task names one. One episode per task."""
    by: dict[str, list[bool]] = {}
    for e in eps:
        split = tasks[e.task_index].get("split")
        if split is not None:
            by.setdefault(str(split), []).append(e.success)
    return {f"heldout_accuracy_{k}": sum(v) / len(v) for k, v in sorted(by.items())}


__all__ = [
    "EnvFailure",
    "Episode",
    "EpisodeBatch",
    "EpisodeRunner",
    "episode_batch",
    "episode_metrics",
    "first_difference",
    "guarded",
    "iteration_table",
    "split_success",
]


def iteration_table(run_dir: str | Path) -> str:
    """A text table of an episode run's iterations: reward, strict success, turns, calls, cut and
    environment errors, with the held-out success where it was evaluated."""
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    held = {r["iteration"]: r["heldout_accuracy"] for r in rows if r.get("heldout_accuracy") is not None}
    its = [r for r in rows if "episode_reward_mean" in r]
    head = f"{'iter':>4}  {'reward':>6}  {'success':>7}  {'turns':>5}  {'calls':>5}  {'cut':>5}  {'errors':>6}  {'held-out':>8}"
    lines = [head, "-" * len(head)]
    if 0 in held:
        lines.append(f"{0:>4}  {'':>6}  {'':>7}  {'':>5}  {'':>5}  {'':>5}  {'':>6}  {held[0]:>8.1%}")
    for r in its:
        cut = r.get("finish_turns", 0) + r.get("finish_tokens", 0)
        h = held.get(r["iteration"])
        lines.append(
            f"{r['iteration']:>4}  {r['episode_reward_mean']:>6.3f}  {r['success_rate']:>7.1%}  "
            f"{r['turns_mean']:>5.2f}  {r['tool_calls_mean']:>5.2f}  {cut:>5.1%}  {r['env_errors']:>6d}  "
            + (f"{h:>8.1%}" if h is not None else f"{'':>8}")
        )
    return "\n".join(lines)


if __name__ == "__main__":  # python -m k2_rl.episodes RUN_DIR: the run's table
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m k2_rl.episodes RUN_DIR")
    print(iteration_table(sys.argv[1]))

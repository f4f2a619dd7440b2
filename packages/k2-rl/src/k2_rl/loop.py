"""The RL loop: rollouts, verifiable rewards, the K1.5 objective through k2-train's step, and the
new weights pushed into the rollout engine through k2-ckpt, every iteration, as K2 does.

Legend: P prompts per iteration, K samples per prompt, N = P * K responses, L padded length.

Each iteration:
1. P task prompts, drawn without replacement by a generator seeded with (seed, iteration), are
   rendered in the Kimi chat format and sent to the rollout engine, which samples K responses
   each at the iteration's temperature, at most `max_response_tokens` tokens (the budget), with
   per-request seeds derived from (seed, iteration, prompt, sample).
2. Rewards are computed in worker processes (`RewardPool`: math-verify's signal-based timeouts
   only work on a process's main thread), one batch per reward name (a task's own `"reward"`
   field, else `cfg.rewards.reward`); group rewards (`GroupReward`, e.g. the self-critique `rubric`
   reward) score each prompt's K responses together, in this process, through their critic. A
   response cut at the budget gets `truncation_penalty` subtracted. With the rubric reward in
   use, the critic is also checked on the verifiable prompts' groups (`critic_agreement`) and the
   pairs it got wrong are written to `critic_sft/` as critic SFT data.
3. `logp_old`: the trainer's own forward on the sampled tokens, before the first update (the
   engine's sampling log-probs are only logged: `logp_mismatch`). With one update per iteration
   (the default) that is the update's own forward, detached (the losses record it); with more, a
   separate no-grad forward first.
4. `updates_per_iteration` Trainer steps on the batch with the K1.5 loss (or the GRPO-style one),
   micro-batches holding whole prompts; MuonClip clips as in pretraining.
5. The policy's weights go into the rollout engine (`PolicyEngine.sync`, k2_rl.policy_engine: a
   k2-ckpt `ParameterServer` update into the rollout worker's receiver, which loads them between
   two engine steps, or a copy into the in-process engine).
6. Every `eval_every` iterations: greedy accuracy on the held-out prompts.

Under torchrun the trainer runs on every process (FSDP2, or FSDP2 x EP with `ep` > 1, as
`k2 pretrain`); rank 0 alone drives the rollout worker, the rewards and the metrics. It
broadcasts each iteration's batch, every rank trains on its own whole prompts (P / world each;
the Trainer normalises over the global batch, so the step equals the one-process step), and the
sync gathers the full state dict onto rank 0, the single owner in k2-ckpt's update. Any step
that may have to re-sync (a dead worker restarted) is entered by all ranks together.

The run's state (policy, optimizer, scheduler, RNG, trainer step, iteration) is a k2-train
`TrainState`, saved atomically; `resume=True` continues exactly (prompts and sampling seeds are
functions of the iteration, and the restarted worker first gets the saved policy). A rollout
worker that dies is restarted and re-synced once per iteration, then reported.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from k2_train import distributed as dd

from k2_rl.config import RLConfig
from k2_rl.loss import GRPOClippedLoss, KimiK15Loss, sequence_logprobs, token_logprobs
from k2_rl.policy_engine import PolicyEngine
from k2_rl.rewards.base import budget_penalty
from k2_rl.rollout import Sample, derive_seed
from k2_rl.routing import mismatch_metrics, routes_batch

METRICS = "metrics.jsonl"
CONFIG = "config.json"


@dataclass
class RLResult:
    run_dir: Path
    iterations_done: int
    steps: int
    reward_mean: float
    heldout_accuracy: float | None
    interrupted: bool
    plots: list[Path] = field(default_factory=list)
    heldout_accuracy_start: float | None = None  # before the first update (iteration 0)
    reward_mean_start: float | None = None  # the first iteration's mean reward
    heldout_prompts: int = 0  # prompts of each held-out evaluation


class _Rewards(NamedTuple):
    shaped: list[float]  # with the truncation penalty, in row order
    raw: list[float]
    errors: int
    texts: list[list[str]]  # per prompt, per sample
    grouped: list[list[float]]  # raw, per prompt
    metrics: dict[str, Any]  # the group rewards' own (e.g. rubric_position_bias)


class _IterationState:
    """The loop's own train-state component: how many iterations are done."""

    def __init__(self) -> None:
        self.iteration = 0

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.iteration = int(sd["iteration"])


# ----------------------------------------------------------------------------- pieces


def temperature_at(cfg: RLConfig, iteration: int) -> float:
    """Linear decay from `temperature` to `temperature_end` over the run (K2's temperature decay)."""
    if cfg.iterations <= 1:
        return cfg.rollouts.temperature
    frac = iteration / (cfg.iterations - 1)
    return cfg.rollouts.temperature + (cfg.rollouts.temperature_end - cfg.rollouts.temperature) * frac


def draw_prompts(tasks: Sequence[dict], n: int, seed: int, iteration: int) -> list[dict]:
    rng = random.Random(derive_seed(seed, "prompts", iteration))
    return rng.sample(list(tasks), min(n, len(tasks)))


def build_batch(
    prompt_ids: Sequence[Sequence[int]],
    samples: Sequence[Sequence[Sample]],
    rewards: Sequence[float],
    pad_id: int,
) -> dict[str, torch.Tensor]:
    """One row per response: prompt + response tokens (right-padded), `shift_labels` on the
    response's tokens only, `group_ids` (the prompt's index), `prompt_lens`, `rewards`; and
    `routed_experts` where the engine recorded them (k2_rl.routing)."""
    rows = [
        (p, list(prompt_ids[p]) + list(s.token_ids), len(prompt_ids[p]))
        for p, group in enumerate(samples)
        for s in group
    ]
    L = max(len(ids) for _, ids, _ in rows)
    input_ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), L), -100, dtype=torch.long)
    for r, (_, ids, n_prompt) in enumerate(rows):
        t = torch.tensor(ids, dtype=torch.long)
        input_ids[r, : len(ids)] = t
        labels[r, n_prompt - 1 : len(ids) - 1] = t[n_prompt:]  # position t predicts token t + 1
    batch = {
        "input_ids": input_ids,
        "shift_labels": labels,
        "group_ids": torch.tensor([p for p, _, _ in rows], dtype=torch.long),
        "prompt_lens": torch.tensor([n for _, _, n in rows], dtype=torch.long),
        "rewards": torch.tensor(list(rewards), dtype=torch.float32),
    }
    routes = routes_batch([s.routed_experts for group in samples for s in group], L)
    if routes is not None:
        batch["routed_experts"] = routes
    return batch


@torch.no_grad()
def policy_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], rows_per_chunk: int, per_token: bool = False
) -> torch.Tensor:
    """Sequence (or per-token) log-probs of the batch's responses under `model`, in eval mode (no
    max-logit record, no expert-load counts), in chunks of rows."""
    was = model.training
    model.eval()
    try:
        parts = []
        for i in range(0, batch["input_ids"].shape[0], rows_per_chunk):
            chunk = {k: v[i : i + rows_per_chunk] for k, v in batch.items()}
            parts.append(token_logprobs(model, chunk) if per_token else sequence_logprobs(model, chunk))
        return torch.cat(parts)
    finally:
        model.train(was)


def load_tokenizer_for(init: str | None):
    """The tokenizer the policy was trained with: an HF dir's own, a k2 run's `tokenizer/`, else k2-data's."""
    from k2_data import load_tokenizer

    if init:
        d = Path(init)
        for cand in (d, d / "tokenizer"):
            if (cand / "tokenizer.json").is_file() or (cand / "tiktoken.model").is_file():
                return load_tokenizer(cand)
    return load_tokenizer()


# ----------------------------------------------------------------------------- the run


def run_rl(
    cfg: RLConfig,
    resume: bool = False,
    log: Callable[[str], None] | None = None,
    on_iteration: Callable[[dict], None] | None = None,
) -> RLResult:
    """Run (or continue, with `resume=True`) the RL loop in `cfg.out`; see the module docstring."""
    cfg.validate()
    log = log or print
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return _Loop(cfg, resume, log, on_iteration).run()


class _Loop:
    def __init__(
        self,
        cfg: RLConfig,
        resume: bool,
        log: Callable[[str], None],
        on_iteration: Callable[[dict], None] | None,
    ) -> None:
        self.cfg, self.resume, self.log, self.on_iteration = cfg, resume, log, on_iteration
        self.run_dir = Path(cfg.out)
        self.interrupted = False
        self.metrics: Any = None  # the metrics writer (rank 0), made by _setup
        self.critic: Any = None  # the rubric reward's critic, when a task needs one

    # -------------------------------------------------------------- setup
    def _setup(self) -> None:
        from k2_train.builders import build_model, build_optimizer, describe_ns_dtype
        from k2_train.metrics import JSONLMetrics
        from k2_train.state import ModelState, OptimizerState, RNGState, TrainState, latest_state
        from k2_train.trainer import Trainer, TrainerConfig

        from k2_rl.tasks import read_tasks, write_addition_dataset

        cfg, run_dir = self.cfg, self.run_dir
        from k2_model.device import pick_device

        self.device = pick_device(cfg.device)
        self.info = info = dd.init_distributed(self.device.type)
        if self.device.type == "cuda" and info.enabled:
            self.device = torch.device("cuda", info.local_rank)
            torch.cuda.set_device(self.device)
        if not info.is_main:
            self.log = lambda _m: None
        self.share_prompts = cfg.prompt_sharing == "on" or (
            cfg.prompt_sharing == "auto" and self.device.type == "cpu"
        )
        if cfg.ep > 1 and not info.enabled:
            raise ValueError(f"rl config: ep={cfg.ep} needs several trainer processes (run under torchrun)")
        if info.enabled:
            if cfg.rollouts.rollout != "process":
                raise ValueError(
                    f"rl config: rollout={cfg.rollouts.rollout!r}: under torchrun the rollout engine is a worker "
                    "process driven by rank 0 (rollout='process')"
                )
            if cfg.prompts_per_iteration % info.world_size:
                raise ValueError(
                    f"rl config: prompts_per_iteration={cfg.prompts_per_iteration}: expected a multiple of "
                    f"the {info.world_size} processes (each trains on whole prompts)"
                )
            local = cfg.prompts_per_iteration // info.world_size
            if cfg.micro_prompts and local % cfg.micro_prompts:
                raise ValueError(
                    f"rl config: micro_prompts={cfg.micro_prompts}: expected a divisor of the "
                    f"{local} prompts each of the {info.world_size} processes trains on"
                )
        if self.resume and latest_state(run_dir) is None:
            raise FileNotFoundError(f"--resume {run_dir}: no complete train state under {run_dir / 'state'}")
        if not self.resume and latest_state(run_dir) is not None:
            raise FileExistsError(
                f"{run_dir} already holds a run; continue it with --resume {run_dir} or pick a new --out"
            )
        if info.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            tmp = run_dir / f".{CONFIG}.tmp"
            tmp.write_text(json.dumps(dict(cfg.to_dict(), task="rl"), indent=2))
            os.replace(tmp, run_dir / CONFIG)

        # tasks
        self.env_maker = None
        if cfg.episodes.env is not None:  # multi-turn episodes (k2_rl.episodes): the environment's tasks
            from k2_rl.envs import get_env
            from k2_rl.envs.expert import heldout_tasks
            from k2_rl.tasks import read_env_tasks

            if info.enabled:
                raise ValueError(
                    "rl config: env: tool episodes run in one trainer process (not under torchrun)"
                )
            self.env_maker = get_env(cfg.episodes.env)
            n_tasks, n_held = cfg.episodes.env_tasks, cfg.eval_prompts or 16
            self.tasks = read_env_tasks(cfg.tasks) if cfg.tasks else self.env_maker.tasks(n_tasks, cfg.seed)
            self.heldout = (
                read_env_tasks(cfg.heldout)
                if cfg.heldout
                else heldout_tasks(self.env_maker, n_held, cfg.seed + 1)
            )
        elif cfg.tasks is None:
            data = run_dir / "data"
            if info.is_main and not (data / "rl.jsonl").is_file():
                write_addition_dataset(data, seed=0)
            dd.barrier(info)
            self.tasks = read_tasks(data / "rl.jsonl", cfg.rewards.reward)
            self.heldout = read_tasks(
                Path(cfg.heldout) if cfg.heldout else data / "heldout.jsonl", cfg.rewards.reward
            )
        else:
            self.tasks = read_tasks(cfg.tasks, cfg.rewards.reward)
            self.heldout = read_tasks(cfg.heldout, cfg.rewards.reward) if cfg.heldout else []
        if self.env_maker is None:
            self._resolve_rewards()
        else:  # the environment scores its episodes; open tasks also by the rubric reward
            from k2_rl.envs.base import is_open_task

            self.group_names, self.response_names, self.group_rewards, self.critic = set(), [], {}, None
            if any(is_open_task(t) for t in self.tasks):
                self.group_names = {"rubric"}
        # held-out accuracy is a verifier's: prompts scored by a group reward (a critic) are left out
        self.heldout = [t for t in self.heldout if self._reward_name(t) not in self.group_names]
        if cfg.eval_prompts:
            self.heldout = self.heldout[: cfg.eval_prompts]

        # policy, optimizer, loss, trainer
        from k2_data.chat import render_ids

        self.tok = load_tokenizer_for(cfg.model.init)
        self.render = lambda messages: render_ids(self.tok, messages, add_generation_prompt=True)
        self.pad_id = int(
            self.tok.pad_id if getattr(self.tok, "pad_id", None) is not None else self.tok.eos_id
        )
        self.episodes = None
        if self.env_maker is not None:
            from k2_rl.episodes import EpisodeRunner

            stops = sorted({self.tok.eos_id, self.tok.token_to_id("<|im_end|>")})
            self.episodes = EpisodeRunner(cfg, self.tok, self.env_maker, stops, self.log)
        self.model = build_model(
            cfg.model, self.tok.vocab_size, self.device, cfg.seed
        )  # seeded init, then cfg.model.init's weights
        self.model.train()
        if cfg.rollouts.routing_replay:  # the trainer routes by the rollout engine's record
            self.model.set_routing_replay(True)
        if info.enabled:
            from k2_model.parallelize import parallelize

            cfg.validate_layout(info.world_size, self.model.config.n_routed_experts)
            parallelize(self.model, data_parallel=True, ep=cfg.ep)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.log(
            f"k2 rl: trainer on {self.device} x {info.world_size} process(es); {cfg.optim.optimizer} "
            f"(lr {cfg.optim.lr:g}); Newton-Schulz: {describe_ns_dtype(cfg.optim, self.device)}"
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _s: 1.0)
        self.loss = (
            KimiK15Loss(cfg.objective.rl_tau, cfg.objective.ptx_coef)
            if cfg.objective.loss == "k15"
            else GRPOClippedLoss(cfg.objective.clip_eps)
        )
        K = cfg.rollouts.samples_per_prompt
        local_prompts = cfg.prompts_per_iteration // info.world_size
        self.rows_per_micro = (cfg.micro_prompts or local_prompts) * K
        self.metrics = JSONLMetrics(run_dir / METRICS) if info.is_main else None
        self.trainer = Trainer(
            self.model,
            self.optimizer,
            self.loss,
            self.scheduler,
            config=TrainerConfig(
                steps=cfg.steps,
                micro_batch=self.rows_per_micro,
                grad_clip=cfg.optim.grad_clip,
                bias_update_speed=cfg.bias_update_speed,
            ),
            info=info,
            device=self.device,
        )
        self.it_state = _IterationState()
        self.state = TrainState(
            run_dir,
            {
                "model": ModelState(self.model, info),
                "optimizer": OptimizerState(self.model, self.optimizer, info),
                "scheduler": self.scheduler,
                "rng": RNGState(),
                "trainer": self.trainer,
                "rl": self.it_state,
            },
            info=info,
            meta={"config": cfg.to_dict(), "task": "rl", "model_config": self.model.config.to_hf()},
            layout={"ep": cfg.ep},
        )
        if self.resume:
            self.state.load()
            done = self.it_state.iteration
            if cfg.stop_at and cfg.stop_at <= done:  # it would never be reached: the run would go on
                raise ValueError(
                    f"--stop-at {cfg.stop_at}: the run in {run_dir} has done {done} iterations already; "
                    f"give a later one (or none, to run to --iterations {cfg.iterations})"
                )
        if info.is_main and not (run_dir / "tokenizer").exists():
            self.tok.save(run_dir / "tokenizer")
        if self.metrics is not None:
            self.metrics.on_fit_start(self.trainer)  # on resume: drop rows after the saved step
        self.ptx = self._ptx_rows() if cfg.objective.ptx_coef else None

    def _reward_name(self, task: dict) -> str:
        return task.get("reward") or self.cfg.rewards.reward

    def _resolve_rewards(self) -> None:
        """The reward names the tasks use, split into per-response and group rewards."""
        from k2_rl.rewards.base import is_group_reward

        names = {self._reward_name(t) for t in [*self.tasks, *self.heldout]}
        try:
            self.group_names = {n for n in names if is_group_reward(n)}
        except KeyError as e:
            raise ValueError(str(e.args[0])) from None
        self.response_names = sorted(names - self.group_names)
        self.group_rewards: dict[str, Any] = {}
        self.critic = None

    def _setup_group_rewards(self) -> None:
        """Build the group rewards (and their critic) once the rollout engine runs."""
        from k2_rl.rewards.base import lookup_reward

        objs = {n: lookup_reward(n) for n in sorted(self.group_names)}
        if any(getattr(o, "needs_critic", False) for o in objs.values()):
            self.critic = self._make_critic()
        for n, o in objs.items():
            if hasattr(o, "from_config"):
                self.group_rewards[n] = o.from_config(self.cfg, self.critic)
            else:
                self.group_rewards[n] = o() if isinstance(o, type) else o
        names = ", ".join(sorted(self.group_rewards))
        critic = getattr(self.critic, "base_url", None) or ("the policy" if self.critic else "none")
        self.log(f"group rewards: {names}; critic: {critic}")

    def _make_critic(self) -> Any:
        from k2_rl.rewards.critic import HTTPCritic, PolicyCritic

        url = self.cfg.rubric.critic_url or self.engine.chat_url()
        if url is None:
            raise ValueError(
                "the rubric reward needs a critic, and the rollout worker serves only /generate "
                "(token ids), not an OpenAI chat endpoint: pass --critic-url URL (an OpenAI-compatible "
                "API root, e.g. `k2 serve --model <the policy>` at http://127.0.0.1:8000/v1), or "
                "--critic-url policy to have the rollout engine judge through /generate"
            )
        if url == "policy":
            # rank 0 alone scores, so under torchrun the critic calls the engine directly
            return PolicyCritic(
                self.engine.generate if not self.info.enabled else self.engine.generate_on_rank0,
                self.render,
                lambda ids: self.tok.decode(ids),
                self.engine.stop_ids,
            )
        return HTTPCritic(
            url,
            self.cfg.rubric.critic_model,
            max_concurrency=self.cfg.rubric.critic_concurrency,
            cache=self.run_dir / "critic_cache.sqlite",
        )

    def _ptx_rows(self) -> list[tuple[list[int], list[int]]]:
        """(ids, mask) of the PTX set's conversations (the loss on their assistant turns)."""
        from k2_data.chat import render_ids_with_mask

        rows = []
        for i, line in enumerate(Path(self.cfg.objective.ptx_data).read_text().splitlines(), 1):
            if line.strip():
                rec = json.loads(line)
                if "messages" not in rec:
                    raise ValueError(f"{self.cfg.objective.ptx_data}:{i}: no field 'messages'")
                rows.append(render_ids_with_mask(self.tok, rec["messages"], rec.get("tools")))
        return rows

    def _ptx_batch(self, iteration: int, n: int) -> dict[str, torch.Tensor]:
        rng = random.Random(derive_seed(self.cfg.seed, "ptx", iteration))
        picked = [self.ptx[rng.randrange(len(self.ptx))] for _ in range(n)]
        L = max(len(ids) for ids, _ in picked)
        ids_t = torch.full((n, L), self.pad_id, dtype=torch.long)
        lab_t = torch.full((n, L), -100, dtype=torch.long)
        for r, (ids, mask) in enumerate(picked):
            t = torch.tensor(ids)
            ids_t[r, : len(ids)] = t
            m = torch.tensor(mask[1:], dtype=torch.bool)
            lab_t[r, : len(ids) - 1] = torch.where(m, t[1:], torch.full_like(t[1:], -100))
        return {"ptx_input_ids": ids_t, "ptx_shift_labels": lab_t}

    # -------------------------------------------------------------- rewards and evaluation
    def _rewards(self, prompts: list[dict], samples: list[list[Sample]], seed: int = 0) -> _Rewards:
        """Rewards in row order: per-response rewards in the pool (one batch per reward name), group
        rewards per prompt group in this process (`seed` goes into their critic's requests)."""
        texts = [
            [self.tok.decode([t for t in s.token_ids if t not in self._stop_set]) for s in group]
            for group in samples
        ]
        names = [self._reward_name(t) for t in prompts]
        grouped: list[list[float]] = [[0.0] * len(g) for g in samples]
        errors, metrics = 0, {}
        for name in sorted(set(names) - self.group_names):
            idx = [p for p, n in enumerate(names) if n == name]
            items = [
                (
                    prompts[p]["messages"][-1]["content"],
                    text,
                    {"answer": prompts[p].get("answer"), **prompts[p]},
                )
                for p in idx
                for text in texts[p]
            ]
            res = self.pool.compute(name, items)
            values = iter(res.rewards)
            for p in idx:
                grouped[p] = [next(values) for _ in texts[p]]
            errors += len(res.failed)
        for name in sorted(set(names) & self.group_names):
            idx = [p for p, n in enumerate(names) if n == name]
            scores = self.group_rewards[name].score_groups(
                [(prompts[p]["messages"], texts[p], prompts[p]) for p in idx], seed=seed
            )
            for p, r in zip(idx, scores.rewards):
                grouped[p] = [float(x) for x in r]
            metrics[f"{name}_prompts"] = len(idx)
            metrics.update({f"{name}_{k}": v for k, v in scores.stats.items()})
        raw = [r for g in grouped for r in g]
        truncated = [s.finish_reason == "length" for g in samples for s in g]
        penalty = self.cfg.rewards.truncation_penalty
        shaped = [budget_penalty(r, cut, penalty) for r, cut in zip(raw, truncated)]
        return _Rewards(shaped, raw, errors, texts, grouped, metrics)

    def _with_length_reward(self, scored: _Rewards, lengths: list[int], K: int, iteration: int) -> _Rewards:
        """K1.5's length reward added to the shaped rewards (k2_rl.rewards.length), after its warm-up;
        correct = a raw reward of 1."""
        from k2_rl.rewards.length import add_length_reward, length_coef_at

        rc = self.cfg.rewards
        coef = length_coef_at(rc.length_reward_coef, rc.length_reward_warmup, iteration)
        if not coef:
            return scored
        groups = [r // K for r in range(len(lengths))]
        shaped, extra = add_length_reward(
            scored.shaped, lengths, [r >= 1.0 for r in scored.raw], groups, coef
        )
        metrics = {**scored.metrics, "length_reward_mean": statistics.mean(extra)}
        return scored._replace(shaped=shaped, metrics=metrics)

    def _refine_critic(self, tasks: list[dict], scored: _Rewards, iteration: int) -> dict[str, Any]:
        """The critic against the verifiable rewards of this iteration's verifiable prompts; the pairs
        it got wrong go to `critic_sft/iteration-N.jsonl` (chat JSONL for `k2 sft --data`)."""
        from k2_rl.rewards.rubric import write_sft

        rubric = self.group_rewards.get("rubric")
        if rubric is None or not self.cfg.rubric.critic_refine_pairs:
            return {}
        ver = [p for p, t in enumerate(tasks) if self._reward_name(t) not in self.group_names]
        if not ver:
            return {}
        t0 = time.perf_counter()
        ref = rubric.refine(
            [(tasks[p]["messages"], scored.texts[p], tasks[p], scored.grouped[p]) for p in ver],
            max_pairs=self.cfg.rubric.critic_refine_pairs,
            seed=derive_seed(self.cfg.seed, "critic-refine", iteration),
        )
        path = self.run_dir / "critic_sft" / f"iteration-{iteration + 1:06d}.jsonl"
        if ref.sft_records:
            write_sft(ref.sft_records, path)
        else:
            path.unlink(missing_ok=True)  # a resumed iteration that now has none
        return {**ref.metrics(), "critic_refine_s": time.perf_counter() - t0}

    def _evaluate(self) -> dict[str, float]:
        """Greedy held-out accuracy (every rank enters; rank 0's numbers, {} elsewhere)."""
        main = self.info.is_main
        if self.episodes is not None:  # greedy episodes: strict success on the held-out tasks
            from k2_rl.episodes import split_success

            eps = self.episodes.rollout(
                self.engine.generate, self.heldout, 1, temperature=0.0, top_p=1.0, seed=0
            )
            return {
                "heldout_accuracy": sum(e.success for e in eps) / len(eps),
                "heldout_reward": statistics.mean(e.reward for e in eps),
                "heldout_response_tokens": statistics.mean(e.policy_tokens for e in eps),
                **split_success(eps, self.heldout),
            }
        prompts = [self.render(t["messages"]) for t in self.heldout] if main else []
        samples = self.engine.generate(
            prompts, n=1, temperature=0.0, max_tokens=self.cfg.rollouts.max_response_tokens, seed=0
        )
        if not main:
            return {}
        raw = self._rewards(self.heldout, samples).raw
        lengths = [len(g[0].token_ids) for g in samples]
        return {
            "heldout_accuracy": sum(r >= 1.0 for r in raw) / len(raw),
            "heldout_response_tokens": statistics.mean(lengths),
        }

    # -------------------------------------------------------------- the loop
    def run(self) -> RLResult:
        from k2_data import lifetime

        from k2_rl.rewards.pool import RewardPool

        lifetime.tether()  # before any child: the rollout and reward workers die with this process
        self._setup()
        self.engine = PolicyEngine(
            self.cfg, self.model, self.tok, self.info, self.device, self.run_dir, self.log
        )
        self._stop_set = set(self.engine.stop_ids)
        self.pool = None
        if self.info.is_main and self.episodes is None:  # rewards are computed by rank 0 only
            self.pool = RewardPool(
                self.cfg.rewards.reward_workers,
                timeout_s=self.cfg.rewards.reward_timeout_s,
                preload=tuple(self.response_names),
            )
        try:
            self.engine.start()
            if self.group_names and self.info.is_main:
                self._setup_group_rewards()
                if self.episodes is not None:
                    self.episodes.rubric = self.group_rewards["rubric"]
            sync_s = self.engine.sync(f"start-{self.it_state.iteration}")
            self.log(f"policy synced into the rollout engine in {sync_s:.2f} s")
            with self._sigint_finishes_iteration():
                self._iterate()
        finally:
            if self.metrics is not None:
                self.metrics.on_fit_end(self.trainer, None)
            if self.pool is not None:
                self.pool.close()
            if self.critic is not None:
                self.critic.close()
            self.engine.close()
            if self.env_maker is not None:
                self.env_maker.close()
        try:
            return self._result()
        finally:
            dd.shutdown(self.info)

    def _iterate(self) -> None:
        cfg, K, info = self.cfg, self.cfg.rollouts.samples_per_prompt, self.info
        main = info.is_main
        first_eval = main and self.it_state.iteration == 0 and not self._logged_initial_eval()
        if cfg.eval_every and self.heldout and dd.broadcast_object(first_eval, info):
            row = {"iteration": 0, "step": self.trainer.step, **self._evaluate()}
            self._write(row)
            if main and row.get("heldout_accuracy") is not None:  # the baseline the run is judged by
                acc, n = row["heldout_accuracy"], len(self.heldout)
                self.log(
                    f"rl iteration 0 (before training): held-out {acc:.1%} of {n} prompts "
                    f"(+/- {100 * (acc * (1 - acc) / max(n, 1)) ** 0.5:.1f} points, one standard error)"
                )
        while self.it_state.iteration < cfg.iterations and not self.interrupted:
            it = self.it_state.iteration
            t_it = time.perf_counter()
            temperature = temperature_at(cfg, it)
            tasks = draw_prompts(self.tasks, cfg.prompts_per_iteration, cfg.seed, it) if main else []
            payload, scored, critic_row = None, None, {}
            if self.episodes is not None:  # multi-turn episodes: rollout and rewards in one (k2_rl.episodes)
                t0 = time.perf_counter()
                eb = self.episodes.iteration(
                    self.engine.generate,
                    tasks,
                    K,
                    temperature=temperature,
                    top_p=cfg.rollouts.top_p,
                    seed=derive_seed(cfg.seed, "rollout", it),
                    iteration=it,
                    pad_id=self.pad_id,
                    out_dir=self.run_dir / "episodes",
                )
                rollout_s = eb.metrics["episode_rollout_s"]
                reward_s = time.perf_counter() - t0 - rollout_s
                scored = _Rewards(eb.shaped, eb.raw, eb.metrics["env_errors"], [], [], eb.metrics)
                lengths = [e.policy_tokens for e in eb.episodes]
                truncated = [e.truncated for e in eb.episodes]
                payload = {"batch": eb.batch, "engine_logp": eb.engine_logp}
            else:
                prompt_ids = [self.render(t["messages"]) for t in tasks]
                t0 = time.perf_counter()
                samples = self.engine.generate(
                    prompt_ids,
                    n=K,
                    temperature=temperature,
                    top_p=cfg.rollouts.top_p,
                    max_tokens=cfg.rollouts.max_response_tokens,
                    seed=derive_seed(cfg.seed, "rollout", it),
                )
                rollout_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                lengths = [len(s.token_ids) for g in samples for s in g]
                truncated = [s.finish_reason == "length" for g in samples for s in g]
                if main:
                    scored = self._rewards(tasks, samples, seed=derive_seed(cfg.seed, "critic", it))
                    scored = self._with_length_reward(scored, lengths, K, it)
                    critic_row = self._refine_critic(tasks, scored, it) if self.group_rewards else {}
                    payload = {
                        "batch": build_batch(prompt_ids, samples, scored.shaped, self.pad_id),
                        "engine_logp": torch.tensor([sum(s.logprobs) for g in samples for s in g]),
                    }
                reward_s = time.perf_counter() - t0
            switch_row = self.engine.free_cache()

            t0 = time.perf_counter()
            payload = dd.broadcast_object(payload, info)
            batch = {k: self._my_rows(v).to(self.device) for k, v in payload["batch"].items()}
            if not self.share_prompts:
                del batch["prompt_lens"]
            engine_logp = self._my_rows(payload["engine_logp"]).to(self.device)
            chunk = self.rows_per_micro
            on_policy = cfg.updates_per_iteration == 1
            self.model.reset_routing_mismatch()
            routing_row: dict[str, float] = {}
            if on_policy:  # the one update's forward is pi_old's: the loss records logp_old
                self.loss.recorded_logp_old.clear()
            else:
                batch["logp_old"] = policy_logprobs(self.model, batch, chunk)
                routing_row = self._routing_mismatch()  # pi_old's forward against the engine's
                if cfg.objective.loss == "grpo":
                    batch["logp_old_tok"] = policy_logprobs(self.model, batch, chunk, per_token=True)
            step_rows = []
            for u in range(cfg.updates_per_iteration):
                train_batch = dict(batch)
                if self.ptx is not None:
                    n_rows = payload["batch"]["input_ids"].shape[0]
                    ptx = self._ptx_batch(it * cfg.updates_per_iteration + u, n_rows)
                    train_batch.update({k: self._my_rows(v) for k, v in ptx.items()})
                m = self.trainer.train_step(train_batch)
                if on_policy:  # this forward was pi_old's: the same weights the engine sampled with
                    routing_row = self._routing_mismatch()
                row = m.row()
                row["iteration"] = it + 1
                self._write(row)
                step_rows.append(row)
            if on_policy:
                batch["logp_old"] = torch.cat(self.loss.recorded_logp_old)
            # summed over every rank's rows: tokens, KL(pi_old || pi_theta) per token estimated on
            # pi_old's own samples (k1, one more forward: every kl_every iterations), and the engine's
            # sampling log-probs against the trainer's
            n_tok = dd.all_reduce_scalar(
                float((batch["shift_labels"] != -100).sum()), "sum", info, self.device
            )
            kl = None
            if cfg.kl_every and (it + 1) % cfg.kl_every == 0:
                logp_new = policy_logprobs(self.model, batch, chunk)
                kl = dd.all_reduce_scalar(
                    float((batch["logp_old"] - logp_new).sum()), "sum", info, self.device
                )
            mismatch = dd.all_reduce_scalar(
                float((engine_logp - batch["logp_old"]).abs().sum()), "sum", info, self.device
            )
            train_s = time.perf_counter() - t0

            sync_s = self.engine.sync(str(it + 1))
            self.it_state.iteration = it + 1
            done = it + 1
            evaluated = {}
            if cfg.eval_every and self.heldout and (done % cfg.eval_every == 0 or done == cfg.iterations):
                evaluated = self._evaluate()
            if main:
                rewards, raw = scored.shaped, scored.raw
                row = {
                    "iteration": done,
                    "step": self.trainer.step,
                    "reward_mean": statistics.mean(rewards),
                    "reward_std": statistics.pstdev(rewards),
                    "solve_rate": sum(r >= 1.0 for r in raw) / len(raw),
                    "response_tokens_mean": statistics.mean(lengths),
                    "truncation_rate": sum(truncated) / len(truncated),
                    "kl_estimate": kl / n_tok if kl is not None else None,
                    "logp_mismatch": mismatch / n_tok,
                    **routing_row,
                    "temperature": temperature,
                    "max_logit": max(
                        (r["max_logit"] for r in step_rows if r.get("max_logit") is not None), default=None
                    ),
                    "clipped_heads": sum(r["clipped_heads"] for r in step_rows),
                    "loss": step_rows[-1]["loss"],
                    "reward_errors": scored.errors,
                    **scored.metrics,
                    **critic_row,
                    **switch_row,
                    "rollout_s": rollout_s,
                    "reward_s": reward_s,
                    "train_s": train_s,
                    "sync_s": sync_s,
                    **evaluated,
                }
                row["iteration_s"] = time.perf_counter() - t_it
                self._write(row)
                if self.on_iteration is not None:
                    self.on_iteration(row)
            # an interrupt on any rank stops every rank after this iteration
            self.interrupted = bool(dd.all_reduce_scalar(float(self.interrupted), "max", info, self.device))
            stop_here = bool(cfg.stop_at) and done == cfg.stop_at
            due = bool(cfg.save_every) and done % cfg.save_every == 0
            if due or done == cfg.iterations or stop_here or self.interrupted:
                self.state.save(self.trainer.step)
            if stop_here:
                self.interrupted = True

    def _routing_mismatch(self) -> dict[str, float]:
        """The share of recorded tokens whose experts the trainer's forward chose differently from
        the rollout engine (k2_rl.routing), summed over ranks, since the last reset; then reset."""
        counts = self.model.routing_mismatch().to(self.device)
        if self.info.enabled:
            import torch.distributed as dist

            dist.all_reduce(counts)
        self.model.reset_routing_mismatch()
        return mismatch_metrics(counts)

    def _my_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole-iteration tensor: its P / world prompts' K responses each
        (rows are grouped by prompt, so every rank holds whole groups)."""
        n = t.shape[0] // self.info.world_size
        return t[self.info.rank * n : (self.info.rank + 1) * n]

    def _logged_initial_eval(self) -> bool:
        path = self.run_dir / METRICS
        if not path.is_file():
            return False
        return any(
            json.loads(line).get("iteration") == 0 for line in path.read_text().splitlines() if line.strip()
        )

    def _write(self, row: dict) -> None:
        if self.metrics is None:  # ranks other than 0 log nothing
            return
        row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.metrics.write(row)

    def _sigint_finishes_iteration(self):
        from k2_train.trainer import finish_then_stop_on_sigint

        def first() -> None:
            self.interrupted = True
            self.log(
                "interrupt: finishing this iteration, then saving the train state (Ctrl-C again to abort)"
            )

        return finish_then_stop_on_sigint(first, lambda: self.interrupted)

    def _result(self) -> RLResult:
        from k2_train.metrics import read_metrics

        rows = read_metrics(self.run_dir / METRICS) if (self.run_dir / METRICS).is_file() else []
        its = [r for r in rows if "reward_mean" in r]
        accs = [r["heldout_accuracy"] for r in rows if r.get("heldout_accuracy") is not None]
        plots: list[Path] = []
        if its and self.info.is_main:
            from k2_rl.plots import plot_rl

            plots = plot_rl(rows, self.run_dir / "plots")
        return RLResult(
            run_dir=self.run_dir,
            iterations_done=self.it_state.iteration,
            steps=self.trainer.step,
            reward_mean=its[-1]["reward_mean"] if its else float("nan"),
            heldout_accuracy=accs[-1] if accs else None,
            interrupted=self.it_state.iteration < self.cfg.iterations,
            plots=plots,
            heldout_accuracy_start=next(
                (r["heldout_accuracy"] for r in rows if r.get("iteration") == 0 and "heldout_accuracy" in r),
                None,
            ),
            reward_mean_start=its[0]["reward_mean"] if its else None,
            heldout_prompts=len(self.heldout) if self.heldout else 0,
        )


__all__ = ["RLResult", "build_batch", "draw_prompts", "policy_logprobs", "run_rl", "temperature_at"]

"""`RLConfig`: one dataclass for a `k2 rl` run, loadable from JSON/TOML, overridable by flags.

Names shared with k2-train's configs mean the same (`lr`, `adamw_lr`, `tau` = QK-Clip's
threshold, `seed`, ...); the K1.5 objective's own tau is `rl_tau`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k2_train.config import NS_DTYPES, RunConfig

LOSSES = ("k15", "grpo")
ROLLOUTS = ("process", "inprocess")


@dataclass
class RLConfig(RunConfig):
    # policy: start from an SFT run dir or an HF-format dir; None = a random init of `preset`
    init: str | None = None
    preset: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    attention: str = "auto"
    # tasks: JSONL records {"messages", "answer"}; None = the generated addition task
    tasks: str | None = None
    heldout: str | None = None
    reward: str = "math"  # a k2_rl.rewards registry name; a task's own "reward" field overrides it
    # the self-critique rubric reward ("rubric", a group reward) and its critic
    critic_url: str | None = None  # OpenAI-compatible API root; "policy": the rollout engine via /generate
    critic_model: str | None = None  # None: the first id the endpoint lists at /models
    critic_concurrency: int = 8
    critic_max_tokens: int = 256
    critic_refine_pairs: int = 16  # verifiable pairs the critic is checked on per iteration; 0 = off
    rubric_dir: str | None = None  # the user's rubric files (.json/.toml), read after the shipped ones
    rubric_aggregation: str = "winrate"  # or "bt" (Bradley-Terry)
    rubric_floor: float = 0.0  # the reward of a response violating a prescriptive rubric
    # rollouts: prompts x samples per iteration, the response budget, the temperature schedule
    iterations: int = 20
    prompts_per_iteration: int = 16
    samples_per_prompt: int = 8
    max_response_tokens: int = 64
    truncation_penalty: float = 0.5  # subtracted from the reward of a response cut at the budget
    temperature: float = 1.0
    temperature_end: float = 1.0  # linear decay from `temperature` to this over the run
    top_p: float = 1.0
    rollout: str = "process"  # "process": `python -m k2_rl.rollout` synced through k2-ckpt
    # engine switching: the rollout engine frees its KV pool while the trainer runs (colocation on
    # one device, as K2 does); "auto" = when the policy is on a GPU, "on", "off"
    free_rollout_cache: str = "auto"
    rollout_threads: int = 0
    reward_workers: int = 2
    reward_timeout_s: float = 10.0
    # the objective
    loss: str = "k15"
    rl_tau: float = 0.1  # K1.5's tau: the weight of the log-ratio
    clip_eps: float = 0.2  # grpo only
    ptx_coef: float = 0.0
    ptx_data: str | None = None  # chat JSONL for the PTX term (its assistant turns)
    # optimizer steps on each iteration's rollouts, in micro-batches of whole prompts
    updates_per_iteration: int = 1
    micro_prompts: int = 0  # prompts per micro-batch; 0 = all of them
    # "on": the trainer's forwards run each prompt once for its K responses (k2_rl.shared_prompt)
    # while a packed row stays short; "off": row by row; "auto": on for a CPU trainer, where it was
    # measured faster, off on a GPU (the fused kernel on rows there; not measured against it yet)
    prompt_sharing: str = "auto"
    optimizer: str = "muonclip"
    # Muon updates have a fixed RMS: 2e-3 made held-out accuracy fall (30% -> 16%) in rl-demo
    lr: float = 2e-4
    adamw_lr: float = 5e-5
    weight_decay: float = 0.0
    tau: float = 30.0  # QK-Clip
    # Newton-Schulz dtype: "auto" = bf16 where bf16 GEMMs are native (CUDA, AVX512-BF16 / AMX CPUs),
    # fp32 elsewhere; "fp32" makes updates stable across process layouts and resumes
    ns_dtype: str = "auto"
    grad_clip: float = 1.0
    bias_update_speed: float = 1e-3
    # evaluation, state, run
    eval_every: int = 5  # held-out greedy accuracy every N iterations (and at the last); 0 = never
    eval_prompts: int = 0  # held-out prompts to evaluate; 0 = all
    # the KL(pi_old || pi_theta) estimate costs a forward of the whole batch after the updates (about a
    # fifth of the training phase at one update per iteration): every N iterations; 0 = never
    kl_every: int = 1
    save_every: int = 5  # train state every N iterations (the last / stopped one always)
    stop_at: int = 0  # stop after this iteration with a saved state, as an interrupt would
    out: str = "runs/rl"
    seed: int = 0
    threads: int = 0
    device: str = "auto"
    dtype: str = "auto"
    # under torchrun: the trainer's processes (FSDP2; with ep > 1 the routed experts split over ep
    # ranks, as in `k2 pretrain --ep`); rank 0 also drives the rollout worker and the rewards
    ep: int = 1

    task = "rl"

    def validate(self) -> None:
        def need(cond: bool, name: str, what: str) -> None:
            if not cond:
                raise ValueError(f"rl config: {name}={getattr(self, name)!r}: expected {what}")

        need(self.iterations > 0, "iterations", "> 0")
        need(self.prompts_per_iteration > 0, "prompts_per_iteration", "> 0")
        need(
            self.samples_per_prompt > 1,
            "samples_per_prompt",
            "> 1 (the objective compares a prompt's samples)",
        )
        need(self.max_response_tokens > 0, "max_response_tokens", "> 0")
        need(self.truncation_penalty >= 0, "truncation_penalty", ">= 0")
        need(0 <= self.temperature <= 10 and 0 <= self.temperature_end <= 10, "temperature", "in [0, 10]")
        need(0 < self.top_p <= 1, "top_p", "in (0, 1]")
        need(self.rollout in ROLLOUTS, "rollout", " or ".join(ROLLOUTS))
        need(self.free_rollout_cache in ("auto", "on", "off"), "free_rollout_cache", "auto, on or off")
        need(self.loss in LOSSES, "loss", " or ".join(LOSSES))
        need(self.rl_tau > 0, "rl_tau", "> 0")
        need(self.ptx_coef >= 0, "ptx_coef", ">= 0")
        need(
            self.ptx_coef == 0 or self.ptx_data is not None, "ptx_data", "a chat JSONL file when ptx_coef > 0"
        )
        need(self.updates_per_iteration > 0, "updates_per_iteration", "> 0")
        need(self.micro_prompts >= 0, "micro_prompts", ">= 0")
        need(self.prompt_sharing in ("auto", "on", "off"), "prompt_sharing", "'auto', 'on' or 'off'")
        need(
            self.micro_prompts == 0 or self.prompts_per_iteration % self.micro_prompts == 0,
            "micro_prompts",
            "a divisor of prompts_per_iteration",
        )
        need(self.optimizer in ("muonclip", "muon", "adamw"), "optimizer", "muonclip, muon or adamw")
        need(self.lr > 0, "lr", "> 0")
        need(self.ns_dtype in NS_DTYPES, "ns_dtype", f"one of {', '.join(NS_DTYPES)}")
        need(self.eval_every >= 0 and self.save_every >= 0 and self.stop_at >= 0, "eval_every", "counts >= 0")
        need(self.ep >= 1, "ep", ">= 1")
        need(self.kl_every >= 0, "kl_every", ">= 0")
        need(self.reward_workers > 0, "reward_workers", "> 0")
        need(self.critic_concurrency > 0, "critic_concurrency", "> 0")
        need(self.critic_max_tokens > 0, "critic_max_tokens", "> 0")
        need(self.critic_refine_pairs >= 0, "critic_refine_pairs", ">= 0")
        need(self.rubric_aggregation in ("winrate", "bt"), "rubric_aggregation", "winrate or bt")
        need(
            self.critic_url is None
            or self.critic_url == "policy"
            or self.critic_url.startswith(("http://", "https://")),
            "critic_url",
            "an http(s):// API root or 'policy'",
        )

    # the fields k2-train's builders read
    @property
    def steps(self) -> int:
        return self.iterations * self.updates_per_iteration


__all__ = ["LOSSES", "RLConfig"]

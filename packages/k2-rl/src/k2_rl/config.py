"""`RLConfig`: one `k2 rl` run, composed of component configs, loadable from JSON/TOML,
overridable by flags.

    RLConfig
      model:     k2_model.ModelSpec    init, preset, model_overrides, attention
      optim:     k2_optim.OptimConfig  optimizer, lr, adamw_lr, weight_decay, tau, ns_dtype, grad_clip
      rollouts:  RolloutConfig         samples_per_prompt, the response budget, sampling, the engine
      rewards:   RewardConfig          reward, its workers and timeout, the truncation penalty, the length reward
      rubric:    RubricConfig          the self-critique rubric reward and its critic
      objective: LossConfig            loss, rl_tau, clip_eps, the PTX term
      episodes:  EpisodeConfig         env, max_turns, max_episode_tokens: multi-turn tool episodes
      and the loop's own fields (iterations, prompts_per_iteration, eval_every, out, seed, ...)

Every leaf keeps one flat name (`--lr`, `{"rl_tau": ...}`; k2_train.config_tree). Names shared
with k2-train's configs mean the same (`lr`, `adamw_lr`, `tau` = QK-Clip's threshold, `seed`,
...); the K1.5 objective's own tau is `rl_tau`. `eval_every`, `save_every` and `stop_at` count the
loop's unit, as in k2-train: here that unit is the iteration (`updates_per_iteration` optimizer
steps on one iteration's rollouts).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from k2_model.spec import ModelSpec
from k2_optim.config import OptimConfig
from k2_train.config import RunConfig, option

LOSSES = ("k15", "grpo")
ROLLOUTS = ("process", "inprocess", "vllm")  # vllm: k2_rl.vllm_rollout, docs/vllm.md
SWITCHES = ("auto", "on", "off")


def _needer(where: str, cfg: object):
    def need(cond: bool, name: str, what: str) -> None:
        if not cond:
            raise ValueError(f"{where}: {name}={getattr(cfg, name)!r}: expected {what}")

    return need


@dataclass
class RolloutConfig:
    """How responses are sampled, and by which engine."""

    samples_per_prompt: int = option(8, "responses sampled per prompt (K)")
    max_response_tokens: int = option(64, "response budget; longer responses are cut and penalised")
    temperature: float = option(1.0, "rollout temperature at the first iteration")
    temperature_end: float = option(1.0, "rollout temperature at the last iteration (linear decay)")
    top_p: float = option(1.0, "rollout nucleus-sampling threshold (1 = off)")
    rollout: str = option(
        "process",
        "process (a rollout worker synced through k2-ckpt), inprocess, or vllm (a vLLM server from "
        "$K2_VLLM_PYTHON, default .venv-vllm, synced through k2-ckpt: docs/vllm.md)",
        choices=ROLLOUTS,
    )
    # engine switching: the rollout engine frees its KV pool while the trainer runs (colocation on
    # one device, as K2 does); "auto" = when the policy is on a GPU, "on", "off"
    free_rollout_cache: str = option(
        "auto",
        "engine switching: the rollout engine frees its KV pool while the trainer runs (auto = on a GPU; on; off)",
        choices=SWITCHES,
    )
    routing_replay: bool = option(
        False,
        "MoE routing replay: the training forward routes each token to the experts the rollout engine "
        "chose (the mismatch is logged either way as routing_mismatch; k2_rl.routing)",
    )
    rollout_threads: int = option(0, "torch threads of the rollout worker (0 = torch's default)")
    rollout_port: int = option(
        0, "loopback port of the rollout worker's HTTP API (0 = a free port, fresh at every start and resume)"
    )

    def validate(self, where: str) -> None:
        need = _needer(where, self)
        need(
            self.samples_per_prompt > 1,
            "samples_per_prompt",
            "> 1 (the objective compares a prompt's samples)",
        )
        need(self.max_response_tokens > 0, "max_response_tokens", "> 0")
        need(0 <= self.temperature <= 10 and 0 <= self.temperature_end <= 10, "temperature", "in [0, 10]")
        need(0 < self.top_p <= 1, "top_p", "in (0, 1]")
        need(self.rollout in ROLLOUTS, "rollout", " or ".join(ROLLOUTS))
        need(self.free_rollout_cache in SWITCHES, "free_rollout_cache", "auto, on or off")
        need(
            not (self.routing_replay and self.rollout == "vllm"),
            "routing_replay",
            "off with --rollout vllm (k2's engine records the routing; vLLM's capture is not wired yet)",
        )
        need(self.rollout_threads >= 0, "rollout_threads", ">= 0 (0 = torch's default)")
        need(0 <= self.rollout_port <= 65535, "rollout_port", "0 (a free port) or a port in 1..65535")


@dataclass
class RewardConfig:
    """Which reward scores a response (a task's own "reward" field overrides it) and where it runs."""

    reward: str = option(
        "math", 'reward name (k2_rl.rewards registry); a task\'s own "reward" field overrides it'
    )
    reward_workers: int = option(2, "reward worker processes")
    reward_timeout_s: float = option(
        10.0, "seconds one reward call may take (a code reward's sandbox run included)"
    )
    truncation_penalty: float = option(0.5, "subtracted from a cut response's reward")
    length_reward_coef: float = option(
        0.0,
        "weight of Kimi K1.5's length reward (per group: correct get lambda, incorrect min(0, lambda)); 0 = off",
    )
    length_reward_warmup: int = option(0, "iterations without the length reward before it applies")

    def validate(self, where: str) -> None:
        from k2_rl.rewards.base import known_rewards, reward_known

        need = _needer(where, self)
        need(self.truncation_penalty >= 0, "truncation_penalty", ">= 0")
        need(self.length_reward_coef >= 0, "length_reward_coef", ">= 0")
        need(self.length_reward_warmup >= 0, "length_reward_warmup", ">= 0")
        need(self.reward_workers > 0, "reward_workers", "> 0")
        need(reward_known(self.reward), "reward", f"one of {', '.join(known_rewards())} or MODULE:NAME")


@dataclass
class RubricConfig:
    """The self-critique rubric reward ("rubric", a group reward) and its critic."""

    critic_url: str | None = option(
        None,
        "critic of the rubric reward: an OpenAI-compatible API root (e.g. k2 serve's http://HOST:PORT/v1), or 'policy' (the rollout engine judges through /generate); required with rubric tasks unless the rollout worker serves an OpenAI chat endpoint",
    )
    critic_model: str | None = option(
        None, "model id sent to the critic (None: the first the endpoint lists)"
    )
    critic_concurrency: int = option(8, "concurrent requests to the critic endpoint")
    critic_max_tokens: int = option(256, "the critic's reply budget in tokens")
    critic_refine_pairs: int = option(16, "verifiable pairs the critic is checked on per iteration (0 = off)")
    rubric_dir: str | None = option(
        None, "a directory (or file) of your own rubrics, .json/.toml, read after the shipped ones"
    )
    rubric_aggregation: str = option(
        "winrate",
        "winrate or bt (Bradley-Terry): how pairwise verdicts become rewards",
        choices=("winrate", "bt"),
    )
    rubric_floor: float = option(0.0, "the reward of a response violating a prescriptive rubric")

    def validate(self, where: str) -> None:
        need = _needer(where, self)
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


@dataclass
class EpisodeConfig:
    """Multi-turn episodes against a tool environment (`--env`; k2_rl.episodes, k2_rl.envs)."""

    env: str | None = option(
        None,
        "tool environment for multi-turn episodes: kvstore, calculator, python or MODULE:NAME (None: single-turn)",
    )
    env_tasks: int = option(64, "tasks the environment generates when no --tasks file is given")
    max_turns: int = option(
        3, "assistant turns per episode; an episode still calling tools after them is cut"
    )
    max_episode_tokens: int = option(
        512, "tokens an episode may add after its first prompt (sampled and tool turns); past it, cut"
    )
    env_timeout_s: float = option(
        30.0,
        "seconds one environment call (reset, step, score) may take before its episode ends with an error",
    )
    max_tool_result_chars: int = option(
        1000, "a tool result longer than this is cut (with a note) before rendering"
    )

    def validate(self, where: str) -> None:
        from k2_rl.envs import SHIPPED, env_known

        need = _needer(where, self)
        need(self.env is None or env_known(self.env), "env", f"one of {', '.join(SHIPPED)} or MODULE:NAME")
        need(self.env_tasks > 0, "env_tasks", "> 0")
        need(self.max_turns > 0, "max_turns", "> 0")
        need(self.max_episode_tokens > 0, "max_episode_tokens", "> 0")
        need(self.env_timeout_s > 0, "env_timeout_s", "> 0")
        need(self.max_tool_result_chars > 0, "max_tool_result_chars", "> 0")


@dataclass
class LossConfig:
    """The objective: Kimi K1.5's (or clipped GRPO's, for comparison) and the PTX term."""

    loss: str = option("k15", "k15 (Kimi K1.5's objective) or grpo (clipped, for comparison)", choices=LOSSES)
    rl_tau: float = option(0.1, "K1.5's tau (weight of the log-ratio)")
    clip_eps: float = option(0.2, "the clipping range of --loss grpo")
    ptx_coef: float = option(0.0, "weight of the PTX next-token term (needs --ptx-data)")
    ptx_data: str | None = option(None, "chat JSONL for the PTX term")

    def validate(self, where: str) -> None:
        need = _needer(where, self)
        need(self.loss in LOSSES, "loss", " or ".join(LOSSES))
        need(self.rl_tau > 0, "rl_tau", "> 0")
        need(self.ptx_coef >= 0, "ptx_coef", ">= 0")
        need(
            self.ptx_coef == 0 or self.ptx_data is not None, "ptx_data", "a chat JSONL file when ptx_coef > 0"
        )


@dataclass
class RLConfig(RunConfig):
    model: ModelSpec = option(default_factory=ModelSpec, help="the policy: init weights or a preset")
    # tasks: JSONL records {"messages", "answer"}; None = the generated addition task
    tasks: str | None = option(None, "task JSONL ({messages, answer}) (None: the generated addition task)")
    heldout: str | None = option(None, "held-out task JSONL for the accuracy (None: the generated task's)")
    rewards: RewardConfig = option(default_factory=RewardConfig, help="the reward")
    rubric: RubricConfig = option(default_factory=RubricConfig, help="the rubric reward and its critic")
    iterations: int = option(20, "RL iterations (rollout, reward, update, sync)")
    prompts_per_iteration: int = option(
        16, "prompts per iteration (split over the trainer processes under torchrun)"
    )
    rollouts: RolloutConfig = option(default_factory=RolloutConfig, help="sampling and the rollout engine")
    objective: LossConfig = option(default_factory=LossConfig, help="the RL objective")
    episodes: EpisodeConfig = option(default_factory=EpisodeConfig, help="multi-turn tool episodes (--env)")
    # optimizer steps on each iteration's rollouts, in micro-batches of whole prompts
    updates_per_iteration: int = option(1, "optimizer steps on each iteration's rollouts")
    micro_prompts: int = option(0, "prompts per micro-batch (0 = all)")
    # "on": the trainer's forwards run each prompt once for its K responses (k2_rl.shared_prompt)
    # while a packed row stays short; "off": row by row; "auto": on for a CPU trainer, where it was
    # measured faster, off on a GPU (the fused kernel on rows there; not measured against it yet)
    prompt_sharing: str = option(
        "auto",
        "on: one prompt pass for its K responses in the trainer's forwards; off: row by row; auto: on for a CPU trainer",
        choices=SWITCHES,
    )
    # Muon updates have a fixed RMS: lr 2e-3 made held-out accuracy fall (30% -> 16%) in rl-demo;
    # no weight decay on a policy that starts from trained weights
    optim: OptimConfig = option(
        default_factory=partial(OptimConfig, lr=2e-4, adamw_lr=5e-5, weight_decay=0.0),
        help="the optimizer and QK-Clip",
    )
    bias_update_speed: float = option(
        1e-3, "aux-loss-free balancing: the expert-bias step per optimizer step"
    )
    # evaluation, state, run
    eval_every: int = option(5, "held-out greedy accuracy every N iterations (0 = never)")
    eval_prompts: int = option(0, "held-out prompts to evaluate (0 = all)")
    # the KL(pi_old || pi_theta) estimate costs a forward of the whole batch after the updates (about a
    # fifth of the training phase at one update per iteration): every N iterations; 0 = never
    kl_every: int = option(1, "log the KL estimate (one more forward) every N iterations (0 = never)")
    save_every: int = option(5, "save the train state every N iterations")
    stop_at: int = option(0, "stop after this iteration and save, as an interrupt would")
    out: str = option("runs/rl", "the run directory")
    seed: int = option(0, "random seed (prompts, sampling, init)")
    threads: int = option(0, "torch threads of the trainer (0 = torch's default)")
    device: str = option("auto", "auto, cpu or cuda")
    dtype: str = option(
        "auto",
        "not read: the RL trainer keeps the policy in fp32; kept so that stored configs load",
        flag=False,
    )
    # under torchrun: the trainer's processes (FSDP2; with ep > 1 the routed experts split over ep
    # ranks, as in `k2 pretrain --ep`); rank 0 also drives the rollout worker and the rewards
    ep: int = option(1, "under torchrun: routed experts split over N trainer ranks (FSDP2 x EP)")

    task = "rl"

    def validate(self) -> None:
        from k2_model.device import DEVICE_CHOICES, device_name_ok

        where = "rl config"
        need = _needer(where, self)
        need(self.iterations > 0, "iterations", "> 0")
        need(self.prompts_per_iteration > 0, "prompts_per_iteration", "> 0")
        self.rollouts.validate(where)
        self.objective.validate(where)
        need(self.updates_per_iteration > 0, "updates_per_iteration", "> 0")
        need(self.micro_prompts >= 0, "micro_prompts", ">= 0")
        need(self.prompt_sharing in SWITCHES, "prompt_sharing", "'auto', 'on' or 'off'")
        need(
            self.micro_prompts == 0 or self.prompts_per_iteration % self.micro_prompts == 0,
            "micro_prompts",
            "a divisor of prompts_per_iteration",
        )
        self.optim.validate(where)
        self.model.validate(where)
        if self.model.qat != "none" and self.rollouts.rollout == "vllm":
            raise ValueError(
                f"{where}: qat={self.model.qat!r} with rollout='vllm': vLLM would sample from the "
                "full-precision weights the sync pushes, not the INT4 ones the trainer's forward sees; "
                "use k2's rollout worker (it quantises like the trainer) or --qat none"
            )
        need(self.eval_every >= 0 and self.save_every >= 0 and self.stop_at >= 0, "eval_every", "counts >= 0")
        need(self.ep >= 1, "ep", ">= 1")
        need(self.kl_every >= 0, "kl_every", ">= 0")
        self.rubric.validate(where)
        need(self.threads >= 0, "threads", ">= 0 (0 = torch's default)")
        need(device_name_ok(self.device), "device", DEVICE_CHOICES)
        self.rewards.validate(where)
        self.episodes.validate(where)

    # the field k2-train's Trainer reads
    @property
    def steps(self) -> int:
        return self.iterations * self.updates_per_iteration


__all__ = [
    "LOSSES",
    "EpisodeConfig",
    "LossConfig",
    "RLConfig",
    "RewardConfig",
    "RolloutConfig",
    "RubricConfig",
]

"""Run configurations: one dataclass per task (pretraining, SFT), composed of the component
configs of the packages that build each part, loadable from JSON/TOML, overridable by flags.
`TrainConfig.trainer_config()` is the part the Trainer itself reads.

    PretrainConfig
      model:    k2_model.ModelSpec    preset, model_overrides, init, attention
      optim:    k2_optim.OptimConfig  optimizer, lr, adamw_lr, weight_decay, tau, ns_dtype, grad_clip
      schedule: k2_optim.WSDConfig    warmup_steps, decay_fraction, schedule_steps, min_lr_ratio
      dataset:  k2_data.DataConfig    data, tokenizer, max_corpus_mb, val_fraction, document_mask,
                                      packing, seq_len
      and the run's own fields (steps, batch, eval_every, out, seed, device, ep, ...)

Every leaf keeps one flat name (`cfg.optim.lr` is `lr`: `--lr`, `{"lr": ...}` in a file), see
k2_train.config_tree. Every field is declared with its help text in the field's metadata
(`option(default, help)` here), and the `k2` command generates one flag per field from it
(`k2_stack.config_flags`), so a field cannot exist without a flag or a flag without a field.
In code, `PretrainConfig.flat(lr=..., seq_len=...)` builds a config from flat names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from k2_data.config import PACKINGS, DataConfig
from k2_model.device import DEVICE_CHOICES, device_name_ok
from k2_model.spec import ModelSpec
from k2_optim.config import NS_DTYPES, OPTIMIZERS, OptimConfig, WSDConfig

from k2_train.config_tree import apply_overrides, from_flat_dict, option, to_flat_dict, type_problem

__all__ = [
    "NS_DTYPES",
    "OPTIMIZERS",
    "PACKINGS",
    "PretrainConfig",
    "RunConfig",
    "SFTConfig",
    "SFTData",
    "option",
]

_type_problem = type_problem  # the per-field type check of from_dict (k2_train.config_tree)


class RunConfig:
    """What every run config shares (a dataclass with a class attribute `task`): `to_dict` (flat),
    `from_dict` / `from_file` (JSON or TOML, optionally under a `[task]` table; flat keys or
    component tables) that name unknown fields and the file, and `flat(**fields)` for code.
    k2-rl's RLConfig uses it too."""

    task = "run"

    def to_dict(self) -> dict[str, Any]:
        """{flat field name: value}: the form of `--config` files, flags and stored config.json."""
        return to_flat_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config"):
        return from_flat_dict(cls, d, source)

    @classmethod
    def flat(cls, **fields: Any):
        """The defaults with these fields (by flat name, e.g. `lr=0.01`) replaced."""
        return apply_overrides(cls(), fields)

    @classmethod
    def from_file(cls, path: str | Path):
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"{cls.task} config file {p} not found")
        text = p.read_text()
        try:
            if p.suffix == ".toml":
                import tomllib

                d = tomllib.loads(text)
            else:
                d = json.loads(text)
        except ValueError as e:  # json.JSONDecodeError and tomllib.TOMLDecodeError are ValueErrors
            raise ValueError(f"{p}: not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: {e}") from e
        return cls.from_dict(d.get(cls.task, d), source=str(p))

    def warnings(self) -> list[str]:
        """Settings that are allowed but almost certainly not what was meant (printed at start)."""
        return []

    def validate_layout(self, world_size: int, n_routed_experts: int) -> None:
        """`ep` against the process count and the model (known once the run has started)."""
        ep = getattr(self, "ep", 1)
        if ep == 1:
            return
        if world_size % ep:
            raise ValueError(
                f"{self.task} config: ep={ep}: expected a divisor of the number of processes "
                f"({world_size}); start torchrun with a multiple of {ep} processes"
            )
        if n_routed_experts % ep:
            raise ValueError(
                f"{self.task} config: ep={ep}: expected a divisor of the model's "
                f"n_routed_experts={n_routed_experts} (each rank holds whole experts)"
            )


# The counters `eval_every`, `save_every` and `stop_at` count the task loop's unit: optimizer steps
# here, iterations in k2-rl (one iteration = rollouts + updates_per_iteration steps). It is the
# unit of metrics.jsonl's rows and of the train state, so "every N" means the same in both.


@dataclass
class PretrainConfig(RunConfig):
    model: ModelSpec = option(default_factory=ModelSpec, help="the model: preset, overrides, init, attention")
    # K2 recipe: Muon with RMS matched to AdamW, weight decay 0.1, tau 100 at scale
    optim: OptimConfig = option(default_factory=OptimConfig, help="the optimizer and QK-Clip")
    # WSD schedule, as fractions of the run (warmup, then constant, then cosine to min_lr_ratio)
    schedule: WSDConfig = option(default_factory=WSDConfig, help="the WSD learning-rate schedule")
    dataset: DataConfig = option(default_factory=DataConfig, help="the data and its packing")
    # aux-loss-free balancing: the bias step per optimizer step
    bias_update_speed: float = option(1e-3, "aux-loss-free balancing: the bias step per optimizer step")
    # batch: global batch in sequences; micro_batch sequences per forward (gradient accumulation)
    steps: int = option(200, "optimizer steps")
    batch: int = option(8, "global batch in sequences")
    micro_batch: int = option(0, "sequences per forward (gradient accumulation); 0 = whole batch")
    eval_every: int = option(50, "validation loss every N optimizer steps (0 = off)")
    eval_batches: int = option(4, "validation batches per evaluation")
    # run
    out: str = option("runs/pretrain", "the run directory")
    cache_dir: str | None = option(
        None, "where tokenized data and generated example sets are cached (None: $K2_CACHE, else ~/.cache/k2)"
    )
    save_every: int = option(
        100, "save the train state every N optimizer steps (the last step is always saved)"
    )
    stop_at: int = option(0, "stop after this optimizer step and save the train state, as an interrupt would")
    seed: int = option(0, "random seed (model init and data order)")
    threads: int = option(0, "torch threads (0 = torch's default)")
    # Recompute activations in backward: "full" = every decoder layer, "selective" = every
    # other layer (torchtitan's layer-frequency SAC), "none".
    activation_checkpointing: str = option(
        "none",
        "recompute layers in backward: every layer (full), every other layer (selective) or none",
        choices=("none", "full", "selective"),
    )
    # After each step, re-run the step's first micro-batch (no grad) and log the max logit the
    # updated (clipped) weights give: `max_logit_after_clip`. Costs about a third of a step.
    log_post_clip_logit: bool = option(
        False,
        "after each step, log the max logit the clipped weights give on the step's first micro-batch "
        "(max_logit_after_clip; costs about a third of a step)",
    )
    dtype: str = option(
        "auto", "auto (fp32 on CPU, bf16 on GPU), fp32 or bf16", choices=("auto", "fp32", "bf16")
    )
    device: str = option("auto", "auto, cpu or cuda")
    # Expert parallelism under torchrun: routed experts split over this many ranks (each holds
    # n_routed_experts / ep whole experts; tokens reach them by all-to-all), FSDP2 over all ranks.
    ep: int = option(1, "expert parallelism under torchrun: routed experts split over N ranks (FSDP2 x EP)")

    task = "pretrain"  # a class attribute: which entry point's config this is

    def validate(self) -> None:
        where = f"{self.task} config"

        def need(cond: bool, name: str, what: str) -> None:
            if not cond:
                raise ValueError(f"{where}: {name}={getattr(self, name)!r}: expected {what}")

        self.optim.validate(where)
        self.model.validate(where)
        need(self.steps > 0, "steps", "> 0")
        need(self.batch > 0, "batch", "> 0")
        need(self.micro_batch >= 0, "micro_batch", ">= 0")
        need(self.micro_batch == 0 or self.batch % self.micro_batch == 0, "micro_batch", "a divisor of batch")
        self.dataset.validate(where)
        self.schedule.validate(where)
        need(self.eval_every >= 0, "eval_every", ">= 0")
        need(self.save_every >= 0, "save_every", ">= 0")
        need(self.dtype in ("auto", "fp32", "bf16"), "dtype", "auto, fp32 or bf16")
        need(
            self.activation_checkpointing in ("none", "full", "selective"),
            "activation_checkpointing",
            "none, full or selective",
        )
        self.model.validate(where)
        need(self.stop_at >= 0, "stop_at", ">= 0")
        need(self.ep >= 1, "ep", ">= 1")
        need(self.threads >= 0, "threads", ">= 0 (0 = torch's default)")
        need(device_name_ok(self.device), "device", DEVICE_CHOICES)

    def warnings(self) -> list[str]:
        out = super().warnings()
        if self.schedule.warmup_steps >= self.steps:
            out.append(
                f"warmup_steps={self.schedule.warmup_steps} >= steps={self.steps}: the learning rate is still "
                "warming up when the run ends (it never reaches --lr)"
            )
        return out

    def trainer_config(self):
        from k2_train.trainer import TrainerConfig

        return TrainerConfig(
            steps=self.steps,
            micro_batch=self.micro_batch,
            grad_clip=self.optim.grad_clip,
            bias_update_speed=self.bias_update_speed,
            eval_every=self.eval_every,
            save_every=self.save_every,
            stop_at=self.stop_at,
            log_post_clip_logit=self.log_post_clip_logit,
        )


@dataclass
class SFTData(DataConfig):
    """SFT's data: chat data, whole conversations per sample, attention kept inside each one."""

    # data: None = the shipped tool-use example set (k2_data.examples.tooluse), generated once
    data: str | None = option(
        None,
        "chat JSONL/Parquet/Arrow (messages + tools) or a dir from `k2 data sft` (None: the shipped tool-use example set)",
    )
    val_fraction: float = 0.05
    document_mask: bool = True
    packing: str = "whole"
    seq_len: int = 1024


@dataclass
class SFTConfig(PretrainConfig):
    """Supervised fine-tuning on chat data: the same run, with chat data, a masked loss (the
    data's loss mask: assistant turns only), whole-conversation packing and a document mask."""

    optim: OptimConfig = option(
        default_factory=partial(OptimConfig, lr=1e-2), help="the optimizer and QK-Clip"
    )
    schedule: WSDConfig = option(
        default_factory=partial(WSDConfig, warmup_steps=20), help="the WSD learning-rate schedule"
    )
    dataset: SFTData = option(default_factory=SFTData, help="the chat data and its packing")
    steps: int = option(300, "optimizer steps")
    out: str = option("runs/sft", "the run directory")

    task = "sft"

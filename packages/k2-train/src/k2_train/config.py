"""Run configurations: one dataclass per task (pretraining, SFT), loadable from JSON/TOML,
overridable by flags. `TrainConfig.trainer_config()` is the part the Trainer itself reads."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OPTIMIZERS = ("muonclip", "muon", "adamw")
NS_DTYPES = ("auto", "fp32", "bf16")
PACKINGS = ("stream", "whole")


class RunConfig:
    """What every run config shares (a dataclass with a class attribute `task`): `to_dict`, and
    `from_dict` / `from_file` (JSON or TOML, optionally under a `[task]` table) that name unknown
    fields and the file. k2-rl's RLConfig uses it too."""

    task = "run"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config"):
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"{source}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**d)

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


@dataclass
class PretrainConfig(RunConfig):
    # model
    preset: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    # optimizer (K2 recipe: Muon with RMS matched to AdamW, weight decay 0.1, tau 100 at scale)
    optimizer: str = "muonclip"
    lr: float = 2e-2
    # With muon/muonclip: the AdamW learning rate of embeddings, LM head and 1-D parameters.
    # (At scale K2 shares one lr thanks to Muon's RMS matching; at this tiny scale an embedding
    # table at Muon's lr of ~1e-2 makes the loss spike, so it gets its own.) 0 = same as lr.
    adamw_lr: float = 3e-3
    weight_decay: float = 0.1
    tau: float = 30.0
    # Newton-Schulz compute dtype: "auto" = bf16 where bf16 GEMMs are native (CUDA, CPUs with
    # AMX / AVX512-BF16), fp32 where bf16 is emulated (AVX2 CPUs, where it is ~30x slower)
    ns_dtype: str = "auto"
    grad_clip: float = 1.0
    # WSD schedule, as fractions of the run (warmup, then constant, then cosine to min_lr_ratio)
    warmup_steps: int = 10
    decay_fraction: float = 0.2
    min_lr_ratio: float = 0.1
    # aux-loss-free balancing: the bias step per optimizer step
    bias_update_speed: float = 1e-3
    # batch: global batch in sequences; micro_batch sequences per forward (gradient accumulation)
    steps: int = 200
    batch: int = 8
    micro_batch: int = 0  # 0 = the whole batch in one forward
    seq_len: int = 256
    # data: None = the running interpreter's standard library source
    data: str | None = None
    tokenizer: str | None = None
    max_corpus_mb: float = 0.0  # 0 = all of it
    val_fraction: float = 0.02
    # Attend only within each packed document, with positions restarting at its start.
    document_mask: bool = False
    # "stream": documents concatenated and cut into windows (every token a label once);
    # "whole": each sample holds whole documents only, padded (SFT conversations).
    packing: str = "stream"
    eval_every: int = 50
    eval_batches: int = 4
    # run
    out: str = "runs/pretrain"
    save_every: int = 100
    stop_at: int = 0  # stop (and checkpoint) after this step, as if interrupted; 0 = never
    seed: int = 0
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    # Recompute activations in backward: "full" = every decoder layer, "selective" = every
    # other layer (torchtitan's layer-frequency SAC), "none".
    activation_checkpointing: str = "none"
    # "auto": k2_kernels' fused attention (max logits from the kernel, no score matrix) where a
    # compiled kernel serves the device, else SDPA/eager; or force "fused", "sdpa", "eager".
    attention: str = "auto"
    # After each step, re-run the step's first micro-batch (no grad) and log the max logit the
    # updated (clipped) weights give: `max_logit_after_clip`. Costs about a third of a step.
    log_post_clip_logit: bool = False
    dtype: str = "auto"  # auto: fp32 on CPU, bf16 on GPU
    device: str = "auto"
    # Expert parallelism under torchrun: routed experts split over this many ranks (each holds
    # n_routed_experts / ep whole experts; tokens reach them by all-to-all), FSDP2 over all ranks.
    ep: int = 1

    task = "pretrain"  # a class attribute: which entry point's config this is

    def validate(self) -> None:
        def need(cond: bool, name: str, what: str) -> None:
            if not cond:
                raise ValueError(f"{self.task} config: {name}={getattr(self, name)!r}: expected {what}")

        need(self.optimizer in OPTIMIZERS, "optimizer", f"one of {', '.join(OPTIMIZERS)}")
        need(self.lr > 0, "lr", "> 0")
        need(self.adamw_lr >= 0, "adamw_lr", ">= 0")
        need(self.tau > 0, "tau", "> 0")
        need(self.ns_dtype in NS_DTYPES, "ns_dtype", f"one of {', '.join(NS_DTYPES)}")
        need(self.steps > 0, "steps", "> 0")
        need(self.batch > 0, "batch", "> 0")
        need(self.micro_batch >= 0, "micro_batch", ">= 0")
        need(self.micro_batch == 0 or self.batch % self.micro_batch == 0, "micro_batch", "a divisor of batch")
        need(self.seq_len > 1, "seq_len", "> 1")
        need(0 <= self.decay_fraction <= 1, "decay_fraction", "in [0, 1]")
        need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "in [0, 1]")
        need(0 < self.val_fraction < 1, "val_fraction", "in (0, 1)")
        need(self.eval_every >= 0, "eval_every", ">= 0")
        need(self.save_every >= 0, "save_every", ">= 0")
        need(self.dtype in ("auto", "fp32", "bf16"), "dtype", "auto, fp32 or bf16")
        need(
            self.activation_checkpointing in ("none", "full", "selective"),
            "activation_checkpointing",
            "none, full or selective",
        )
        need(self.attention in ("auto", "fused", "sdpa", "eager"), "attention", "auto, fused, sdpa or eager")
        need(self.packing in PACKINGS, "packing", " or ".join(PACKINGS))
        need(self.stop_at >= 0, "stop_at", ">= 0")
        need(self.ep >= 1, "ep", ">= 1")

    def trainer_config(self):
        from k2_train.trainer import TrainerConfig

        return TrainerConfig(
            steps=self.steps,
            micro_batch=self.micro_batch,
            grad_clip=self.grad_clip,
            bias_update_speed=self.bias_update_speed,
            eval_every=self.eval_every,
            save_every=self.save_every,
            stop_at=self.stop_at,
            log_post_clip_logit=self.log_post_clip_logit,
        )


@dataclass
class SFTConfig(PretrainConfig):
    """Supervised fine-tuning on chat data: the same run, with chat data, a masked loss (the
    data's loss mask: assistant turns only), whole-conversation packing and a document mask."""

    # Start from these weights: an HF-format dir (`k2 export`, from_pretrained) or a k2 run dir
    # (its latest train state); None = a random init of `preset`.
    init: str | None = None
    # data: None = the shipped tool-use example set (k2_data.examples.tooluse), generated once
    data: str | None = None
    packing: str = "whole"
    document_mask: bool = True
    seq_len: int = 1024  # two tool-use conversations (~510 tokens each) per sample
    steps: int = 300
    batch: int = 8
    lr: float = 1e-2
    adamw_lr: float = 3e-3
    warmup_steps: int = 20
    eval_every: int = 50
    save_every: int = 100
    val_fraction: float = 0.05
    out: str = "runs/sft"

    task = "sft"

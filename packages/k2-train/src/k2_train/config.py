"""Run configurations: one dataclass per task (pretraining, SFT), loadable from JSON/TOML,
overridable by flags. `TrainConfig.trainer_config()` is the part the Trainer itself reads.

Every field is declared with `option(default, help)`: its help text lives on the field (dataclass
metadata), and the `k2` command generates one flag per field from it (`k2_stack.config_flags`),
so a field cannot exist without a flag or a flag without a field."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from k2_model.device import DEVICE_CHOICES, device_name_ok

OPTIMIZERS = ("muonclip", "muon", "adamw")
NS_DTYPES = ("auto", "fp32", "bf16")
PACKINGS = ("stream", "whole")


def option(
    default: Any = MISSING,
    help: str = "",
    *,
    default_factory: Any = MISSING,
    choices: tuple[str, ...] | None = None,
    flag: bool = True,
) -> Any:
    """A config field with its help text (and allowed values) in the field's metadata, which the
    `k2` command's flags are generated from. `flag=False`: a field kept for stored configs only."""
    if not help:
        raise ValueError("option(): every config field needs its help text")
    metadata = {"help": help, "choices": choices, "flag": flag}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _type_problem(value: Any, annotation: Any) -> str | None:
    """None when `value` (read from a JSON/TOML file) fits the field's annotation, else the
    expected type in words. An int is a fine float; a bool is not an int."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        problems = [_type_problem(value, a) for a in options if a is not type(None)]
        if any(p is None for p in problems):
            return None
        return " or ".join(problems) + (" or null" if type(None) in options else "")
    base = origin or annotation
    if base is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base in (str, bool, dict, list):
        ok = isinstance(value, base)
    else:  # a type this check does not know: left to the config's validate()
        return None
    words = {float: "a number", int: "an integer", str: "a string", bool: "true or false",
             dict: "a table/object", list: "a list"}  # fmt: skip
    return None if ok else words[base]


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
        hints = typing.get_type_hints(cls)
        for name, value in d.items():
            expected = _type_problem(value, hints[name])
            if expected:
                raise ValueError(f"{source}: {name} = {value!r}: expected {expected}")
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


@dataclass
class PretrainConfig(RunConfig):
    # model
    preset: str = option("tiny", "model preset (tiny, tiny-vllm, kimi-k2, deepseek-v3)")
    model_overrides: dict[str, Any] = option(
        default_factory=dict,
        help="K2Config fields over the preset, as JSON (e.g. '{\"n_routed_experts\": 64}')",
    )
    # optimizer (K2 recipe: Muon with RMS matched to AdamW, weight decay 0.1, tau 100 at scale)
    optimizer: str = option("muonclip", "muonclip | muon | adamw", choices=OPTIMIZERS)
    lr: float = option(
        2e-2, "peak learning rate (Muon's, with RMS matched to AdamW; AdamW's for --optimizer adamw)"
    )
    # With muon/muonclip: the AdamW learning rate of embeddings, LM head and 1-D parameters.
    # (At scale K2 shares one lr thanks to Muon's RMS matching; at this tiny scale an embedding
    # table at Muon's lr of ~1e-2 makes the loss spike, so it gets its own.) 0 = same as lr.
    adamw_lr: float = option(
        3e-3, "with muon/muonclip: AdamW lr of embeddings, head and 1-D params (0 = --lr)"
    )
    weight_decay: float = option(0.1, "decoupled weight decay")
    tau: float = option(30.0, "QK-Clip threshold (also drawn on the max-logit plot of non-clipping runs)")
    # Newton-Schulz compute dtype: "auto" = bf16 where bf16 GEMMs are native (CUDA, CPUs with
    # AMX / AVX512-BF16), fp32 where bf16 is emulated (AVX2 CPUs, where it is ~30x slower)
    ns_dtype: str = option(
        "auto",
        "Newton-Schulz dtype: auto (bf16 where bf16 GEMMs are native, else fp32), fp32, bf16",
        choices=NS_DTYPES,
    )
    grad_clip: float = option(1.0, "gradient-norm clip (0 = off)")
    # WSD schedule, as fractions of the run (warmup, then constant, then cosine to min_lr_ratio)
    warmup_steps: int = option(10, "WSD warmup steps")
    decay_fraction: float = option(0.2, "WSD: fraction of the run spent in the cosine decay")
    schedule_steps: int = option(
        0,
        "steps the WSD schedule spans (0: --steps); past its end the lr holds at min_lr_ratio x lr. "
        "Set when extending a finished run (--resume RUN --steps N) to say what the lr does",
    )
    min_lr_ratio: float = option(0.1, "WSD: the final lr as a fraction of the peak")
    # aux-loss-free balancing: the bias step per optimizer step
    bias_update_speed: float = option(1e-3, "aux-loss-free balancing: the bias step per optimizer step")
    # batch: global batch in sequences; micro_batch sequences per forward (gradient accumulation)
    steps: int = option(200, "optimizer steps")
    batch: int = option(8, "global batch in sequences")
    micro_batch: int = option(0, "sequences per forward (gradient accumulation); 0 = whole batch")
    seq_len: int = option(256, "tokens per sequence")
    # data: None = the running interpreter's standard library source
    data: str | None = option(
        None,
        "corpus file/dir or tokenized dir, or sources mixed by weight, e.g. raw:0.5,rephrased:0.5 (None: this Python's standard library source)",
    )
    tokenizer: str | None = option(None, "tokenizer dir (default: k2-data's bundled BPE)")
    max_corpus_mb: float = option(0.0, "use only the first N MB of the default corpus (0 = all)")
    val_fraction: float = option(0.02, "fraction of documents held out for the validation loss")
    # Attend only within each packed document, with positions restarting at its start.
    document_mask: bool = option(
        False, "attend only within each packed document (positions restart at its start)"
    )
    # "stream": documents concatenated and cut into windows (every token a label once);
    # "whole": each sample holds whole documents only, padded (SFT conversations).
    packing: str = option(
        "stream",
        "stream (documents concatenated and cut into windows) or whole (whole documents per sample, padded)",
        choices=PACKINGS,
    )
    eval_every: int = option(50, "validation loss every N steps (0 = off)")
    eval_batches: int = option(4, "validation batches per evaluation")
    # run
    out: str = option("runs/pretrain", "the run directory")
    cache_dir: str | None = option(
        None, "where tokenized data and generated example sets are cached (None: $K2_CACHE, else ~/.cache/k2)"
    )
    save_every: int = option(100, "save the train state every N steps (the last step is always saved)")
    stop_at: int = option(0, "stop after this step and save the train state, as an interrupt would")
    seed: int = option(0, "random seed (model init and data order)")
    threads: int = option(0, "torch threads (0 = torch's default)")
    # Recompute activations in backward: "full" = every decoder layer, "selective" = every
    # other layer (torchtitan's layer-frequency SAC), "none".
    activation_checkpointing: str = option(
        "none",
        "recompute layers in backward: every layer (full), every other layer (selective) or none",
        choices=("none", "full", "selective"),
    )
    # "auto": k2_kernels' fused attention (max logits from the kernel, no score matrix) where a
    # compiled kernel serves the device, else SDPA/eager; or force "fused", "sdpa", "eager".
    attention: str = option(
        "auto",
        "attention path: auto (the fused k2_kernels kernel where it serves the device), fused, sdpa or eager",
        choices=("auto", "fused", "sdpa", "eager"),
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
        need(self.threads >= 0, "threads", ">= 0 (0 = torch's default)")
        need(self.warmup_steps >= 0, "warmup_steps", ">= 0")
        need(self.schedule_steps >= 0, "schedule_steps", ">= 0 (0 = --steps)")
        need(device_name_ok(self.device), "device", DEVICE_CHOICES)

    def warnings(self) -> list[str]:
        out = super().warnings()
        if self.warmup_steps >= self.steps:
            out.append(
                f"warmup_steps={self.warmup_steps} >= steps={self.steps}: the learning rate is still "
                "warming up when the run ends (it never reaches --lr)"
            )
        return out

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
    init: str | None = option(
        None,
        "start from these weights: an HF-format dir (`k2 export`) or a k2 run dir (None: random init of --preset)",
    )
    # data: None = the shipped tool-use example set (k2_data.examples.tooluse), generated once
    data: str | None = option(
        None,
        "chat JSONL/Parquet/Arrow (messages + tools) or a dir from `k2 data sft` (None: the shipped tool-use example set)",
    )
    packing: str = option(
        "whole",
        "stream (documents concatenated and cut into windows) or whole (whole documents per sample, padded)",
    )
    document_mask: bool = option(
        True, "attend only within each packed document (positions restart at its start)"
    )
    seq_len: int = option(1024, "tokens per sequence")
    steps: int = option(300, "optimizer steps")
    batch: int = option(8, "global batch in sequences")
    lr: float = option(
        1e-2, "peak learning rate (Muon's, with RMS matched to AdamW; AdamW's for --optimizer adamw)"
    )
    adamw_lr: float = option(
        3e-3, "with muon/muonclip: AdamW lr of embeddings, head and 1-D params (0 = --lr)"
    )
    warmup_steps: int = option(20, "WSD warmup steps")
    eval_every: int = option(50, "validation loss every N steps (0 = off)")
    save_every: int = option(100, "save the train state every N steps (the last step is always saved)")
    val_fraction: float = option(0.05, "fraction of documents held out for the validation loss")
    out: str = option("runs/sft", "the run directory")

    task = "sft"

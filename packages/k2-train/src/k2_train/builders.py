"""Builders, each from the config component it needs: device and dtype (the run config), the model
(a ModelSpec: a preset's random init, or weights to start from), the optimizer (an OptimConfig)
and the WSD schedule (a WSDConfig)."""

from __future__ import annotations

from pathlib import Path

import torch
from k2_model import K2Config, K2ForCausalLM
from k2_model.device import pick_device
from k2_model.spec import ModelSpec
from k2_optim import MuonClip, wsd_schedule
from k2_optim.config import OptimConfig, WSDConfig
from torch import nn

from k2_train.config import PretrainConfig


def resolve_device(cfg: PretrainConfig) -> tuple[torch.device, torch.dtype]:
    device = pick_device(cfg.device)
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.dtype]
    return device, dtype


def _init_source(init: str) -> tuple[str, Path]:
    """("hf", dir) for an HF-format model dir, ("state", dir) for a k2 run or train-state dir."""
    path = Path(init)
    if not path.exists():
        raise FileNotFoundError(f"--init {init}: no such directory")
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "hf", path
    from k2_train.state import STATE_FILE, latest_state

    if (path / STATE_FILE).is_file():
        return "state", path
    if latest_state(path) is not None:
        return "state", latest_state(path)
    raise FileNotFoundError(
        f"--init {init}: neither an HF-format model dir (config.json + *.safetensors) nor a k2 run "
        "with a saved train state"
    )


def model_config(spec: ModelSpec) -> K2Config:
    """The architecture: the init weights' config when the run starts from some, else the preset."""
    if spec.init is None:
        return K2Config.preset(spec.preset, **spec.model_overrides)
    kind, path = _init_source(spec.init)
    if kind == "hf":
        return K2Config.from_hf(str(path))
    from k2_train.state import read_state

    meta = read_state(path)["meta"]
    if "model_config" in meta:
        return K2Config.from_hf(meta["model_config"])
    saved = meta.get("config", {})
    return K2Config.preset(saved.get("preset", "tiny"), **saved.get("model_overrides", {}))


def load_init_weights(model: K2ForCausalLM, init: str) -> str:
    """Load `init` (an HF-format dir or a k2 run / train-state dir) into `model`; returns what it was."""
    kind, path = _init_source(init)
    if kind == "hf":
        model.load_state_dict(K2ForCausalLM.from_pretrained(str(path)).state_dict())
        return f"HF weights {path}"
    from k2_train.state import read_state

    state = read_state(path)
    model.load_state_dict(state["components"]["model"])
    return f"train state {path} (step {state['step']})"


def build_model(spec: ModelSpec, vocab_size: int, device: torch.device, seed: int) -> K2ForCausalLM:
    """The model on `device`: random init seeded by `seed`, then the `init` weights when the spec
    has them."""
    config = model_config(spec)
    where = f"--init {spec.init}" if spec.init else f"preset {spec.preset!r}"
    if config.vocab_size < vocab_size:
        raise ValueError(
            f"{where} has vocab_size={config.vocab_size}, smaller than the tokenizer's {vocab_size}; "
            "set model_overrides.vocab_size (or use the tokenizer the model was trained with)"
        )
    from k2_model.memory import check_fits

    where = f"--init {spec.init}" if spec.init else f"--preset {spec.preset}"
    check_fits(config, where, weight_bytes=4, training=True)  # built in fp32 on the CPU first
    torch.manual_seed(seed)
    model = K2ForCausalLM(config)
    if spec.init:
        load_init_weights(model, spec.init)
    model = model.to(device)
    model.set_attention_impl(spec.attention)
    model.set_expert_qat(spec.qat_group_size, spec.qat_bits)
    return model


def describe_attention(model: K2ForCausalLM, attention: str, device: torch.device) -> str:
    """Which attention path training uses, for the start-up line."""
    from k2_model.model import fused_attention_available

    c = model.config
    fused = fused_attention_available(device, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim)
    if attention == "auto":
        return "fused (k2_kernels)" if fused else "sdpa/eager (no compiled k2_kernels attention here)"
    return attention


def describe_ns_dtype(optim: OptimConfig, device: torch.device) -> str:
    """The Newton-Schulz dtype the run will use and why, for the start-up line."""
    from k2_optim.muon import cpu_has_native_bf16, default_ns_dtype

    if optim.optimizer == "adamw":
        return "none (AdamW)"
    chosen = str(default_ns_dtype(device, optim.ns_dtype)).removeprefix("torch.")
    if optim.ns_dtype != "auto":
        return f"{chosen} (--ns-dtype {optim.ns_dtype})"
    if device.type == "cpu":
        why = "native bf16 GEMMs" if cpu_has_native_bf16() else "bf16 emulated on this CPU"
        return f"{chosen} (auto: {why})"
    return f"{chosen} (auto: {device.type})"


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    if optim.optimizer == "adamw":
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        return torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": optim.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=optim.lr,
            betas=(0.9, 0.95),
        )
    # Muon for hidden matrices, AdamW for embeddings / head / 1-D; QK-Clip only for "muonclip".
    opt = MuonClip(
        model,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        tau=optim.tau if optim.optimizer == "muonclip" else None,
        ns_dtype=optim.ns_dtype,  # "auto" / "fp32" / "bf16": Muon takes the names
    )
    if optim.adamw_lr:
        for group in opt.param_groups:
            if group.get("algorithm") == "adamw":
                group["lr"] = optim.adamw_lr
    return opt


def build_schedule(
    optimizer: torch.optim.Optimizer, schedule: WSDConfig, steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """WSD: `warmup_steps`, then constant, then a cosine decay over `decay_fraction` of the
    schedule's span (`schedule_steps`, default the run's `steps`), then held at the floor."""
    warmup, stable, decay = schedule.phases(schedule.span(steps))
    return wsd_schedule(optimizer, warmup, stable, decay, schedule.min_lr_ratio)


__all__ = [
    "build_model",
    "build_optimizer",
    "build_schedule",
    "describe_attention",
    "describe_ns_dtype",
    "load_init_weights",
    "model_config",
    "resolve_device",
]

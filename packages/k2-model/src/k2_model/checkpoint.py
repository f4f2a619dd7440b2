"""HF-format checkpoints: DeepseekV3ForCausalLM tensor names in (sharded, indexed) safetensors.

* Routed experts: ours are stacked (`mlp.experts.gate_proj [E, I, D]`); files hold HF's per-expert
  `mlp.experts.{j}.gate_proj.weight [I, D]`.
* FP8: a float8_e4m3fn `W [n, m]` with `W_scale_inv [ceil(n/128), ceil(m/128)]` is dequantised
  on load to `W * scale` block by block (the last row/column blocks may be partial).
* INT4 (compressed-tensors pack-quantized, K2-Thinking's routed experts): `X.weight_packed` /
  `X.weight_scale` / `X.weight_shape` are dequantised on load to `X.weight` (k2_model.int4), and
  `save_pretrained(..., quantize=Int4Format())` writes the same layout (the rest in bf16).
* Multi-token-prediction layers (`model.layers.{num_hidden_layers + k}.*`) are skipped with a notice.
* Files are written under temporary names and renamed, index and config last.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from k2_model.config import K2Config
from k2_model.int4 import (
    INT4_SUFFIXES,
    Int4Format,
    dequantize_int4,
    k2_thinking_quantization_config,
    parse_quantization_config,
    quantize_int4,
)

# This module never imports k2_model.model (model.py imports it): the model arrives as an
# nn.Module with a `.config` K2Config, the class to build as a parameter of load_pretrained.
K2ForCausalLM = Any  # the annotation's meaning: a k2_model.K2ForCausalLM (or subclass) instance

logger = logging.getLogger("k2_model")

_EXPERT_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")
_EXPERT_HF = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def dequantize_fp8_blocks(w_nm: Tensor, scale_inv_ab: Tensor, block: tuple[int, int] = (128, 128)) -> Tensor:
    """fp32 `w * scale_inv` where each (block[0] x block[1]) tile of w has one scale; edge tiles partial."""
    n, m = w_nm.shape
    bn, bm = block
    a, b = math.ceil(n / bn), math.ceil(m / bm)
    if tuple(scale_inv_ab.shape) != (a, b):
        raise ValueError(
            f"FP8 scale shape {tuple(scale_inv_ab.shape)} does not match weight {tuple(w_nm.shape)} "
            f"with {bn}x{bm} blocks (expected {(a, b)})"
        )
    scale_nm = scale_inv_ab.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bm, 1)[:, :m]
    return w_nm.float() * scale_nm


# ---------------------------------------------------------------------------------------- save
def hf_state_dict(model: K2ForCausalLM) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor) pairs: persistent state with stacked experts split per expert."""
    for name, t in model.state_dict().items():
        m = _EXPERT_STACKED.match(name)
        if m is None:
            yield name, t
            continue
        prefix, proj = m.groups()
        for j in range(t.shape[0]):
            yield f"{prefix}.{j}.{proj}.weight", t[j]


def _stored(items: Iterator[tuple[str, Tensor]], quantize: Int4Format | None) -> Iterator[tuple[str, Tensor]]:
    """The tensors as written: as they are, or (with `quantize`) routed experts' weights as
    INT4 triples and the other weights in bf16, as K2-Thinking's files hold them."""
    for name, t in items:
        if quantize is None:
            yield name, t
        elif _EXPERT_HF.match(name) and quantize.quantizes(name):
            packed, scale, shape = quantize_int4(t.detach().float().cpu(), quantize.group_size)
            base = name.removesuffix(".weight")
            yield from (
                (f"{base}.weight_packed", packed),
                (f"{base}.weight_scale", scale),
                (f"{base}.weight_shape", shape),
            )
        elif name.endswith(".weight") and t.is_floating_point():
            yield name, t.to(torch.bfloat16)
        else:  # buffers such as the router's e_score_correction_bias keep their dtype
            yield name, t


def save_pretrained(
    model: K2ForCausalLM, path: str, max_shard_bytes: int = 5 * 2**30, quantize: Int4Format | None = None
) -> None:
    """config.json and safetensors; `quantize`: routed experts in INT4 (compressed-tensors
    pack-quantized, the `quantization_config` K2-Thinking declares), the rest in bf16."""
    os.makedirs(path, exist_ok=True)
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    total = 0
    for name, t in _stored(hf_state_dict(model), quantize):
        if t.device.type == "meta":
            raise ValueError(f"save_pretrained: tensor {name} {tuple(t.shape)} is on the meta device")
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().contiguous().cpu()
        size += nbytes
        total += nbytes
    n = len(shards)
    names = (
        ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    weight_map = {}
    for fname, shard in zip(names, shards):
        tmp = os.path.join(path, f".{fname}.tmp")
        save_file(shard, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(path, fname))
        weight_map.update({k: fname for k in shard})
    if n > 1:
        _write_json(
            os.path.join(path, "model.safetensors.index.json"),
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )
    hf = model.config.to_hf()
    hf["torch_dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    if quantize is not None:
        hf["torch_dtype"] = "bfloat16"
        hf["quantization_config"] = k2_thinking_quantization_config(quantize)
    _write_json(os.path.join(path, "config.json"), hf)


def _write_json(path: str, obj: object) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------- load
class _Files(dict):
    """tensor name -> file, with INT4 triples folded into their weight's name (`int4`: weight
    name -> base name, whose `.weight_packed` / `.weight_scale` / `.weight_shape` hold it)."""

    int4: dict[str, str]
    group_size: int


def _int4_as_weights(files: dict[str, str], int4: Int4Format | None) -> _Files:
    out = _Files()
    out.int4, out.group_size = {}, int4.group_size if int4 is not None else 0
    parts = {}
    for name, fname in files.items():
        base, _, suffix = name.rpartition(".")
        if suffix in INT4_SUFFIXES:
            parts.setdefault(base, {})[suffix] = fname
        else:
            out[name] = fname
    for base, have in parts.items():
        if int4 is None:
            raise ValueError(
                f"tensor {base}.{next(iter(have))}: an INT4 (compressed-tensors) tensor, but config.json "
                "declares no compressed-tensors quantization_config"
            )
        missing = [s for s in INT4_SUFFIXES if s not in have]
        if missing:
            raise ValueError(f"INT4 weight {base}: the checkpoint has no {base}.{missing[0]}")
        out[f"{base}.weight"] = have["weight_packed"]
        out.int4[f"{base}.weight"] = base
        for suffix, fname in have.items():
            out[f"{base}.{suffix}"] = fname
    return out


def _int4_weight(files: _Files, name: str) -> Tensor:
    """The dequantised weight `name` from its INT4 triple (each read from its own file)."""
    base = files.int4[name]

    def get(suffix: str) -> Tensor:
        with safe_open(files[f"{base}.{suffix}"], framework="pt") as f:
            return f.get_tensor(f"{base}.{suffix}")

    shape = tuple(int(x) for x in get("weight_shape").tolist())
    return dequantize_int4(get("weight_packed"), get("weight_scale"), shape, files.group_size, what=base)


def _checkpoint_files(path: str) -> dict[str, str]:
    """tensor name -> file, from the index when present, else from the single/all safetensors files."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: missing 'weight_map'")
        out = {}
        for name, fname in weight_map.items():
            full = os.path.join(path, fname)
            if not os.path.exists(full):
                raise FileNotFoundError(f"{index}: tensor {name} lives in {fname}, which does not exist")
            out[name] = full
        return out
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files (or model.safetensors.index.json) in {path}")
    out = {}
    for fname in files:
        with safe_open(os.path.join(path, fname), framework="pt") as f:
            for name in f.keys():
                out[name] = os.path.join(path, fname)
    return out


def load_pretrained(
    cls: type[K2ForCausalLM], path: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> K2ForCausalLM:
    config = K2Config.from_hf(path)
    qc = config.extra.get("quantization_config") or {}
    block = tuple(qc.get("weight_block_size", (128, 128)))
    int4 = parse_quantization_config(qc, where=os.path.join(path, "config.json"))
    with torch.device("meta"):
        model = cls(config)
    model.to_empty(device=device)
    if dtype is not None:
        model.to(dtype)
    model.reset_buffers()
    load_hf_state_dict(model, _checkpoint_files(path), block=block, int4=int4)  # type: ignore[arg-type]
    return model


@torch.no_grad()
def load_hf_state_dict(
    model: K2ForCausalLM,
    files: dict[str, str],
    block: tuple[int, int] = (128, 128),
    int4: Int4Format | None = None,
) -> None:
    """Copy tensors named as in HF's DeepseekV3ForCausalLM into `model`, strictly (FP8 blocks and
    INT4 pack-quantized weights dequantised tensor by tensor, never the whole model at once)."""
    files = _int4_as_weights(files, int4)
    cfg = model.config
    targets = dict(model.state_dict(keep_vars=True))
    # Expected HF names -> (our tensor, expert index or None)
    expected: dict[str, tuple[Tensor, int | None]] = {}
    for name, t in targets.items():
        m = _EXPERT_STACKED.match(name)
        if m is None:
            expected[name] = (t, None)
        else:
            prefix, proj = m.groups()
            for j in range(t.shape[0]):
                expected[f"{prefix}.{j}.{proj}.weight"] = (t, j)
    scale_names = {n for n in files if n.endswith("_scale_inv")}
    skipped_mtp = 0
    by_file: dict[str, list[str]] = {}
    for name, fname in files.items():
        if name in scale_names or name.rpartition(".")[2] in INT4_SUFFIXES:
            continue  # read with their weight
        lm = _LAYER.match(name)
        if lm and int(lm.group(1)) >= cfg.num_hidden_layers:
            skipped_mtp += 1
            continue
        if name.endswith("rotary_emb.inv_freq"):
            continue
        by_file.setdefault(fname, []).append(name)
    if skipped_mtp:
        logger.warning(
            "k2_model: skipped %d multi-token-prediction tensors (model.layers.%d.* and above); "
            "MTP layers are not part of K2ForCausalLM",
            skipped_mtp,
            cfg.num_hidden_layers,
        )
    seen: set[str] = set()
    for fname, names in by_file.items():
        with safe_open(fname, framework="pt") as f:
            for name in names:
                t = _int4_weight(files, name) if name in files.int4 else f.get_tensor(name)
                if name not in expected:
                    raise ValueError(
                        f"unexpected tensor {name} {tuple(t.shape)} in {os.path.basename(fname)}: "
                        f"no such parameter in K2ForCausalLM for this config"
                    )
                scale_name = name + "_scale_inv"
                if scale_name in files:
                    with safe_open(files[scale_name], framework="pt") as fs:
                        t = dequantize_fp8_blocks(t, fs.get_tensor(scale_name), block)  # type: ignore[arg-type]
                elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    raise ValueError(
                        f"FP8 tensor {name} {tuple(t.shape)} has no {scale_name} in the checkpoint"
                    )
                dst, j = expected[name]
                dst_view = dst if j is None else dst[j]
                if tuple(t.shape) != tuple(dst_view.shape):
                    raise ValueError(
                        f"tensor {name}: checkpoint shape {tuple(t.shape)} != model shape {tuple(dst_view.shape)}"
                    )
                dst_view.copy_(t.to(dst_view.dtype))
                seen.add(name)
    missing = [n for n in expected if n not in seen]
    if missing:
        shown = ", ".join(f"{n} {tuple(expected[n][0].shape if expected[n][1] is None else expected[n][0].shape[1:])}"
                          for n in missing[:5])  # fmt: skip
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}{more}")
    orphan_scales = [n for n in scale_names if n.removesuffix("_scale_inv") not in files]
    if orphan_scales:
        raise ValueError(f"unexpected tensor {orphan_scales[0]}: a scale without its weight")

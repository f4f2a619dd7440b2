"""Export a pretraining run to an HF-format directory (config.json, safetensors, tokenizer) that
`K2ForCausalLM.from_pretrained`, `transformers` and `k2 serve --model` load."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from k2_model import K2Config, K2ForCausalLM

from k2_stack.pretrain import checkpoint as ckpt
from k2_stack.pretrain.config import PretrainConfig


def export_run(run_dir: str | Path, out_dir: str | Path) -> Path:
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    latest = ckpt.latest_checkpoint(run_dir)
    if latest is None:
        raise FileNotFoundError(f"{run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
    state = ckpt.load_checkpoint(latest)
    cfg = PretrainConfig.from_dict(state["config"], source=str(latest))
    model = K2ForCausalLM(K2Config.preset(cfg.preset, **cfg.model_overrides))
    model.load_state_dict(state["model"])
    # Write into a temporary sibling and rename, so an interrupted export leaves nothing half-written.
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tok_dir = run_dir / "tokenizer"
    if tok_dir.is_dir():
        for f in tok_dir.iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir

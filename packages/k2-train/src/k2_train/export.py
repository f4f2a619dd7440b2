"""Export a run (pretraining or SFT) to an HF-format directory (config.json, safetensors, the
tokenizer with the Kimi chat template) that `K2ForCausalLM.from_pretrained`, `transformers` (also
`apply_chat_template` and `transformers serve`) and `k2 serve --model` load."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from k2_data.chat.template import write_chat_template
from k2_model import K2Config, K2ForCausalLM

from k2_train.builders import model_config
from k2_train.config import PretrainConfig, SFTConfig
from k2_train.state import latest_state, read_state


def export_run(run_dir: str | Path, out_dir: str | Path) -> Path:
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    latest = latest_state(run_dir)
    if latest is None:
        raise FileNotFoundError(
            f"{run_dir}: no complete train state under {run_dir / 'state'} (not a k2 run dir?)"
        )
    state = read_state(latest)
    meta = state["meta"]
    if "model_config" in meta:  # the architecture as trained (also when it came from --init weights)
        config = K2Config.from_hf(meta["model_config"])
    else:
        config_cls = SFTConfig if meta.get("task") == "sft" else PretrainConfig
        config = model_config(config_cls.from_dict(meta["config"], source=str(latest)).model)
    model = K2ForCausalLM(config)
    model.load_state_dict(state["components"]["model"])
    return export_model(model, run_dir / "tokenizer", out_dir)


def export_model(model: K2ForCausalLM, tok_dir: str | Path, out_dir: str | Path) -> Path:
    """`model` and the tokenizer files in `tok_dir` (when it exists) as an HF-format dir with the Kimi
    chat template, written atomically (e.g. a run's random init, for a before-training baseline)."""
    tok_dir, out_dir = Path(tok_dir), Path(out_dir)
    # Write into a temporary sibling and rename, so an interrupted export leaves nothing half-written.
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    if tok_dir.is_dir():
        for f in tok_dir.iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        # the Kimi chat format as a Jinja chat_template, so transformers (`apply_chat_template`,
        # `transformers serve`) renders conversations exactly as k2 does (k2_data.chat.render)
        write_chat_template(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir

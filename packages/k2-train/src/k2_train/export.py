"""Export a run (pretraining or SFT) to an HF-format directory (config.json, safetensors, the
tokenizer with the Kimi chat template, generation_config.json) that `K2ForCausalLM.from_pretrained`,
`transformers` (also `apply_chat_template` and `transformers serve`), vLLM and `k2 serve --model` load."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from k2_data.chat.render import K2_TEMPLATE
from k2_data.chat.template import write_chat_template
from k2_model import K2Config, K2ForCausalLM

from k2_train.builders import model_config
from k2_train.config import PretrainConfig, SFTConfig
from k2_train.state import latest_state, read_state

GENERATION_CONFIG_FILE = "generation_config.json"
END_OF_TURN = "<|im_end|>"


def export_run(
    run_dir: str | Path, out_dir: str | Path, force: bool = False, quantize: str | None = None
) -> Path:
    """A run's latest weights as an HF-format dir; `quantize="int4"`: routed experts in INT4
    (compressed-tensors pack-quantized, groups of 32, as K2-Thinking ships), the rest in bf16."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    check_out_dir(out_dir, force)
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
    template = meta.get("chat_template") or K2_TEMPLATE  # runs before it was recorded used k2's
    return export_model(
        model, run_dir / "tokenizer", out_dir, force=force, chat_template=template, quantize=quantize
    )


def check_out_dir(out_dir: Path, force: bool) -> None:
    """Refuse to replace an existing non-empty `out_dir` (or a file there) unless `force`."""
    if force or not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory (pass --force to replace it)")
    if any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty (pass --force to replace it)")


def generation_config(config: K2Config, tokenizer: Any | None) -> dict[str, Any]:
    """The generation defaults `k2 serve` uses, for vLLM and transformers' `generate`: every id that
    ends a turn (the tokenizer's EOS, `<|im_end|>`, the config's eos_token_id; without this file
    both run past `<|im_end|>` to the length limit) and k2's default sampling (temperature 1, no
    top-p/top-k cut)."""
    stop = {config.eos_token_id} if config.eos_token_id is not None else set()
    if tokenizer is not None:
        stop |= {tokenizer.eos_id, tokenizer.token_to_id(END_OF_TURN)}
    out: dict[str, Any] = {"eos_token_id": sorted(stop)}
    if config.bos_token_id is not None:
        out["bos_token_id"] = config.bos_token_id
    if config.pad_token_id is not None:
        out["pad_token_id"] = config.pad_token_id
    out.update(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    return out


def export_model(
    model: K2ForCausalLM,
    tok_dir: str | Path,
    out_dir: str | Path,
    force: bool = False,
    chat_template: str = K2_TEMPLATE,
    quantize: str | None = None,
) -> Path:
    """`model` and the tokenizer files in `tok_dir` (when it exists) as an HF-format dir with the Kimi
    chat template the model was trained with (`chat_template`: "k2", or a released template's
    name), written atomically (e.g. a run's random init, for a before-training baseline).
    An existing non-empty `out_dir` is replaced only with `force`."""
    from k2_data import load_tokenizer

    tok_dir, out_dir = Path(tok_dir), Path(out_dir)
    check_out_dir(out_dir, force)
    # Write into a temporary sibling and rename, so an interrupted export leaves nothing half-written.
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if quantize not in (None, "none", "int4"):
        raise ValueError(f"--quantize {quantize!r}: expected none or int4")
    if quantize == "int4":
        from k2_model.int4 import Int4Format

        model.save_pretrained(str(tmp), quantize=Int4Format())
    else:
        model.save_pretrained(str(tmp))
    tokenizer = None
    if tok_dir.is_dir():
        for f in tok_dir.iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        # the Kimi chat format as a Jinja chat_template, so transformers (`apply_chat_template`,
        # `transformers serve`) renders conversations exactly as k2 does (k2_data.chat.render)
        write_chat_template(tmp, chat_template)
        tokenizer = load_tokenizer(tmp)
    with open(tmp / GENERATION_CONFIG_FILE, "w") as f:
        json.dump(generation_config(model.config, tokenizer), f, indent=2)
    _apply_umask(tmp)
    if out_dir.is_dir():
        shutil.rmtree(out_dir)
    elif out_dir.exists():
        out_dir.unlink()
    os.replace(tmp, out_dir)
    return out_dir


def _apply_umask(directory: Path) -> None:
    """Give every file the mode a plain `open` would (0666 less the umask): safetensors writes its
    files 0600, and copies keep their source's mode, so an export would not be readable by others."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(directory, 0o777 & ~mask)
    for f in directory.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)

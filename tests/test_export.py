"""`k2 export`: generation_config.json (end-of-turn ids, k2's default sampling) that makes transformers'
generate stop at <|im_end|>; an existing non-empty --out is refused unless --force; files get the
umask's permissions."""

from __future__ import annotations

import json
import os
import shutil
import stat
import textwrap
from pathlib import Path

import pytest
import torch
from k2_data import load_tokenizer
from k2_model.testing import SMALL_OVERRIDES, plant_next_token
from safetensors.torch import load_file, save_file

from k2_stack.cli import main

TRIGGER = 7900  # an ordinary token of the shipped tokenizer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A 1-step pretraining run of a small model."""
    from k2_train import PretrainConfig, run_training

    root = tmp_path_factory.mktemp("export")
    corpus = root / "corpus"
    corpus.mkdir()
    lines = Path(textwrap.__file__).read_text().splitlines()
    for i in range(8):
        (corpus / f"doc{i}.py").write_text("\n".join(lines[i * 40 + 7 : i * 40 + 47]) + "\n")
    cfg = PretrainConfig.flat(
        model_overrides=SMALL_OVERRIDES, steps=1, batch=2, micro_batch=2, seq_len=32, data=str(corpus),
        val_fraction=0.2, eval_every=0, save_every=0, threads=1, out=str(root / "run"), warmup_steps=0,
    )  # fmt: skip
    return run_training(cfg, log=lambda _msg: None).run_dir


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "model"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    return out


def test_generation_config_names_every_end_of_turn(exported):
    tok = load_tokenizer(exported)
    gen = json.loads((exported / "generation_config.json").read_text())
    config = json.loads((exported / "config.json").read_text())
    im_end = tok.token_to_id("<|im_end|>")
    # the ids k2 serve stops at: the tokenizer's EOS, <|im_end|>, config.json's eos_token_id
    assert gen["eos_token_id"] == sorted({tok.eos_id, im_end, config["eos_token_id"]}) == [7937, 7938]
    assert (gen["bos_token_id"], gen["pad_token_id"]) == (config["bos_token_id"], config["pad_token_id"])
    # k2 serve's defaults (temperature 1, no top-p/top-k cut), also for transformers, whose own
    # default would be top_k 50
    assert (gen["do_sample"], gen["temperature"], gen["top_p"], gen["top_k"]) == (True, 1.0, 1.0, 0)


def test_transformers_generate_stops_at_im_end(exported, tmp_path):
    """With the export's generation_config.json, transformers' generate stops at <|im_end|>;
    without it, it runs on to the length limit (what vLLM did too)."""
    transformers = pytest.importorskip("transformers")
    im_end = load_tokenizer(exported).token_to_id("<|im_end|>")
    planted = tmp_path / "planted"
    shutil.copytree(exported, planted)
    weights = load_file(str(planted / "model.safetensors"))
    plant_next_token(weights, after=TRIGGER, token=im_end)
    save_file(weights, str(planted / "model.safetensors"), metadata={"format": "pt"})
    prompt = torch.tensor([[40, 41, 300, TRIGGER]])

    def greedy(d: Path) -> list[int]:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=6, do_sample=False)
        return out[0, prompt.shape[1] :].tolist()

    assert greedy(planted) == [im_end]
    (planted / "generation_config.json").unlink()
    rest = greedy(planted)
    assert rest[0] == im_end and len(rest) == 6


def test_refuses_a_non_empty_out_without_force(run_dir, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["export", str(run_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"k2 export: --out {out} exists and is not empty (pass --force to replace it)"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # untouched
    assert main(["export", str(run_dir), "--out", str(out), "--force"]) == 0
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file()
    # an existing empty directory, and a file only with --force
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(run_dir), "--out", str(empty)]) == 0
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert main(["export", str(run_dir), "--out", str(a_file)]) == 2
    assert "exists and is not a directory (pass --force" in capsys.readouterr().err
    assert main(["export", str(run_dir), "--out", str(a_file), "--force"]) == 0
    assert (a_file / "config.json").is_file()


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_files_get_the_umask_permissions(run_dir, tmp_path, umask):
    old = os.umask(umask)
    try:
        assert main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old)
    files = sorted((tmp_path / "hf").iterdir())
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= {
        f.name for f in files
    }
    for f in files:  # safetensors alone would write 0600
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f.name
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o777 & ~umask


def test_quantize_int4_writes_k2_thinking_s_layout_and_serves(run_dir, tmp_path):
    """`k2 export --quantize int4`: routed experts as INT4 triples, the rest bf16, the
    quantization_config K2-Thinking declares; k2 loads it back (and so k2 serve --model)."""
    from k2_model import K2ForCausalLM
    from k2_model.int4 import parse_quantization_config
    from safetensors import safe_open

    out = tmp_path / "int4"
    assert main(["export", str(run_dir), "--out", str(out), "--quantize", "int4"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert parse_quantization_config(config["quantization_config"]).group_size == 32
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        packed = [n for n in names if n.endswith(".weight_packed")]
        assert packed and all(".mlp.experts." in n for n in packed)
        assert f.get_tensor(packed[0]).dtype == torch.int32
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    model = K2ForCausalLM.from_pretrained(str(out))
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.isfinite(model(ids).logits).all()

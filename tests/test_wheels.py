"""`make wheels` gives wheels a cluster can install, and k2-train installs from them alone.

Builds every wheel with scripts/build_wheels.sh (k2-kernels repaired to a manylinux tag by
auditwheel), makes a clean venv with only torch, runs `pip install --find-links DIST k2-train`
there, and checks (1) the loop came without the checkpoint engine or the server stack, (2) the
installed k2-kernels wheel (not this checkout) runs its compiled kernels and matches the
reference, (3) a Trainer step trains a model. Slow: a venv with torch, about 2-4 minutes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

CHECK = r"""
import json, sys, torch
import k2_kernels, k2_train
from k2_kernels import ops, reference
from k2_model import K2Config, K2ForCausalLM
from k2_train import NextTokenLoss, Trainer, TrainerConfig

caps = k2_kernels.capabilities()
torch.manual_seed(0)
x, w = torch.randn(64, 96), torch.rand(96) + 0.5
norm_err = (ops.rms_norm(x, w, 1e-6) - reference.rms_norm(x, w, 1e-6)).abs().max().item()
logits, bias = torch.randn(32, 16), torch.randn(16) * 0.1
idx, wt = ops.moe_route(logits, bias, 4, 1, 1, 2.5, True)
ridx, rwt = reference.moe_route(logits, bias, 4, 1, 1, 2.5, True)
route_ok = bool(torch.equal(idx.long(), ridx.long())) and (wt - rwt).abs().max().item() < 1e-6

model = K2ForCausalLM(K2Config.preset("tiny", num_hidden_layers=2, vocab_size=512)).train()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
trainer = Trainer(model, opt, NextTokenLoss(), config=TrainerConfig(steps=4))
ids = torch.randint(0, 512, (2, 33))
batch = {"input_ids": ids[:, :-1], "shift_labels": ids[:, 1:]}
losses = [trainer.train_step(batch).loss for _ in range(4)]
print(json.dumps({
    "kernels_file": k2_kernels.__file__, "train_file": k2_train.__file__,
    "cpu_kernels": caps.cpu_kernels, "norm_err": norm_err, "route_ok": route_ok, "losses": losses,
}))
"""


def _run(*cmd, **kw) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
def test_wheels_install_k2_train_without_the_server_stack(tmp_path):
    dist = tmp_path / "dist"
    _run(
        "bash",
        ROOT / "scripts" / "build_wheels.sh",
        sys.executable,
        cwd=ROOT,
        env={**os.environ, "DIST": str(dist)},
    )
    wheels = sorted(p.name for p in dist.glob("*.whl"))
    kernels = [n for n in wheels if n.startswith("k2_kernels-")]
    assert len(kernels) == 1 and re.search(r"-cp3\d+-cp3\d+-manylinux_2_\d+_x86_64\.whl$", kernels[0]), wheels
    for pkg in ("k2_model", "k2_optim", "k2_data", "k2_train", "k2_ckpt", "k2_rl", "k2_stack"):
        assert any(re.fullmatch(rf"{pkg}-[\d.]+-py3-none-any\.whl", n) for n in wheels), (pkg, wheels)

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    py = venv / "bin" / "python"
    pip = (py, "-m", "pip", "install", "-q", "--disable-pip-version-check")
    _run(*pip, f"torch=={torch.__version__.split('+')[0]}")
    _run(*pip, "--find-links", dist, "k2-train")

    installed = {p["name"].lower() for p in json.loads(_run(py, "-m", "pip", "list", "--format", "json"))}
    assert {"k2-train", "k2-model", "k2-optim", "k2-data", "k2-kernels"} <= installed
    assert not installed & {"k2-ckpt", "k2-rl", "k2-stack", "fastapi", "uvicorn", "pyzmq", "llguidance"}, (
        installed
    )

    out = json.loads(_run(py, "-c", CHECK, cwd=tmp_path).strip().splitlines()[-1])
    assert out["kernels_file"].startswith(str(venv)) and out["train_file"].startswith(str(venv)), out
    assert out["cpu_kernels"], "the repaired wheel's compiled module did not load"
    assert out["norm_err"] < 1e-5 and out["route_ok"], out
    assert out["losses"][-1] < out["losses"][0], out["losses"]

"""`k2 pretrain` end to end on a small corpus: metrics, plots, train state, exact resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from k2_model.testing import SMALL_OVERRIDES
from k2_train import PretrainConfig, run_training
from k2_train.state import latest_state

from k2_stack.cli import main


def run_pretrain(cfg: PretrainConfig, resume: bool = False):
    return run_training(cfg, resume=resume, log=lambda _msg: None)


# A model small enough for a test, with K2's structure (dense first layer, MoE after, MLA).
SMALL = SMALL_OVERRIDES  # K2's structure at test size (k2_model.testing)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    # Real Python source from the standard library, cut into 80 documents of 40 lines.
    import textwrap

    lines = Path(textwrap.__file__).read_text().splitlines()
    for i in range(80):
        chunk = lines[(i * 40) % len(lines) : (i * 40) % len(lines) + 40]
        (d / f"doc{i:03d}.py").write_text("\n".join(chunk) + "\n")
    return d


def _cfg(tmp_path: Path, corpus: Path, **kw) -> PretrainConfig:
    base = dict(
        model_overrides=SMALL,
        steps=8,
        batch=4,
        micro_batch=2,
        seq_len=32,
        lr=1e-2,
        adamw_lr=1e-2,
        tau=5.0,
        warmup_steps=2,
        data=str(corpus),
        val_fraction=0.2,
        eval_every=4,
        eval_batches=1,
        save_every=0,
        threads=1,
        out=str(tmp_path / "run"),
    )
    base.update(kw)
    return PretrainConfig.flat(**base)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K2_CACHE", str(tmp_path / "cache"))


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_run_writes_metrics_plots_checkpoint_and_learns(tmp_path, corpus):
    cfg = _cfg(tmp_path, corpus, steps=12)
    result = run_pretrain(cfg)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    for r in rows:
        for key in ("loss", "lr", "max_logit", "clipped_heads", "tokens_per_s", "expert_maxvio", "grad_norm"):
            assert key in r and math.isfinite(r[key]), key
        assert r["tokens"] == r["step"] * 4 * 32
    # The first loss is about ln(vocab) for a random init; 12 steps must bring it down.
    assert abs(rows[0]["loss"] - math.log(8192)) < 1.0
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8, 12]
    assert (result.run_dir / "plots" / "loss.png").stat().st_size > 1000
    assert (result.run_dir / "plots" / "max_logit.png").stat().st_size > 1000
    assert (result.run_dir / "tokenizer").is_dir()
    assert latest_state(result.run_dir).name == "step_000012"
    # The WSD schedule: warmup to the peak, then decay to lr * min_lr_ratio at the end.
    assert rows[0]["lr"] == pytest.approx(1e-2 / 2)
    assert max(r["lr"] for r in rows) == pytest.approx(1e-2)


def test_clipping_caps_logits_at_tau(tmp_path, corpus):
    # A tau below the logits this small model reaches (its max logits start near 0.06): heads get
    # clipped, and the optimizer reports it.
    result = run_pretrain(_cfg(tmp_path, corpus, tau=0.05, lr=3e-2, steps=6, eval_every=0))
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["clipped_heads"] for r in rows) > 0
    assert all(r["clipped_heads"] <= SMALL["num_hidden_layers"] * SMALL["num_attention_heads"] for r in rows)


def test_stop_and_resume_is_bit_identical(tmp_path, corpus):
    full = run_pretrain(_cfg(tmp_path, corpus, out=str(tmp_path / "full")))
    assert full.steps_done == 8 and not full.interrupted
    stopped = run_pretrain(_cfg(tmp_path, corpus, out=str(tmp_path / "part"), stop_at=4))
    assert stopped.interrupted and stopped.steps_done == 4
    resumed = run_pretrain(_cfg(tmp_path, corpus, out=str(tmp_path / "part")), resume=True)
    assert resumed.steps_done == 8
    assert _losses(tmp_path / "part") == _losses(tmp_path / "full")  # exact, not approximate


def test_cli_resume_and_errors(tmp_path, corpus, capsys):
    cfg_file = tmp_path / "pretrain.json"
    cfg_file.write_text(json.dumps(_cfg(tmp_path, corpus, steps=4, eval_every=0).to_dict()))
    assert main(["pretrain", "--config", str(cfg_file), "--stop-at", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps_done"] == 2 and out["interrupted"]
    # a resume may name a new stop point (the stored one is spent)
    assert main(["pretrain", "--resume", str(tmp_path / "run"), "--stop-at", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps_done"] == 3 and out["interrupted"]
    # a stop point the run has passed would never be reached: refused, not run to the end
    assert main(["pretrain", "--resume", str(tmp_path / "run"), "--stop-at", "3", "--json"]) == 2
    captured = capsys.readouterr()
    assert "--stop-at 3" in captured.out + captured.err
    assert main(["pretrain", "--resume", str(tmp_path / "run"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps_done"] == 4 and not out["interrupted"]
    # Starting again into a run directory that has a run is refused (resume it instead).
    assert main(["pretrain", "--config", str(cfg_file)]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"stepz": 3}))
    with pytest.raises(ValueError, match="stepz"):
        PretrainConfig.from_file(bad)
    with pytest.raises(ValueError, match="optimizer"):
        PretrainConfig.flat(optimizer="sgd").validate()


def test_optimizers_build(tmp_path, corpus):
    from k2_optim import MuonClip
    from k2_train.builders import build_model, build_optimizer

    model = build_model(_cfg(tmp_path, corpus).model, 8192, torch.device("cpu"), 0)
    assert isinstance(
        build_optimizer(model, _cfg(tmp_path, corpus, optimizer="adamw").optim), torch.optim.AdamW
    )
    muon = build_optimizer(model, _cfg(tmp_path, corpus, optimizer="muon").optim)
    assert isinstance(muon, MuonClip) and muon.tau is None
    clip = build_optimizer(model, _cfg(tmp_path, corpus, optimizer="muonclip", tau=7.0, adamw_lr=1e-3).optim)
    assert clip.tau == 7.0
    lrs = {g["algorithm"]: g["lr"] for g in clip.param_groups}
    assert lrs == {"muon": 1e-2, "adamw": 1e-3}
    # The embedding table and the LM head are AdamW's, every MLA/MoE matrix Muon's.
    adamw_ids = {id(p) for g in clip.param_groups if g["algorithm"] == "adamw" for p in g["params"]}
    assert id(model.model.embed_tokens.weight) in adamw_ids and id(model.lm_head.weight) in adamw_ids
    assert id(model.model.layers[0].self_attn.kv_b_proj.weight) not in adamw_ids


def test_export_loads_in_k2_and_transformers(tmp_path, corpus):
    import transformers
    from k2_model import K2ForCausalLM

    result = run_pretrain(_cfg(tmp_path, corpus, steps=2, eval_every=0))
    hf_dir = tmp_path / "hf"
    assert main(["export", str(result.run_dir), "--out", str(hf_dir)]) == 0
    ids = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = K2ForCausalLM.from_pretrained(str(hf_dir)).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = ours(ids).logits, theirs(ids).logits
    assert (a - b).norm() / b.norm() <= 1e-5
    assert (hf_dir / "tokenizer_config.json").is_file()


@pytest.mark.dist
def test_two_process_fsdp2_matches_one_process(tmp_path, corpus, torchrun):
    """torchrun with 2 processes (FSDP2 on gloo) follows the 1-process run with the same global batch
    (fp32 Newton-Schulz: bf16 NS would round the reduction-order noise into different updates)."""
    cfg = _cfg(tmp_path, corpus, steps=4, eval_every=0, ns_dtype="fp32", out=str(tmp_path / "one"))
    run_pretrain(cfg)
    cfg_file = tmp_path / "two.json"
    cfg_file.write_text(json.dumps(dict(cfg.to_dict(), out=str(tmp_path / "two"), micro_batch=0)))
    proc = torchrun("pretrain", "--config", str(cfg_file))
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(two) == 4
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-4 * abs(a), (one, two)
    # The multi-process checkpoint holds the full model, which exports like any other.
    assert main(["export", str(tmp_path / "two"), "--out", str(tmp_path / "two_hf")]) == 0


@pytest.mark.dist
@pytest.mark.parametrize("ns_dtype", ["auto", "fp32", "bf16"])
def test_two_process_stop_and_resume_is_exact(tmp_path, corpus, torchrun, ns_dtype):
    """A 2-process (FSDP2) run stopped after step 2 and resumed with 2 processes logs the same
    losses as the uninterrupted 2-process run: the checkpoint holds the full optimizer state,
    whatever the Newton-Schulz dtype (torch.distributed.checkpoint stores its param groups)."""
    cfg = _cfg(tmp_path, corpus, steps=4, eval_every=0, micro_batch=0, ns_dtype=ns_dtype)

    def pretrain(*args: str) -> None:
        proc = torchrun("pretrain", *args)
        assert proc.returncode == 0, proc.stderr[-4000:]

    for name, extra in (("full", {}), ("part", {"stop_at": 2})):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps(dict(cfg.to_dict(), out=str(tmp_path / name), **extra)))
        pretrain("--config", str(f))
    assert len(_losses(tmp_path / "part")) == 2
    pretrain("--resume", str(tmp_path / "part"))
    assert _losses(tmp_path / "part") == _losses(tmp_path / "full")  # exact, not approximate
    # a different process count is refused with a clear message
    with pytest.raises(ValueError, match="same number"):
        run_pretrain(_cfg(tmp_path, corpus, out=str(tmp_path / "part")), resume=True)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_loss_grads_and_expert_loads(tmp_path, corpus, mode):
    from k2_model.parallelize import parallelize
    from k2_train.builders import build_model
    from k2_train.losses import NextTokenLoss, mean_loss

    ids = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(1))
    results = []
    for ac in ("none", mode):
        model = build_model(
            _cfg(tmp_path, corpus, model_overrides=dict(SMALL, num_hidden_layers=3)).model,
            8192,
            torch.device("cpu"),
            0,
        )
        parallelize(model, activation_checkpointing=ac)
        assert [layer.activation_checkpointing for layer in model.model.layers] == {
            "none": [False] * 3,
            "full": [True] * 3,
            "selective": [True, False, True],
        }[ac]
        model.train()
        loss = mean_loss(NextTokenLoss(), model, {"input_ids": ids[:, :-1], "shift_labels": ids[:, 1:]})
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append(
            (loss.detach(), grads, model.expert_load().clone(), model.attention_max_logits().clone())
        )
    (l0, g0, load0, s0), (l1, g1, load1, s1) = results
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7, msg=n)
    assert torch.equal(load0, load1)  # the recompute did not count tokens twice
    assert torch.equal(s0, s1)


def test_document_mask_equals_separate_documents(tmp_path, corpus):
    """With the document mask, a packed sample's loss equals running each document on its own."""
    import torch.nn.functional as F
    from k2_train.builders import build_model
    from k2_train.data import build_datasets, prepare_tokenized

    cfg = _cfg(tmp_path, corpus, document_mask=True, seq_len=256)
    train, _ = build_datasets(cfg, prepare_tokenized(cfg))
    s = next(train[g] for g in range(len(train)) if train[g]["document_ids"].max() >= 1)
    b = {k: torch.from_numpy(v).long().unsqueeze(0) for k, v in s.items()}
    model = build_model(cfg.model, 8192, torch.device("cpu"), cfg.seed).eval()
    with torch.no_grad():
        packed = model(**b).loss  # the loader's keys are the model's arguments
        total, count = 0.0, 0
        for d in b["document_ids"].unique():
            sel = b["document_ids"][0] == d
            logits = model(b["input_ids"][:, sel]).logits[0]
            lab = b["shift_labels"][0, sel]
            total += F.cross_entropy(logits, lab, ignore_index=-100, reduction="sum").item()
            count += int((lab != -100).sum())
    assert packed.item() == pytest.approx(total / count, rel=1e-5)


@pytest.mark.slow
def test_ctrl_c_saves_and_resume_continues_exactly(tmp_path, corpus):
    """SIGINT finishes the current step, checkpoints, exits 130; --resume reproduces the losses."""
    import os
    import signal
    import subprocess
    import sys
    import time

    run_pretrain(_cfg(tmp_path, corpus, steps=40, eval_every=0, out=str(tmp_path / "full")))
    cfg_file = tmp_path / "int.json"
    cfg_file.write_text(
        json.dumps(_cfg(tmp_path, corpus, steps=40, eval_every=0, out=str(tmp_path / "int")).to_dict())
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "k2_stack", "pretrain", "--config", str(cfg_file), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    metrics = tmp_path / "int" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    done = json.loads(out.strip().splitlines()[-1])["steps_done"]
    assert 3 <= done < 40 and latest_state(tmp_path / "int").name == f"step_{done:06d}"
    assert len(_losses(tmp_path / "int")) == done  # nothing logged past the checkpoint
    assert main(["pretrain", "--resume", str(tmp_path / "int"), "--json"]) == 0
    assert _losses(tmp_path / "int") == _losses(tmp_path / "full")


def test_progress_lines_when_stdout_is_not_a_terminal(tmp_path, corpus):
    """Piped (CI, `| tee`): a plain progress line at the first and last step (and every 10 s),
    not a live bar that prints nothing until the end."""
    import os
    import subprocess
    import sys

    cfg_file = tmp_path / "p.json"
    cfg_file.write_text(json.dumps(_cfg(tmp_path, corpus, steps=3, eval_every=3).to_dict()))
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    proc = subprocess.run(
        [sys.executable, "-m", "k2_stack", "pretrain", "--config", str(cfg_file)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("pretrain step ")]
    assert lines[0].startswith("pretrain step 1/3  loss ") and lines[-1].startswith(
        "pretrain step 3/3  loss "
    )
    assert "val " in lines[-1]  # the evaluation step shows the held-out loss
    first_loss = float(lines[0].split("loss ")[1].split()[0])
    assert first_loss == pytest.approx(_losses(tmp_path / "run")[0], abs=1e-4)


def _lrs(run: Path) -> list[float]:
    return [r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_resume_extends_a_run_and_says_what_the_lr_does(tmp_path, corpus, capsys):
    """`--resume RUN --steps N` extends a run. Inside the stable phase the extension is the N-step
    run exactly; past a decay already taken it is refused until --schedule-steps says what the lr
    does: hold the finished schedule's final lr, or re-warm to the N-step schedule."""
    cfg = dict(steps=8, warmup_steps=1, decay_fraction=0.5, eval_every=0)
    # stopped at step 2 of 8 (decay from step 4): extending to 12 (decay from 6) changes no lr taken
    run_pretrain(_cfg(tmp_path, corpus, out=str(tmp_path / "ext"), stop_at=2, **cfg))
    assert main(["pretrain", "--resume", str(tmp_path / "ext"), "--steps", "12", "--json"]) == 0
    run_pretrain(_cfg(tmp_path, corpus, out=str(tmp_path / "whole"), **{**cfg, "steps": 12}))
    assert _losses(tmp_path / "ext") == _losses(tmp_path / "whole")  # the 12-step run, exactly
    assert _lrs(tmp_path / "ext") == _lrs(tmp_path / "whole")

    # a finished 8-step run has decayed: extending needs --schedule-steps
    run_pretrain(_cfg(tmp_path, corpus, out=str(tmp_path / "done"), **cfg))
    capsys.readouterr()
    assert main(["pretrain", "--resume", str(tmp_path / "done"), "--steps", "12"]) == 2
    err = " ".join(capsys.readouterr().out.split())
    assert "--schedule-steps 8 keeps the finished schedule" in err and "--schedule-steps 12 re-warms" in err
    before = _lrs(tmp_path / "done")
    assert (
        main(["pretrain", "--resume", str(tmp_path / "done"), "--steps", "12", "--schedule-steps", "8"]) == 0
    )
    lrs = _lrs(tmp_path / "done")
    assert lrs[:8] == before and lrs[8:] == pytest.approx([1e-2 * 0.1] * 4)  # held at min_lr_ratio x lr
    # shortening is refused
    assert main(["pretrain", "--resume", str(tmp_path / "done"), "--steps", "10"]) == 2

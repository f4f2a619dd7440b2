"""Bad input to the `k2` command ends in one line naming the flag and what was expected, exit 2,
before anything slow happens (no traceback, no model allocated, no data tokenized)."""

from __future__ import annotations

import socket

import pytest
import torch

from k2_stack.cli import main


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out + out.err


def _one_line_error(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip() and "warning" not in ln]
    assert "Traceback" not in text, text
    assert len(lines) == 1, text
    return lines[0]


no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.mark.parametrize("command", ["pretrain", "sft", "rl"])
@no_cuda
def test_cuda_on_a_cpu_only_machine(command, tmp_path, capsys):
    code, text = _run([command, "--device", "cuda", "--out", str(tmp_path / "run")], capsys)
    assert code == 2
    line = _one_line_error(text)
    assert "--device cuda" in line and ("without CUDA" in line or "no CUDA device" in line)
    assert not (tmp_path / "run" / "state").exists()


@no_cuda
@pytest.mark.parametrize("command", ["serve", "chat"])
def test_cuda_on_a_cpu_only_machine_serving(command, capsys):
    code, text = _run([command, "--preset", "tiny", "--device", "cuda"], capsys)
    assert code == 2
    assert "--device cuda" in _one_line_error(text)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["pretrain", "--device", "tpu"], "device='tpu': expected auto, cpu, cuda or cuda:N"),
        (["pretrain", "--threads", "-1"], "threads=-1: expected >= 0"),
        (["sft", "--threads", "-2"], "threads=-2: expected >= 0"),
        (["rl", "--reward", "nope"], "reward='nope': expected one of code, instruction, math, rubric"),
        (["rl", "--threads", "-1"], "threads=-1"),
        (["rl", "--device", "gpu0"], "device='gpu0'"),
        (["serve", "--preset", "tiny", "--device", "tpu"], "--device 'tpu': expected auto, cpu, cuda"),
    ],
)
def test_bad_values_are_one_line(argv, needle, capsys):
    code, text = _run(argv, capsys)
    assert code == 2
    assert needle in _one_line_error(text)


@pytest.mark.parametrize(
    "body, needle",
    [
        ('batch = "two"', "batch = 'two': expected an integer"),
        ("lr = true", "lr = True: expected a number"),
        ('model_overrides = "big"', "expected a table/object"),
        ("init = 3", "init = 3: expected a string or null"),
    ],
)
def test_config_file_values_of_the_wrong_type(body, needle, tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text(body + "\n")
    code, text = _run(["sft", "--config", str(cfg)], capsys)
    assert code == 2
    line = _one_line_error(text)
    assert str(cfg) in line and needle in line


def test_a_preset_too_large_for_the_machine_is_refused_before_allocating(capsys):
    code, text = _run(["serve", "--preset", "kimi-k2"], capsys)
    assert code == 2
    line = _one_line_error(text)
    assert "--preset kimi-k2: 1,026.41B parameters need at least" in line and "GiB available" in line


def test_port_in_use_is_refused_before_the_model_loads(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, text = _run(["serve", "--preset", "tiny", "--port", str(port)], capsys)
    assert code == 2
    assert f"argument --port: cannot listen on 127.0.0.1:{port}" in _one_line_error(text)


def test_resume_refuses_another_out_dir(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"task": "pretrain", "steps": 4}')
    code, text = _run(["pretrain", "--resume", str(run), "--out", str(tmp_path / "other")], capsys)
    assert code == 2
    assert f"--out {tmp_path / 'other'} names another directory" in _one_line_error(text)


def test_warmup_longer_than_the_run_is_warned_by_name():
    from k2_train import PretrainConfig

    assert PretrainConfig.flat(steps=100, warmup_steps=10).warnings() == []
    (warning,) = PretrainConfig.flat(steps=10, warmup_steps=500).warnings()
    assert "warmup_steps=500 >= steps=10" in warning


def test_serve_and_chat_help_show_defaults(capsys):
    for command, needle in (("serve", "(default: 8000)"), ("chat", "(default: 256)")):
        code, text = _run([command, "--help"], capsys)
        assert code == 0 and needle in " ".join(text.split())  # help wraps lines

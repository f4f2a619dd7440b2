"""The `k2` command from outside: help for every subcommand, `python -m k2_stack`, and `k2 model stats`."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from k2_stack.cli import COMMANDS, build_parser, main

K2_TOTAL = 1_026_408_209_408
K2_ACTIVE = 32_861_477_888
V3_TOTAL = 671_026_404_352


def _subcommand_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path in the parser tree: ('model',), ('model', 'stats'), ..."""
    paths = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths.append(prefix + (name,))
                paths.extend(_subcommand_paths(sub, prefix + (name,)))
    return paths


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def _listed_commands(help_text: str) -> set[str]:
    """Names argparse lists under COMMAND (indented 4 spaces, then the name)."""
    return set(re.findall(r"^ {4}(\S+)", help_text, flags=re.M))


def test_help_lists_every_subcommand(capsys):
    code, out, _ = _run(["--help"], capsys)
    assert code == 0
    assert COMMANDS and _listed_commands(out) == set(COMMANDS)


@pytest.mark.parametrize("path", _subcommand_paths(build_parser()), ids="-".join)
def test_every_subcommand_has_help(path, capsys):
    code, out, _ = _run([*path, "--help"], capsys)
    assert code == 0
    assert out.startswith("usage: k2 " + " ".join(path))


def test_python_dash_m_k2_stack_help():
    r = subprocess.run(
        [sys.executable, "-m", "k2_stack", "--help"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert _listed_commands(r.stdout) == set(COMMANDS)


def test_model_stats_json_compare(capsys):
    code, out, _ = _run(
        ["model", "stats", "--preset", "kimi-k2", "--compare", "deepseek-v3", "--json"], capsys
    )
    assert code == 0
    obj = json.loads(out)
    assert obj["total_params"] == K2_TOTAL and obj["active_params"] == K2_ACTIVE
    assert obj["compare"]["total_params"] == V3_TOTAL
    assert (obj["context"], obj["ep"]) == (131072, 128)
    comps = {c["key"]: c for c in obj["comparisons"]}
    assert comps["ep_rank_expert_bytes"]["ours_a"] == 10_569_646_080
    assert (
        comps["ep_rank_expert_bytes"]["paper_a"] == 10e9 and comps["ep_rank_expert_bytes"]["paper_b"] == 7.5e9
    )
    assert comps["heads_prefill_flops"]["paper_change"] == pytest.approx(0.83)


def test_model_stats_tables(capsys):
    code, out, _ = _run(["model", "stats", "--preset", "kimi-k2", "--compare", "deepseek-v3"], capsys)
    assert code == 0
    for text in ("1,026,408,209,408", "671,026,404,352", "32,861,477,888", "+76.7%", "+86.5%", "+83.0%",
                 "10.57 GB", "7.663 GB", "7.5 GB", "70,272 B", "COST_MODEL.md"):  # fmt: skip
        assert text in out, text


def test_model_stats_context_and_default_ep(capsys):
    code, out, _ = _run(["model", "stats", "--preset", "tiny", "--context", "4096", "--json"], capsys)
    assert code == 0
    obj = json.loads(out)
    assert obj["ep"] == 16  # the default 128 is capped at tiny's 16 routed experts
    assert obj["flops_per_token"]["context"] == 4096


def test_model_stats_config_file(tmp_path, capsys):
    from k2_model import K2Config

    (tmp_path / "config.json").write_text(json.dumps(K2Config.preset("kimi-k2").to_hf()))
    code, out, _ = _run(["model", "stats", "--config", str(tmp_path), "--json"], capsys)
    assert code == 0
    assert json.loads(out)["total_params"] == K2_TOTAL


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--ep", "0"], "--ep"),
        (["--ep", "385"], "--ep"),
        (["--context", "0"], "--context"),
        (["--preset", "gpt-5"], "--preset"),
        (["--compare", "nope"], "--compare"),
        (["--config", "/nonexistent/config.json"], "/nonexistent/config.json"),
    ],
)
def test_model_stats_bad_arguments(argv, needle, capsys):
    code, _, err = _run(["model", "stats", *argv], capsys)
    assert code == 2
    assert needle in err

"""Flags generated from the run configs (k2_stack.config_flags): one per field, help from the field,
today's flat names kept, values applied over --config and defaults, nested configs flattened."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest
from k2_rl.config import RLConfig
from k2_train import PretrainConfig, SFTConfig
from k2_train.config import option

from k2_stack.cli import build_parser
from k2_stack.config_flags import add_config_flags, apply_overrides, config_overrides, flag_fields, get_flat

ROOT = Path(__file__).resolve().parents[1]

# The flags each command had when they were hand-written tables: the generated ones are a superset.
BEFORE = {
    "pretrain": "--activation-checkpointing --adamw-lr --attention --batch --config --data --decay-fraction "
    "--device --document-mask --dtype --ep --eval-every --grad-clip --json --lr --max-corpus-mb "
    "--micro-batch --ns-dtype --optimizer --out --preset --resume --save-every --seed --seq-len --steps "
    "--stop-at --tau --threads --tokenizer --val-fraction --warmup-steps --weight-decay",
    "sft": "--activation-checkpointing --adamw-lr --attention --batch --config --data --decay-fraction "
    "--device --document-mask --dtype --ep --eval-every --grad-clip --init --json --lr --micro-batch "
    "--ns-dtype --optimizer --out --packing --preset --resume --save-every --seed --seq-len --steps "
    "--stop-at --tau --threads --tokenizer --val-fraction --warmup-steps --weight-decay",
    "rl": "--adamw-lr --config --critic-model --critic-refine-pairs --critic-url --device --ep --eval-every "
    "--eval-prompts --free-rollout-cache --heldout --init --iterations --json --kl-every --loss --lr "
    "--max-response-tokens --micro-prompts --ns-dtype --optimizer --out --preset --prompt-sharing "
    "--prompts-per-iteration --ptx-coef --ptx-data --resume --reward --reward-workers --rl-tau --rollout "
    "--rollout-threads --rubric-aggregation --rubric-dir --samples-per-prompt --save-every --seed "
    "--stop-at --tasks --tau --temperature --temperature-end --threads --truncation-penalty "
    "--updates-per-iteration",
}
CONFIGS = {"pretrain": PretrainConfig, "sft": SFTConfig, "rl": RLConfig}


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_every_field_has_a_flag_with_its_help_and_old_names_stay(command):
    sub, cls = _subparser(command), CONFIGS[command]
    options = {s for a in sub._actions for s in a.option_strings}
    dests = {a.dest: a for a in sub._actions}
    for name, (path, _, meta) in flag_fields(cls).items():  # every leaf, nested ones included
        assert meta.get("help"), f"{cls.__name__}.{'.'.join(path)} has no help text"
        if meta.get("flag", True):
            assert "--" + name.replace("_", "-") in options, name
            assert meta["help"] in dests[name].help
    assert set(BEFORE[command].split()) <= options, set(BEFORE[command].split()) - options


def test_flags_apply_over_the_config_file_and_defaults(tmp_path):
    from k2_stack.commands.training import build_config

    args = _subparser("pretrain").parse_args([])
    assert build_config(args, PretrainConfig) == PretrainConfig()  # no flag: the defaults exactly
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"lr": 0.5, "steps": 7, "document_mask": True}))
    args = _subparser("pretrain").parse_args(
        [
            "--config",
            str(f),
            "--steps",
            "9",
            "--no-document-mask",
            "--model-overrides",
            '{"n_routed_experts": 8}',
        ]
    )
    cfg = build_config(args, PretrainConfig)
    assert (cfg.optim.lr, cfg.steps, cfg.dataset.document_mask, cfg.model.model_overrides) == (
        0.5,
        9,
        False,
        {"n_routed_experts": 8},
    )
    with pytest.raises(SystemExit):  # not a JSON object: refused by argparse, naming the flag
        _subparser("pretrain").parse_args(["--model-overrides", "[1, 2]"])
    with pytest.raises(SystemExit):
        _subparser("rl").parse_args(["--loss", "ppo"])  # choices come from the field


def test_rl_flags_reach_fields_that_had_none():
    from k2_stack.commands.rl import build_config

    args = _subparser("rl").parse_args(["--top-p", "0.9", "--weight-decay", "0.05", "--ns-dtype", "fp32"])
    cfg = build_config(args)
    assert (cfg.rollouts.top_p, cfg.optim.weight_decay, cfg.optim.ns_dtype) == (0.9, 0.05, "fp32")
    assert "dtype" not in vars(args)  # RLConfig.dtype is not read by k2 rl: no flag that does nothing


@dataclasses.dataclass
class _Optim:
    lr: float = option(0.1, "learning rate")
    ns_dtype: str = option("auto", "NS dtype", choices=("auto", "fp32"))


@dataclasses.dataclass
class _Task:
    steps: int = option(3, "steps")
    optim: _Optim = option(default_factory=_Optim, help="the optimizer")
    verbose: bool = option(False, "talk")


def test_nested_configs_get_flat_flags():
    p = argparse.ArgumentParser()
    add_config_flags(p, _Task)
    args = p.parse_args(["--lr", "0.5", "--verbose"])
    overrides = config_overrides(args, _Task)
    assert overrides == {"lr": 0.5, "verbose": True}
    cfg = apply_overrides(_Task(), overrides)
    assert cfg == _Task(steps=3, optim=_Optim(lr=0.5), verbose=True)
    assert get_flat(cfg, "lr") == 0.5 and get_flat(cfg, ("optim", "ns_dtype")) == "auto"
    with pytest.raises(ValueError, match="unknown field"):
        apply_overrides(_Task(), {"momentum": 0.9})

    @dataclasses.dataclass
    class Clash:
        lr: float = option(0.2, "another lr")
        optim: _Optim = option(default_factory=_Optim, help="the optimizer")

    with pytest.raises(TypeError, match="two config fields are named 'lr'"):
        flag_fields(Clash)

    @dataclasses.dataclass
    class Ambiguous:  # a file's {"optim": ...} could mean either
        optim: _Optim = option(default_factory=_Optim, help="the optimizer")
        other: _Other = option(default_factory=lambda: _Other(), help="more")

    with pytest.raises(TypeError, match="optim names both a component and a field"):
        flag_fields(Ambiguous)
    titles = {g.title: {a.dest for a in g._group_actions} for g in p._action_groups}
    assert titles["optim"] == {"lr", "ns_dtype"}  # --help lists a component's flags under its name


@dataclasses.dataclass
class _Other:
    optim: str = option("x", "a field named like a component")


def test_a_field_without_help_is_refused():
    with pytest.raises(ValueError, match="help"):
        option(1)


# Every field's default as the flat configs declared them, before they were composed of component
# configs (written by `PretrainConfig().to_dict()` etc. at commit fb71228).
DEFAULTS_BEFORE = json.loads((ROOT / "tests" / "fixtures" / "config_defaults.json").read_text())


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_composed_configs_keep_every_default_and_their_flat_file_form(command):
    cls = CONFIGS[command]
    now = cls().to_dict()
    before = DEFAULTS_BEFORE[command]
    assert {k: now[k] for k in before} == before  # SFT's seq_len 1024, RL's lr 2e-4, ... kept
    # fields added since, each defaulting to the old behaviour: pretraining's --init (ModelSpec's),
    # --qat (INT4 quantisation-aware training, off by default), RL's --routing-replay (off)
    assert set(now) - set(before) <= {"init", "qat", "routing_replay"}
    assert cls.from_dict(before) == cls()  # a stored flat config.json loads


def test_task_configs_nest_the_components_of_the_packages_that_build_them():
    from k2_data.config import DataConfig
    from k2_model.spec import ModelSpec
    from k2_optim.config import TASK_QK_CLIP_TAU, OptimConfig, WSDConfig
    from k2_rl.config import LossConfig, RewardConfig, RolloutConfig, RubricConfig

    cfg, rl = SFTConfig(), RLConfig()
    assert (type(cfg.model), type(cfg.optim), type(cfg.schedule)) == (ModelSpec, OptimConfig, WSDConfig)
    assert isinstance(cfg.dataset, DataConfig)
    assert (cfg.dataset.seq_len, cfg.dataset.packing, cfg.dataset.document_mask) == (1024, "whole", True)
    assert [type(c) for c in (rl.objective, rl.rollouts, rl.rewards, rl.rubric)] == [
        LossConfig,
        RolloutConfig,
        RewardConfig,
        RubricConfig,
    ]
    # one QK-Clip default for every task, distinct from MuonClip's K2-scale 100
    assert PretrainConfig().optim.tau == SFTConfig().optim.tau == rl.optim.tau == TASK_QK_CLIP_TAU == 30.0
    # the same concept is one field: RL's optimizer and model are the components pretraining uses
    assert flag_fields(RLConfig)["lr"][0] == ("optim", "lr") == flag_fields(PretrainConfig)["lr"][0]


def test_from_dict_reads_flat_and_nested_forms_and_names_bad_keys():
    flat = {"lr": 0.5, "seq_len": 64, "warmup_steps": 3, "preset": "tiny", "steps": 9}
    nested = {"optim": {"lr": 0.5}, "dataset": {"seq_len": 64}, "schedule": {"warmup_steps": 3}, "steps": 9}
    a, b = PretrainConfig.from_dict(flat), PretrainConfig.from_dict(nested)
    assert a == b == PretrainConfig.flat(lr=0.5, seq_len=64, warmup_steps=3, steps=9)
    assert (a.optim.lr, a.dataset.seq_len, a.schedule.warmup_steps, a.steps) == (0.5, 64, 3, 9)
    assert PretrainConfig.from_dict(a.to_dict()) == a  # the stored (flat) form round-trips
    problems = {
        "c.json: lr = 'fast': expected a number": {"lr": "fast"},
        "c.json: optim.lr = 'fast': expected a number": {"optim": {"lr": "fast"}},
        "c.json: dataset.seq_len = 1.5: expected an integer": {"dataset": {"seq_len": 1.5}},
        "c.json: unknown field(s) optim.seq_len": {"optim": {"seq_len": 8}},
        "c.json: unknown field(s) momentum": {"momentum": 0.9},
        "c.json: lr is given twice (lr and optim.lr)": {"lr": 1.0, "optim": {"lr": 2.0}},
        "c.json: optim = 3: expected a table/object": {"optim": 3},
    }
    for message, d in problems.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            PretrainConfig.from_dict(d, source="c.json")
    with pytest.raises(ValueError, match="unknown field"):
        RLConfig.flat(top_k=5)


def test_a_nested_config_file_runs_through_the_command(tmp_path):
    from k2_stack.commands.rl import build_config

    f = tmp_path / "rl.toml"
    f.write_text(
        "iterations = 3\n[rl.objective]\nrl_tau = 0.25\n[rl.rollouts]\ntop_p = 0.5\n".replace("[rl.", "[")
    )
    args = _subparser("rl").parse_args(["--config", str(f), "--rl-tau", "0.5"])
    cfg = build_config(args)
    assert (cfg.iterations, cfg.objective.rl_tau, cfg.rollouts.top_p) == (3, 0.5, 0.5)

"""Flags generated from the run configs (k2_stack.config_flags): one per field, help from the field,
today's flat names kept, values applied over --config and defaults, nested configs flattened."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
from k2_rl.config import RLConfig
from k2_train import PretrainConfig, SFTConfig
from k2_train.config import option

from k2_stack.cli import build_parser
from k2_stack.config_flags import add_config_flags, apply_overrides, config_overrides, flag_fields, get_flat

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
    for f in dataclasses.fields(cls):
        meta = flag_fields(cls)[f.name][2]
        assert meta.get("help"), f"{cls.__name__}.{f.name} has no help text"
        if meta.get("flag", True):
            assert "--" + f.name.replace("_", "-") in options, f.name
            assert meta["help"] in dests[f.name].help
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
    assert (cfg.lr, cfg.steps, cfg.document_mask, cfg.model_overrides) == (
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
    assert (cfg.top_p, cfg.weight_decay, cfg.ns_dtype) == (0.9, 0.05, "fp32")
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


def test_a_field_without_help_is_refused():
    with pytest.raises(ValueError, match="help"):
        option(1)

"""`k2 pretrain`: flags and rendering around k2_train.run_training (the loop lives in k2-train)."""

from __future__ import annotations

import argparse

from k2_stack.commands import training


def register(sub: argparse._SubParsersAction) -> None:
    from k2_train import PretrainConfig

    p = sub.add_parser(
        "pretrain",
        help="pretrain a K2-architecture model with MuonClip on the embedded default data",
        description="Pretrain a K2-architecture model (MuonClip, WSD schedule, aux-loss-free balancing). "
        "Writes metrics.jsonl, plots, the tokenizer and the atomic train state into --out.",
    )
    training.add_common_flags(p, PretrainConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from k2_train import PretrainConfig

    return training.run(args, PretrainConfig)

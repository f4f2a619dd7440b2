"""`k2 sft`: supervised fine-tuning on chat data (flags and rendering; the loop is k2-train's)."""

from __future__ import annotations

import argparse

from k2_stack.commands import training


def register(sub: argparse._SubParsersAction) -> None:
    from k2_train import SFTConfig

    p = sub.add_parser(
        "sft",
        help="supervised fine-tuning on chat data (loss on assistant turns only)",
        description="Fine-tune a K2-architecture model on conversations in the Kimi chat format, with the "
        "loss on assistant turns and their tool calls only. Same loop, train state, resume and metrics as "
        "`k2 pretrain`; `k2 export RUN --out DIR` then `k2 serve --model DIR` serves the result.",
    )
    training.add_common_flags(p, SFTConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from k2_train import SFTConfig

    return training.run(args, SFTConfig)

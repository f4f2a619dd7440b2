"""The `k2` command: argument parsing and dispatch only.

Each subcommand lives in `k2_stack.commands.<name>` and exposes
`register(subparsers) -> None`, which adds its parser and sets `func` (called with the parsed
namespace, returning an exit code). Logic belongs in the packages, not here.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `k2 --help` lists them.
COMMANDS = ["model", "data", "pretrain", "sft", "rl", "export", "ckpt", "serve", "chat"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k2",
        description="Kimi K2's training system: model, optimizer, data, RL and checkpoint engine.",
    )
    from k2_stack import __version__

    parser.add_argument("--version", action="version", version=f"k2-stack {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"k2_stack.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

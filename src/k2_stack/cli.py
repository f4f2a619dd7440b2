"""The `k2` command: argument parsing and dispatch only.

Each subcommand lives in `k2_stack.commands.<name>` and exposes
`register(subparsers) -> None`, which adds its parser and sets `func` (called with the parsed
namespace, returning an exit code). Logic belongs in the packages, not here.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help already speaks of its default or
    there is none worth showing (None, False, a suppressed default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default in (None, False, argparse.SUPPRESS)
            or not action.option_strings
            or action.nargs == 0
        ):
            return text
        return f"{text} (default: {default})"


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


# Errors that mean "the input was wrong", not "k2 has a bug": one line naming what was wrong,
# exit 2 (argparse's code for bad usage). K2_DEBUG=1 shows the traceback instead.
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    finally:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # a torchrun rank: free what the run left in reference cycles (FSDP2 modules, device
            # meshes and their gloo process group) while the interpreter is alive, so the group's
            # threads are joined here and not in static destructors at exit, where one now and
            # then aborted a rank after a finished run (SIGABRT; docs/training.md)
            import gc

            gc.collect()


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        if os.environ.get("K2_DEBUG") == "1":
            raise
        print(f"k2 {args.command}: {e} (K2_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # commands that save on Ctrl-C handle it themselves
        print(f"k2 {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

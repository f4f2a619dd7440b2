"""`k2 data ...`: tokenize corpora into Arrow shards, train a tokenizer, inspect a tokenized dataset,
tokenize SFT chats, rephrase documents and synthesize agentic tool-use data through an LLM endpoint.

k2 data tokenize [INPUT ...] --out DIR [--tokenizer PATH] [--text-field text] [--format arrow|parquet]
                 [--workers N] [--on-error fail|skip] [--shard-mb 16] [--engine auto|hf]
k2 data train-tokenizer [INPUT ...] --out DIR [--vocab-size 8192]
k2 data inspect DIR [--seq-len 256] [--show 1]
k2 data sft INPUT... --out DIR [--tokenizer PATH] [--workers N] [--on-error skip|fail]
            [--messages-field messages] [--tools-field tools] [--format arrow|parquet] [--shard-mb 16]
k2 data tooluse-example --out DIR [--n-train 2000] [--n-heldout 200] [--seed 0]
k2 data rephrase [INPUT ...] --out DIR --base-url URL --model NAME [--rounds N] [--mode knowledge|math]
k2 data agentic --out DIR --base-url URL --model NAME [--mcp-server NAME|CMD ...] [--tools-json FILE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "data",
        help="data: tokenize corpora (text or SFT chat), train a tokenizer, rephrase, synthesize agentic data",
        description="Data pipeline commands (k2-data).",
    )
    sub = parser.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    sub.required = True

    tok = sub.add_parser(
        "tokenize",
        help="tokenize text/JSONL/Parquet/Arrow inputs into shards plus manifest.json",
        description=(
            "Tokenize inputs (text files, directories, JSONL, Parquet, Arrow IPC) into shards with one row "
            "per document (input_ids list<int32>, doc_id, source) and a manifest.json. Resumable: rerun the "
            "same command and completed shards are kept. With no INPUT, the default corpus (this "
            "interpreter's standard library source) is used."
        ),
    )
    tok.add_argument(
        "inputs", nargs="*", metavar="INPUT", help="files or directories (default: the stdlib corpus)"
    )
    tok.add_argument("--out", required=True, type=Path, help="output directory")
    tok.add_argument(
        "--tokenizer", help="tokenizer dir or tokenizer.json (default: k2-data's bundled 8192-id BPE)"
    )
    tok.add_argument(
        "--text-field", default="text", help="field/column holding the text in JSONL/Parquet/Arrow"
    )
    tok.add_argument("--format", choices=["arrow", "parquet"], default="arrow", help="shard format")
    tok.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="processes")
    tok.add_argument(
        "--on-error",
        choices=["fail", "skip"],
        default="fail",
        help="a bad record fails the run (default) or is skipped and listed in the manifest",
    )
    tok.add_argument("--shard-mb", type=float, default=16.0, help="text per shard, in MiB")
    tok.add_argument(
        "--engine",
        choices=["auto", "hf"],
        default="auto",
        help="auto: the BPE's tiktoken engine (about 5x faster; every 64th document checked "
        "against HF tokenizers), hf: HF tokenizers only",
    )
    tok.set_defaults(func=run_tokenize)

    train = sub.add_parser(
        "train-tokenizer",
        help="train a byte-level BPE with K2's 256 reserved special tokens",
        description=(
            "Train a byte-level BPE (HF tokenizers, the Kimi split pattern) whose last 256 ids are K2's "
            "reserved special tokens at K2's offsets. With no INPUT, trains on the default corpus."
        ),
    )
    train.add_argument("inputs", nargs="*", metavar="INPUT", help="text files or directories")
    train.add_argument(
        "--out", required=True, type=Path, help="output directory (tokenizer.json + tokenizer_config.json)"
    )
    train.add_argument("--vocab-size", type=int, default=8192, help="total ids, including the 256 specials")
    train.set_defaults(func=run_train_tokenizer)

    insp = sub.add_parser(
        "inspect",
        help="summarise a tokenized dataset and decode a packed sample",
        description="Print a tokenized dataset's manifest summary and decode its first packed sample.",
    )
    insp.add_argument("dir", type=Path, help="a directory written by `k2 data tokenize`")
    insp.add_argument("--seq-len", type=int, default=128, help="sample length to pack and show")
    insp.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    insp.set_defaults(func=run_inspect)

    sft = sub.add_parser(
        "sft",
        help="tokenize chat conversations (JSONL/Parquet/Arrow) into SFT shards with a loss mask",
        description=(
            'Tokenize chat records {"messages": [...], "tools": [...]} (OpenAI format, tool calls included) '
            "in the Kimi K2 chat format into shards with one row per conversation (input_ids list<int32>, "
            "loss_mask list<uint8>: 1 on assistant turns, doc_id, source) and a manifest.json with "
            '"kind": "chat". Records that are not valid JSON, lack messages or fail validation (unanswered '
            "tool calls, undeclared functions, arguments that are not a JSON object, no assistant turn, ...) "
            "are listed with file:line and skipped (or fail the run with --on-error fail). Resumable."
        ),
    )
    sft.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="JSONL, Parquet or Arrow files, or directories of them"
    )
    sft.add_argument("--out", required=True, type=Path, help="output directory")
    sft.add_argument(
        "--tokenizer", help="tokenizer dir or tokenizer.json (default: k2-data's bundled 8192-id BPE)"
    )
    sft.add_argument("--messages-field", default="messages", help="field/column holding the messages list")
    sft.add_argument(
        "--tools-field", default="tools", help="field/column holding the tools list (optional per record)"
    )
    sft.add_argument("--format", choices=["arrow", "parquet"], default="arrow", help="shard format")
    sft.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="processes")
    sft.add_argument(
        "--on-error",
        choices=["skip", "fail"],
        default="skip",
        help="a bad record is skipped and listed (default) or fails the run",
    )
    sft.add_argument("--shard-mb", type=float, default=16.0, help="input per shard, in MiB")
    sft.add_argument(
        "--chat-template",
        choices=["k2", "kimi-k2-instruct-0905", "kimi-k2-thinking"],  # k2_data.chat.TEMPLATES (kept light)
        default="k2",
        help="chat template: k2's own rendering (default) or one of Moonshot's released templates, byte-exact",
    )
    sft.add_argument(
        "--no-normalize-ids",
        dest="normalize_ids",
        action="store_false",
        help="keep tool-call ids as written (default: rename them to functions.NAME:IDX, as K2 was trained)",
    )
    sft.set_defaults(func=run_sft)

    ex = sub.add_parser(
        "tooluse-example",
        help="write the generated tool-use SFT set (train.jsonl + heldout.jsonl)",
        description=(
            "Write k2-data's deterministic, generated tool-use SFT set: calculator, unit conversion, weather "
            "and time tools plus no-tool chit-chat. train.jsonl holds whole conversations (tokenize them with "
            '`k2 data sft`); heldout.jsonl holds prompts (system + user) with a "reference" call or null.'
        ),
    )
    ex.add_argument("--out", required=True, type=Path, help="output directory")
    ex.add_argument("--n-train", type=int, default=2000, help="training conversations")
    ex.add_argument("--n-heldout", type=int, default=200, help="held-out prompts")
    ex.add_argument("--seed", type=int, default=0, help="generator seed (same seed, same bytes)")
    ex.set_defaults(func=run_tooluse_example)

    _register_rephrase(sub)
    _register_agentic(sub)


def _register_rephrase(sub: argparse._SubParsersAction) -> None:
    """`k2 data rephrase`: the arguments and the run live in k2_data.rephrase.cli (thin entrypoint)."""
    from k2_data.rephrase.cli import DESCRIPTION, add_arguments

    reph = sub.add_parser(
        "rephrase",
        help="rewrite documents with an LLM endpoint (styles, math learning notes), checked for fidelity",
        description=DESCRIPTION,
    )
    add_arguments(reph)
    reph.set_defaults(func=run_rephrase)


def _register_agentic(sub: argparse._SubParsersAction) -> None:
    """`k2 data agentic`: the arguments and the run live in k2_data.agentic.cli (thin entrypoint)."""
    from k2_data.agentic.cli import DESCRIPTION, add_arguments

    ag = sub.add_parser(
        "agentic",
        help="synthesize multi-turn tool-use SFT data (MCP tools, agents, tasks, rubrics, simulators, judge)",
        description=DESCRIPTION,
    )
    add_arguments(ag)
    ag.set_defaults(func=run_agentic)


def run_agentic(args: argparse.Namespace) -> int:
    from k2_data.agentic.cli import run

    return run(args)


def run_rephrase(args: argparse.Namespace) -> int:
    from k2_data.rephrase.cli import run

    return run(args)


def run_tokenize(args: argparse.Namespace) -> int:
    from k2_data import TokenizeConfig, tokenize_corpus
    from rich.console import Console

    console = Console(stderr=True)
    cfg = TokenizeConfig(
        text_field=args.text_field,
        format=args.format,
        workers=args.workers,
        on_error=args.on_error,
        shard_bytes=max(1, int(args.shard_mb * 2**20)),
        engine=args.engine,
    )
    what = ", ".join(args.inputs) if args.inputs else "the default corpus (Python stdlib source)"
    print(
        f"tokenizing {what} -> {args.out} ({cfg.format}, {cfg.workers} workers, "
        f"tokenizer {args.tokenizer or 'k2-data default BPE'})",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    manifest = _with_shard_progress(
        console,
        "tokenize",
        lambda on_shard: tokenize_corpus(
            args.inputs or None, args.out, tokenizer=args.tokenizer, config=cfg, progress=on_shard
        ),
    )
    if manifest is None:
        return 1
    dt = time.perf_counter() - t0
    _print_skipped(manifest, limit=20)
    print(
        f"{manifest['num_docs']} documents, {manifest['num_tokens']} tokens in {len(manifest['shards'])} shards "
        f"({manifest['resumed_shards']} kept from an earlier run), {manifest['num_skipped']} skipped, "
        f"{manifest['num_tokens'] / max(dt, 1e-9):,.0f} tokens/s"
    )
    print(f"wrote {args.out}")
    return 0


def _with_shard_progress(console, label: str, run) -> dict | None:
    """`run(on_shard)` (a tokenize call) under a transient shards progress bar; its manifest, or
    None after printing a one-line error for bad input."""
    from k2_data import BadRecordError
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("shards"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(label, total=None)
        try:
            return run(lambda done, total, meta: progress.update(task, completed=done, total=total))
        except (BadRecordError, ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return None


def _print_skipped(manifest: dict, limit: int = 10) -> None:
    for rec in manifest["skipped"][:limit]:
        print(f"skipped {rec['file']}:{rec['where']}: {rec['reason']}", file=sys.stderr)
    if manifest["num_skipped"] > limit:
        print(f"... {manifest['num_skipped'] - limit} more skipped records in manifest.json", file=sys.stderr)


def run_sft(args: argparse.Namespace) -> int:
    from k2_data.sft import ChatTokenizeConfig, tokenize_chat
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    try:
        cfg = ChatTokenizeConfig(
            messages_field=args.messages_field,
            tools_field=args.tools_field,
            format=args.format,
            workers=args.workers,
            on_error=args.on_error,
            shard_bytes=max(1, int(args.shard_mb * 2**20)),
            template=args.chat_template,
            normalize_ids=args.normalize_ids,
        )
        cfg.validate()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"tokenizing chat records from {', '.join(args.inputs)} -> {args.out} ({cfg.format}, {cfg.workers} workers, "
        f"on error: {cfg.on_error}, tokenizer {args.tokenizer or 'k2-data default BPE'})",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    manifest = _with_shard_progress(
        console,
        "sft",
        lambda on_shard: tokenize_chat(
            args.inputs, args.out, tokenizer=args.tokenizer, config=cfg, progress=on_shard
        ),
    )
    if manifest is None:
        return 1
    dt = time.perf_counter() - t0
    _print_skipped(manifest)
    table = Table(title="k2 data sft", show_header=False)
    table.add_column("what", justify="right")
    table.add_column("value")
    for what, value in [
        ("conversations", f"{manifest['num_docs']:,}"),
        ("tokens", f"{manifest['num_tokens']:,}"),
        (
            "trained tokens (mask 1)",
            (
                f"{manifest['num_trained_tokens']:,} "
                f"({manifest['num_trained_tokens'] / max(manifest['num_tokens'], 1):.1%})"
            ),
        ),
        ("skipped records", f"{manifest['num_skipped']:,}"),
        ("shards", f"{len(manifest['shards'])} ({manifest['resumed_shards']} kept from an earlier run)"),
        ("seconds", f"{dt:.2f}"),
    ]:
        table.add_row(what, value)
    Console().print(table)
    print(
        f"{manifest['num_docs']} conversations, {manifest['num_tokens']} tokens, "
        f"{manifest['num_trained_tokens']} trained, {manifest['num_skipped']} skipped"
    )
    print(f"wrote {args.out}")
    return 0


def run_tooluse_example(args: argparse.Namespace) -> int:
    from k2_data.examples.tooluse import write_tooluse_dataset

    print(
        f"generating the tool-use SFT set (seed {args.seed}): {args.n_train} train, {args.n_heldout} held-out "
        f"-> {args.out}",
        file=sys.stderr,
    )
    try:
        counts = write_tooluse_dataset(
            args.out, n_train=args.n_train, n_heldout=args.n_heldout, seed=args.seed
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(", ".join(f"{k} {v}" for k, v in counts.items() if not isinstance(v, dict)))
    print(f"wrote {args.out}")
    return 0


def run_train_tokenizer(args: argparse.Namespace) -> int:
    from k2_data.train_tokenizer import train_on_files

    what = ", ".join(args.inputs) if args.inputs else "the default corpus (Python stdlib source)"
    print(f"training a {args.vocab_size}-id byte-level BPE on {what}", file=sys.stderr)
    try:
        tok = train_on_files(args.inputs or None, vocab_size=args.vocab_size)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tok.save(args.out)
    print(
        f"{tok.num_base_tokens} BPE ids + 256 special ids (EOS = {tok.eos_id}), sha256 {tok.fingerprint()[:16]}"
    )
    print(f"wrote {args.out}")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from k2_data import PackedDataset, load_manifest, load_tokenizer

    try:
        manifest = load_manifest(args.dir)
        ds = PackedDataset(args.dir, seq_len=args.seq_len, shuffle=False)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    summary = {
        "dir": str(args.dir),
        "format": manifest["format"],
        "tokenizer": manifest["tokenizer"],
        "documents": manifest["num_docs"],
        "tokens": manifest["num_tokens"],
        "shards": len(manifest["shards"]),
        "skipped": manifest["num_skipped"],
        f"samples_of_{args.seq_len}": len(ds),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    for k, v in summary.items():
        print(f"{k:>16}: {v if k != 'tokenizer' else v['kind'] + ', vocab ' + str(v['vocab_size'])}")
    tok = load_tokenizer(args.dir / manifest["tokenizer"].get("path", "tokenizer"))
    print(f"--- first packed sample ({args.seq_len} tokens) ---")
    print(tok.decode(ds[0]["input_ids"].tolist()))
    return 0

"""Command line of the rephrasing pipeline: `k2 data rephrase ...` and `python -m k2_data.rephrase ...`.

The arguments live here, next to the pipeline, so the `k2` command stays a thin registration and a
pip-installed k2-data runs the same pipeline without the monorepo.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from k2_data.rephrase.fidelity import FidelityConfig
from k2_data.rephrase.pipeline import MAX_ROUNDS, RephraseConfig, rephrase

DESCRIPTION = (
    "Rephrase documents with an OpenAI-compatible endpoint (k2 serve, vLLM, SGLang, a hosted API): each "
    "document is cut into ~256-token chunks on sentence boundaries, each chunk rewritten given the preceding "
    "source and rewrite in a style chosen per document and round from the prompt library, and every rewrite "
    "checked against its source (numbers, formulas, named entities, MiniLM similarity, an optional LLM judge); "
    "a failing chunk is resampled, then keeps its source text. DIR gets shards with a `text` column plus "
    "provenance, which `k2 data tokenize DIR` reads. --mode math writes learning notes and translates "
    "non-English math into English. Resumable: rerun the same command after a crash or kill. Every answer is "
    "cached, so a rerun pays for nothing twice. With no INPUT, the small shipped corpus is used."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="text/JSONL/Parquet/Arrow files or dirs (default: shipped corpus)",
    )
    p.add_argument(
        "--out", required=True, type=Path, help="output directory (shards + .k2-rephrase/ bookkeeping)"
    )
    p.add_argument("--base-url", required=True, help="API root, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="model name sent with each request")
    p.add_argument(
        "--rounds", type=int, default=1, help=f"rephrasings per document, 1..{MAX_ROUNDS} (default 1)"
    )
    p.add_argument(
        "--mode",
        choices=["knowledge", "math"],
        default="knowledge",
        help="knowledge: style/perspective rewrites; math: learning notes, non-English math translated to English",
    )
    p.add_argument("--math-notes", action="store_true", help="same as --mode math")
    p.add_argument(
        "--text-field", default="text", help="field/column holding the text in JSONL/Parquet/Arrow"
    )
    p.add_argument("--format", choices=["parquet", "arrow"], default="parquet", help="shard format")
    p.add_argument("--chunk-tokens", type=int, default=256, help="chunk size in tokens")
    p.add_argument("--tokenizer", help="count chunk tokens with this tokenizer (default: words x 4/3)")
    p.add_argument("--prompts", help="directory of *.txt prompt files replacing the shipped library")
    p.add_argument("--seed", type=int, default=0, help="prompt choice and request seeds")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, help="per chunk request (default 2 x chunk tokens + 64)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument(
        "--reject-retries",
        type=int,
        default=1,
        help="resamples after a failed check before keeping the source",
    )
    p.add_argument(
        "--min-similarity",
        type=float,
        default=0.7,
        help="MiniLM cosine threshold; 0 skips the embedding model",
    )
    p.add_argument(
        "--min-entity-recall", type=float, default=0.9, help="share of source entities a rewrite must keep"
    )
    p.add_argument(
        "--allow-added-numbers", action="store_true", help="accept numbers that are not in the source"
    )
    p.add_argument(
        "--judge-model", help="also ask this model (same endpoint) PASS/FAIL for each passing chunk"
    )
    p.add_argument("--shard-docs", type=int, default=256, help="documents per shard")
    p.add_argument("--limit", type=int, help="only the first N documents")
    p.add_argument("--cache", type=Path, help="request cache file (default DIR/.k2-rephrase/cache.sqlite)")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the API key")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request before a retry")
    p.add_argument("--max-retries", type=int, default=4, help="retries on 429/5xx/timeouts, with backoff")
    p.add_argument(
        "--overwrite", action="store_true", help="discard shards of an earlier run with other settings"
    )
    p.add_argument(
        "--max-failed-fraction",
        type=float,
        default=0.1,
        help="exit 1 when more than this fraction of this run's chunk requests failed (4xx: wrong "
        "--model, a refused request); the source text is kept for them (default 0.1)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")


def run(args: argparse.Namespace) -> int:
    from k2_data.agent.client import EndpointError

    try:
        config = RephraseConfig(
            model=args.model,
            rounds=args.rounds,
            mode="math" if args.math_notes else args.mode,
            chunk_tokens=args.chunk_tokens,
            seed=args.seed,
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            reject_retries=args.reject_retries,
            fidelity=FidelityConfig(
                min_similarity=args.min_similarity,
                min_entity_recall=args.min_entity_recall,
                allow_added_numbers=args.allow_added_numbers,
            ),
            judge_model=args.judge_model,
            prompts_dir=args.prompts,
            text_field=args.text_field,
            format=args.format,
            shard_docs=args.shard_docs,
            concurrency=args.concurrency,
            limit=args.limit,
            tokenizer=args.tokenizer,
        )
        config.validate()
        if not 0 <= args.max_failed_fraction <= 1:
            raise ValueError(
                f"--max-failed-fraction {args.max_failed_fraction}: expected a fraction in [0, 1]"
            )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = ", ".join(args.inputs) if args.inputs else f"the shipped {config.mode} corpus"
    print(
        f"rephrasing {what} -> {args.out} with {config.model} at {args.base_url} ({config.mode}, {config.rounds} "
        f"round(s), {config.chunk_tokens}-token chunks, concurrency {config.concurrency})",
        file=sys.stderr,
    )
    try:
        manifest = rephrase(
            args.inputs or None,
            args.out,
            base_url=args.base_url,
            config=config,
            api_key=os.environ.get(args.api_key_env) or None,
            cache=args.cache,
            timeout_s=args.timeout,
            max_retries=args.max_retries,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EndpointError as e:
        print(f"error: {e}\n(rerun the same command to resume)", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(manifest, indent=2))
    else:
        _summary(manifest)
    print(f"wrote {args.out}")
    problem = run_problem(manifest, args.max_failed_fraction)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    return 0


def run_problem(m: dict, max_failed_fraction: float) -> str | None:
    """Why a finished run is a failure (nothing was read, or too many requests failed), or None."""
    skipped = m.get("skipped") or []
    if m["documents"] == 0:
        why = "; ".join(f"{r['file']}:{r['where']}: {r['reason']}" for r in skipped[:3])
        return "no documents to rephrase" + (
            f" ({len(skipped)} input record(s) skipped: {why})" if why else ""
        )
    requested = m["chunks"] - m["chunks_resumed"]
    failed = m.get("chunks_request_failed", 0)
    if requested > 0 and failed > max_failed_fraction * requested:
        return (
            f"{failed} of {requested} chunk requests failed (more than --max-failed-fraction "
            f"{max_failed_fraction}); the server said: {m.get('first_request_error')}"
        )
    return None


def _summary(m: dict) -> None:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    cl = m["client"]
    rows = [
        ("documents x rounds", f"{m['documents']} ({m['documents_resumed']} done before this run)"),
        ("chunks", f"{m['chunks']} ({m['chunks_resumed']} from the journal)"),
        ("accepted first try / final", f"{pct(m['pass_rate_first_attempt'])} / {pct(m['pass_rate_final'])}"),
        ("kept source text", str(m["chunks_kept_source"])),
        (
            "requests failed",
            f"{m.get('chunks_request_failed', 0)}"
            + (f" (first: {m['first_request_error']})" if m.get("first_request_error") else ""),
        ),
        ("input records skipped", str(len(m.get("skipped") or []))),
        ("rejections", ", ".join(f"{k} {v}" for k, v in m["rejections"].items()) or "none"),
        ("similarity mean", "-" if m["similarity_mean"] is None else f"{m['similarity_mean']:.3f}"),
        (
            "requests / cache hits",
            f"{cl['calls']} / {cl['cache_hits']} ({pct(cl['hit_rate'])}), {cl['retries']} retries",
        ),
        ("tokens in / out", f"{cl['prompt_tokens']:,} / {cl['completion_tokens']:,}"),
        ("seconds", f"{m['seconds']:.1f}"),
        (
            "documents/s, tokens out/s",
            f"{m['documents_per_s'] or 0:.2f}, {m['completion_tokens_per_s'] or 0:.1f}",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:>{width}}: {v}")
    for rec in (m.get("skipped") or [])[:10]:
        print(f"skipped {rec['file']}:{rec['where']}: {rec['reason']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k2_data.rephrase", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))

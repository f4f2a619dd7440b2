"""`k2 model ...`: model utilities. `k2 model stats` prints the cost model (k2_model.stats) as tables.

k2 model stats --preset kimi-k2 --compare deepseek-v3 [--context 131072] [--ep 128] [--json]
               [--train-world 256 --train-ep 16 --tokens-per-rank 4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

DEFAULT_CONTEXT = 131072
DEFAULT_EP = 128
# Training communication: K2's EP16 over 256 GPUs (FSDP2 x EP here; the paper adds PP16 and ZeRO-1)
DEFAULT_TRAIN_WORLD = 256
DEFAULT_TRAIN_EP = 16
DEFAULT_TOKENS_PER_RANK = 4096


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "model", help="model utilities: the cost model (stats)", description="Model utilities."
    )
    sub = parser.add_subparsers(dest="model_command", metavar="SUBCOMMAND")
    sub.required = True

    stats = sub.add_parser(
        "stats",
        help="parameters, FLOPs, KV cache and per-EP-rank bytes of a config",
        description=(
            "The K2 cost model: exact total/active parameters and their breakdown, prefill and decode "
            "FLOPs per token at a context length, KV-cache bytes per token (MLA compressed vs expanded "
            "heads) and per-EP-rank expert weight bytes (FP8). With --compare, the seed comparisons "
            "(128 vs 64 heads, QKVO parameters, per-rank MLP bytes) next to the paper's numbers. "
            "Conventions: packages/k2-model/COST_MODEL.md."
        ),
    )
    stats.add_argument(
        "--preset", default="kimi-k2", help="config preset: kimi-k2, deepseek-v3, tiny (default kimi-k2)"
    )
    stats.add_argument(
        "--config", metavar="PATH", help="an HF config.json (or its directory); overrides --preset"
    )
    stats.add_argument(
        "--compare", metavar="PRESET", help="a second preset to compare against, e.g. deepseek-v3"
    )
    stats.add_argument(
        "--context",
        type=int,
        default=DEFAULT_CONTEXT,
        help=f"context length in tokens (default {DEFAULT_CONTEXT})",
    )
    stats.add_argument(
        "--ep",
        type=int,
        default=None,
        help=f"expert-parallel ranks (default {DEFAULT_EP}, capped at the config's n_routed_experts)",
    )
    stats.add_argument(
        "--train-world",
        type=int,
        default=DEFAULT_TRAIN_WORLD,
        help=f"training ranks for the communication model (default {DEFAULT_TRAIN_WORLD})",
    )
    stats.add_argument(
        "--train-ep",
        type=int,
        default=None,
        help=f"training expert parallelism (`k2 pretrain --ep`; default {DEFAULT_TRAIN_EP}, capped at "
        "n_routed_experts)",
    )
    stats.add_argument(
        "--tokens-per-rank",
        type=int,
        default=DEFAULT_TOKENS_PER_RANK,
        help=f"tokens per rank per micro-batch for the communication model (default {DEFAULT_TOKENS_PER_RANK})",
    )
    stats.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    stats.set_defaults(func=run_stats, _parser=stats)


def _load(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[str, Any, Any | None, str | None]:
    from k2_model import PRESETS, K2Config

    def preset(name: str, flag: str) -> Any:
        if name not in PRESETS:
            parser.error(f"{flag}: unknown preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
        return K2Config.preset(name)

    if args.config:
        try:
            cfg, name = K2Config.from_hf(args.config), args.config
        except (OSError, ValueError) as e:
            parser.error(f"--config {args.config}: {e}")
    else:
        cfg, name = preset(args.preset, "--preset"), args.preset
    other = preset(args.compare, "--compare") if args.compare else None
    return name, cfg, other, args.compare


def run_stats(args: argparse.Namespace) -> int:
    from k2_model.stats import model_stats, seed_comparisons

    parser: argparse.ArgumentParser = args._parser
    name, cfg, other, other_name = _load(args, parser)
    if args.context < 1:
        parser.error(f"--context must be a positive number of tokens, got {args.context}")
    experts = [cfg.n_routed_experts] + ([other.n_routed_experts] if other is not None else [])
    if args.ep is None:
        ep = min([DEFAULT_EP, *experts])
    else:
        ep = args.ep
        if not 1 <= ep <= min(experts):
            parser.error(f"--ep must be between 1 and n_routed_experts ({min(experts)}), got {ep}")

    train_ep = args.train_ep if args.train_ep is not None else min(DEFAULT_TRAIN_EP, cfg.n_routed_experts)
    if args.train_world < 1 or args.tokens_per_rank < 1:
        parser.error("--train-world and --tokens-per-rank must be positive")
    if train_ep < 1 or args.train_world % train_ep or cfg.n_routed_experts % train_ep:
        parser.error(
            f"--train-ep {train_ep} must divide --train-world {args.train_world} and "
            f"n_routed_experts ({cfg.n_routed_experts})"
        )
    comm = _train_comm(cfg, args.tokens_per_rank, args.train_world, train_ep)

    a = model_stats(cfg, context=args.context, ep=ep, name=name)
    b = model_stats(other, context=args.context, ep=ep, name=other_name) if other is not None else None
    comparisons = (
        seed_comparisons(cfg, other, args.context, ep, name, other_name) if other is not None else []
    )

    if args.json:
        obj = a.to_dict()
        obj["context"], obj["ep"] = args.context, ep
        obj["train_comm"] = {
            label: {**dataclasses.asdict(c), "a2a_bytes_per_token": c.a2a_bytes_per_token}
            for label, c in comm.items()
        }
        if b is not None:
            obj["compare"] = b.to_dict()
            obj["comparisons"] = [
                {
                    "key": c.key,
                    "label": c.label,
                    "unit": c.unit,
                    "ours_a": c.ours_a,
                    "ours_b": c.ours_b,
                    "ours_change": c.ours_change,
                    "paper_a": c.paper_a,
                    "paper_b": c.paper_b,
                    "paper_change": c.paper_change,
                    "note": c.note,
                }  # fmt: skip
                for c in comparisons
            ]
        json.dump(obj, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0

    print_report(a, b, comparisons, context=args.context, ep=ep)
    print_comm(name, comm)
    return 0


def _train_comm(cfg: Any, tokens: int, world: int, ep: int) -> dict[str, Any]:
    """The bf16 training step's communication (fp32 gradient reduction), FSDP-only vs FSDP x EP."""
    from k2_model.stats import train_comm_bytes

    out = {"FSDP2": train_comm_bytes(cfg, tokens, world, 1, act_bytes=2, param_bytes=2)}
    if ep > 1:
        out[f"FSDP2 x EP{ep}"] = train_comm_bytes(cfg, tokens, world, ep, act_bytes=2, param_bytes=2)
    return out


def print_comm(name: str, comm: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 110)
    first = next(iter(comm.values()))
    t = Table(
        title=f"Training communication per rank per micro-batch of {first.tokens_per_rank:,} tokens, "
        f"{first.world} ranks ({name}; bf16 compute, fp32 gradient reduce-scatter)",
        title_justify="left",
        title_style="bold",
    )
    t.add_column("bytes sent or received", ratio=1)
    for label in comm:
        t.add_column(label, justify="right", no_wrap=True)
    rows = [
        ("EP all-to-all (dispatch + combine, fwd + bwd)", "a2a_bytes"),
        ("  of which to other ranks (balanced routing)", "a2a_offrank_bytes"),
        ("FSDP all-gather (fwd + bwd)", "fsdp_all_gather_bytes"),
        ("FSDP reduce-scatter (fp32 grads)", "fsdp_reduce_scatter_bytes"),
        ("[b]total", "total_bytes"),
    ]
    for label, attr in rows:
        t.add_row(label, *[_num(getattr(c, attr), "bytes") for c in comm.values()])
    t.add_row("all-to-all bytes per token", *[f"{c.a2a_bytes_per_token:,.0f} B" for c in comm.values()])
    con.print(t)
    con.print(
        "The model and its comparison with K2's setup: packages/k2-model/README.md (Expert parallelism)."
    )


# ---------------------------------------------------------------------------------- rendering
def _num(n: float, unit: str) -> str:
    """1.026 T params, 227.1 GFLOP, 10.57 GB (decimal prefixes, as the paper and seeds write them)."""
    suffix = {"params": "", "flops": "FLOP", "bytes": "B"}[unit]
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            p = "B" if unit == "params" and prefix == "G" else prefix
            return f"{n / scale:.4g} {p}{suffix}"
    return f"{n:.4g} {suffix}".rstrip()


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x * 100:+.1f}%"


def _describe(s: Any) -> str:
    c = s.config
    q = f"q {c.q_lora_rank}" if c.q_lora_rank is not None else "q full-rank"
    groups = f", {c.n_group} groups top-{c.topk_group}" if c.n_group > 1 else ""
    return (
        f"{s.name}: {c.num_hidden_layers} layers ({c.first_k_dense_replace} dense), hidden {c.hidden_size}, "
        f"{c.num_attention_heads} MLA heads ({q}, kv {c.kv_lora_rank}), {c.n_routed_experts} routed + "
        f"{c.n_shared_experts} shared experts, {c.num_experts_per_tok} per token{groups}, vocab {c.vocab_size}"
    )


def print_report(a: Any, b: Any | None, comparisons: list[Any], context: int, ep: int) -> None:
    from rich.console import Console
    from rich.table import Table

    # Piped output has no terminal width to respect; give the tables room instead of rich's 80.
    con = Console(width=None if sys.stdout.isatty() else 110)
    runs = [a] if b is None else [a, b]
    for s in runs:
        con.print(_describe(s))

    def table(title: str, first: str) -> Table:
        t = Table(title=title, title_justify="left", title_style="bold")
        t.add_column(first, ratio=1)
        return t

    t = table("Parameters by category (active = read by one token)", "category")
    for s in runs:
        t.add_column(f"{s.name} total", justify="right", no_wrap=True)
        t.add_column(f"{s.name} active", justify="right", no_wrap=True)
    for i, (cat, _) in enumerate(a.params.rows()):
        cells = [
            _num(x, "params")
            for s in runs
            for x in (s.params.rows()[i][1].total, s.params.rows()[i][1].active)
        ]
        t.add_row(cat.replace("_", " "), *cells)
    t.add_section()
    t.add_row("[b]sum", *[_num(x, "params") for s in runs for x in (s.total_params, s.active_params)])
    t.add_row("QKVO (q_b, kv_b, o; in attention)", *[
        x for s in runs for x in (_num(s.params.attention_head_projections, "params"), "")
    ])  # fmt: skip
    t.add_row(
        "MTP layer (not in the model)", *[x for s in runs for x in (_num(s.params.mtp_layer, "params"), "")]
    )
    con.print(t)

    t = table("Exact counts", "count")
    for s in runs:
        t.add_column(s.name, justify="right", no_wrap=True)
    t.add_row("[b]total parameters", *[f"[b]{s.total_params:,}" for s in runs])
    t.add_row("[b]active per token (HF style: embeddings + head)", *[f"[b]{s.active_params:,}" for s in runs])
    t.add_row(
        "active without the input embedding", *[f"{s.params.active_params_no_embedding:,}" for s in runs]
    )
    t.add_row(
        "active matmul weights (the 2N of FLOPs)", *[f"{s.params.active_matmul_params:,}" for s in runs]
    )
    con.print(t)

    t = table(f"Forward FLOPs per token at context {context:,} (2 FLOPs per MAC)", "quantity")
    for s in runs:
        t.add_column(s.name, justify="right", no_wrap=True)
    rows = [
        ("linear: 2 x active matmul weights", "linear"),
        ("prefill attention core (causal mean)", "prefill_attention"),
        ("[b]prefill total (causal)", "prefill"),
        ("prefill total, no mask (2hs^2d per layer)", "prefill_full"),
        ("decode attention, naive (expanded K/V)", "decode_attention_naive"),
        ("[b]decode total, naive", "decode_naive"),
        ("decode attention, absorbed MLA (latent K/V)", "decode_attention_absorbed"),
        ("[b]decode total, absorbed MLA", "decode_absorbed"),
    ]
    for label, attr in rows:
        t.add_row(label, *[_num(getattr(s.flops, attr), "flops") for s in runs])
    con.print(t)

    t = table(f"KV cache (bf16, all layers): per token and per {context:,}-token sequence", "cache")
    for s in runs:
        t.add_column(f"{s.name} /token", justify="right", no_wrap=True)
        t.add_column(f"{s.name} /seq", justify="right", no_wrap=True)
    for label, attr in (
        ("MLA compressed: kv_lora + rope", "compressed"),
        ("expanded heads: H*(qk + v)", "expanded"),
    ):
        t.add_row(label, *[
            x for s in runs for x in (f"{getattr(s.kv, attr):,} B", _num(getattr(s.kv, attr) * context, "bytes"))
        ])  # fmt: skip
    t.add_row("expanded / compressed", *[x for s in runs for x in (f"{s.kv.ratio:.1f}x", "")])
    con.print(t)

    t = table(f"Weights per expert-parallel rank at EP={ep} (FP8, 1 byte per weight)", "quantity")
    for s in runs:
        t.add_column(s.name, justify="right", no_wrap=True)
    t.add_row("routed experts per MoE layer x MoE layers", *[
        f"{s.ep.routed_experts_per_layer}{'' if s.ep.evenly_divided else ' (fullest rank)'} x {s.ep.moe_layers}"
        for s in runs
    ])  # fmt: skip
    t.add_row("routed experts", *[_num(s.ep.routed_bytes, "bytes") for s in runs])
    t.add_row("shared expert (replicated)", *[_num(s.ep.shared_bytes, "bytes") for s in runs])
    t.add_row(
        "[b]MLP weights per rank (routed + shared)", *[f"[b]{_num(s.ep.expert_bytes, 'bytes')}" for s in runs]
    )
    t.add_row("+ fp32 128x128 block scales", *[_num(s.ep.block_scale_bytes, "bytes") for s in runs])
    t.add_row(
        "dense-layer MLPs (replicated; not above)", *[_num(s.ep.dense_mlp_bytes, "bytes") for s in runs]
    )
    t.add_row(
        "attention (replicated, DP attention; not above)",
        *[_num(s.ep.attention_bytes, "bytes") for s in runs],
    )
    con.print(t)

    from k2_model.stats import serving_bytes

    t = table(
        "Serving footprint by checkpoint format: all weights / weights read per decoded token", "format"
    )
    for s in runs:
        t.add_column(f"{s.name} total", justify="right", no_wrap=True)
        t.add_column(f"{s.name} /token", justify="right", no_wrap=True)
    rows = [serving_bytes(s.config) for s in runs]
    for i, fmt in enumerate(rows[0]):
        t.add_row(fmt.name, *[
            x for r in rows for x in (_num(r[i].total_bytes, "bytes"), _num(r[i].active_bytes, "bytes"))
        ])  # fmt: skip
    con.print(t)

    if not comparisons:
        return
    t = table(f"Seed comparisons: A = {a.name}, B = {b.name}; ours next to the paper's", "quantity")
    for col in ("A ours", "B ours", "B/A ours", "A paper", "B paper", "B/A paper"):
        t.add_column(col, justify="right", no_wrap=True)
    for i, c in enumerate(comparisons, 1):
        t.add_row(
            f"{c.label} [{i}]", _num(c.ours_a, c.unit), _num(c.ours_b, c.unit), _pct(c.ours_change),
            "" if c.paper_a is None or c.unit == "flops" else _num(c.paper_a, c.unit),
            "" if c.paper_b is None or c.unit == "flops" else _num(c.paper_b, c.unit),
            _pct(c.paper_change),
        )  # fmt: skip
    con.print(t)
    for i, c in enumerate(comparisons, 1):
        con.print(f"  [{i}] {c.note}")
    con.print("Why ours differ from the paper's: packages/k2-model/COST_MODEL.md.")

"""`k2 export RUN_DIR --out HF_DIR`: a run's latest train state as an HF-format model (with the tokenizer,
the Kimi chat template and generation_config.json)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a k2 pretrain/sft run's latest weights as an HF-format directory",
        description="Write config.json, safetensors (DeepseekV3ForCausalLM names), the tokenizer and "
        "generation_config.json of a `k2 pretrain` or `k2 sft` run into --out, loadable by "
        "K2ForCausalLM.from_pretrained, transformers and vLLM, with the Kimi K2 chat template "
        "(chat_template.jinja and tokenizer_config.json), so that `apply_chat_template` and "
        "`transformers serve` render conversations exactly as `k2 serve` does, and generation stops at "
        "<|im_end|>. Files get the umask's permissions.",
    )
    p.add_argument("run_dir", type=Path, help="a `k2 pretrain` or `k2 sft` run directory")
    p.add_argument("--out", type=Path, required=True, help="the HF-format output directory")
    p.add_argument(
        "--force", action="store_true", help="replace --out when it exists and is not empty (default: refuse)"
    )
    p.add_argument(
        "--quantize",
        choices=["none", "int4"],
        default="none",
        help="int4: routed experts as compressed-tensors INT4 (pack-quantized, groups of 32, the layout "
        "K2-Thinking ships), the rest in bf16; none (default): every weight as trained",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from k2_train.export import export_run

    try:
        out = export_run(args.run_dir, args.out, force=args.force, quantize=args.quantize)
    except FileExistsError as e:
        print(f"k2 export: --out {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"k2 export: {e}")
        return 2
    print(f"exported {args.run_dir} -> {out}")
    return 0

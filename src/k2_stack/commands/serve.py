"""`k2 serve`: the OpenAI-compatible server (logic in `k2_stack.serve`)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible server (chat, completions, tool calls)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF-format checkpoint directory (config.json + safetensors)")
    src.add_argument("--preset", help="a K2Config preset with random weights (e.g. tiny), for tests")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name", default=None, help="model id (default: the preset or directory name)"
    )
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the config's)")
    p.add_argument(
        "--device", default=None, help="cpu | cuda (default: cpu for a preset, cuda if available for --model)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the preset's random weights and of sampling")
    p.add_argument(
        "--ckpt-rank",
        type=int,
        default=0,
        help="rank in the k2-ckpt device id of the weight receiver mounted at /ckpt",
    )
    p.add_argument("--no-ckpt-receiver", action="store_true", help="do not accept k2-ckpt weight updates")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from k2_stack.serve import build_bridge, create_app

    bridge = build_bridge(
        args.model,
        args.preset,
        args.served_model_name,
        args.max_batch_size,
        args.max_model_len,
        args.seed,
        args.device,
    )
    try:
        uvicorn.run(
            create_app(bridge, None if args.no_ckpt_receiver else args.ckpt_rank),
            host=args.host,
            port=args.port,
            log_level="info",
        )
    finally:
        bridge.close()
    return 0

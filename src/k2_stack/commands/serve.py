"""`k2 serve`: the OpenAI-compatible server (logic in `k2_stack.serve`)."""

from __future__ import annotations

import argparse
import sys

from k2_stack.cli import DefaultsHelpFormatter


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible server (chat, completions, tool calls)",
        formatter_class=DefaultsHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model", help="HF-format model directory (config.json + safetensors, e.g. from `k2 export`)"
    )
    src.add_argument("--preset", help="a K2Config preset with random weights (e.g. tiny), for tests")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (0: any free port)")
    p.add_argument(
        "--served-model-name", default=None, help="model id (default: the preset or directory name)"
    )
    p.add_argument(
        "--max-batch-size", type=int, default=32, help="sequences decoded together (n samples count n)"
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the config's)")
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="KV cache budget in tokens; requests whose worst case does not fit wait in the queue "
        "(default: max-batch-size full-length sequences)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=2048,
        help="prompt tokens prefilled per step; a longer prompt is prefilled in chunks over several "
        "steps while the running sequences keep decoding (chunked prefill)",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="prefill every prompt from scratch")
    p.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        help="seconds between metric summaries in the log (0: off)",
    )
    p.add_argument(
        "--device", default=None, help="cpu | cuda (default: cpu for a preset, cuda if available for --model)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the preset's random weights and of sampling")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="weights, activations and KV cache. auto: on CUDA the checkpoint's dtype; on CPU bfloat16 "
        "where this CPU multiplies bf16 natively (AVX512-BF16 or AMX, as k2-optim decides; "
        "K2_NATIVE_BF16=0|1 overrides), else float32",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the model step on CPU (default: usable cores - 1, at least 1: one core "
        "stays with the HTTP server and detokenisation, as vLLM reserves one for its API process)",
    )
    p.add_argument(
        "--ckpt-rank",
        type=int,
        default=0,
        help="rank in the k2-ckpt device id of the weight receiver mounted at /ckpt",
    )
    p.add_argument(
        "--chat-template",
        choices=["k2", "kimi-k2-instruct-0905", "kimi-k2-thinking"],  # k2_data.chat.TEMPLATES
        default="k2",
        help="how prompts are rendered: k2's own chat format (default) or a released Kimi template "
        "(kimi-k2-thinking also returns reasoning_content)",
    )
    p.add_argument(
        "--no-normalize-ids",
        dest="normalize_ids",
        action="store_false",
        help="render the client's tool-call ids as sent (default: rename them to functions.NAME:IDX)",
    )
    p.add_argument("--no-ckpt-receiver", action="store_true", help="do not accept k2-ckpt weight updates")
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    """One line naming the argument, argparse's exit code for bad usage, no traceback."""
    print(f"k2 serve: error: {message}", file=sys.stderr)
    return 2


def check_args(args: argparse.Namespace) -> str | None:
    """The first bad argument, as a message naming it; None when all are fine (cheap checks, before loading)."""
    from pathlib import Path

    from k2_model import K2Config
    from k2_model.config import PRESETS

    if args.preset is not None and args.preset not in PRESETS:
        return (
            f"argument --preset: unknown preset {args.preset!r}; choose one of {', '.join(sorted(PRESETS))}"
        )
    if args.model is not None:
        d = Path(args.model)
        if not d.is_dir():
            return f"argument --model: {d} is not a directory (expected an HF-format model, e.g. from `k2 export`)"
        if (d / "metrics.jsonl").is_file() or not any(d.glob("*.safetensors")):
            what = "a training run directory" if (d / "metrics.jsonl").is_file() else "not an HF-format model"
            return f"argument --model: {d} is {what}; export it first: `k2 export {d} --out DIR`, then --model DIR"
        try:
            K2Config.from_hf(d / "config.json")
        except Exception as e:  # any unreadable config is the argument's fault, reported in one line
            return f"argument --model: {d}/config.json is not a K2/DeepSeek-V3 HF config ({e})"
    for flag, value, low in (
        ("--max-batch-size", args.max_batch_size, 1),
        ("--max-model-len", args.max_model_len, 2),
        ("--kv-cache-tokens", args.kv_cache_tokens, 1),
        ("--block-size", args.block_size, 1),
        ("--max-prefill-tokens", getattr(args, "max_prefill_tokens", None), 1),  # k2 chat shares these checks
        ("--port", args.port, 0),
        ("--threads", getattr(args, "threads", None), 1),
    ):
        if value is not None and value < low:
            return f"argument {flag}: must be >= {low}, got {value}"
    if args.device is not None:
        from k2_model.device import pick_device

        try:
            pick_device(args.device)
        except ValueError as e:
            return f"argument {e}"
    return None


def port_problem(host: str, port: int) -> str | None:
    """Why uvicorn could not listen on host:port (checked before the model loads), or None."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"argument --host: cannot resolve {host!r} ({e.strerror})"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(addr)
        except OSError as e:
            return f"argument --port: cannot listen on {host}:{port} ({e.strerror}); is another server running there? choose another --port"
    return None


def run(args: argparse.Namespace) -> int:
    problem = check_args(args) or port_problem(args.host, args.port)
    if problem:
        return _fail(problem)
    import logging

    import uvicorn

    from k2_stack.serve import build_bridge, create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import torch

    from k2_stack.serve.bridge import default_threads

    torch.set_num_threads(args.threads or default_threads())
    try:
        bridge = build_bridge(
            args.model,
            args.preset,
            args.served_model_name,
            args.max_batch_size,
            args.max_model_len,
            args.seed,
            args.device,
            kv_cache_tokens=args.kv_cache_tokens,
            block_size=args.block_size,
            max_prefill_tokens=args.max_prefill_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            log_stats_interval=args.log_stats_interval,
            chat_template=args.chat_template,
            normalize_ids=args.normalize_ids,
            dtype=args.dtype,
        )
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        return _fail(str(e))
    from k2_stack.serve.bridge import describe_dtype

    weight = bridge.model.lm_head.weight
    print(
        f"k2 serve: {bridge.config.served_model_name} on {weight.device}, "
        f"{describe_dtype(args.dtype, weight.dtype, weight.device)}, {torch.get_num_threads()} torch "
        f"thread(s), max batch {bridge.config.max_batch_size}, max length {bridge.max_model_len}",
        flush=True,
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

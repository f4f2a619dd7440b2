"""Greedy generation with k2_model.engine vs transformers' `generate`, same tiny weights, same run.

    .venv/bin/python benchmarks/decode.py [--prompts 16] [--new-tokens 128] [--repeats 3] [--threads 1]

The tiny preset with random weights (fixed seed) is saved with `save_pretrained` and loaded by
transformers' DeepseekV3ForCausalLM (`from_pretrained`, fp32, its default sdpa attention and
grouped_mm experts). 16 prompts of different lengths (16..76 tokens), 128 new tokens each,
greedy, eos ignored (transformers: left padding + attention mask, `min_new_tokens` = max).
Tokens/s = generated tokens / wall time of the whole call (prefill included), repeats alternate
between the two so machine load hits both alike; min and median are reported.

Also prints the KV cache bytes per token: the engine's (kv_lora_rank + qk_rope_head_dim) per
layer, against an expanded-head cache (H * (qk_head_dim + v_head_dim) per layer), and the bytes
per token transformers' DynamicCache actually held after its run (5.x caches the latent too, and
re-expands every cached token through kv_b_proj at every step; the engine never expands it).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from k2_model import K2Config, K2ForCausalLM
from k2_model.engine import Engine, SamplingParams


def cache_tensors_bytes(past) -> int:
    """Bytes of every tensor held by a transformers cache object (layers' keys and values)."""
    total, seen = 0, set()
    for layer in getattr(past, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (1: steadier on shared cores)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import DeepseekV3ForCausalLM
    from transformers import __version__ as tf_version

    device = torch.device(args.device)
    cfg = K2Config.preset("tiny")
    torch.manual_seed(0)
    ours = K2ForCausalLM(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        ours.save_pretrained(d)
        theirs = DeepseekV3ForCausalLM.from_pretrained(d, dtype=torch.float32).eval().to(device)
    ours = ours.to(device)
    g = torch.Generator().manual_seed(1)
    lengths = [16 + (4 * i) % 64 for i in range(args.prompts)]
    prompts = [torch.randint(0, 7936, (n,), generator=g).tolist() for n in lengths]
    pad = cfg.pad_token_id
    S = max(lengths)
    ids = torch.tensor([[pad] * (S - len(p)) + p for p in prompts], device=device)
    mask = (
        torch.arange(S, device=device)[None] >= torch.tensor([S - n for n in lengths], device=device)[:, None]
    ).long()
    n_new = args.new_tokens
    total = n_new * len(prompts)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def run_ours() -> tuple[float, list[list[int]], Engine]:
        engine = Engine(ours, max_batch_size=len(prompts))
        sync()
        t = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True))
        sync()
        return time.perf_counter() - t, [o.token_ids for o in outs], engine

    def run_theirs() -> tuple[float, list[list[int]], object]:
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            out = theirs.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                pad_token_id=pad, return_dict_in_generate=True,
            )  # fmt: skip
        sync()
        return time.perf_counter() - t, out.sequences[:, S:].tolist(), out.past_key_values

    run_ours(), run_theirs()  # warm-up
    t_ours, t_theirs = [], []
    for _ in range(args.repeats):
        dt, tok_ours, engine = run_ours()
        t_ours.append(dt)
        dt, tok_theirs, past = run_theirs()
        t_theirs.append(dt)

    agree = sum(a == b for x, y in zip(tok_ours, tok_theirs) for a, b in zip(x, y)) / total
    same_seq = sum(x == y for x, y in zip(tok_ours, tok_theirs))
    print(f"# decode benchmark: tiny preset ({ours.num_parameters() / 1e6:.1f}M params, fp32, {device}),")
    print(
        f"# {len(prompts)} prompts of {min(lengths)}..{max(lengths)} tokens, {n_new} new tokens each, greedy;"
    )
    print(
        f"# torch {torch.__version__}, transformers {tf_version}, threads {args.threads}, repeats {args.repeats}"
    )
    print(f"# greedy tokens identical: {agree:.1%} of tokens, {same_seq}/{len(prompts)} sequences")
    print()
    print(
        "| generator | s min | s median | tokens/s (min time) | tokens/s (median) | speed-up (min) | speed-up (median) |"
    )
    print("|---|---|---|---|---|---|---|")
    base_min, base_med = min(t_theirs), statistics.median(t_theirs)
    for name, ts in (
        ("transformers DeepseekV3ForCausalLM.generate", t_theirs),
        ("k2_model.engine.Engine", t_ours),
    ):
        mn, md = min(ts), statistics.median(ts)
        print(
            f"| {name} | {mn:.3f} | {md:.3f} | {total / mn:.0f} | {total / md:.0f} | {base_min / mn:.2f}x | {base_med / md:.2f}x |"
        )

    H, L = cfg.num_attention_heads, cfg.num_hidden_layers
    ours_b = engine.cache_bytes_per_token()
    expanded_b = H * (cfg.qk_head_dim + cfg.v_head_dim) * L * 4
    hf_tokens = len(prompts) * (S + n_new - 1)  # padded slots; the last token is never cached
    hf_b = cache_tensors_bytes(past) / hf_tokens
    k2 = K2Config.preset("kimi-k2")
    k2_ours = (k2.kv_lora_rank + k2.qk_rope_head_dim) * k2.num_hidden_layers * 2
    k2_exp = k2.num_attention_heads * (k2.qk_head_dim + k2.v_head_dim) * k2.num_hidden_layers * 2
    print()
    print(
        "| KV cache bytes per token | k2_model.engine (latent + rotary key) | expanded per-head K and V | ratio |"
    )
    print("|---|---|---|---|")
    print(f"| tiny preset, fp32 (formula) | {ours_b:,} | {expanded_b:,} | {expanded_b / ours_b:.2f}x |")
    print(
        f"| tiny preset, fp32 (measured: transformers 5.x DynamicCache, also latent) | {ours_b:,} | {hf_b:,.0f} | {hf_b / ours_b:.2f}x |"
    )
    print(f"| Kimi K2, bf16 (formula) | {k2_ours:,} | {k2_exp:,} | {k2_exp / k2_ours:.2f}x |")


if __name__ == "__main__":
    main()

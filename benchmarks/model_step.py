"""One fp32 training step (forward + backward) of k2_model.K2ForCausalLM vs transformers'
DeepseekV3ForCausalLM on the same MoE config, weights and batch, measured in the same run.

    .venv/bin/python benchmarks/model_step.py [--steps 5] [--batch 4] [--seq 256]

Prints seconds per step (median), the ratio, achieved GFLOP/s (analytic FLOP count of the step,
below) and that as a fraction of this machine's fp32 matmul rate measured here (1024x512 @ 512x512).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from k2_model import K2Config, K2ForCausalLM


def bench_config() -> K2Config:
    # issue 2 section 5: hidden 256, 4 layers, 128 experts top-8, vocab 1024 (other dims: the tiny preset)
    return K2Config.preset(
        "tiny",
        vocab_size=1024,
        n_routed_experts=128,
        num_experts_per_tok=8,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


def step_flops(cfg: K2Config, B: int, S: int) -> float:
    """Matmul FLOPs of fwd + bwd (3x forward): projections, experts (active only), router, head,
    and causal attention (q.k and p.v over the S(S+1)/2 allowed pairs)."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    P, R, V, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    Q = cfg.q_lora_rank
    attn = (D * Q + Q * H * (P + R)) if Q else D * H * (P + R)
    attn += D * (C + R) + C * H * (P + V) + H * V * D
    per_tok = 0
    for i in range(cfg.num_hidden_layers):
        per_tok += attn
        if cfg.is_moe_layer(i):
            I = cfg.moe_intermediate_size
            per_tok += 3 * D * I * (cfg.num_experts_per_tok + cfg.n_shared_experts) + D * cfg.n_routed_experts
        else:
            per_tok += 3 * D * cfg.intermediate_size
    per_tok += D * cfg.vocab_size
    T = B * S
    fwd = 2 * per_tok * T + cfg.num_hidden_layers * 2 * B * H * (S * (S + 1) // 2) * (P + R + V)
    return 3.0 * fwd


def matmul_gflops() -> float:
    a, b = torch.randn(1024, 512), torch.randn(512, 512)
    for _ in range(5):
        a @ b
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < 1.0:
        a @ b
        n += 1
    return n * 2 * 1024 * 512 * 512 / (time.perf_counter() - t) / 1e9


def time_steps(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> tuple[float, float]:
    model.train()
    times, loss = [], 0.0
    for i in range(steps + 1):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        out = model(ids, labels=ids)
        out.loss.backward()
        if i:  # first step is warm-up
            times.append(time.perf_counter() - t)
        loss = out.loss.item()
    return statistics.median(times), loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = bench_config()
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    flops = step_flops(cfg, args.batch, args.seq)
    peak = matmul_gflops()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, fp32 matmul {peak:.0f} GFLOP/s")
    print(f"config: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.n_routed_experts} experts "
          f"top-{cfg.num_experts_per_tok}, vocab {cfg.vocab_size}; batch {args.batch}x{args.seq}; "
          f"{flops / 1e9:.1f} GFLOP per step")  # fmt: skip

    rows = []
    hf_cfg = DeepseekV3Config(**cfg.to_hf())
    with tempfile.TemporaryDirectory() as d:
        for impl in ("eager", "sdpa"):
            hf_cfg._attn_implementation = impl
            theirs = DeepseekV3ForCausalLM(hf_cfg)
            if impl == "eager":
                theirs.save_pretrained(d)
                ours = K2ForCausalLM.from_pretrained(d)
            t, loss = time_steps(theirs, ids, args.steps)
            rows.append((f"transformers DeepseekV3ForCausalLM ({impl} attention)", t, loss))
            del theirs
    for impl in ("sdpa", "eager"):
        ours.set_attention_impl(impl)
        t, loss = time_steps(ours, ids, args.steps)
        rows.append((f"k2_model K2ForCausalLM ({impl} attention, max-logit recording on)", t, loss))

    anchor = rows[0][1]
    print("\n| model | s/step | speed-up vs transformers (eager) | GFLOP/s | % of matmul peak | loss |")
    print("|---|---|---|---|---|---|")
    for name, t, loss in rows:
        gf = flops / t / 1e9
        print(f"| {name} | {t:.3f} | {anchor / t:.2f}x | {gf:.0f} | {100 * gf / peak:.0f}% | {loss:.4f} |")


if __name__ == "__main__":
    main()

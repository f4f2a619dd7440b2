"""One fp32 training step (forward + backward) of k2_model.K2ForCausalLM vs transformers'
DeepseekV3ForCausalLM on the same MoE config, weights and batch, measured in the same run.

    .venv/bin/python benchmarks/model_step.py [--steps 5] [--batch 4] [--seq 256] [--threads 2]
        [--torch-experts]

Prints seconds per step (median), the ratio, achieved GFLOP/s (analytic FLOP count of the step,
below) and that as a fraction of this machine's fp32 matmul rate measured here (1024x512 @ 512x512).
`--torch-experts` adds our model with its routed experts through `torch._grouped_mm` instead of
k2-kernels' fused grouped GEMM, to show what that kernel contributes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from k2_model import K2Config, K2ForCausalLM
from k2_model.moe import RoutedExperts


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


def attention_label() -> str:
    """What our default attention ('auto') runs here: the fused kernel where one is built."""
    try:
        from k2_model.model import fused_attention_available
    except ImportError:
        return "sdpa attention"
    cfg = bench_config()
    fused = fused_attention_available(
        torch.device("cpu"), cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    )
    return "fused attention kernel" if fused else "eager attention (auto)"


def expert_backend() -> str:
    """Which path runs our routed experts' MLP on fp32 CPU tensors."""
    try:
        import k2_kernels
        from k2_kernels.grouped_gemm_ops import kernel_available
    except ImportError:
        return "torch._grouped_mm (k2-kernels without the grouped GEMM)"
    if not kernel_available():
        return "torch._grouped_mm (k2_kernels._C not built)"
    return f"k2-kernels fused SwiGLU grouped GEMM, BLAS: {k2_kernels.info()['blas']}"


def matmul_gflops() -> float:
    a, b = torch.randn(1024, 512), torch.randn(512, 512)
    for _ in range(5):
        a @ b
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < 1.0:
        a @ b
        n += 1
    return n * 2 * 1024 * 512 * 512 / (time.perf_counter() - t) / 1e9


def one_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    out = model(ids, labels=ids)
    out.loss.backward()
    return time.perf_counter() - t, out.loss.item()


def time_round_robin(
    models: dict[str, torch.nn.Module], ids: torch.Tensor, steps: int
) -> dict[str, tuple[float, float]]:
    """Median s/step per model; steps alternate between the models so that load from other
    processes on a shared machine hits all of them alike. The first round is warm-up."""
    times: dict[str, list[float]] = {k: [] for k in models}
    loss: dict[str, float] = {}
    for r in range(steps + 1):
        for name, model in models.items():
            t, loss[name] = one_step(model, ids)
            if r:
                times[name].append(t)
    return {k: (min(v), statistics.median(v), loss[k]) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--torch-experts",
        action="store_true",
        help="also time ours with the experts through torch._grouped_mm",
    )
    args = ap.parse_args()
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = bench_config()
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    flops = step_flops(cfg, args.batch, args.seq)
    peak = matmul_gflops()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, fp32 matmul {peak:.0f} GFLOP/s")
    print(f"our routed experts: {expert_backend()}")
    print(f"config: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.n_routed_experts} experts "
          f"top-{cfg.num_experts_per_tok}, vocab {cfg.vocab_size}; batch {args.batch}x{args.seq}; "
          f"{flops / 1e9:.1f} GFLOP per step")  # fmt: skip

    hf_eager = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg.to_hf(), attn_implementation="eager")).train()
    hf_sdpa = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg.to_hf(), attn_implementation="sdpa")).train()
    with tempfile.TemporaryDirectory() as d:
        hf_eager.save_pretrained(d)
        hf_sdpa.load_state_dict(hf_eager.state_dict())
        ours_auto = K2ForCausalLM.from_pretrained(d).train()
        ours_eager = K2ForCausalLM.from_pretrained(d).train()
        ours_torch_experts = K2ForCausalLM.from_pretrained(d).train() if args.torch_experts else None
    ours_eager.set_attention_impl("eager")
    models = {
        "transformers DeepseekV3ForCausalLM (eager attention)": hf_eager,
        "transformers DeepseekV3ForCausalLM (sdpa attention)": hf_sdpa,
        f"k2_model K2ForCausalLM ({attention_label()}, max-logit recording on)": ours_auto,
        "k2_model K2ForCausalLM (eager attention, max-logit recording on)": ours_eager,
    }
    if ours_torch_experts is not None:
        for m in ours_torch_experts.modules():
            if isinstance(m, RoutedExperts):
                m.use_k2_kernel = False
        models[f"k2_model K2ForCausalLM ({attention_label()}, experts via torch._grouped_mm)"] = (
            ours_torch_experts
        )
    res = time_round_robin(models, ids, args.steps)
    peak_after = matmul_gflops()
    print(f"fp32 matmul after the run: {peak_after:.0f} GFLOP/s (a large change means the machine was busy)")
    names = list(models)
    a_min, a_med = res[names[0]][0], res[names[0]][1]
    print(
        "\n| model | s/step min | s/step median | speed-up vs transformers eager (min / median) "
        "| GFLOP/s (min) | % of matmul rate | loss |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in names:
        t_min, t_med, loss = res[name]
        gf = flops / t_min / 1e9
        print(
            f"| {name} | {t_min:.3f} | {t_med:.3f} | {a_min / t_min:.2f}x / {a_med / t_med:.2f}x "
            f"| {gf:.0f} | {100 * gf / max(peak, peak_after):.0f}% | {loss:.4f} |"
        )
    for ref in names[:2]:
        for ours in names[2:]:
            print(
                f"ratio {ref.split(' (')[0]} ({ref.split('(')[1][:-1]}) / {ours}: "
                f"min {res[ref][0] / res[ours][0]:.2f}x, median {res[ref][1] / res[ours][1]:.2f}x"
            )


if __name__ == "__main__":
    main()

"""The whole fp32 training step, optimizer included: k2 vs transformers + torch.optim.Muon, one run.

    .venv/bin/python benchmarks/train_step.py [--experts 64] [--batch 8] [--seq 256] [--steps 5] [--threads 0]

k2: `k2_train.Trainer.train_step` on K2ForCausalLM with MuonClip (what `k2 pretrain` runs: forward,
backward, grad-norm clip, Muon on every hidden matrix, the routed experts included (batched
Newton-Schulz per shape), AdamW on embeddings/head/1-D, QK-Clip, the aux-loss-free bias update).
Anchor: transformers' DeepseekV3ForCausalLM with the same weights and batch, torch.optim.Muon on
its 2-D hidden matrices (as shipped, adjust_lr_fn="match_rms_adamw") and AdamW on the rest,
including the 3-D expert tensors, which torch's Muon refuses; the same grad-norm clip.

Prints seconds per step (median over --steps, the two sides interleaved so load from other jobs
hits both), the ratio (anchor / k2: above 1 = k2 faster), the optimizer's share of each step,
the NS dtype k2 chose and the CPU's flags that decide it (bf16 NS only where bf16 GEMMs are native).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from bench_common import cpu_flags, machine
from k2_model import K2Config, K2ForCausalLM
from k2_optim import MuonClip
from k2_optim.muon import cpu_has_native_bf16, default_ns_dtype
from k2_train import NextTokenLoss, Trainer, TrainerConfig

# With one torch thread the clock is this process's CPU time, which other jobs on a shared
# machine do not inflate (set in main); otherwise wall time.
clock = time.perf_counter


def bench_config(experts: int, top_k: int = 6, vocab: int = 1024) -> K2Config:
    # a tiny DeepSeek-V3 shape: the tiny preset's attention and layers, `experts` routed experts
    # top-`top_k`, a small vocabulary (as benchmarks/model_step.py), so that the MoE and the
    # optimizer's expert matrices, not the LM head, are what the step spends its time on
    return K2Config.preset(
        "tiny",
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        vocab_size=vocab,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


class K2Side:
    def __init__(self, model: K2ForCausalLM, ids: torch.Tensor) -> None:
        self.model = model.train()
        opt = MuonClip(model, lr=0.02, weight_decay=0.1, tau=30.0)
        for group in opt.param_groups:  # k2 pretrain's default: AdamW lr 3e-3 for embeddings/head/1-D
            if group.get("algorithm") == "adamw":
                group["lr"] = 3e-3
        self.opt = opt
        self.trainer = Trainer(model, opt, NextTokenLoss(), config=TrainerConfig(steps=10**6, grad_clip=1.0))
        self.batch = {"input_ids": ids[:, :-1], "shift_labels": ids[:, 1:]}

    def step(self) -> tuple[float, float]:
        t = clock()
        self.trainer.train_step(self.batch)
        return clock() - t, float("nan")  # the optimizer's part: k2_optimizer_time


class AnchorSide:
    """transformers' model with torch.optim.Muon on its 2-D hidden matrices and AdamW on the rest
    (`muon=False`: AdamW on everything, the cheapest optimizer, for the forward+backward's share)."""

    def __init__(self, hf_model: torch.nn.Module, ids: torch.Tensor, muon: bool = True) -> None:
        self.model = hf_model.train()
        hidden, rest = [], []
        for name, p in hf_model.named_parameters():
            is_hidden = (
                muon and ".layers." in name and p.ndim == 2
            )  # attention, dense MLP, shared expert, router
            (hidden if is_hidden else rest).append(p)
        self.opts: list[torch.optim.Optimizer] = [
            torch.optim.AdamW(rest, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        ]
        if hidden:
            self.opts.append(
                torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
            )
        self.ids = ids
        self.n_muon, self.n_adamw = len(hidden), len(rest)

    def step(self) -> tuple[float, float]:
        t = clock()
        self.model.zero_grad(set_to_none=True)
        self.model(input_ids=self.ids[:, :-1], labels=self.ids[:, :-1]).loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        t_opt = clock()
        for opt in self.opts:
            opt.step()
        end = clock()
        return end - t, end - t_opt


def k2_optimizer_time(side: K2Side) -> float:
    """One more k2 step split by hand: forward+backward+clip, then the optimizer (NS, QK-Clip)."""
    m = side.model
    m.zero_grad(set_to_none=True)
    loss = NextTokenLoss()(m, side.batch) / max(NextTokenLoss().weight(side.batch), 1.0)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    t = clock()
    side.opt.step()
    return clock() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6, help="experts per token")
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary (the tiny preset has 8192)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    global clock
    if args.threads:
        torch.set_num_threads(args.threads)
    if torch.get_num_threads() == 1:
        clock = time.process_time
    cfg = bench_config(args.experts, args.top_k, args.vocab)
    torch.manual_seed(0)
    model = K2ForCausalLM(cfg)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        hf_adamw = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1))
    ours, anchor, adamw = K2Side(model, ids), AnchorSide(hf, ids), AnchorSide(hf_adamw, ids, muon=False)
    sides = (("k2", ours), ("anchor", anchor), ("adamw", adamw))

    times: dict[str, list[float]] = {k: [] for k, _ in sides}
    opt_times: dict[str, list[float]] = {k: [] for k, _ in sides}
    for r in range(args.steps + 1):  # round 0 is warm-up
        for name, side in sides:
            total, opt_s = side.step()
            if r:
                times[name].append(total)
                opt_times[name].append(opt_s)
    opt_times["k2"] = [k2_optimizer_time(ours) for _ in range(max(2, args.steps // 2))]
    med = {k: statistics.median(v) for k, v in times.items()}
    opt_med = {k: statistics.median(v) for k, v in opt_times.items()}

    print(f"machine: {machine(load=True)}; flags: {' '.join(cpu_flags()) or '-'}")
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()} "
        f"({'process CPU time' if clock is time.process_time else 'wall time'}); k2 NS dtype (library default): "
        f"{str(default_ns_dtype(torch.device('cpu'))).replace('torch.', '')} (native bf16 GEMM: {cpu_has_native_bf16()})"
    )
    print(
        f"tiny preset with {cfg.n_routed_experts} routed experts (top-{cfg.num_experts_per_tok}), vocab {cfg.vocab_size}, "
        f"batch {args.batch} x {args.seq} tokens, fp32; median of {args.steps} steps\n"
    )
    print("| step (fwd + bwd + clip + optimizer) | s/step | optimizer share | vs anchor |")
    print("|---|---|---|---|")
    print(
        f"| transformers DeepseekV3 + torch.optim.Muon ({anchor.n_muon} 2-D) + AdamW "
        f"({anchor.n_adamw}, experts included) | {med['anchor']:.3f} | "
        f"{opt_med['anchor'] / med['anchor']:.0%} | 1.00x |"
    )
    print(
        f"| transformers DeepseekV3 + AdamW on everything (no Newton-Schulz at all) | {med['adamw']:.3f} | "
        f"{opt_med['adamw'] / med['adamw']:.0%} | {med['anchor'] / med['adamw']:.2f}x |"
    )
    print(
        f"| k2 Trainer + MuonClip (Muon on every hidden matrix, experts included; QK-Clip) | "
        f"{med['k2']:.3f} | {opt_med['k2'] / med['k2']:.0%} | **{med['anchor'] / med['k2']:.2f}x** |"
    )


if __name__ == "__main__":
    main()

"""One training step of a tiny MoE under FSDP2 only vs FSDP2 x EP, per rank, split by where time goes.

    .venv/bin/python benchmarks/ep_step.py [--procs 2] [--steps 3] [--json OUT]

Both layouts run in one spawn of --procs gloo processes on CPU (fp32, MuonClip, same model and
global batch), interleaved step by step so load from other processes hits both alike. Each step
's forward + backward is profiled (torch.profiler, CPU self time per op, in categories):

  experts     the routed experts' grouped GEMMs (k2-kernels' moe_swiglu_experts / _grouped_mm)
  all-to-all  EP token dispatch/combine and the count exchange (gloo all_to_all)
  fsdp        FSDP2 all-gather / reduce-scatter and their copy-in/out
  other       the rest of forward + backward: attention, dense MLPs, router, norms, head
  ns          the optimizer side, timed: gradient clip, MuonClip step (Newton-Schulz, distributed
              Muon's all-to-all, AdamW, QK-Clip) and the expert-bias update

Bytes: the all-to-all bytes this rank counted (k2_model.expert_parallel.COMM) next to
k2_model.stats.train_comm_bytes' prediction (mean over ranks, which the model gives exactly).
The anchor is the FSDP2-only step of the same run: EP's ratios are against it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# A tiny DeepSeek-V3-shaped MoE (FACTS.md's: hidden 256, 64 experts top-6) cut to 3 layers.
MODEL = dict(
    hidden_size=256, num_hidden_layers=3, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, intermediate_size=512,
    moe_intermediate_size=128, n_routed_experts=64, num_experts_per_tok=6, vocab_size=1024,
)  # fmt: skip
BATCH_PER_RANK, SEQ = 4, 128
CATEGORIES = ("experts", "all-to-all", "fsdp", "ns", "other")


def _category(name: str) -> str:
    n = name.lower()
    if "all_to_all" in n or "alltoall" in n:
        return "all-to-all"
    if "grouped_mm" in n or "moe_swiglu" in n:
        return "experts"
    if "fsdp" in n or "all_gather" in n or "allgather" in n or "reduce_scatter" in n or "reducescatter" in n:
        return "fsdp"
    if "newton" in n or n.startswith("ns:"):
        return "ns"
    return "other"


def _build(ep: int):
    from k2_model import K2Config, K2ForCausalLM
    from k2_model.parallelize import parallelize
    from k2_optim import MuonClip

    torch.manual_seed(0)
    model = K2ForCausalLM(K2Config.preset("tiny", **MODEL)).train()
    parallelize(model, data_parallel=True, ep=ep)
    return model, MuonClip(model, lr=1e-2, weight_decay=0.1, tau=100.0, ns_dtype=torch.float32)


def _step(model, opt, ids) -> dict[str, float]:
    """Forward + backward under the profiler (experts, all-to-all and FSDP by op self time, the rest
    of that wall time "other"), then clip + MuonClip step + bias update timed as "ns"."""
    from k2_model.expert_parallel import COMM
    from k2_model.parallelize import clip_grad_norm_
    from torch.profiler import ProfilerActivity, profile

    COMM.reset()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        t1 = time.perf_counter()
    a2a_bytes, offrank = COMM.sent_bytes + COMM.local_bytes, COMM.sent_bytes
    clip_grad_norm_(list(model.parameters()), 1.0)
    opt.step()
    opt.zero_grad()
    model.update_expert_bias(1e-3)
    t2 = time.perf_counter()
    out = dict.fromkeys(CATEGORIES, 0.0)
    for ev in prof.key_averages():
        cat = _category(ev.key)
        if cat in ("experts", "all-to-all", "fsdp"):
            out[cat] += ev.self_cpu_time_total / 1e6
    out["other"] = max(0.0, (t1 - t0) - out["experts"] - out["all-to-all"] - out["fsdp"])
    out["ns"] = t2 - t1
    out["wall"] = t2 - t0
    out["a2a_bytes"], out["a2a_offrank_bytes"] = a2a_bytes, offrank
    return out


def _worker(rank: int, world: int, port: int, steps: int, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        layouts = {"FSDP2": _build(1), f"FSDP2 x EP{world}": _build(world)}
        g = torch.Generator().manual_seed(rank)
        rows: dict[str, list[dict]] = {k: [] for k in layouts}
        for i in range(steps + 1):  # step 0 warms up
            ids = torch.randint(0, MODEL["vocab_size"], (BATCH_PER_RANK, SEQ), generator=g)
            for name, (model, opt) in layouts.items():
                r = _step(model, opt, ids)
                if i:
                    rows[name].append(r)
        gathered = [None] * world
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            with open(result, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", help="also write the table as JSON here")
    args = ap.parse_args()

    from k2_model import K2Config
    from k2_model.stats import train_comm_bytes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = f"/tmp/ep_step_{os.getpid()}.json"
    mp.spawn(_worker, args=(args.procs, port, args.steps, result), nprocs=args.procs, join=True)
    with open(result) as f:
        per_rank = json.load(f)
    os.remove(result)

    cfg = K2Config.preset("tiny", **MODEL)
    tokens = BATCH_PER_RANK * SEQ
    print(
        f"ep_step: {args.procs} gloo processes, fp32 CPU, tiny MoE (hidden {cfg.hidden_size}, "
        f"{cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}), "
        f"{tokens} tokens per rank; median of {args.steps} steps; seconds per rank"
    )
    header = (
        f"{'layout':<14} {'rank':>4} " + " ".join(f"{c:>10}" for c in (*CATEGORIES, "wall")) + "  vs FSDP2"
    )
    print(header)
    table = []
    names = list(per_rank[0])
    for name in names:
        for r, rows in enumerate(per_rank):
            med = {k: _median([row[k] for row in rows[name]]) for k in rows[name][0]}
            base = _median([row["wall"] for row in per_rank[r][names[0]]])
            table.append({"layout": name, "rank": r, **med})
            cells = " ".join(f"{med[c]:>10.3f}" for c in (*CATEGORIES, "wall"))
            print(f"{name:<14} {r:>4} {cells}  {med['wall'] / base:>7.2f}x")
    ep = args.procs
    model = train_comm_bytes(cfg, tokens, args.procs, ep)
    counted = [row for row in table if row["layout"] != names[0]]
    mean = sum(row["a2a_bytes"] for row in counted) / len(counted)
    print(
        f"all-to-all bytes per rank per step (EP{ep}): counted "
        + ", ".join(
            f"rank {row['rank']} {row['a2a_bytes']:,.0f} ({row['a2a_offrank_bytes']:,.0f} off-rank)"
            for row in counted
        )
        + f"; mean {mean:,.0f} vs model {model.a2a_bytes:,} ({mean / model.a2a_bytes - 1:+.2%}); "
        f"model off-rank (balanced) {model.a2a_offrank_bytes:,}"
    )
    print(
        f"FSDP bytes per rank (model): all-gather {model.fsdp_all_gather_bytes:,} with EP vs "
        f"{train_comm_bytes(cfg, tokens, args.procs, 1).fsdp_all_gather_bytes:,} without; reduce-scatter "
        f"{model.fsdp_reduce_scatter_bytes:,} vs {train_comm_bytes(cfg, tokens, args.procs, 1).fsdp_reduce_scatter_bytes:,}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": table, "model": model.__dict__}, f, indent=2)


if __name__ == "__main__":
    main()

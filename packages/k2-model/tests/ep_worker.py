"""Worker for test_expert_parallel.py: one gloo run of a tiny K2 MoE under FSDP2 x EP.

    python ep_worker.py WORLD OUT_DIR EP [EP ...]

For each EP (one spawn, one process group, a fresh mesh and model per EP) every rank trains
STEPS MuonClip steps on its slice of the same global batches and writes `w{WORLD}_ep{EP}_rank{r}.pt`: the global loss per step, the router biases after each step, the full gradient of
the routed experts at step 1, the all-to-all bytes it counted next to its local expert loads,
and the final full parameters. `reference()` is the same training in one process.
"""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from k2_model import K2Config, K2ForCausalLM
from k2_model.testing import SMALL_OVERRIDES
from torch.distributed.elastic.utils.distributed import get_free_port

# 3 layers (dense, MoE, MoE), 8 experts top-2 (whole experts for ep = 2 and 4), a small vocab.
OVERRIDES = dict(SMALL_OVERRIDES, num_hidden_layers=3, n_routed_experts=8, vocab_size=256)
STEPS, BATCH, SEQ = 3, 4, 16
TAU = 0.04  # low enough that QK-Clip fires at this scale (the max logits are ~0.05)
BIAS_SPEED = 1e-2
CLIP = 1.0


def make_model() -> K2ForCausalLM:
    torch.manual_seed(0)
    model = K2ForCausalLM(K2Config.preset("tiny", **OVERRIDES))
    model.set_attention_impl("eager")
    return model.train()


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def make_optimizer(model):
    from k2_optim import MuonClip

    return MuonClip(model, lr=2e-2, weight_decay=0.1, tau=TAU, ns_dtype=torch.float32)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train(model, rank: int, world: int) -> dict:
    from k2_model.expert_parallel import COMM
    from k2_model.parallelize import clip_grad_norm_

    opt = make_optimizer(model)
    rows = BATCH // world
    rec: dict = {"loss": [], "bias": [], "max_logit": [], "comm": [], "load": []}
    for step, ids in enumerate(batches()):
        ids = ids[rank * rows : (rank + 1) * rows]
        COMM.reset()
        loss = model(ids, labels=ids).loss
        loss.backward()
        # as k2_train's Trainer: the norm over all parameters (DTensors on two meshes under EP)
        rec.setdefault("grad_norm", []).append(clip_grad_norm_(list(model.parameters()), CLIP))
        rec["comm"].append((COMM.sent_bytes, COMM.local_bytes, COMM.count_bytes))
        rec["load"].append(model.expert_load().clone())
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        rec["loss"].append(float(total) / world)
        if step == 0:
            rec["grad"] = {
                n: _full(p.grad) for n, p in model.named_parameters() if "experts." in n or "gate.weight" in n
            }
        opt.step()
        rec["max_logit"].append(opt.last_clip_stats()["max_logit"])
        opt.zero_grad()
        model.update_expert_bias(BIAS_SPEED)
        rec["bias"].append(torch.stack([r.e_score_correction_bias.clone() for r in model.moe_routers()]))
    rec["params"] = {n: _full(p) for n, p in model.named_parameters()}
    rec["clipped"] = opt.last_clip_stats()["fraction_ever_clipped"]
    return rec


def reference() -> dict:
    return train(make_model(), 0, 1)


def _worker(rank: int, world: int, eps: list[int], out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from k2_model.parallelize import parallelize

        for ep in eps:
            model = make_model()
            parallelize(model, data_parallel=True, ep=ep)
            rec = train(model, rank, world)
            rec["placements"] = {
                n: str(p.placements) for n, p in model.named_parameters() if "experts.gate_proj" in n
            }
            torch.save(rec, os.path.join(out, f"w{world}_ep{ep}_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
        gc.collect()  # gloo's threads joined now, not in static destructors at exit (docs/training.md)


if __name__ == "__main__":
    world, out, eps = int(sys.argv[1]), sys.argv[2], [int(a) for a in sys.argv[3:]]
    os.makedirs(out, exist_ok=True)
    mp.spawn(_worker, args=(world, eps, out, get_free_port()), nprocs=world, join=True)

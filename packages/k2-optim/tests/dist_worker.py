"""Worker for test_distributed.py: run as a script, spawns `world` gloo processes on CPU.

    python dist_worker.py WORLD OUT_DIR

Each process runs both scenarios (FSDP2 Muon, then the max-logit all-reduce), one spawn for both.
"""

import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class Net(nn.Module):
    """Odd row counts (uneven FSDP shards), a tall and a wide matrix, stacked experts, a fused matrix."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 20, bias=False)
        self.mid = nn.Linear(20, 7, bias=False)  # 7 rows: shards of 4 and 3
        self.fused = nn.Linear(7, 10, bias=False)  # two logical 5x7 matrices
        self.experts = nn.Parameter(torch.randn(4, 6, 10) * 0.3)
        self.out = nn.Linear(6, 3, bias=False)  # 3 rows over 2 ranks

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.fused(h))
        h = torch.einsum("bi,eoi->bo", h, self.experts)
        return self.out(h)


def make(seed=0):
    torch.manual_seed(seed)
    return Net()


def groups(model):
    fused = [model.fused.weight]
    rest = [p for n, p in model.named_parameters() if n != "fused.weight"]
    return [{"params": rest}, {"params": fused, "split_sizes": (5, 5)}]


def run_steps(model, opt, steps=3):
    g = torch.Generator().manual_seed(123)
    for _ in range(steps):
        x = torch.randn(8, 12, generator=g)
        y = torch.randn(8, 3, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def fsdp_worker(rank, world, out_dir):
    from k2_optim import Muon
    from torch.distributed.fsdp import fully_shard

    model = make()
    for m in (model.inp, model.mid, model.fused, model.out):
        fully_shard(m)
    fully_shard(model)
    opt = Muon(groups(model), lr=0.05, weight_decay=0.1, ns_dtype=torch.float32)
    run_steps(model, opt)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    sharded = {n: type(p).__name__ for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"params": full, "types": sharded}, f"{out_dir}/fsdp.pt")
    dist.barrier()


class FakeMaxLogits:
    """A QK-Clip protocol source whose recorded max logits differ per rank."""

    def __init__(self, rank):
        self.w = nn.Parameter(torch.ones(4, 3))  # 2 heads x 2 rows
        self.rank = rank

    def attention_max_logits(self):
        return torch.tensor([[50.0, 200.0]]) if self.rank == 0 else torch.tensor([[150.0, 20.0]])

    def reset_attention_max_logits(self):
        pass

    def qk_clip_layers(self):
        return [
            {
                "name": "l0",
                "num_heads": 2,
                "spans": [{"param": self.w, "stride": 2, "start": 0, "length": 2, "power": 1.0}],
            }
        ]


def maxlogit_worker(rank, world, out_dir):
    from k2_optim import MuonClip

    src = FakeMaxLogits(rank)
    opt = MuonClip(
        [{"params": [src.w], "algorithm": "adamw"}], lr=0.0, weight_decay=0.0, tau=100.0, qk_clip=src
    )
    src.w.grad = torch.zeros_like(src.w)
    opt.step()
    torch.save({"w": src.w.detach().clone(), "stats": opt.last_clip_stats()}, f"{out_dir}/maxlogit{rank}.pt")
    dist.barrier()


def mla_steps(model, opt, steps=2):
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 12), generator=g)
        opt.zero_grad()
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()


def make_mla():
    from k2_optim.testing import loud_mla_model

    return loud_mla_model(seed=3, gain=6.0)


MLA_KW = dict(lr=1e-2, weight_decay=0.1, tau=5.0, ns_dtype=torch.float32)


def muonclip_fsdp_worker(rank, world, out_dir):
    from k2_optim import MuonClip
    from torch.distributed.fsdp import fully_shard

    model = make_mla()
    model.train()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = MuonClip(model, **MLA_KW)
    mla_steps(model, opt)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"params": full, "stats": opt.last_clip_stats()}, f"{out_dir}/muonclip_fsdp.pt")
    dist.barrier()


def worker(rank, world, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    try:
        fsdp_worker(rank, world, out_dir)
        maxlogit_worker(rank, world, out_dir)
        muonclip_fsdp_worker(rank, world, out_dir)
    finally:
        dist.destroy_process_group()
        gc.collect()


if __name__ == "__main__":
    world, out_dir = int(sys.argv[1]), sys.argv[2]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(worker, args=(world, out_dir), nprocs=world, join=True)

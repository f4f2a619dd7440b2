"""Push a trainer's sharded weights into an inference model on every rank.

torchrun --nproc-per-node 2 packages/k2-ckpt/examples/update_module.py
"""

import torch
import torch.distributed as dist
from k2_ckpt import ModuleAdapter, ParameterServer, update_weights_from_ipc
from torch import nn

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)


def make_model() -> nn.Module:  # HF-style names: model.layers.{i}.mlp.down_proj.weight
    m = nn.Module()
    m.model = nn.Module()
    m.model.layers = nn.ModuleList(nn.ModuleDict({"mlp": nn.Linear(256, 256)}) for _ in range(8))
    return m.to(torch.bfloat16)


trained, engine = make_model(), make_model()  # the trainer's new weights; the engine's stale ones
# each training rank owns a shard (here: every world-th layer)
mine = {n: p.detach() for n, p in trained.named_parameters() if int(n.split(".")[2]) % world == rank}

ps = ParameterServer()
ps.register_checkpoint("step-100", named_tensors=mine)
print(f"rank {rank}: {len(ps.gather_metas('step-100'))} tensors across {world} ranks")


def req_func(zmq_handles: dict[str, str]) -> None:
    # normally an RPC to the inference engine (vLLM /collective_rpc, `k2 serve`); here the engine
    # lives in this process, so each rank's own receiver is called directly
    update_weights_from_ipc(zmq_handles[ps.device_id], ModuleAdapter(engine))


stats = ps.update("step-100", req_func, req_on_all_ranks=True)
same = all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), engine.state_dict().values()))
print(
    f"rank {rank}: {stats.nbytes / 2**20:.1f} MiB in {stats.num_buckets} buckets, {stats.seconds * 1e3:.0f} ms, "
    f"engine == trainer bitwise: {same}"
)
ps.close()
dist.destroy_process_group()

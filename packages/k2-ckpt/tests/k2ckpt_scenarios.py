"""Multi-rank scenarios the dist tests run in spawned gloo processes (importable by the children).

Each rank owns a disjoint set of tensors (HF-style names), forks its stand-in engine, and
every engine must end up with every rank's tensors. Verification is bitwise: BLAKE2b of each
tensor's bytes on the engine against the same digest of the bytes the owner registered.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from k2_ckpt.errors import UpdateError
from k2_ckpt.harness import EngineProcess, engines_req_func, host_digests, make_tensor
from k2_ckpt.server import ParameterServer, ServerConfig
from safetensors.torch import save_file

DTYPES = ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]
BIG = "model.embed_tokens.weight"  # larger than a bucket


def make_spec(world: int, per_rank: int = 10) -> dict:
    spec = {}
    for r in range(world):
        for i in range(per_rank):
            dt = DTYPES[(r + i) % len(DTYPES)]
            spec[f"model.layers.{r}.mlp.experts.{i}.down_proj.weight"] = (dt, [48, 80 + 8 * i])
        spec[f"model.layers.{r}.mlp.gate.e_score_correction_bias"] = ("float32", [16])
    spec[BIG] = ("bfloat16", [1024, 200])  # 400 KiB, owned by the last rank
    return spec


def owner_of(name: str, world: int) -> int:
    return world - 1 if name == BIG else int(name.split(".")[2])


def tensors_for(spec: dict, rank: int, world: int, version: int) -> dict[str, torch.Tensor]:
    return {n: make_tensor(n, dt, sh, version) for n, (dt, sh) in spec.items() if owner_of(n, world) == rank}


def all_host_digests(ps: ParameterServer, name: str) -> dict[str, str]:
    out: list = [None] * ps.world_size
    dist.all_gather_object(out, host_digests(ps, name))
    return {k: v for d in out for k, v in d.items()}


def _server(timeout_s: float = 20.0) -> ParameterServer:
    return ParameterServer(config=ServerConfig(max_bucket_bytes=64 << 10, timeout_s=timeout_s))


def correctness(rank: int, world: int, run_dir: str) -> dict:
    """fp32/bf16/fp16/fp8 bitwise; many buckets; a split tensor; files; repeats; re-register; subsets.

    The engines swap staged tensors in (assign=True): their weights are views of the server's
    receive arenas, so every later update checks that the live arena is never overwritten."""
    spec = make_spec(world)
    eng = EngineProcess(rank, spec, run_dir, timeout_s=30, assign=True)
    out: dict = {}
    try:
        ps = _server()
        req = engines_req_func(run_dir, world)
        ps.register_checkpoint("v1", named_tensors=tensors_for(spec, rank, world, 1))
        st = ps.update("v1", req)
        d1 = all_host_digests(ps, "v1")
        got = eng.digests()
        out["v1_bad"] = sorted(n for n in spec if got[n] != d1[n])
        out["v1_buckets"], out["bucket_bytes"], out["nbytes"] = st.num_buckets, st.bucket_bytes, st.nbytes
        out["dtypes"] = sorted({str(t.dtype) for t in eng_tensors_dtypes(spec)})

        # v2 from safetensors files (one in /dev/shm, one on disk), updated twice
        mine = tensors_for(spec, rank, world, 2)
        names = sorted(mine)
        files = [os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else run_dir, f"k2ckpt-test-{os.getpid()}-a.safetensors"),
                 os.path.join(run_dir, f"r{rank}-b.safetensors")]
        save_file({n: mine[n] for n in names[::2]}, files[0])
        save_file({n: mine[n] for n in names[1::2]}, files[1])
        try:
            ps.register_checkpoint("v2", files=files)
            for _ in range(2):
                ps.update("v2", req)
            d2 = all_host_digests(ps, "v2")
        finally:
            os.unlink(files[0])
        got = eng.digests()
        out["v2_bad"] = sorted(n for n in spec if got[n] != d2[n])
        out["v2_differs_from_v1"] = sum(d1[n] != d2[n] for n in spec)

        # unregister and re-register v1, then update back to it
        ps.unregister_checkpoint("v1")
        ps.register_checkpoint("v1", named_tensors=tensors_for(spec, rank, world, 1))
        ps.update("v1", req)
        got = eng.digests()
        out["v1_again_bad"] = sorted(n for n in spec if got[n] != d1[n])

        # only rank 0's receiver: the others keep v1
        ps.update("v2", req, ranks=[0])
        got = eng.digests()
        want = d2 if rank == 0 else d1
        out["subset_bad"] = sorted(n for n in spec if got[n] != want[n])

        # the two-slot path (what CUDA uses), on CPU: receivers copy out of reused slots
        ps.config.cpu_receive_arena = False
        slots = {}
        for name, ref in (("v1", d1), ("v2", d2)):
            st = ps.update(name, req)
            got = eng.digests()
            slots[name] = sorted(n for n in spec if got[n] != ref[n])
        out["slots_bad"], out["slots_bucket_bytes"] = slots, st.bucket_bytes
        ps.close()
        return out
    finally:
        eng.stop()


def eng_tensors_dtypes(spec: dict) -> list[torch.Tensor]:
    return [torch.empty(0, dtype=getattr(torch, dt)) for dt, _ in spec.values()]


def _expect_failure(ps: ParameterServer, name: str, req, **kw) -> tuple[UpdateError | None, float]:
    t0 = time.monotonic()
    try:
        ps.update(name, req, **kw)
    except UpdateError as e:
        return e, time.monotonic() - t0
    return None, time.monotonic() - t0


def _summary(e: UpdateError | None, dt: float) -> dict:
    if e is None:
        return {"raised": False}
    f = e.failures[0]
    return {"raised": True, "rank": f.rank, "kind": f.kind, "tensor": f.tensor, "traceback": f.traceback or "",
            "message": str(e), "status": e.status, "seconds": dt, "applied": e.applied,
            "ranks": sorted({x.rank for x in e.failures})}


def failures(rank: int, world: int, run_dir: str) -> dict:
    """Injected error, dtype/shape mismatch, direct-mode exact report, dead worker, hung worker."""
    spec = make_spec(world)
    eng = EngineProcess(rank, spec, run_dir, timeout_s=30, assign=True)
    out: dict = {}
    victim = "model.layers.0.mlp.experts.5.down_proj.weight"  # owned by rank 0, mid-plan
    try:
        ps = _server(timeout_s=20)
        req = engines_req_func(run_dir, world, timeout_s=30)
        ps.register_checkpoint("v1", named_tensors=tensors_for(spec, rank, world, 1))
        ps.register_checkpoint("v2", named_tensors=tensors_for(spec, rank, world, 2))
        ps.update("v1", req)
        d1 = all_host_digests(ps, "v1")
        d2 = all_host_digests(ps, "v2")

        def bad_vs(ref: dict) -> list[str]:
            got = eng.digests()
            return sorted(n for n in spec if got[n] != ref[n])

        # 1. a worker raises while loading `victim` (staged): everyone raises, nobody changes
        if rank == 1:
            eng.call("fault", mode="raise", tensor=victim)
        dist.barrier()
        out["raise"] = _summary(*_expect_failure(ps, "v2", req))
        out["raise_old_kept"] = bad_vs(d1)

        # 2. dtype and shape mismatch with the receiver
        mine = tensors_for(spec, rank, world, 2)
        if rank == 0:
            mine[victim] = mine[victim].float() if mine[victim].dtype != torch.float32 else mine[victim].half()
        else:
            b = f"model.layers.{rank}.mlp.gate.e_score_correction_bias"
            mine[b] = torch.zeros(17)
        ps.register_checkpoint("bad", named_tensors=mine)
        out["mismatch"] = _summary(*_expect_failure(ps, "bad", req))
        out["mismatch_old_kept"] = bad_vs(d1)

        # 3. direct mode: the report names exactly what was applied
        eng.call("mode", staged=False)
        if rank == 1:
            eng.call("fault", mode="raise", tensor=victim)
        dist.barrier()
        out["direct"] = _summary(*_expect_failure(ps, "v2", req))
        applied = set(out["direct"]["applied"].get(rank, []))
        got = eng.digests()
        out["direct_exact"] = all((got[n] == d2[n]) if n in applied else (got[n] == d1[n]) for n in spec)
        out["direct_applied"] = len(applied)
        eng.call("mode", staged=True)
        ps.update("v1", req)  # back to a clean v1 everywhere
        out["v1_restored"] = bad_vs(d1)

        # 4. the worker on rank 1 hangs (for 6 s): update fails within its 3 s timeout
        if rank == 1:
            eng.call("fault", mode="hang", tensor=victim, hang_s=6.0)
        dist.barrier()
        out["hang"] = _summary(*_expect_failure(ps, "v2", req, timeout_s=3.0))
        out["hang_old_kept"] = bad_vs(d1)  # waits until the hung engine is back

        # 5. the worker on rank 1 dies mid-update
        if rank == 1:
            eng.call("fault", mode="die", tensor=victim)
        dist.barrier()
        out["die"] = _summary(*_expect_failure(ps, "v2", req))
        if rank == 0:
            out["die_old_kept"] = bad_vs(d1)
        ps.close()
        return out
    finally:
        eng.stop()


def api_rank(rank: int, world: int, run_dir: str) -> dict:
    """Serve this rank's parameter-server API and a receiver app (in a forked engine) on Unix
    sockets until the test writes `stop`; the test process drives everything over HTTP."""
    import multiprocessing as mp

    from k2_ckpt.api import BackgroundServer, make_server_app

    spec = api_spec(world)
    eng = mp.get_context("fork").Process(target=_receiver_main, args=(rank, spec, run_dir), daemon=True)
    eng.start()
    ps = ParameterServer(config=ServerConfig(max_bucket_bytes=32 << 10, timeout_s=20))
    srv = BackgroundServer(make_server_app(ps), uds=os.path.join(run_dir, f"ps-{rank}.sock")).start()
    open(os.path.join(run_dir, f"ready-{rank}"), "w").close()
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(run_dir, "stop")) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"served": True}
    finally:
        srv.stop()
        eng.kill()
        ps.close()


def api_spec(world: int) -> dict:
    spec = {}
    for r in range(world):
        for i, dt in enumerate(DTYPES):
            spec[f"model.layers.{r}.self_attn.{i}.q_b_proj.weight"] = (dt, [40, 64 + 32 * i])
    return spec


def _receiver_main(rank: int, spec: dict, run_dir: str) -> None:
    from k2_ckpt.adapters import ModuleAdapter
    from k2_ckpt.api import BackgroundServer, make_receiver_app
    from k2_ckpt.device import device_id
    from k2_ckpt.harness import build_module, digest

    module = build_module(spec)
    app = make_receiver_app(ModuleAdapter(module), device_id(torch.device("cpu"), rank), timeout_s=20)

    @app.get("/v1/digests")
    def digests() -> dict:
        return {n: digest(t) for n, t in module.state_dict().items()}

    srv = BackgroundServer(app, uds=os.path.join(run_dir, f"recv-{rank}.sock")).start()
    srv.thread.join()


def engine_integrations(rank: int, world: int) -> dict:
    """The vLLM worker extension and the SGLang path, driven in-process against fakes that
    expose only the public attributes they use (vLLM itself is stubbed in sys.modules)."""
    import sys
    import types

    from k2_ckpt.adapters.sglang import sglang_update_weights_from_ipc
    from k2_ckpt.adapters.vllm import VllmWorkerExtension
    from torch import nn

    calls = []
    mods = ["vllm", "vllm.model_executor", "vllm.model_executor.model_loader", "vllm.model_executor.model_loader.utils"]
    for m in mods:
        sys.modules[m] = types.ModuleType(m)
    sys.modules[mods[-1]].process_weights_after_loading = lambda model, cfg, dev: calls.append((cfg, str(dev)))

    class FakeModel(nn.Module):  # an engine model: load_weights takes (name, tensor) pairs
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(64, 32, dtype=torch.bfloat16), requires_grad=False)
            self.b = nn.Parameter(torch.zeros(64), requires_grad=False)
            self.seen: list[str] = []

        def load_weights(self, weights):
            for name, t in weights:
                self.seen.append(name)
                getattr(self, name.split(".")[-1]).data.copy_(t)

    new = {"model.w": make_tensor("model.w", "bfloat16", [64, 32], 3), "model.b": make_tensor("model.b", "float32", [64], 3)}
    ps = _server()
    ps.register_checkpoint("c", named_tensors=new)
    out = {}

    vworker = VllmWorkerExtension()
    vworker.device, vworker.model_config = torch.device("cpu"), "model-config"
    vworker.model_runner = types.SimpleNamespace(model=FakeModel())
    ps.update("c", lambda h: vworker.update_weights_from_ipc(h))
    m = vworker.model_runner.model
    out["vllm_equal"] = torch.equal(m.w, new["model.w"]) and torch.equal(m.b, new["model.b"])
    out["vllm_post_hook"] = calls

    runner = types.SimpleNamespace(model=FakeModel(), device="cpu")
    ps.update("c", lambda h: sglang_update_weights_from_ipc(runner, h))
    out["sglang_equal"] = torch.equal(runner.model.w, new["model.w"]) and torch.equal(runner.model.b, new["model.b"])
    out["sglang_seen"] = sorted(runner.model.seen)
    ps.close()
    return out

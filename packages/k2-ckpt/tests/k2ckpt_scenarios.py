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
from k2_ckpt.adapters import ModuleAdapter
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
        files = [
            os.path.join(
                "/dev/shm" if os.path.isdir("/dev/shm") else run_dir,
                f"k2ckpt-test-{os.getpid()}-a.safetensors",
            ),
            os.path.join(run_dir, f"r{rank}-b.safetensors"),
        ]
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
    return {
        "raised": True,
        "rank": f.rank,
        "kind": f.kind,
        "tensor": f.tensor,
        "traceback": f.traceback or "",
        "message": str(e),
        "status": e.status,
        "seconds": dt,
        "applied": e.applied,
        "ranks": sorted({x.rank for x in e.failures}),
    }


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
            mine[victim] = (
                mine[victim].float() if mine[victim].dtype != torch.float32 else mine[victim].half()
            )
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
    mods = [
        "vllm",
        "vllm.model_executor",
        "vllm.model_executor.model_loader",
        "vllm.model_executor.model_loader.reload",
    ]
    for m in mods:
        sys.modules[m] = types.ModuleType(m)
    # vLLM's layerwise reload, around the model's load_weights
    sys.modules[mods[-1]].initialize_layerwise_reload = lambda model: calls.append("initialize")
    sys.modules[mods[-1]].finalize_layerwise_reload = lambda model, cfg: calls.append(("finalize", cfg.tag))

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
            return {name.split(".")[-1] for name in self.seen}

    new = {
        "model.w": make_tensor("model.w", "bfloat16", [64, 32], 3),
        "model.b": make_tensor("model.b", "float32", [64], 3),
    }
    ps = _server()
    ps.register_checkpoint("c", named_tensors=new)
    out = {}

    import tempfile

    from safetensors.torch import save_file

    served = tempfile.mkdtemp()  # the checkpoint vLLM was started from: updates are checked against it
    save_file({k: torch.zeros_like(v) for k, v in new.items()}, f"{served}/model.safetensors")
    vworker = VllmWorkerExtension()
    vworker.device = torch.device("cpu")
    vworker.model_config = types.SimpleNamespace(model=served, tag="model-config")
    vworker.model_runner = types.SimpleNamespace(model=FakeModel())
    ps.update("c", lambda h: vworker.update_weights_from_ipc(h))
    m = vworker.model_runner.model
    out["vllm_equal"] = torch.equal(m.w, new["model.w"]) and torch.equal(m.b, new["model.b"])
    out["vllm_post_hook"] = calls

    runner = types.SimpleNamespace(model=FakeModel(), device="cpu")
    ps.update("c", lambda h: sglang_update_weights_from_ipc(runner, h))
    out["sglang_equal"] = torch.equal(runner.model.w, new["model.w"]) and torch.equal(
        runner.model.b, new["model.b"]
    )
    out["sglang_seen"] = sorted(runner.model.seen)
    ps.close()
    return out


class _FaultyAdapter(ModuleAdapter):
    """ModuleAdapter whose next validate / post_load / load can be made to fail or stall."""

    fail_validate = fail_post = False
    slow_load: tuple[str, float] | None = None

    def validate(self, name, dtype, shape):
        if self.fail_validate:
            self.fail_validate = False
            raise RuntimeError("injected staging failure")
        super().validate(name, dtype, shape)

    def load_weights(self, named):
        named = list(named)
        if self.slow_load and any(n == self.slow_load[0] for n, _ in named):
            delay, self.slow_load = self.slow_load[1], None
            time.sleep(delay)
        super().load_weights(named)

    def post_load(self):
        super().post_load()
        if self.fail_post:
            self.fail_post = False
            raise RuntimeError("injected commit failure")


def consistency(rank: int, world: int) -> dict:
    """Receivers in the ranks' own processes (`req_on_all_ranks`), swapping staged tensors in
    (assign=True), so their weights are views of the server's receive arenas. Each case ends
    with a failed update, after which every engine must hold exactly one complete set."""
    from k2_ckpt.harness import build_module
    from k2_ckpt.worker import update_weights_from_ipc

    names = [f"model.layers.{r}.w{i}" for r in range(world) for i in range(3)]
    spec = {n: ("float32", [64, 64]) for n in names}
    module = build_module(spec)
    ad = _FaultyAdapter(module, assign=True)
    ps = ParameterServer(config=ServerConfig(max_bucket_bytes=32 << 10, timeout_s=10))
    mode = {"staged": True, "timeout_s": 10.0}

    def register(name: str, value: float, keep=lambda n: True) -> None:
        ps.register_checkpoint(
            name,
            named_tensors={
                n: torch.full((64, 64), value) for n in names if int(n.split(".")[2]) == rank and keep(n)
            },
        )

    def req(handles):
        loader = ad
        if mode.get("fresh"):  # a new adapter for every update, as in the README example
            loader = _FaultyAdapter(module, assign=True)
            loader.fail_validate = mode.pop("fail_next", False)
        return update_weights_from_ipc(
            handles[ps.device_id], loader, staged=mode["staged"], timeout_s=mode["timeout_s"]
        )

    def values() -> dict[str, float]:  # every tensor is constant: one number each, or "mixed"
        sd = module.state_dict()
        return {n: float(sd[n][0, 0]) if bool((sd[n] == sd[n][0, 0]).all()) else "mixed" for n in names}

    def update(name: str, **kw) -> str:
        try:
            ps.update(name, req, req_on_all_ranks=True, **kw)
            return "ok"
        except UpdateError as e:
            return e.failures[0].kind

    for v in (1, 2, 3, 4, 5, 6):
        register(f"v{v}", float(v))
    register("part", 7.0, keep=lambda n: not n.endswith("w2"))
    out: dict = {}
    out["v1"] = update("v1")
    # 1. a direct-mode update (copies into the swapped-in tensors), then a failed staged one
    mode["staged"] = False
    out["v5"] = update("v5")
    mode["staged"] = True
    ad.fail_validate = rank == 1
    out["v6"] = update("v6")
    out["after_v6"] = values()
    # 2. rank 1's commit fails after it swapped the tensors in: rank 0 committed v2
    ad.fail_post = rank == 1
    out["v2"] = update("v2")
    out["after_v2"] = values()
    ad.fail_validate = rank == 1  # then an update that fails before the commit
    out["v3"] = update("v3")
    out["after_v3"] = values()
    # 3. a checkpoint without some tensors (w2): they keep their older values, and a later
    # failed update must not overwrite them through the arena they used to view
    out["part"] = update("part")
    out["after_part"] = values()
    ad.fail_validate = rank == 1
    out["v4"] = update("v4")
    out["after_v4"] = values()
    # 4. a staged commit that swaps nothing in (a copy commit) after swapping ones, then a failed
    # update: the tensors swapped in earlier must not still view a buffer the server reuses
    # (full-size updates throughout: a receive arena of another size would be made afresh)
    out["v2_swap"] = update("v2")
    ad.assign = False
    out["v5_copy"] = update("v5")
    ad.assign = True
    ad.fail_validate = rank == 1
    out["v6_after_copy"] = update("v6")
    out["after_v6_copy"] = values()
    # 5. the same with a new adapter for every update: a subset checkpoint, then a failure
    mode["fresh"] = True
    out["v2_fresh"] = update("v2")
    out["part_fresh"] = update("part")
    out["after_part_fresh"] = values()
    mode["fail_next"] = rank == 1
    out["v4_fresh"] = update("v4")
    out["after_v4_fresh"] = values()
    mode["fresh"] = False
    # 6. the engine writes into its swapped-in weights in place, then the same checkpoint is
    # pushed again: every engine gets the registered bytes, not its own writes
    out["v5_assign"] = update("v5")
    with torch.no_grad():
        for p in module.parameters():
            p.add_(100.0)
    out["v5_again"] = update("v5")
    out["after_v5_again"] = values()
    # 7. the two-slot path in direct mode: rank 1's receiver stalls 2 s on one tensor, its
    # server times out after 0.5 s and keeps broadcasting until the vote, but not into the
    # slots the stalled receiver still reads: whatever it loads late is the right tensor
    ps.config.cpu_receive_arena = False
    mode["staged"] = False
    slow = f"model.layers.0.w{1}"
    ad.slow_load = (slow, 2.0) if rank == 1 else None
    try:
        ps.update("v1", req, req_on_all_ranks=True, timeout_s=0.5)
        out["slow"] = "ok"
    except UpdateError as e:
        out["slow"] = e.failures[0].kind
        out["slow_applied"] = {str(r): a for r, a in e.applied.items()}
    time.sleep(2.5)  # the stalled receiver finishes what it was loading
    out["after_slow"] = values()
    ps.close()
    return out


def registration_errors(rank: int, world: int) -> dict:
    """A registration that fails part-way frees what it had allocated (its /dev/shm arena)."""
    import glob

    from k2_ckpt.buffer import SHM_DIR
    from k2_ckpt.errors import BadCheckpoint

    def my_files() -> list[str]:
        return sorted(glob.glob(os.path.join(SHM_DIR, f"k2ckpt-*-{os.getpid()}-*.buf")))

    ps = _server()
    before = my_files()
    out: dict = {}
    try:  # the second "x" fails after the arena for both was made
        ps.register_checkpoint("dup", named_tensors=[("x", torch.zeros(1024)), ("x", torch.ones(1024))])
    except BadCheckpoint as e:
        out["error"] = str(e)
    out["leaked"] = [f for f in my_files() if f not in before]
    out["registered"] = ps.checkpoints()
    ps.register_checkpoint("ok", named_tensors={"x": torch.zeros(1024)})
    out["after_ok"] = len(my_files()) - len(before)
    try:  # a timeout the server group's collectives could not wait out is refused up front
        ps.update("ok", lambda handles: None, timeout_s=1e5)
    except ValueError as e:
        out["timeout_error"] = str(e)
    ps.close()
    out["after_close"] = len(my_files()) - len(before)
    return out

"""`k2 ckpt bench`: update throughput against a raw `torch.distributed.broadcast` of the same bytes.

Each of N gloo ranks registers `size_mb / N` MB of random named tensors (bf16 and fp32 expert
weights, and one tensor larger than a bucket), forks its stand-in engine, and runs timed
updates. In the same run it times a raw broadcast of the same bytes, owner by owner, from
buffers that are already filled (no host copy, no receiver): the anchor the update is measured
against, both in bucket-sized chunks and in one call per owner (the faster one counts).
Every tensor is verified bitwise on every engine (BLAKE2b digests of the bytes).
Update and raw repeats are interleaved; the headline numbers are the best of the repeats on
both sides (the least disturbed by other load on a shared machine); medians are reported too,
and the median of the per-repeat ratios (each update against the raw broadcast right after it).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from k2_ckpt.dtypes import dtype_from_name
from k2_ckpt.harness import EngineProcess, engines_req_func, host_digests, make_tensor
from k2_ckpt.server import ParameterServer, ServerConfig


@dataclass
class BenchConfig:
    ranks: int = 2
    size_mb: float = 256.0
    bucket_mb: float = 32.0
    repeats: int = 10  # the machine's load comes and goes: more pairs, steadier best-of numbers
    tensor_mb: float = 4.0  # typical tensor size
    staged: bool = True
    assign: bool = True  # staged commit by swapping tensors in (ModuleAdapter(assign=True))
    agree_every: int = 4  # ServerConfig.agree_every
    num_slots: int = 2


def _spec(cfg: BenchConfig) -> dict:
    per_rank = cfg.size_mb * 2**20 / cfg.ranks
    spec: dict = {}
    for r in range(cfg.ranks):
        # one tensor 1.5x the bucket (split across buckets), then tensor_mb-sized ones; capped at
        # the rank's share, so the total is --size-mb (with size/ranks <= bucket, no tensor spans)
        big = int(min(1.5 * cfg.bucket_mb * 2**20, per_rank)) // 4
        cols = 1024
        spec[f"model.layers.{r}.embed.weight"] = ("float32", [max(1, big // cols), cols])
        left = per_rank - spec_nbytes(spec, r)
        i = 0
        while left > 0:
            dt = "bfloat16" if i % 2 == 0 else "float32"
            elems = int(min(left, cfg.tensor_mb * 2**20)) // (2 if dt == "bfloat16" else 4)
            rows = max(1, elems // cols)
            spec[f"model.layers.{r}.mlp.experts.{i}.down_proj.weight"] = (dt, [rows, cols])
            left -= rows * cols * (2 if dt == "bfloat16" else 4)
            i += 1
    return spec


def spec_nbytes(spec: dict, rank: int) -> int:
    size = {"float32": 4, "bfloat16": 2}
    return sum(size[dt] * sh[0] * sh[1] for n, (dt, sh) in spec.items() if n.split(".")[2] == str(rank))


def _raw_broadcast(ps: ParameterServer, name: str, bucket_bytes: int, chunked: bool, repeats: int) -> float:
    """Seconds for broadcasting every owner's bytes from pre-filled buffers (median of repeats)."""
    metas = ps.gather_metas(name)
    per_owner: dict[int, int] = {}
    for m in metas:
        per_owner[m.owner] = per_owner.get(m.owner, 0) + m.nbytes
    bufs = {o: torch.ones(n, dtype=torch.uint8) for o, n in per_owner.items()}
    times = []
    for _ in range(repeats):
        dist.barrier(group=ps.group)
        t0 = time.perf_counter()
        for owner, buf in bufs.items():
            step = bucket_bytes if chunked else buf.numel()
            for s in range(0, buf.numel(), step):
                dist.broadcast(buf[s : s + step], src=owner, group=ps.group)
        dist.barrier(group=ps.group)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_rank(rank: int, world: int, cfg: BenchConfig, run_dir: str) -> dict:
    spec = _spec(cfg)
    eng = EngineProcess(rank, spec, run_dir, staged=cfg.staged, timeout_s=120, assign=cfg.assign)
    try:
        torch.set_num_threads(1)
        ps = ParameterServer(
            config=ServerConfig(
                max_bucket_bytes=int(cfg.bucket_mb * 2**20),
                timeout_s=120,
                agree_every=cfg.agree_every,
                num_slots=cfg.num_slots,
            )
        )
        mine = {n: make_tensor(n, dt, sh, 1) for n, (dt, sh) in spec.items() if n.split(".")[2] == str(rank)}
        ps.register_checkpoint("bench", named_tensors=mine)
        del mine
        req = engines_req_func(run_dir, world, timeout_s=300)
        for _ in range(2):  # warm-up: page in both receive arenas, connect sockets
            ps.update("bench", req)
        # interleave update and raw-broadcast repeats so both see the same machine load
        times, raw_chunked, raw_whole, stats = [], [], [], None
        for _ in range(cfg.repeats):
            dist.barrier(group=ps.group)
            t0 = time.perf_counter()
            stats = ps.update("bench", req)
            times.append(time.perf_counter() - t0)
            raw_chunked.append(_raw_broadcast(ps, "bench", stats.bucket_bytes, True, 1))
            raw_whole.append(_raw_broadcast(ps, "bench", stats.bucket_bytes, False, 1))
        # best of the repeats on both sides (as timeit does): the least disturbed by other load
        update_s = min(times)
        raw_chunked_s, raw_whole_s = min(raw_chunked), min(raw_whole)
        raw_median_s = min(statistics.median(raw_chunked), statistics.median(raw_whole))
        # bitwise verification on every engine against every owner's registered bytes
        want: list = [None] * world
        dist.all_gather_object(want, host_digests(ps, "bench"), group=ps.group)
        want_all = {k: v for d in want for k, v in d.items()}
        got = eng.digests()
        bad = sorted(n for n in spec if got.get(n) != want_all[n])
        ok = torch.tensor([0 if bad else 1], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=ps.group)
        nbytes = stats.nbytes
        raw_s = min(raw_chunked_s, raw_whole_s)
        ps.close()
        return {
            "ranks": world,
            "size_mb": nbytes / 2**20,
            "bucket_mb": stats.bucket_bytes / 2**20,
            "num_buckets": stats.num_buckets,
            "tensors": len(spec),
            "staged": cfg.staged,
            "assign": cfg.assign,
            "verified": bool(ok.item()),
            "mismatched": bad[:5],
            "update_s": update_s,
            "update_gbps": nbytes / update_s / 1e9,
            "raw_broadcast_s": raw_s,
            "raw_broadcast_gbps": nbytes / raw_s / 1e9,
            "raw_chunked_gbps": nbytes / raw_chunked_s / 1e9,
            "raw_whole_gbps": nbytes / raw_whole_s / 1e9,
            "ratio": raw_s / update_s,
            "median_update_gbps": nbytes / statistics.median(times) / 1e9,
            "median_raw_broadcast_gbps": nbytes / raw_median_s / 1e9,
            "median_ratio": raw_median_s / statistics.median(times),
            # each update against the raw broadcast timed right after it, under the same load
            "paired_ratio_median": statistics.median(
                min(c, w) / t for t, c, w in zip(times, raw_chunked, raw_whole)
            ),
            "update_times_s": times,
            "phases_s": stats.phases,
        }
    finally:
        eng.stop()


def run_bench(cfg: BenchConfig, timeout_s: float = 600.0) -> dict:
    """Run the benchmark on `cfg.ranks` local gloo ranks; returns rank 0's report."""
    from k2_ckpt.launch import run_world

    with tempfile.TemporaryDirectory(prefix="k2ckpt-bench-") as run_dir:
        results = run_world(cfg.ranks, bench_rank, (cfg, run_dir), timeout_s=timeout_s)
    out = results[0]
    out["config"] = asdict(cfg)
    return out


# ---- the model benchmark (`benchmarks/ckpt_update.py`): a K2-shaped bf16 model, CPU or CUDA ----
#
# Shape legend for the spec: H hidden, V vocab, L layers, E routed experts, I dense FFN width,
# M expert FFN width, Q q_lora rank, K kv_lora rank, N heads, D nope head dim, R rope head dim.


def k2_like_dims(params: float) -> dict[str, int]:
    """DeepSeek-V3/K2-style dimensions (MLA attention, first layer dense, then MoE layers with a
    shared expert), scaled so the model has about `params` parameters: wide enough at 1B to
    look like a small K2 (32 experts per layer, ~2.5k tensors), narrow below ~300M."""
    H = 1024 if params >= 3e8 else 256
    d = {
        "H": H,
        "V": 32000 if H >= 1024 else 8000,
        "E": 32 if H >= 1024 else 8,
        "I": H * 11 // 4,
        "M": H * 3 // 8,
        "Q": H * 3 // 8,
        "K": H // 4,
        "N": max(1, H // 128),
        "D": 64,
        "R": 32,
    }
    per_layer = _layer_params(d, moe=True)
    fixed = 2 * d["V"] * H + H + _layer_params(d, moe=False)  # embed, lm_head, final norm, dense layer 0
    d["L"] = 1 + max(1, round((params - fixed) / per_layer))
    return d


def _attn_shapes(d: dict[str, int]) -> dict[str, list[int]]:
    H, Q, K, N, D, R = d["H"], d["Q"], d["K"], d["N"], d["D"], d["R"]
    return {
        "q_a_proj.weight": [Q, H],
        "q_a_layernorm.weight": [Q],
        "q_b_proj.weight": [N * (D + R), Q],
        "kv_a_proj_with_mqa.weight": [K + R, H],
        "kv_a_layernorm.weight": [K],
        "kv_b_proj.weight": [N * (D + D), K],
        "o_proj.weight": [H, N * D],
    }


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _layer_params(d: dict[str, int], moe: bool) -> int:
    H = d["H"]
    attn = sum(_numel(s) for s in _attn_shapes(d).values()) + 2 * H
    if not moe:
        return attn + 3 * H * d["I"]
    return attn + (d["E"] + 1) * 3 * H * d["M"] + d["E"] * H + d["E"]


def k2_like_spec(params: float) -> dict[str, tuple[str, list[int]]]:
    """{HF name: (dtype, shape)} of a K2-shaped model with about `params` parameters, all bf16
    except the router's fp32 `e_score_correction_bias` (as in the released checkpoints)."""
    d = k2_like_dims(params)
    H, bf = d["H"], "bfloat16"
    spec: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": (bf, [d["V"], H])}
    for i in range(d["L"]):
        p = f"model.layers.{i}"
        spec[f"{p}.input_layernorm.weight"] = (bf, [H])
        for n, shape in _attn_shapes(d).items():
            spec[f"{p}.self_attn.{n}"] = (bf, shape)
        spec[f"{p}.post_attention_layernorm.weight"] = (bf, [H])
        if i == 0:  # first_k_dense_replace = 1
            ffn = {"mlp": d["I"]}
        else:
            spec[f"{p}.mlp.gate.weight"] = (bf, [d["E"], H])
            spec[f"{p}.mlp.gate.e_score_correction_bias"] = ("float32", [d["E"]])
            ffn = {f"mlp.experts.{e}": d["M"] for e in range(d["E"])} | {"mlp.shared_experts": d["M"]}
        for q, width in ffn.items():
            spec[f"{p}.{q}.gate_proj.weight"] = (bf, [width, H])
            spec[f"{p}.{q}.up_proj.weight"] = (bf, [width, H])
            spec[f"{p}.{q}.down_proj.weight"] = (bf, [H, width])
    spec["model.norm.weight"] = (bf, [H])
    spec["lm_head.weight"] = (bf, [d["V"], H])
    return spec


def spec_params(spec: dict[str, tuple[str, list[int]]]) -> int:
    return sum(_numel(sh) for _, sh in spec.values())


def owner_rank(name: str, world: int) -> int:
    """Layers round-robin over the ranks (like pipeline stages); the embedding on rank 0, the
    final norm and lm_head on the last rank."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        return int(parts[2]) % world
    return 0 if parts[1] == "embed_tokens" else world - 1


def _random_tensor(name: str, dtype: str, shape: list[int], device: torch.device) -> torch.Tensor:
    """Deterministic per name; generated on the GPU when there is one (1B CPU randn is slow)."""
    if device.type != "cuda":
        return make_tensor(name, dtype, shape, 1)
    import hashlib

    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype_from_name(dtype))


@dataclass
class ModelBenchConfig:
    device: str = "cuda"  # "cuda" or "cpu"
    ranks: int = 1  # one GPU per rank; the lent GPU machine has one
    params: float = 1e9
    bucket_mb: float = 256.0
    repeats: int = 5
    staged: bool = True
    assign: bool = True


def _sync(ps: ParameterServer) -> None:
    """A cross-rank sync point on the server's own group (a barrier that also drains CUDA work)."""
    flag = torch.zeros(1, dtype=torch.int32, device=ps.device)
    dist.all_reduce(flag, group=ps.group)
    if ps.device.type == "cuda":
        torch.cuda.synchronize(ps.device)


def _raw_broadcast_on(ps: ParameterServer, bufs: dict[int, torch.Tensor], step: int | None) -> float:
    """Seconds to broadcast every owner's pre-filled bytes (in `step`-byte chunks, or whole)."""
    _sync(ps)
    t0 = time.perf_counter()
    for owner, buf in bufs.items():
        n = buf.numel()
        for s in range(0, n, step or n):
            dist.broadcast(buf[s : s + (step or n)], src=owner, group=ps.group)
    _sync(ps)
    return time.perf_counter() - t0


def _pinned_h2d(nbytes: int, step: int, device: torch.device, repeats: int) -> tuple[float, float]:
    """Best seconds of a pinned host -> device `copy_` of `nbytes`: (whole, in `step` chunks)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm-up: maps the pages, sets up the copy engines
    torch.cuda.synchronize(device)
    best = {True: float("inf"), False: float("inf")}
    for _ in range(repeats):
        for chunked in (False, True):
            t0 = time.perf_counter()
            size = step if chunked else nbytes
            for s in range(0, nbytes, size):
                dst[s : s + size].copy_(src[s : s + size], non_blocking=True)
            torch.cuda.synchronize(device)
            best[chunked] = min(best[chunked], time.perf_counter() - t0)
    if not torch.equal(dst[:4096].cpu(), src[:4096]):
        raise RuntimeError("pinned H2D anchor: copied bytes differ")
    return best[False], best[True]


def model_bench_rank(rank: int, world: int, cfg: ModelBenchConfig, run_dir: str) -> dict:
    device = torch.device("cuda", rank) if cfg.device == "cuda" else torch.device("cpu")
    spec = k2_like_spec(cfg.params)
    eng = EngineProcess(
        rank, spec, run_dir, staged=cfg.staged, timeout_s=300, assign=cfg.assign, device=str(device)
    )
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ps = ParameterServer(
            device=device,
            config=ServerConfig(
                max_bucket_bytes=int(cfg.bucket_mb * 2**20), timeout_s=120, time_h2d=device.type == "cuda"
            ),
        )
        t0 = time.perf_counter()
        mine = {
            n: _random_tensor(n, dt, sh, device)
            for n, (dt, sh) in spec.items()
            if owner_rank(n, world) == rank
        }
        gen_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ps.register_checkpoint("model", named_tensors=mine)  # pinned host arena on CUDA
        register_s = time.perf_counter() - t0
        del mine
        if device.type == "cuda":
            torch.cuda.empty_cache()
        eng.wait_ready(timeout_s=180)
        ids: list = [None] * world
        dist.all_gather_object(ids, ps.device_id, group=ps.group)
        req = engines_req_func(run_dir, world, timeout_s=300, device_ids=ids)
        for _ in range(2):  # warm-up: IPC mappings, staging buffers, NCCL communicator
            ps.update("model", req)
        metas = ps.gather_metas("model")
        per_owner: dict[int, int] = {}
        for m in metas:
            per_owner[m.owner] = per_owner.get(m.owner, 0) + m.nbytes
        raw_bufs = {o: torch.ones(n, dtype=torch.uint8, device=device) for o, n in per_owner.items()}
        times, h2d, raw, stats = [], [], [], None
        for _ in range(cfg.repeats):  # interleaved, so both see the same machine state
            _sync(ps)
            t0 = time.perf_counter()
            stats = ps.update("model", req)
            times.append(time.perf_counter() - t0)
            if stats.h2d_s:
                h2d.append(stats.h2d_bytes / stats.h2d_s / 1e9)
            raw.append(
                min(
                    _raw_broadcast_on(ps, raw_bufs, stats.bucket_bytes), _raw_broadcast_on(ps, raw_bufs, None)
                )
            )
        del raw_bufs
        assert stats is not None
        pinned = None
        if device.type == "cuda" and per_owner.get(rank):
            pinned = _pinned_h2d(per_owner[rank], stats.bucket_bytes, device, cfg.repeats)
        # bitwise verification on every engine against every owner's registered bytes
        t0 = time.perf_counter()
        want: list = [None] * world
        dist.all_gather_object(want, host_digests(ps, "model"), group=ps.group)
        want_all = {k: v for d in want for k, v in d.items()}
        got = eng.call("digest", timeout_s=300)
        bad = sorted(n for n in spec if got.get(n) != want_all[n])
        ok = torch.tensor([0 if bad else 1], dtype=torch.int32, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=ps.group)
        verify_s = time.perf_counter() - t0
        nbytes, update_s, raw_s = stats.nbytes, min(times), min(raw)
        out = {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "ranks": world,
            "params": spec_params(spec),
            "tensors": len(spec),
            "model_gb": nbytes / 1e9,
            "bucket_mb": stats.bucket_bytes / 2**20,
            "num_buckets": stats.num_buckets,
            "staged": cfg.staged,
            "assign": cfg.assign,
            "verified": bool(ok.item()),
            "mismatched": bad[:5],
            "update_s": update_s,
            "update_gbps": nbytes / update_s / 1e9,
            "median_update_s": statistics.median(times),
            "update_times_s": times,
            "raw_broadcast_s": raw_s,
            "raw_broadcast_gbps": nbytes / raw_s / 1e9,
            "ratio": raw_s / update_s,
            "h2d_pipeline_gbps": max(h2d) if h2d else None,
            "pinned_copy_gbps": per_owner[rank] / min(pinned) / 1e9 if pinned else None,
            "pinned_copy_whole_gbps": per_owner[rank] / pinned[0] / 1e9 if pinned else None,
            "pinned_copy_chunked_gbps": per_owner[rank] / pinned[1] / 1e9 if pinned else None,
            "phases_s": stats.phases,
            "generate_s": gen_s,
            "register_s": register_s,
            "verify_s": verify_s,
        }
        out["h2d_ratio"] = (
            out["h2d_pipeline_gbps"] / out["pinned_copy_gbps"]
            if out["h2d_pipeline_gbps"] and out["pinned_copy_gbps"]
            else None
        )
        out["update_vs_pinned_copy"] = (
            out["update_gbps"] / out["pinned_copy_gbps"] if out["pinned_copy_gbps"] else None
        )
        notes = []
        if world == 1:
            notes.append(
                "world size 1: the broadcast has no peer (NCCL/gloo launch cost only), so 'ratio' "
                "is not the 2+ rank target; the overlap of broadcast k+1 with loading k across "
                "GPUs needs 2+ GPUs"
                + (
                    ". Here the update is bounded by H2D: see update_vs_pinned_copy"
                    if device.type == "cuda"
                    else ""
                )
            )
        out["notes"] = notes
        ps.close()
        return out
    finally:
        eng.stop()


def run_model_bench(cfg: ModelBenchConfig, timeout_s: float = 600.0) -> dict:
    """Run the model benchmark on `cfg.ranks` local ranks; returns rank 0's report."""
    from k2_ckpt.launch import run_world

    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("ModelBenchConfig.device='cuda' but torch sees no CUDA GPU")
        if cfg.ranks > torch.cuda.device_count():
            raise ValueError(
                f"ranks={cfg.ranks}: one GPU per rank, but only {torch.cuda.device_count()} visible"
            )
    elif cfg.device != "cpu":
        raise ValueError(f"device={cfg.device!r}: expected 'cpu' or 'cuda'")
    with tempfile.TemporaryDirectory(prefix="k2ckpt-mbench-") as run_dir:
        results = run_world(cfg.ranks, model_bench_rank, (cfg, run_dir), timeout_s=timeout_s)
    out = results[0]
    out["config"] = asdict(cfg)
    return out

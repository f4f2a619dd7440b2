"""The CUDA path on one GPU with one rank (the lent GPU machine has one): pinned host arena,
H2D into the two-slot device buffer, NCCL broadcast (world size 1), CUDA IPC handoff to a
spawned engine process on the same GPU, staged load. Verified bitwise (BLAKE2b of every
tensor's bytes on the engine against the owner's registered bytes) for bf16, fp8 (e4m3, e5m2),
fp16 and fp32. Skipped without a GPU (root conftest); run by scripts/gpu_check.sh. The same
scenario also runs on the CPU path (a dry run, everywhere).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # the spawned rank imports this module's scenario by name

pytestmark = pytest.mark.dist  # the GPU tests are marked `cuda` one by one; the dry run is not

DTYPES = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float16", "float32"]
BIG = "model.embed_tokens.weight"  # 400 KiB: larger than the 64 KiB bucket, split over several
VICTIM = "model.layers.0.mlp.experts.3.down_proj.weight"


def cuda_spec() -> dict:
    spec = {
        f"model.layers.0.mlp.experts.{i}.down_proj.weight": (DTYPES[i % len(DTYPES)], [48, 80 + 8 * i])
        for i in range(15)
    }
    spec["model.layers.0.mlp.gate.e_score_correction_bias"] = ("float32", [16])
    spec[BIG] = ("bfloat16", [1024, 200])
    return spec


def cuda_scenario(rank: int, world: int, run_dir: str, device: str = "cuda") -> dict:
    """Runs in a spawned rank (gloo default group; the server makes its own NCCL group).
    `device="cpu"` runs the same steps on the CPU path (a dry run of the scenario itself)."""
    from k2_ckpt.errors import UpdateError
    from k2_ckpt.harness import EngineProcess, engines_req_func, host_digests, make_tensor
    from k2_ckpt.server import ParameterServer, ServerConfig
    from safetensors.torch import save_file

    spec = cuda_spec()
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    eng = EngineProcess(rank, spec, run_dir, timeout_s=60, assign=True, device=str(dev))
    out: dict = {}
    try:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        ps = ParameterServer(
            device=dev, config=ServerConfig(max_bucket_bytes=64 << 10, timeout_s=60, time_h2d=True)
        )
        out["engine_device_id"] = eng.wait_ready(timeout_s=180)
        out["server_device_id"] = ps.device_id
        req = engines_req_func(run_dir, world, timeout_s=120, device_ids=[ps.device_id])

        def bad_tensors(name: str) -> list[str]:
            want, got = host_digests(ps, name), eng.digests()
            return sorted(n for n in spec if got[n] != want[n])

        # v1 from named tensors (pinned arena), updated twice (slot buffer and IPC mapping reused)
        ps.register_checkpoint(
            "v1", named_tensors={n: make_tensor(n, dt, sh, 1) for n, (dt, sh) in spec.items()}
        )
        st = ps.update("v1", req)
        out["v1_bad"] = bad_tensors("v1")
        ps.update("v1", req)
        out["v1_again_bad"] = bad_tensors("v1")
        out.update(
            nbytes=st.nbytes,
            bucket_bytes=st.bucket_bytes,
            num_buckets=st.num_buckets,
            h2d_bytes=st.h2d_bytes,
            h2d_s=st.h2d_s,
        )
        v1 = eng.digests()

        # an injected receiver error: UpdateError naming rank and tensor, the engine keeps v1
        ps.register_checkpoint(
            "v2", named_tensors={n: make_tensor(n, dt, sh, 2) for n, (dt, sh) in spec.items()}
        )
        eng.call("fault", mode="raise", tensor=VICTIM)
        try:
            ps.update("v2", req)
            out["fault"] = None
        except UpdateError as e:
            f = e.failures[0]
            out["fault"] = {"rank": f.rank, "kind": f.kind, "tensor": f.tensor}
        out["fault_old_kept"] = sorted(n for n, d in eng.digests().items() if d != v1[n])

        # v2 through the same server after the abort, then v3 from a safetensors file (pinned mmap)
        ps.update("v2", req)
        out["v2_bad"] = bad_tensors("v2")
        out["v2_differs_from_v1"] = sum(eng.digests()[n] != v1[n] for n in spec)
        path = os.path.join(run_dir, "v3.safetensors")
        save_file({n: make_tensor(n, dt, sh, 3) for n, (dt, sh) in spec.items()}, path)
        ps.register_checkpoint("v3", files=[path])
        ps.update("v3", req)
        out["v3_bad"] = bad_tensors("v3")

        # direct mode: each bucket copied into the live weights on arrival
        eng.call("mode", staged=False)
        ps.update("v1", req)
        out["direct_bad"] = bad_tensors("v1")
        out["engine_dtypes"] = sorted({dt for dt, _ in spec.values()})

        # a receiver in the server's own process (the README example): CUDA cannot open an IPC
        # handle where it was made, so the receiver gets the server's buffer itself
        from k2_ckpt.adapters import ModuleAdapter
        from k2_ckpt.dtypes import as_bytes
        from k2_ckpt.harness import build_module
        from k2_ckpt.worker import update_weights_from_ipc

        local = build_module(spec, dev)
        ps.update(
            "v2",
            lambda h: update_weights_from_ipc(h[ps.device_id], ModuleAdapter(local), device=dev),
            req_on_all_ranks=True,
        )
        want = {n: make_tensor(n, dt, sh, 2) for n, (dt, sh) in spec.items()}
        sd = local.state_dict()
        out["in_process_bad"] = sorted(
            n for n in spec if not torch.equal(as_bytes(sd[n].cpu()), as_bytes(want[n]))
        )
        ps.close()
        return out
    finally:
        eng.stop()


@pytest.mark.cuda
def test_cuda_update_is_bitwise_exact_for_bf16_and_fp8_on_one_gpu(tmp_path):
    import test_ckpt_cuda as me  # by module name, so the spawned rank can unpickle the function
    from k2_ckpt.launch import run_world

    (r,) = run_world(1, me.cuda_scenario, (str(tmp_path),), timeout_s=200)
    assert r["engine_device_id"] == r["server_device_id"] and r["server_device_id"].startswith("GPU-")
    assert r["v1_bad"] == [] and r["v1_again_bad"] == [], "bitwise mismatch after a CUDA update"
    assert r["engine_dtypes"] == sorted(DTYPES)
    # many buckets through two 64 KiB slots (slot reuse waits for acks), the big tensor split
    assert r["bucket_bytes"] == 64 << 10 and r["num_buckets"] >= r["nbytes"] / r["bucket_bytes"] >= 10
    # the owner copied every byte host -> device, timed by CUDA events
    assert r["h2d_bytes"] == r["nbytes"] and r["h2d_s"] > 0
    assert r["fault"] == {"rank": 0, "kind": "worker_error", "tensor": VICTIM}
    assert r["fault_old_kept"] == [], "a failed staged update changed the engine's weights"
    assert r["v2_bad"] == [] and r["v2_differs_from_v1"] == len(cuda_spec())
    assert r["v3_bad"] == [], "safetensors registration (pinned mmap) on CUDA"
    assert r["direct_bad"] == [], "direct mode on CUDA"
    assert r["in_process_bad"] == [], "a receiver in the server's own process"


def test_cuda_scenario_dry_run_on_cpu(tmp_path):
    """The same steps on the CPU path, so the scenario itself is checked where there is no GPU."""
    import test_ckpt_cuda as me
    from k2_ckpt.launch import run_world

    (r,) = run_world(1, me.cuda_scenario, (str(tmp_path), "cpu"), timeout_s=200)
    assert r["v1_bad"] == r["v1_again_bad"] == r["v2_bad"] == r["v3_bad"] == r["direct_bad"] == []
    assert r["fault"] == {"rank": 0, "kind": "worker_error", "tensor": VICTIM} and r["fault_old_kept"] == []
    assert r["in_process_bad"] == []


@pytest.mark.cuda
def test_cuda_model_bench_verifies_and_reports_h2d():
    from k2_ckpt.bench import ModelBenchConfig, run_model_bench

    res = run_model_bench(
        ModelBenchConfig(device="cuda", ranks=1, params=2e7, bucket_mb=4, repeats=2), timeout_s=200
    )
    assert res["verified"] is True and res["mismatched"] == []
    assert res["params"] == pytest.approx(2e7, rel=0.05) and res["num_buckets"] >= 10
    assert res["ratio"] == pytest.approx(res["update_gbps"] / res["raw_broadcast_gbps"], rel=1e-9)
    for key in ("update_gbps", "h2d_pipeline_gbps", "pinned_copy_gbps", "h2d_ratio"):
        assert res[key] is not None and res[key] > 0, key

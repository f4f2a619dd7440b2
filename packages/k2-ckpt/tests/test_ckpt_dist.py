"""End-to-end updates across gloo ranks, each with a forked stand-in engine (real ZMQ, real shm)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks import the scenarios by module name
import k2ckpt_scenarios as S  # noqa: E402
from k2_ckpt.launch import run_world  # noqa: E402

pytestmark = pytest.mark.dist


def test_updates_are_bitwise_exact_across_3_ranks(tmp_path):
    results = run_world(3, S.correctness, (str(tmp_path),), timeout_s=150)
    for rank, r in enumerate(results):
        assert r["v1_bad"] == [], f"rank {rank}: tensors differ after the first update"
        assert r["v2_bad"] == [] and r["v2_differs_from_v1"] == len(S.make_spec(3)), rank
        assert r["v1_again_bad"] == [], f"rank {rank}: unregister + re-register"
        assert r["subset_bad"] == [], f"rank {rank}: ranks=[0] updated the wrong receivers"
        assert r["slots_bad"] == {"v1": [], "v2": []}, f"rank {rank}: two-slot path"
        assert r["dtypes"] == sorted(f"torch.{d}" for d in S.DTYPES)
        # many buckets, and the 400 KiB tensor spans several 64 KiB ones
        assert r["bucket_bytes"] == 64 << 10
        assert r["v1_buckets"] >= r["nbytes"] / r["bucket_bytes"] >= 10


def test_failures_are_reported_and_never_mix_weights(tmp_path):
    results = run_world(2, S.failures, (str(tmp_path),), timeout_s=150)
    victim = "model.layers.0.mlp.experts.5.down_proj.weight"
    for rank, r in enumerate(results):
        # injected worker error: the remote traceback comes back naming rank and tensor
        e = r["raise"]
        assert e["raised"] and e["rank"] == 1 and e["kind"] == "worker_error" and e["tensor"] == victim
        assert "injected failure while loading" in e["traceback"] and "rank 1" in e["message"]
        assert r["raise_old_kept"] == [], f"rank {rank}: staged update left new weights behind"
        # dtype mismatch (rank 0's tensor) and shape mismatch (rank 1's bias): 409, tensor named
        m = r["mismatch"]
        assert m["raised"] and m["kind"] == "mismatch" and m["status"] == 409 and m["tensor"] == victim
        assert "dtype torch.float16 sent, receiver has torch.float32" in m["message"]
        assert r["mismatch_old_kept"] == []
        # direct mode: exactly the reported tensors changed, the rest are the old ones
        assert r["direct"]["raised"] and r["direct_exact"], rank
        assert 0 < r["direct_applied"] < len(S.make_spec(2))
        assert r["v1_restored"] == []
        # a hung worker: fails within its 3 s timeout (plus scheduling slack), not after
        h = r["hang"]
        assert h["raised"] and h["rank"] == 1 and h["kind"] == "timeout" and h["status"] == 504
        assert 3.0 <= h["seconds"] < 6.0, h["seconds"]
        assert r["hang_old_kept"] == []
        # a killed worker: detected by the socket disconnect, well within the 20 s timeout
        d = r["die"]
        assert d["raised"] and d["rank"] == 1 and d["kind"] == "worker_died" and d["seconds"] < 5.0
    assert results[0]["die_old_kept"] == []


def test_vllm_extension_and_sglang_path_load_through_engine_load_weights():
    (r,) = run_world(1, S.engine_integrations, (), timeout_s=90)
    assert r["vllm_equal"] and r["vllm_post_hook"] == [("model-config", "cpu")]
    assert r["sglang_equal"] and r["sglang_seen"] == ["model.b", "model.w"]

"""The HTTP API end to end: 2 ranks serving on Unix sockets, receivers behind their own API."""

from __future__ import annotations

import os
import sys
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
import k2ckpt_scenarios as S
from k2_ckpt.api import CkptClient
from k2_ckpt.harness import digest, make_tensor
from k2_ckpt.launch import run_world

pytestmark = pytest.mark.dist
WORLD = 2


def _save_shards(tmp, spec, version, tweak=None):
    files, tensors = [], {}
    for r in range(WORLD):
        mine = {
            n: make_tensor(n, dt, sh, version) for n, (dt, sh) in spec.items() if n.split(".")[2] == str(r)
        }
        if tweak:
            tweak(r, mine)
        path = os.path.join(tmp, f"v{version}-r{r}.safetensors")
        save_file(mine, path)
        files.append([path])
        tensors.update(mine)
    return files, tensors


def test_http_api_register_gather_update_delete_and_errors(tmp_path):
    run_dir = str(tmp_path)
    result: dict = {}
    th = threading.Thread(target=lambda: result.update(out=_run(run_dir)), daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 90
        while not all(os.path.exists(os.path.join(run_dir, f"ready-{r}")) for r in range(WORLD)):
            assert time.monotonic() < deadline and th.is_alive(), f"ranks did not come up: {result}"
            time.sleep(0.1)
        client = CkptClient(uds=[os.path.join(run_dir, f"ps-{r}.sock") for r in range(WORLD)], timeout_s=60)
        recv = [os.path.join(run_dir, f"recv-{r}.sock") for r in range(WORLD)]
        for r in range(WORLD):  # the receivers are up too
            _wait_for_socket(recv[r])
        spec = S.api_spec(WORLD)

        assert [h.json()["rank"] for h in client.health()] == list(range(WORLD))
        files, tensors = _save_shards(run_dir, spec, 1)
        reg = client.register_files("v1", files)
        assert [x.status_code for x in reg] == [200] * WORLD
        assert sum(x.json()["tensors"] for x in reg) == len(spec)
        # already registered -> 409; missing file -> 404 naming the file
        again = client.register_files("v1", files)
        assert again[0].status_code == 409 and "already registered" in again[0].json()["message"]
        missing = client.register_files("nope", [[os.path.join(run_dir, "missing.safetensors")]] * WORLD)
        assert missing[0].status_code == 404 and "missing.safetensors" in missing[0].json()["message"]
        # bad body -> 422 in the API's error shape, naming the field
        bad = client.update("v1", ranks="all")
        assert bad[0].status_code == 422
        assert bad[0].json()["error"] == "bad_request" and "ranks" in bad[0].json()["message"]
        # gather metas: every tensor, with its owner
        metas = client.gather_metas("v1")
        got = {m["name"]: m for m in metas[0].json()["metas"]}
        assert set(got) == set(spec) and metas[0].json() == metas[1].json()
        assert all(m["owner"] == int(n.split(".")[2]) and m["dtype"] == spec[n][0] for n, m in got.items())
        # update through the receivers' HTTP endpoints, then verify bitwise
        up = client.update("v1", update_uds=recv)
        assert [u.status_code for u in up] == [200] * WORLD, up[0].text
        assert up[0].json()["nbytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
        assert up[0].json()["num_buckets"] > 1
        want = {n: digest(t) for n, t in tensors.items()}
        for sock in recv:
            assert _digests(sock) == want
        # a receiver that is not there: every rank fails at once (not after its 40 s timeout),
        # naming the socket
        nobody = os.path.join(run_dir, "nobody.sock")
        t0 = time.monotonic()
        gone = client.update("v1", update_uds=[nobody], timeout_s=40)
        assert time.monotonic() - t0 < 15 and {u.status_code for u in gone} == {502}, gone[0].text
        req_failure = [f for f in gone[0].json()["failures"] if f["kind"] == "req_func"]
        assert req_failure and "nobody.sock" in req_failure[0]["traceback"], gone[0].json()
        for sock in recv:
            assert _digests(sock) == want
        # unknown checkpoint -> 404 on every rank
        unk = client.update("v9", update_uds=recv)
        assert [u.status_code for u in unk] == [404] * WORLD and "'v9'" in unk[0].json()["message"]
        # shape mismatch with the receiver -> 409 naming the tensor; weights stay v1

        def tweak(r, mine):
            if r == 1:
                mine["model.layers.1.self_attn.2.q_b_proj.weight"] = torch.zeros(40, 999, dtype=torch.float16)

        files2, _ = _save_shards(run_dir, spec, 2, tweak)
        assert [x.status_code for x in client.register_files("v2", files2)] == [200] * WORLD
        mm = client.update("v2", update_uds=recv)
        assert [u.status_code for u in mm] == [409] * WORLD, mm[0].text
        body = mm[0].json()
        assert body["failures"][0]["kind"] == "mismatch"
        assert body["failures"][0]["tensor"] == "model.layers.1.self_attn.2.q_b_proj.weight"
        assert "(40, 999)" in body["message"]
        for sock in recv:
            assert _digests(sock) == want
        # delete, then delete again -> 404
        assert [d.status_code for d in client.delete("v2")] == [200] * WORLD
        assert [d.status_code for d in client.delete("v2")] == [404] * WORLD
    finally:
        open(os.path.join(run_dir, "stop"), "w").close()
        th.join(60)
    assert result.get("out") == [{"served": True}] * WORLD, result


def _run(run_dir):
    try:
        return run_world(WORLD, S.api_rank, (run_dir,), timeout_s=150)
    except Exception as e:  # surfaced by the assertion at the end of the test
        return repr(e)


def _wait_for_socket(path, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=path), timeout=5) as c:
                if c.get("http://r/v1/healthz").status_code == 200:
                    return
        except (httpx.TransportError, FileNotFoundError):
            pass
        assert time.monotonic() < deadline, f"receiver at {path} did not come up"
        time.sleep(0.1)


def _digests(sock):
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=30) as c:
        return c.get("http://r/v1/digests").json()

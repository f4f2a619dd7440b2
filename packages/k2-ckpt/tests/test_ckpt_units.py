"""Single-process tests: bucket planning, byte views, safetensors mapping, the module adapter."""

from __future__ import annotations

import math

import pytest
import torch
from k2_ckpt.adapters import ModuleAdapter, dequantize_fp8_blocks
from k2_ckpt.dtypes import as_bytes, dtype_from_name, dtype_name, from_bytes
from k2_ckpt.errors import BadCheckpoint, FileMissing, RankFailure, TensorMismatch, UpdateError
from k2_ckpt.harness import build_module, make_tensor
from k2_ckpt.host import HostCheckpoint
from k2_ckpt.planner import ALIGN, plan_buckets
from k2_ckpt.types import TensorMeta
from safetensors.torch import load_file, save_file


def _metas(sizes_by_owner: dict[int, list[int]]) -> list[TensorMeta]:
    out = []
    for owner, sizes in sizes_by_owner.items():
        for i, n in enumerate(sizes):
            out.append(
                TensorMeta(name=f"r{owner}.t{i}", dtype="uint8", shape=[n], owner=owner, offset=0, nbytes=n)
            )
    return out


def _reassemble(plan, metas):
    """Per tensor, the byte ranges the plan covers, checked for order and completeness."""
    covered = {m.name: 0 for m in metas}
    for b in plan:
        used = 0
        for it in b.items:
            assert it.buf_offset % ALIGN == 0 and it.buf_offset >= used
            assert it.chunk_start == covered[it.name], "chunks must arrive in order"
            covered[it.name] += it.nbytes
            used = it.buf_offset + it.nbytes
        assert used == b.nbytes
    return covered


@pytest.mark.parametrize("bucket", [1024, 4096, 1 << 20])
def test_plan_covers_every_byte_once_and_respects_bucket_size(bucket):
    metas = _metas({0: [10, 300, 5000, 7, 1024], 1: [2048, 1, 0, 999], 2: [100_000]})
    plan = plan_buckets(metas, bucket)
    assert all(b.nbytes <= bucket for b in plan)
    assert all(len({it.name.split(".")[0] for it in b.items}) == 1 for b in plan), "one owner per bucket"
    assert all(b.owner == int(b.items[0].name[1]) for b in plan)
    covered = _reassemble(plan, metas)
    assert covered == {m.name: m.nbytes for m in metas}
    assert [b.index for b in plan] == list(range(len(plan)))


def test_plan_splits_a_tensor_larger_than_the_bucket():
    metas = _metas({0: [100, 10_000, 50]})
    plan = plan_buckets(metas, 4096)
    chunks = [it for b in plan for it in b.items if it.name == "r0.t1"]
    # a split tensor starts a fresh bucket, then fills whole buckets: ceil(10000/4096) = 3 chunks
    assert [c.nbytes for c in chunks] == [4096, 4096, 10_000 - 8192]
    assert all(not c.is_whole for c in chunks)
    # the tail chunk shares its bucket with the next tensor
    assert plan[-1].items[-1].name == "r0.t2" and plan[-1].items[0].name == "r0.t1"
    # whole tensors that fit are never split
    assert all(it.is_whole for b in plan for it in b.items if it.name != "r0.t1")


def test_plan_packs_small_tensors_densely():
    metas = _metas({0: [256] * 64})
    plan = plan_buckets(metas, 4096)
    assert len(plan) == math.ceil(64 * 256 / 4096)


@pytest.mark.parametrize(
    "dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int64", "bool"]
)
def test_byte_views_roundtrip_bitwise(dtype):
    t = make_tensor("x", dtype, [7, 5], 3)
    b = as_bytes(t)
    assert b.dtype == torch.uint8 and b.numel() == t.numel() * t.element_size()
    back = from_bytes(b.clone(), dtype_from_name(dtype), [7, 5])
    assert back.dtype == t.dtype and torch.equal(as_bytes(back), b)
    assert dtype_name(t.dtype) == dtype


def test_dtype_errors_name_the_dtype():
    with pytest.raises(TypeError, match="complex64"):
        dtype_name(torch.complex64)
    with pytest.raises(TypeError, match="float128"):
        dtype_from_name("float128")


def test_safetensors_files_are_mapped_bitwise(tmp_path):
    tensors = {
        f"w.{d}": make_tensor(f"w.{d}", d, [33, 17], 1)
        for d in ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int32"]
    }
    path = tmp_path / "a.safetensors"
    save_file(tensors, str(path))
    ref = load_file(str(path))
    ck = HostCheckpoint("c", rank=3)
    ck.add_safetensors(path)
    assert {m.name for m in ck.metas} == set(tensors)
    for m in ck.metas:
        assert m.owner == 3 and m.shape == [33, 17]
        got = from_bytes(ck.bytes_by_name[m.name], dtype_from_name(m.dtype), m.shape)
        assert torch.equal(as_bytes(got.contiguous()), as_bytes(ref[m.name]))


def test_named_tensors_are_copied_not_aliased():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    ck = HostCheckpoint("c", rank=0)
    ck.add_named_tensors({"a": t, "b": t[:, 1]})  # non-contiguous input is fine
    t.add_(100)  # the trainer keeps training: the registered copy must not move
    assert torch.equal(
        from_bytes(ck.bytes_by_name["a"], torch.float32, [3, 4]), torch.arange(12.0).reshape(3, 4)
    )
    assert torch.equal(from_bytes(ck.bytes_by_name["b"], torch.float32, [3]), torch.tensor([1.0, 5.0, 9.0]))
    assert all(m.offset % ALIGN == 0 for m in ck.metas)


def test_host_errors_name_the_file_and_tensor(tmp_path):
    ck = HostCheckpoint("c", rank=0)
    with pytest.raises(FileMissing, match="nope.safetensors"):
        ck.add_safetensors(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(BadCheckpoint, match="bad.safetensors"):
        ck.add_safetensors(bad)
    ck.add_named_tensors({"x": torch.zeros(2)})
    with pytest.raises(BadCheckpoint, match="'x' registered twice"):
        ck.add_named_tensors({"x": torch.zeros(2)})


def _safetensors_bytes(header: dict, data: bytes) -> bytes:
    import json
    import struct

    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 8]},
            r"'w' spans 8 bytes, but F32 \[4, 4\] needs 64",
        ),
        ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, r"'w' has data_offsets \[8, 0\]"),
        (
            {"dtype": "F32", "shape": [32], "data_offsets": [0, 128]},
            r"'w' ends at byte \d+, past the file end",
        ),
    ],
)
def test_safetensors_entries_must_match_their_byte_range(tmp_path, entry, message):
    path = tmp_path / "lying.safetensors"
    path.write_bytes(_safetensors_bytes({"w": entry}, bytes(64)))
    with pytest.raises(BadCheckpoint, match="lying.safetensors") as e:
        HostCheckpoint("c", rank=0).add_safetensors(path)
    assert e.match(message)


def test_stale_buffer_files_of_dead_processes_are_swept(tmp_path):
    import os
    import subprocess

    from k2_ckpt.buffer import _pid_namespace, sweep_stale_files

    ns = _pid_namespace()
    if ns == "0":
        pytest.skip("no /proc/self/ns/pid here")
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    files = {
        who: tmp_path / f"k2ckpt-{ns}-{pid}-0123abcd.buf"
        for who, pid in (("dead", dead.pid), ("me", os.getpid()), ("init", 1))
    }
    other_ns = tmp_path / f"k2ckpt-{ns}1-{dead.pid}-0123abcd.buf"  # another namespace: not ours to judge
    for f in [*files.values(), other_ns]:
        f.write_bytes(b"x")
    assert sweep_stale_files(str(tmp_path)) == [str(files["dead"])]
    assert (
        not files["dead"].exists() and files["me"].exists() and files["init"].exists() and other_ns.exists()
    )


def test_assign_commit_gives_tensors_a_later_commit_does_not_carry_their_own_memory():
    # the receiver stages views of the server's transfer buffer; once a commit without "b"
    # lands, "b" must no longer live in that buffer (the server reuses it)
    module = build_module({"a": ("float32", [8]), "b": ("float32", [8])})
    ad = ModuleAdapter(module, assign=True)
    arena = torch.arange(16, dtype=torch.float32)
    ad.commit_staged([("a", arena[:8]), ("b", arena[8:])])
    ad.post_load()
    assert module.b.data_ptr() == arena[8:].data_ptr()  # swapped in: a view, no copy
    ad.commit_staged([("a", torch.full((8,), -1.0))])
    ad.post_load()
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel() * 4
    assert not lo <= module.b.data_ptr() < hi, "b still views the transfer buffer"
    arena.fill_(99.0)  # the server overwrites the buffer with a later update
    assert torch.equal(module.b, torch.arange(8.0, 16.0)) and torch.equal(module.a, torch.full((8,), -1.0))


def test_module_adapter_abort_forgets_half_received_fp8_pairs():
    module = build_module({"a.weight": ("float32", [4, 4])})
    ad = ModuleAdapter(module)
    ad.load_weights([("a.weight", make_tensor("a", "float8_e4m3fn", [4, 4], 1))])
    ad.abort()  # the update was abandoned before the scale came
    ad.post_load()  # the next update's end does not report the old half


def test_module_adapter_loads_by_hf_name_bitwise():
    spec = {
        "model.layers.0.self_attn.q_a_proj.weight": ("bfloat16", [8, 16]),
        "model.layers.0.mlp.gate.e_score_correction_bias": ("float32", [4]),
        "model.layers.1.mlp.experts.3.up_proj.weight": ("float8_e4m3fn", [4, 8]),
    }
    module = build_module(spec)
    ad = ModuleAdapter(module)
    new = {n: make_tensor(n, dt, sh, 7) for n, (dt, sh) in spec.items()}
    for n, t in new.items():
        ad.validate(n, t.dtype, tuple(t.shape))
    ad.load_weights(new.items())
    ad.post_load()
    sd = module.state_dict()
    for n, t in new.items():
        assert torch.equal(as_bytes(sd[n]), as_bytes(t)), n


def test_module_adapter_rejects_mismatches_by_name():
    module = build_module({"model.norm.weight": ("float32", [8])})
    ad = ModuleAdapter(module)
    with pytest.raises(TensorMismatch, match=r"'model.norm.weight'.*shape \(9,\)"):
        ad.validate("model.norm.weight", torch.float32, (9,))
    with pytest.raises(TensorMismatch, match=r"'model.norm.weight'.*dtype torch.float16"):
        ad.validate("model.norm.weight", torch.float16, (8,))
    with pytest.raises(TensorMismatch, match="lm_head.weight"):
        ad.validate("lm_head.weight", torch.float32, (8,))
    ModuleAdapter(module, ignore_unknown=True).validate("lm_head.weight", torch.float32, (8,))


@pytest.mark.parametrize("scale_first", [False, True])
def test_module_adapter_dequantizes_fp8_block_scaled_weights(scale_first):
    O, I = 200, 300  # not multiples of 128: partial edge blocks
    module = build_module({"model.layers.0.mlp.down_proj.weight": ("float32", [O, I])})
    ad = ModuleAdapter(module)
    w = make_tensor("w", "float8_e4m3fn", [O, I], 1)
    s = torch.rand(math.ceil(O / 128), math.ceil(I / 128)) + 0.5
    name = "model.layers.0.mlp.down_proj.weight"
    ad.validate(name, w.dtype, (O, I))
    ad.validate(name + "_scale_inv", s.dtype, tuple(s.shape))
    with pytest.raises(TensorMismatch, match="block scale shape"):
        ad.validate(name + "_scale_inv", s.dtype, (1, 1))
    pairs = [(name + "_scale_inv", s), (name, w)] if scale_first else [(name, w), (name + "_scale_inv", s)]
    for p in pairs:  # one at a time, as in direct mode across buckets
        ad.load_weights([p])
    ad.post_load()
    # reference: every element times the scale of its 128x128 tile
    i = torch.arange(O)[:, None] // 128
    j = torch.arange(I)[None, :] // 128
    ref = w.float() * s[i, j]
    assert torch.equal(module.state_dict()[name], ref)
    assert torch.equal(dequantize_fp8_blocks(w, s), ref)


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("scale_first", [False, True])
def test_module_adapter_loads_fp8_and_scale_into_an_fp8_engine(scale_first, assign):
    # an engine that serves FP8 holds the weight and its block scale: both arrive unchanged
    O, I = 200, 300
    name = "model.layers.0.mlp.down_proj.weight"
    spec = {name: ("float8_e4m3fn", [O, I]), name + "_scale_inv": ("float32", [2, 3])}
    module = build_module(spec)
    ad = ModuleAdapter(module, assign=assign)
    new = {n: make_tensor(n, dt, sh, 5) for n, (dt, sh) in spec.items()}
    for n, t in new.items():
        ad.validate(n, t.dtype, tuple(t.shape))
    with pytest.raises(TensorMismatch, match=r"_scale_inv'.*shape \(1, 1\)"):
        ad.validate(name + "_scale_inv", torch.float32, (1, 1))
    pairs = list(new.items())[::-1] if scale_first else list(new.items())
    ad.commit_staged([(n, t.clone()) for n, t in pairs])
    ad.post_load()  # no "without partner" error: nothing was held back for dequantisation
    sd = module.state_dict()
    for n, t in new.items():
        assert sd[n].dtype == t.dtype and torch.equal(as_bytes(sd[n]), as_bytes(t)), n


def test_module_adapter_reports_fp8_without_scale():
    module = build_module({"a.weight": ("float32", [4, 4])})
    ad = ModuleAdapter(module)
    ad.load_weights([("a.weight", make_tensor("a", "float8_e4m3fn", [4, 4], 1))])
    with pytest.raises(TensorMismatch, match="a.weight"):
        ad.post_load()


def test_update_error_names_rank_tensor_and_remote_traceback():
    e = UpdateError(
        "ck",
        [
            RankFailure(
                rank=2,
                kind="worker_error",
                message="boom",
                bucket=5,
                tensor="x.weight",
                traceback="Traceback ...\nRuntimeError: boom",
            )
        ],
        {2: ["a"]},
    )
    text = str(e)
    assert "rank 2" in text and "bucket 5" in text and "'x.weight'" in text and "RuntimeError: boom" in text
    assert e.status == 502 and e.applied == {2: ["a"]}
    assert UpdateError("ck", [RankFailure(rank=0, kind="mismatch", message="m")]).status == 409
    assert UpdateError("ck", [RankFailure(rank=0, kind="timeout", message="t")]).status == 504
    # a commit failure keeps its cause's status
    assert UpdateError("ck", [RankFailure(rank=0, kind="commit_mismatch", message="m")]).status == 409
    assert UpdateError("ck", [RankFailure(rank=0, kind="commit_worker_died", message="d")]).status == 504
    assert UpdateError("ck", [RankFailure(rank=0, kind="commit_worker_error", message="e")]).status == 502


def test_receiver_gives_up_at_once_when_the_server_goes_away(tmp_path):
    """A receiver whose server closes the connection mid-update drops its staging and raises
    well before its own (long) timeout, instead of waiting it out."""
    import threading
    import time

    import zmq
    from k2_ckpt.buffer import SlotBuffer
    from k2_ckpt.errors import UpdateAborted
    from k2_ckpt.types import BucketItem, BucketMsg, BufferMsg
    from k2_ckpt.worker import update_weights_from_ipc

    module = build_module({"a": ("float32", [16]), "b": ("float32", [16])})
    buf = SlotBuffer(1024, 2, torch.device("cpu"))
    buf.data[:64].view(torch.float32).copy_(torch.full((16,), 3.0))
    ctx = zmq.Context()
    server = ctx.socket(zmq.PAIR)
    address = f"ipc://{tmp_path}/s.sock"
    server.bind(address)
    result: dict = {}

    def receive():
        t0 = time.monotonic()
        try:
            update_weights_from_ipc(address, ModuleAdapter(module), timeout_s=60, zmq_ctx=ctx)
        except Exception as e:
            result["error"] = e
        result["seconds"] = time.monotonic() - t0

    th = threading.Thread(target=receive)
    th.start()
    try:
        server.send(
            BufferMsg(handle=buf.handle(), slot_bytes=1024, num_slots=2, checkpoint="c", num_buckets=2)
            .model_dump_json()
            .encode()
        )
        assert server.poll(10_000) and b"ready" in server.recv()
        item = BucketItem(
            name="a", dtype="float32", shape=[16], tensor_nbytes=64, chunk_start=0, nbytes=64, buf_offset=0
        )
        server.send(BucketMsg.of(0, 0, [item]).model_dump_json().encode())
        assert server.poll(10_000) and b"ack" in server.recv()
        server.close(linger=0)  # the server process "dies" before bucket 1 and the commit
        th.join(20)
    finally:
        buf.close()
    assert isinstance(result.get("error"), UpdateAborted), result
    assert "closed the connection" in str(result["error"]) and "old weights are intact" in str(
        result["error"]
    )
    assert result["seconds"] < 10, result["seconds"]
    assert torch.equal(module.a, torch.zeros(16)), "a staged tensor was applied without a commit"
    ctx.term()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn", "int64", "bool"])
def test_receiver_views_equal_byte_slices(dtype):
    # the receiver's one-call tensor views of a transfer buffer (as_strided on a typed view)
    # against slicing the bytes and viewing them, for odd shapes and offsets
    from k2_ckpt.dtypes import nbytes_of
    from k2_ckpt.worker import _Receiver

    buf = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    recv = _Receiver(None, None, ModuleAdapter(build_module({})), None, "cpu", True, 1.0)
    dt = dtype_from_name(dtype)
    for shape, offset in (([], 256), ([0, 5], 512), ([3, 1, 7], 768), ([17], 1024), ([5, 9], 8)):
        n = nbytes_of(dt, shape)
        got = recv._view(buf, offset, n, dt, shape)
        want = from_bytes(buf[offset : offset + n], dt, shape)
        assert got.dtype == dt and got.shape == want.shape and got.is_contiguous()
        assert got.data_ptr() == want.data_ptr() and torch.equal(as_bytes(got), as_bytes(want))
    if dt.itemsize > 1:  # misaligned (never planned: offsets are 256-aligned): refused, as by slicing
        with pytest.raises(RuntimeError, match="divisible"):
            recv._view(buf, 3, nbytes_of(dt, [2]), dt, [2])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.bool])
def test_pooled_storages_are_reused_as_flat_bytes(dtype):
    # an assign commit pools the swapped-out tensor as it was (any dtype, any shape); the next
    # update stages into its bytes
    from k2_ckpt.worker import _Receiver

    module = build_module({"x": (dtype_name(dtype), [4, 4])})
    ad = ModuleAdapter(module, assign=True)
    old = module.x.data
    ad.commit_staged([("x", torch.ones(4, 4, dtype=dtype))])
    recv = _Receiver(None, None, ad, None, "cpu", True, 1.0)
    nbytes = old.numel() * old.element_size()
    buf = recv._stage_buffer("x", nbytes, torch.device("cpu"))
    assert buf.dtype == torch.uint8 and buf.shape == (nbytes,) and buf.data_ptr() == old.data_ptr()
    buf.copy_(torch.arange(nbytes, dtype=torch.uint8))  # a staging copy of flat bytes fits


def test_direct_mode_failure_reports_what_was_loaded_and_the_failing_tensor(tmp_path):
    # a loader that fails part-way through a bucket: the error names the tensor it failed on
    # (not the bucket's last) and `applied` lists exactly the tensors loaded before it
    import json
    import threading

    import zmq
    from k2_ckpt.buffer import SlotBuffer
    from k2_ckpt.types import BucketItem, BucketMsg, BufferMsg
    from k2_ckpt.worker import FunctionLoader, update_weights_from_ipc

    loaded: list[str] = []

    def load(named):
        for name, _t in named:
            if name == "b":
                raise RuntimeError("cannot load b")
            loaded.append(name)

    buf = SlotBuffer(1024, 2, torch.device("cpu"))
    ctx = zmq.Context()
    server = ctx.socket(zmq.PAIR)
    address = f"ipc://{tmp_path}/s.sock"
    server.bind(address)
    result: dict = {}

    def receive():
        try:
            update_weights_from_ipc(address, FunctionLoader(load), staged=False, timeout_s=10, zmq_ctx=ctx)
        except Exception as e:
            result["error"] = e

    th = threading.Thread(target=receive)
    th.start()
    try:
        server.send(
            BufferMsg(handle=buf.handle(), slot_bytes=1024, num_slots=2, checkpoint="c", num_buckets=1)
            .model_dump_json()
            .encode()
        )
        assert server.poll(10_000) and b"ready" in server.recv()
        items = [
            BucketItem(name=n, dtype="float32", shape=[16], tensor_nbytes=64, chunk_start=0, nbytes=64,
                       buf_offset=64 * i)
            for i, n in enumerate("abc")
        ]  # fmt: skip
        server.send(BucketMsg.of(0, 0, items).model_dump_json().encode())
        assert server.poll(10_000)
        reply = json.loads(server.recv())
        server.close(linger=0)
        th.join(20)
    finally:
        buf.close()
    assert reply["op"] == "error" and reply["tensor"] == "b", reply
    assert reply["applied"] == ["a"] == loaded
    assert "cannot load b" in reply["message"]
    ctx.term()


def test_vllm_receiver_checks_the_update_against_the_served_checkpoint(tmp_path):
    # the vLLM receiver refuses, before touching the model, a tensor the checkpoint vLLM serves
    # does not have, another shape or a non-float dtype, and an update that leaves tensors out
    from k2_ckpt.adapters.vllm import VllmCheckpointLoader, checkpoint_tensors
    from k2_ckpt.errors import TensorMismatch
    from safetensors.torch import save_file

    save_file({"a.weight": torch.zeros(4, 8), "b.weight": torch.zeros(3, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    expected = checkpoint_tensors(tmp_path)
    assert expected == {"a.weight": (torch.float32, (4, 8)), "b.weight": (torch.bfloat16, (3,))}
    loader = VllmCheckpointLoader(model=None, model_config=None, expected=expected)
    loader.validate("a.weight", torch.bfloat16, (4, 8))  # vLLM converts float dtypes on load
    with pytest.raises(TensorMismatch, match=r"'c.weight': not in the checkpoint"):
        loader.validate("c.weight", torch.float32, (4, 8))
    with pytest.raises(TensorMismatch, match=r"shape \(8, 4\) sent, the checkpoint has \(4, 8\)"):
        loader.validate("a.weight", torch.float32, (8, 4))
    with pytest.raises(TensorMismatch, match="dtype torch.int64"):
        loader.validate("b.weight", torch.int64, (3,))
    with pytest.raises(TensorMismatch, match=r"incomplete update: 1 of the checkpoint's 2 tensors"):
        loader.check_staged(["a.weight"])
    loader.check_staged(["a.weight", "b.weight"])
    assert not loader.touched
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        checkpoint_tensors(tmp_path / "nothing")

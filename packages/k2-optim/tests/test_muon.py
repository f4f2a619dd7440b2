"""Muon: parity with torch.optim.Muon, batched/fused logical matrices, NS accuracy."""

import pytest
import torch
from k2_optim import Muon, declare_fused
from k2_optim.newton_schulz import newton_schulz, resolve_ns_schedule


def _pairs(shapes, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    a = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    return a, b


def _set_grads(pa, pb, seed):
    g = torch.Generator().manual_seed(seed)
    for a, b in zip(pa, pb):
        grad = torch.randn(a.shape, generator=g, dtype=a.dtype)
        a.grad, b.grad = grad.clone(), grad.clone().to(b.dtype)


@pytest.mark.parametrize("nesterov", [True, False])
def test_bf16_update_equals_torch_muon(nesterov):
    # Small shapes: torch's NS is bf16, emulated (slow) on this CPU. Mixed orientations and a
    # repeated shape exercise the transposed path and our same-shape batching.
    shapes = [(32, 48), (48, 32), (32, 48), (16, 16)]
    ours, ref = _pairs(shapes)
    o1 = Muon(ours, lr=0.02, weight_decay=0.1, nesterov=nesterov, ns_dtype=torch.bfloat16)
    o2 = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn="match_rms_adamw")
    for step in range(3):
        _set_grads(ours, ref, seed=100 + step)
        o1.step()
        o2.step()
        for a, b in zip(ours, ref):
            # same bf16 NS arithmetic; measured bit-identical on torch 2.13 CPU
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# Tolerances against a float64 run of the same algorithm after 2 steps at lr 0.05 (update scale
# lr * 0.2 * sqrt(40) ~ 0.06 per step): fp32 NS rounds at ~1e-7 relative; bf16 NS at 2^-8, measured
# up to 7.5e-4 absolute here.
NS_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-3}


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16, None])
def test_ns_dtypes_match_a_float64_run(ns_dtype):
    """Each NS dtype against float64, with the tolerance of the dtype in use; None (the default)
    is whichever the machine picks (bf16 where bf16 GEMMs are native, else fp32)."""
    from k2_optim.muon import default_ns_dtype

    used = default_ns_dtype(torch.device("cpu"), ns_dtype)
    ours, ref = _pairs([(24, 40), (40, 24)])
    ref64 = [torch.nn.Parameter(p.detach().double()) for p in ref]
    same = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    o1 = Muon(ours, lr=0.05, weight_decay=0.1, ns_dtype=ns_dtype)
    o2 = Muon(ref64, lr=0.05, weight_decay=0.1, ns_dtype=torch.float64)
    o3 = Muon(same, lr=0.05, weight_decay=0.1, ns_dtype=used)
    for step in range(2):
        _set_grads(ours, ref64, seed=7 + step)
        _set_grads(same, ref64, seed=7 + step)
        for o in (o1, o2, o3):
            o.step()
    for a, b, c in zip(ours, ref64, same):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=NS_TOLERANCE[used])
        assert torch.equal(a, c)  # the default is exactly the dtype it resolves to


def test_stacked_experts_equal_per_expert_2d_params():
    E, O, I = 6, 12, 20
    g = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(E, O, I, generator=g))
    singles = [torch.nn.Parameter(w.detach()[e].clone()) for e in range(E)]
    o1 = Muon([w], lr=0.03, weight_decay=0.05, ns_dtype=torch.float32)
    o2 = Muon(singles, lr=0.03, weight_decay=0.05, ns_dtype=torch.float32)
    for _step in range(3):
        grad = torch.randn(E, O, I, generator=g)
        w.grad = grad.clone()
        for e in range(E):
            singles[e].grad = grad[e].clone()
        o1.step()
        o2.step()
    torch.testing.assert_close(w.detach(), torch.stack([s.detach() for s in singles]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("how", ["group", "attribute"])
def test_fused_gate_up_orthogonalised_separately(how):
    E, F, D = 3, 8, 20
    g = torch.Generator().manual_seed(2)
    gate_up = torch.nn.Parameter(torch.randn(E, 2 * F, D, generator=g))
    gate = torch.nn.Parameter(gate_up.detach()[:, :F].clone())
    up = torch.nn.Parameter(gate_up.detach()[:, F:].clone())
    if how == "group":
        o1 = Muon(
            [{"params": [gate_up], "split_sizes": (F, F)}], lr=0.03, weight_decay=0.1, ns_dtype=torch.float32
        )
    else:
        o1 = Muon([declare_fused(gate_up, (F, F))], lr=0.03, weight_decay=0.1, ns_dtype=torch.float32)
    o2 = Muon([gate, up], lr=0.03, weight_decay=0.1, ns_dtype=torch.float32)
    unsplit = torch.nn.Parameter(gate_up.detach().clone())
    o3 = Muon([unsplit], lr=0.03, weight_decay=0.1, ns_dtype=torch.float32)
    for _ in range(2):
        grad = torch.randn(E, 2 * F, D, generator=g)
        gate_up.grad, unsplit.grad = grad.clone(), grad.clone()
        gate.grad, up.grad = grad[:, :F].clone(), grad[:, F:].clone()
        for o in (o1, o2, o3):
            o.step()
    torch.testing.assert_close(
        gate_up.detach(), torch.cat([gate.detach(), up.detach()], dim=1), rtol=0, atol=1e-6
    )
    # and it matters: treating the fused tensor as one matrix gives a different update
    assert (unsplit - gate_up).abs().max() > 1e-3


def test_ns_never_mutates_momentum_buffer():
    # nesterov=False hands the buffer itself to NS; with bf16 params the dtype cast is a no-op,
    # so an in-place normalisation would scale the buffer (torch.optim.Muon's bf16 path does).
    p = torch.nn.Parameter(torch.randn(16, 24, dtype=torch.bfloat16))
    grad = torch.randn(16, 24, dtype=torch.bfloat16)
    p.grad = grad
    opt = Muon([p], lr=0.01, nesterov=False, ns_dtype=torch.bfloat16, momentum=0.9)
    opt.step()
    expected = torch.zeros_like(grad).lerp_(grad, 1 - 0.9)
    assert torch.equal(opt.state[p]["momentum_buffer"], expected)


def test_ns_output_approximates_polar_factor():
    g = torch.Generator().manual_seed(3)
    G = torch.randn(4, 64, 128, generator=g, dtype=torch.float64)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    polar = U @ Vh
    keller = newton_schulz(G.float(), resolve_ns_schedule("keller", 5)).double()
    s = torch.linalg.svdvals(keller)
    assert s.min() > 0.5 and s.max() < 1.5  # Keller's quintic: S' ~ U(0.5, 1.5) by design
    pe = newton_schulz(G.float(), resolve_ns_schedule("polar_express", 8)).double()
    assert ((pe - polar).norm() / polar.norm()) < 1e-3  # Polar Express converges to U V^T
    # tall input goes through the transposed path and gives the transposed answer
    tall = newton_schulz(G.mT.float(), resolve_ns_schedule("polar_express", 8)).double()
    torch.testing.assert_close(tall, pe.mT, rtol=0, atol=1e-5)


def test_polar_express_schedule_values():
    sched = resolve_ns_schedule("polar_express", 10)
    a0, b0, c0 = sched.coeffs[0]
    assert a0 == pytest.approx(8.28721201814563 / 1.01)
    assert b0 == pytest.approx(-23.595886519098837 / 1.01**3)
    assert c0 == pytest.approx(17.300387312530933 / 1.01**5)
    assert sched.coeffs[7] == sched.coeffs[9] == (1.875, -1.25, 0.375)
    assert resolve_ns_schedule("keller", 3).coeffs == ((3.4445, -4.7750, 2.0315),) * 3


def test_bad_arguments_have_clear_errors():
    with pytest.raises(ValueError, match="Muon takes matrices"):
        Muon([torch.nn.Parameter(torch.zeros(5))])
    with pytest.raises(ValueError, match="split sizes"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(6, 4))], "split_sizes": (3, 2)}])
    with pytest.raises(ValueError, match="ns_coefficients"):
        Muon([torch.nn.Parameter(torch.zeros(6, 4))], ns_coefficients="nope")


def test_default_ns_dtype_follows_the_machine(monkeypatch):
    from k2_optim import muon

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert muon.default_ns_dtype(cuda) == torch.bfloat16
    monkeypatch.setattr(muon, "cpu_has_native_bf16", lambda: True)
    assert muon.default_ns_dtype(cpu) == torch.bfloat16  # native bf16 GEMMs (AMX / AVX512-BF16) -> bf16
    assert muon.default_ns_dtype(cpu, "auto") == torch.bfloat16  # None and "auto" are one default
    monkeypatch.setattr(muon, "cpu_has_native_bf16", lambda: False)
    assert muon.default_ns_dtype(cpu) == torch.float32  # AVX2: bf16 emulated, ~30x slower
    assert muon.default_ns_dtype(cpu, "auto") == torch.float32
    assert muon.default_ns_dtype(cpu, torch.float64) == torch.float64
    assert muon.default_ns_dtype(cpu, "bf16") == muon.default_ns_dtype(cpu, "bfloat16") == torch.bfloat16
    for bad in ("fast", "fp16x", "int8", 3):
        with pytest.raises(ValueError, match="ns_dtype"):
            Muon([torch.nn.Parameter(torch.zeros(4, 4))], ns_dtype=bad)


@pytest.mark.parametrize("env", ["0", "1"])
def test_native_bf16_probe_override(monkeypatch, env):
    from k2_kernels import capabilities, cpu_has_native_bf16
    from k2_optim.muon import default_ns_dtype

    monkeypatch.setenv("K2_NATIVE_BF16", env)
    assert cpu_has_native_bf16() is (env == "1")
    assert capabilities().native_bf16 is (env == "1")
    assert default_ns_dtype(torch.device("cpu")) == (torch.bfloat16 if env == "1" else torch.float32)
    monkeypatch.setenv("K2_NATIVE_BF16", "yes")
    with pytest.raises(ValueError, match="K2_NATIVE_BF16='yes'"):
        cpu_has_native_bf16()


@pytest.mark.parametrize("ns_dtype", [None, "auto", torch.float32, torch.bfloat16, "fp32"])
def test_param_groups_store_the_ns_dtype_by_name(ns_dtype):
    """torch.distributed.checkpoint cannot store a torch.dtype in a param group: Muon keeps names,
    for the constructor's default and for a group's own value alike, and resolves them per step."""
    p, q = torch.nn.Parameter(torch.randn(8, 6)), torch.nn.Parameter(torch.randn(6, 8))
    opt = Muon([{"params": [p]}, {"params": [q], "ns_dtype": torch.float64}], ns_dtype=ns_dtype)
    names = [g["ns_dtype"] for g in opt.state_dict()["param_groups"]]
    want = {
        None: "auto",
        "auto": "auto",
        torch.float32: "float32",
        torch.bfloat16: "bfloat16",
        "fp32": "float32",
    }
    assert names == [want[ns_dtype], "float64"]
    assert all(isinstance(v, (str, int, float, bool, tuple, list, type(None))) for g in opt.param_groups
               for k, v in g.items() if k != "params")  # fmt: skip
    # a name resolves exactly like the dtype: the same update
    p.grad, q.grad = torch.randn(8, 6), torch.randn(6, 8)
    ref = [torch.nn.Parameter(t.detach().clone()) for t in (p, q)]
    ref[0].grad, ref[1].grad = p.grad.clone(), q.grad.clone()
    dt = torch.float32 if ns_dtype in ("fp32", torch.float32) else ns_dtype
    opt_ref = Muon([{"params": [ref[0]]}, {"params": [ref[1]]}], ns_dtype=dt)
    opt_ref.param_groups[1]["ns_dtype"] = torch.float64  # a dtype set by hand still works
    opt.step()
    opt_ref.step()
    assert torch.equal(p, ref[0]) and torch.equal(q, ref[1])


@pytest.mark.parametrize("schedule", ["keller", "polar_express"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_ns_workspace_and_chunks_change_nothing(schedule, dtype):
    """The reused-buffer iteration is the same arithmetic (bit-identical), wide and tall, and one
    workspace serves calls of different shapes in turn."""
    from k2_optim.newton_schulz import NSWorkspace

    sched = resolve_ns_schedule(schedule, 5)
    ws = NSWorkspace()
    g = torch.Generator().manual_seed(3)
    for shape in [(6, 16, 24), (6, 24, 16), (3, 40, 24), (2, 8, 8), (6, 16, 24)]:
        G = torch.randn(shape, generator=g)
        plain = newton_schulz(G, sched, dtype=dtype, backend="torch")
        reused = newton_schulz(G, sched, dtype=dtype, backend="torch", workspace=ws)
        assert torch.equal(plain, reused), shape
        # chunks of the batch: the matrices are independent
        halves = torch.cat([newton_schulz(h, sched, dtype=dtype, backend="torch") for h in G.split(2)])
        assert torch.equal(plain, halves), shape


def test_chunked_step_equals_one_batch(monkeypatch):
    """Muon's CPU chunks (momentum, NS and update per chunk, small pieces packed together) give the
    same parameters as one NS call per shape."""
    from k2_optim import muon

    shapes = [(10, 12, 20), (12, 20), (12, 20), (3, 20, 12), (16, 16)]
    runs = []
    for chunk_bytes in (1 << 40, 12 * 20 * 2 * 3):  # everything at once; 3 bf16 matrices per chunk
        monkeypatch.setattr(muon, "NS_CHUNK_BYTES", chunk_bytes)
        ps, _ = _pairs(shapes, seed=5)
        opt = Muon(ps, lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16)
        for step in range(2):
            _set_grads(ps, ps, seed=11 + step)
            opt.step()
        runs.append(ps)
    for a, b in zip(*runs):
        assert torch.equal(a, b)

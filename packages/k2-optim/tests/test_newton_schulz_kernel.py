"""k2_optim.newton_schulz on the k2-kernels NS kernel vs its batched PyTorch path.

Ground truth: the PyTorch path in float64. fp32 on either path lands within 1e-5 relative
Frobenius error per matrix (fp32 rounding, measured 1e-6 to 4e-6).
"""

import pytest
import torch
from k2_optim import newton_schulz, resolve_ns_schedule

kernels = pytest.importorskip("k2_kernels.newton_schulz_ops")
needs_cpu_kernel = pytest.mark.skipif(
    not kernels.kernel_serves("cpu", torch.float32), reason="k2_kernels._C without the CPU NS kernel"
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    out = out.double().reshape(-1, *out.shape[-2:])
    ref = ref.double().reshape(-1, *ref.shape[-2:])
    return (out - ref).norm(dim=(-2, -1)) / ref.norm(dim=(-2, -1))


@needs_cpu_kernel
@pytest.mark.parametrize("schedule", ["keller", "polar_express"])
@pytest.mark.parametrize("shape", [(256, 512), (512, 256), (8, 96, 64), (2, 3, 37, 53)], ids=str)
def test_cpu_fp32_kernel_matches_float64(shape, schedule):
    sched = resolve_ns_schedule(schedule, 5)
    G = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
    G_before = G.clone()
    ref = newton_schulz(G.double(), sched, dtype=torch.float64, backend="torch")
    out = newton_schulz(G, sched, dtype=torch.float32)  # auto: the kernel on CPU fp32
    assert out.shape == G.shape and out.dtype == torch.float32
    assert torch.equal(G, G_before), "newton_schulz must not write into G"
    assert torch.equal(out, newton_schulz(G, sched, dtype=torch.float32, backend="kernel"))
    assert rel_err(out, ref).max() <= 1e-5
    torch_path = newton_schulz(G, sched, dtype=torch.float32, backend="torch")
    assert rel_err(torch_path, ref).max() <= 1e-5


def test_cpu_bf16_keeps_the_torch_path():
    """CPU bf16 stays on the baddbmm path that is bit-identical to torch.optim.Muon."""
    sched = resolve_ns_schedule("keller", 5)
    G = torch.randn(4, 64, 128, generator=torch.Generator().manual_seed(0))
    auto = newton_schulz(G, sched, dtype=torch.bfloat16)
    assert torch.equal(auto, newton_schulz(G, sched, dtype=torch.bfloat16, backend="torch"))


def test_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        newton_schulz(torch.randn(4, 4), backend="cublas")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_against_torch_path(dtype):
    if not kernels.kernel_serves("cuda", dtype):
        pytest.fail("k2_kernels._C was built without the CUDA NS kernel (rebuild with K2_CUDA=ON)")
    sched = resolve_ns_schedule("keller", 5)
    G = torch.randn(16, 512, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    ref = newton_schulz(G.double(), sched, dtype=torch.float64, backend="torch")
    out = newton_schulz(G, sched, dtype=dtype)  # auto: the CUDA kernel
    plain = newton_schulz(G, sched, dtype=dtype, backend="torch")
    if dtype == torch.float32:
        assert rel_err(out, ref).max() <= 1e-5
    else:
        assert (rel_err(out, ref) <= 2 * rel_err(plain, ref)).all()

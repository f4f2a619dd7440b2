"""k2_kernels.newton_schulz_ops (compiled NS kernels) against the PyTorch reference.

Shape legend: B matrices, M rows, N columns (tall inputs are transposed to M <= N inside).
Ground truth: `newton_schulz_reference` in float64 on the same normalised input. Tolerances:
fp32 kernels within 1e-5 relative Frobenius error per matrix (fp32 torch itself lands at 1e-6 to
4e-6 here: the products are rounded differently, never more loosely); the bf16 CUDA kernel at
most 2x the error of a plain bf16 torch NS (matmul, then the a/b/c terms) on the same input.
"""

import pytest
import torch
from k2_kernels import _lib
from k2_kernels.newton_schulz_ops import newton_schulz, newton_schulz_reference

pytestmark = pytest.mark.skipif(
    _lib.compiled() is None or not hasattr(_lib.compiled(), "newton_schulz_cpu"),
    reason="k2_kernels._C not built (or built before the Newton-Schulz kernels)",
)

KELLER = [(3.4445, -4.7750, 2.0315)] * 5
# Polar Express (arXiv:2505.16932) with the 1.01 safety factor, as k2_optim ships it; 5 steps.
_PE_RAW = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
]
POLAR_EXPRESS = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _PE_RAW]
SCHEDULES = {"keller": (KELLER, 1.0), "polar_express": (POLAR_EXPRESS, 1.01)}

CPU_SHAPES = [
    (1, 37, 53),  # odd sizes, one matrix (row blocks inside the matrix when threads > 1)
    (5, 53, 37),  # tall: transposed in and out; 5 = 2 * 2 + 1 with 2 threads (both paths)
    (16, 64, 96),  # many matrices: one thread per matrix
    (3, 100, 300),
    (2, 128, 128),  # square
    (1, 257, 130),  # tall, odd, one matrix
]


def normalised(B: int, M: int, N: int, scale: float, seed: int, device: str = "cpu") -> torch.Tensor:
    """Random (never zero) matrices divided by scale * ||X||_F, in float64."""
    g = torch.Generator().manual_seed(seed)
    G = torch.randn(B, M, N, generator=g, dtype=torch.float64)
    return (G / (scale * G.norm(dim=(-2, -1), keepdim=True))).to(device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-matrix relative Frobenius error, [B]."""
    out, ref = out.double(), ref.double()
    return (out - ref).norm(dim=(-2, -1)) / ref.norm(dim=(-2, -1))


def plain_ns(X: torch.Tensor, coeffs) -> torch.Tensor:
    """The textbook NS in X's dtype: matmul, then the a/b/c terms as separate ops."""
    t = X.shape[-2] > X.shape[-1]
    if t:
        X = X.mT
    for a, b, c in coeffs:
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.mT if t else X


@pytest.fixture(params=[1, 2], ids=lambda t: f"threads{t}")
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cpu_fp32_matches_reference(shape, schedule, threads):
    coeffs, scale = SCHEDULES[schedule]
    X64 = normalised(*shape, scale, seed=sum(shape))
    ref = newton_schulz_reference(X64, coeffs)
    X = X64.float()
    X_before = X.clone()
    out = newton_schulz(X, coeffs)
    assert out.shape == X.shape and out.dtype == torch.float32
    assert torch.equal(X, X_before), "the input must not be modified"
    err = rel_err(out, ref)
    assert err.max() <= 1e-5, f"per-matrix relative errors {err.tolist()}"


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_cpu_step_counts(steps, threads):
    """0 steps returns a copy; an odd count ends in the kernel's workspace and is copied back."""
    X64 = normalised(4, 48, 80, 1.0, seed=steps)
    out = newton_schulz(X64.float(), KELLER[:steps])
    err = rel_err(out, newton_schulz_reference(X64, KELLER[:steps]))
    assert err.max() <= 1e-5


def test_cpu_leading_dims_and_2d():
    X64 = normalised(6, 40, 24, 1.0, seed=7)
    out = newton_schulz(X64.float().reshape(2, 3, 40, 24), KELLER)
    assert out.shape == (2, 3, 40, 24)
    assert rel_err(out.reshape(6, 40, 24), newton_schulz_reference(X64, KELLER)).max() <= 1e-5
    one = newton_schulz(X64[0].float(), KELLER)
    assert one.shape == (40, 24)
    assert rel_err(one[None], newton_schulz_reference(X64[:1], KELLER)).max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_cpu_other_dtypes_run_the_reference(dtype):
    """Outside the CPU kernel's range (fp32 only) the op is exactly the reference."""
    X = normalised(3, 20, 30, 1.0, seed=3).to(dtype)
    assert torch.equal(newton_schulz(X, KELLER), newton_schulz_reference(X, KELLER))


def test_bad_arguments():
    X = torch.randn(2, 8, 8)
    with pytest.raises(ValueError, match="triple"):
        newton_schulz(X, [(1.0, 2.0)])
    with pytest.raises(ValueError, match="rows, cols"):
        newton_schulz(torch.randn(8), KELLER)
    with pytest.raises(TypeError, match="floating"):
        newton_schulz(torch.ones(2, 4, 4, dtype=torch.int32), KELLER)


def test_fake_and_opcheck():
    X = normalised(3, 12, 20, 1.0, seed=1).float()
    torch.library.opcheck(torch.ops.k2.newton_schulz.default, (X, [v for t in KELLER for v in t]))
    Xt = normalised(3, 20, 12, 1.0, seed=2).float()
    torch.library.opcheck(torch.ops.k2.newton_schulz.default, (Xt, [v for t in KELLER for v in t]))
    meta = newton_schulz(torch.empty(4, 30, 10, device="meta"), KELLER)
    assert meta.shape == (4, 30, 10) and meta.device.type == "meta"


# ---------------------------------------------------------------------------------------------
# CUDA (run by scripts/gpu_check.sh on a GPU machine)

CUDA_SHAPES = [
    (1, 37, 53),  # odd: partial tiles, scalar loads (row stride not a multiple of 8)
    (3, 53, 37),  # tall
    (8, 256, 512),  # the benchmark's MoE experts
    (2, 130, 200),  # 3 x 3 tiles of the Gram matrix: mirrored off-diagonal tiles
    (4, 512, 512),
    (2, 96, 1000),
]


def _cuda_ready():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not _lib.has_cuda() or not hasattr(_lib.compiled(), "newton_schulz_cuda"):
        pytest.fail("k2_kernels._C was built without the CUDA Newton-Schulz kernel (rebuild with K2_CUDA=ON)")


@pytest.mark.cuda
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_fp32_matches_reference(shape, schedule):
    _cuda_ready()
    coeffs, scale = SCHEDULES[schedule]
    X64 = normalised(*shape, scale, seed=sum(shape), device="cuda")
    ref = newton_schulz_reference(X64, coeffs)
    X = X64.float()
    X_before = X.clone()
    out = newton_schulz(X, coeffs)
    torch.cuda.synchronize()
    assert torch.equal(X, X_before)
    err = rel_err(out, ref)
    assert err.max() <= 1e-5, f"per-matrix relative errors {err.tolist()}"


@pytest.mark.cuda
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_bf16_error_within_2x_plain_bf16(shape, schedule):
    _cuda_ready()
    coeffs, scale = SCHEDULES[schedule]
    X64 = normalised(*shape, scale, seed=sum(shape), device="cuda")
    ref = newton_schulz_reference(X64, coeffs)
    Xb = X64.bfloat16()
    out = newton_schulz(Xb, coeffs)
    assert out.dtype == torch.bfloat16 and out.shape == Xb.shape
    err = rel_err(out, ref)
    err_plain = rel_err(plain_ns(Xb, coeffs), ref)
    assert torch.isfinite(err).all()
    assert (err <= 2 * err_plain).all(), f"kernel {err.tolist()} vs plain bf16 {err_plain.tolist()}"


@pytest.mark.cuda
@pytest.mark.parametrize("steps", [0, 1, 3])
def test_cuda_step_counts(steps):
    _cuda_ready()
    X64 = normalised(4, 70, 150, 1.0, seed=steps, device="cuda")
    out = newton_schulz(X64.float(), KELLER[:steps])
    assert rel_err(out, newton_schulz_reference(X64, KELLER[:steps])).max() <= 1e-5


@pytest.mark.cuda
def test_cuda_bf16_close_to_bf16_reference():
    """Same roundings as the reference's bf16 bmm/baddbmm: after one step, within bf16 noise."""
    _cuda_ready()
    Xb = normalised(4, 256, 512, 1.0, seed=11, device="cuda").bfloat16()
    out = newton_schulz(Xb, KELLER[:1])
    ref = newton_schulz_reference(Xb, KELLER[:1])
    assert rel_err(out, ref).max() <= 1e-2

"""k2_kernels.newton_schulz_ops (compiled NS kernels) against the PyTorch reference.

Shape legend: B matrices, M rows, N columns (tall inputs are transposed to M <= N inside).
Ground truth: `newton_schulz_reference` in float64 on the same normalised input. Tolerances:
fp32 kernels within 1e-5 relative Frobenius error per matrix (fp32 torch itself lands at 1e-6 to
4e-6 here: the products are rounded differently, never more loosely); the bf16 CUDA kernel at
most 2x the error of a plain bf16 torch NS (matmul, then the a/b/c terms) on the same input.
"""

import re
import shutil
import subprocess
from pathlib import Path

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


# ---------------------------------------------------------------------------------------------
# The CUDA kernel's logic on the CPU: csrc/cuda/newton_schulz.cu compiled as C++ against a host
# emulation of the CUDA model (a block = real threads with real barriers; __shared__ = static, one
# block at a time; wmma fragments held whole by every lane, with wmma's alignment rules checked).
# It checks tiling, the upper-triangle grid, mirrored stores, edges, epilogues and ping-pong on
# machines without a GPU; rounding is the GPU's except for the order of fp32 additions.

_CSRC = Path(__file__).resolve().parents[3] / "csrc"

_EMU_HEADER = r"""
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
struct dim3 { unsigned x = 1, y = 1, z = 1; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
struct uint4 { uint32_t x, y, z, w; };
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline thread_local dim3 threadIdx, blockIdx, blockDim;
inline std::barrier<>* g_block_barrier = nullptr;
inline std::vector<std::unique_ptr<std::barrier<>>> g_warp_barriers;
inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { g_warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
typedef int cudaError_t;
constexpr cudaError_t cudaSuccess = 0;
typedef void* cudaStream_t;
enum cudaMemcpyKind { cudaMemcpyDeviceToDevice = 3 };
inline const char* cudaGetErrorString(cudaError_t) { return "emulated error"; }
inline cudaError_t cudaSetDevice(int) { return cudaSuccess; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaMemcpy2DAsync(void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h, cudaMemcpyKind,
                                     cudaStream_t) {
  for (size_t r = 0; r < h; ++r) std::memcpy(static_cast<char*>(d) + r * dp, static_cast<const char*>(s) + r * sp, w);
  return cudaSuccess;
}
inline long g_blocks = 0;
template <typename K, typename P>
void emu_launch(K kernel, dim3 grid, unsigned threads, const P& p) {
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x, ++g_blocks) {
        std::barrier<> bar(threads);
        g_block_barrier = &bar;
        g_warp_barriers.clear();
        for (unsigned w = 0; w < threads / 32; ++w) g_warp_barriers.emplace_back(new std::barrier<>(32));
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < threads; ++t)
          ts.emplace_back([&, t] { threadIdx = dim3(t); blockIdx = dim3(x, y, z); blockDim = dim3(threads); kernel(p); });
        for (auto& t : ts) t.join();
      }
}
struct __nv_bfloat16 { uint16_t b; };
inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float(uint32_t(h.b) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return {uint16_t((x >> 16) | 0x40u)};
  x += 0x7fffu + ((x >> 16) & 1u);
  return {uint16_t(x >> 16)};
}
inline __nv_bfloat16 __ushort_as_bfloat16(uint16_t u) { return {u}; }
inline uint16_t __bfloat16_as_ushort(__nv_bfloat16 h) { return h.b; }
struct __half { uint16_t b; };
inline float __half2float(__half) { std::abort(); }
inline __half __float2half_rn(float) { std::abort(); }
inline __half __ushort_as_half(uint16_t u) { return {u}; }
inline uint16_t __half_as_ushort(__half h) { return h.b; }
namespace nvcuda { namespace wmma {
struct row_major {}; struct col_major {}; struct matrix_a {}; struct matrix_b {}; struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };
template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment { float v[16][16]; };
inline void check_ptr(const void* p, unsigned ldm, size_t es) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0 || (ldm * es) % 16 != 0) { std::puts("wmma alignment violated"); std::abort(); }
}
template <typename Use, typename Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, __nv_bfloat16, Layout>& f, const __nv_bfloat16* p, unsigned ldm) {
  check_ptr(p, ldm, 2);
  constexpr bool rm = std::is_same<Layout, row_major>::value;
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) f.v[r][c] = __bfloat162float(rm ? p[r * ldm + c] : p[c * ldm + r]);
}
inline void fill_fragment(fragment<accumulator, 16, 16, 16, float>& f, float x) { for (auto& r : f.v) for (auto& e : r) e = x; }
template <typename LA, typename LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA>& a,
              const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  fragment<accumulator, 16, 16, 16, float> t;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) { float s = c.v[i][j]; for (int k = 0; k < 16; ++k) s += a.v[i][k] * b.v[k][j]; t.v[i][j] = s; }
  d = t;
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t l) {
  check_ptr(p, ldm, 4);
  if (threadIdx.x % 32 != 0) return;  // one writer; the kernel's __syncwarp publishes it
  for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j) (l == mem_row_major ? p[i * ldm + j] : p[j * ldm + i]) = f.v[i][j];
}
}}  // namespace nvcuda::wmma
"""

_EMU_DRIVER = r"""
#include <algorithm>
#include <random>
#include "k2/newton_schulz.h"
namespace k2 {  // newton_schulz_cpu.cpp is linked for validate(); its BLAS calls are not made here
void sgemm(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t, float, float*,
           int64_t) { std::abort(); }
void ssyrk_upper(bool, int64_t, int64_t, float, const float*, int64_t, float, float*, int64_t) { std::abort(); }
}
using Mat = std::vector<double>;
template <typename R>  // one step in double; round() rounds each product like the kernel (bf16) or not
void ns_step(Mat& X, int M, int N, double a, double b, double c, R round) {
  Mat A(M * M), P(M * M), Y(M * N);
  for (int i = 0; i < M; ++i) for (int j = 0; j < M; ++j) {
    double s = 0; for (int k = 0; k < N; ++k) s += X[i * N + k] * X[j * N + k]; A[i * M + j] = round(s); }
  for (int i = 0; i < M; ++i) for (int j = 0; j < M; ++j) {
    double s = 0; for (int k = 0; k < M; ++k) s += A[i * M + k] * A[j * M + k]; P[i * M + j] = round(c * s + b * A[i * M + j]); }
  for (int i = 0; i < M; ++i) for (int j = 0; j < N; ++j) {
    double s = 0; for (int k = 0; k < M; ++k) s += P[i * M + k] * X[k * N + j]; Y[i * N + j] = round(s + a * X[i * N + j]); }
  X = Y;
}
int main() {
  struct Case { int B, M, N, steps; };
  const Case cases[] = {{2, 37, 53, 5}, {1, 130, 200, 5}, {2, 64, 64, 3}, {1, 70, 150, 1}, {1, 96, 400, 2}, {3, 16, 24, 4}};
  const double kc[3] = {3.4445, -4.7750, 2.0315};
  int failures = 0;
  for (const Case& cs : cases) {
    const int B = cs.B, M = cs.M, N = cs.N;
    std::mt19937 gen(M * 7 + N);
    std::normal_distribution<double> nd;
    std::vector<Mat> X0(B, Mat(M * N));
    for (auto& X : X0) {
      double n2 = 0;
      for (auto& v : X) { v = nd(gen); n2 += v * v; }
      for (auto& v : X) v /= std::sqrt(n2);
    }
    std::vector<float> coeffs;
    for (int s = 0; s < cs.steps; ++s) coeffs.insert(coeffs.end(), {float(kc[0]), float(kc[1]), float(kc[2])});
    for (int bf = 0; bf < 2; ++bf) {
      const int64_t stride = int64_t(M) * N + (B > 1 ? 8 : 0);  // padded: the gaps must stay untouched
      std::vector<float> xf(B * stride, 0.0f);
      std::vector<__nv_bfloat16> xb(B * stride, __ushort_as_bfloat16(0));
      std::vector<Mat> Xin(B, Mat(M * N));
      for (int b = 0; b < B; ++b)
        for (int i = 0; i < M * N; ++i) {
          xf[b * stride + i] = float(X0[b][i]);
          xb[b * stride + i] = __float2bfloat16_rn(float(X0[b][i]));
          Xin[b][i] = bf ? __bfloat162float(xb[b * stride + i]) : xf[b * stride + i];
        }
      k2::NewtonSchulzArgs a{bf ? static_cast<void*>(xb.data()) : static_cast<void*>(xf.data()),
                             bf ? k2::DType::kBFloat16 : k2::DType::kFloat32, B, M, N, stride, coeffs.data(), cs.steps};
      std::vector<char> ws(k2::newton_schulz_cuda_workspace_bytes(B, M, N, a.dtype) + 256);
      k2::newton_schulz_cuda(a, reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 255) / 256 * 256), 0, 0);
      double worst = 0, worst_emul = 0;
      for (int b = 0; b < B; ++b) {
        Mat ref = Xin[b], emul = Xin[b];
        for (int s = 0; s < cs.steps; ++s) {
          ns_step(ref, M, N, kc[0], kc[1], kc[2], [](double v) { return v; });
          ns_step(emul, M, N, float(kc[0]), float(kc[1]), float(kc[2]),
                  [bf](double v) { return bf ? double(__bfloat162float(__float2bfloat16_rn(float(v)))) : v; });
        }
        double e = 0, e2 = 0, n = 0;
        for (int i = 0; i < M * N; ++i) {
          const double got = bf ? __bfloat162float(xb[b * stride + i]) : xf[b * stride + i];
          e += (got - ref[i]) * (got - ref[i]);
          e2 += (got - emul[i]) * (got - emul[i]);
          n += ref[i] * ref[i];
        }
        worst = std::max(worst, std::sqrt(e / n));
        worst_emul = std::max(worst_emul, std::sqrt(e2 / n));
        for (int64_t i = M * N; i < stride && b + 1 < B; ++i)
          if ((bf ? __bfloat16_as_ushort(xb[b * stride + i]) : __float_as_uint(xf[b * stride + i])) != 0) ++failures;
      }
      // fp32: fp32 rounding; bf16: the same roundings as the double emulation up to the order of
      // fp32 additions (which can flip a bf16 rounding, then grow through the steps)
      const bool ok = bf ? (worst <= 5e-2 && worst_emul <= 1e-2) : worst <= 1e-5;
      failures += !ok;
      std::printf("%s B=%d M=%d N=%d steps=%d: rel err %.3e, vs same roundings %.3e %s\n", bf ? "bf16" : "fp32", B, M, N,
                  cs.steps, worst, worst_emul, ok ? "ok" : "FAIL");
    }
  }
  std::printf("blocks: %ld, failures: %d\n", g_blocks, failures);
  return failures != 0;
}
"""


def _emulation_compiler() -> str | None:
    """g++ with C++20 <barrier> and OpenMP, or None."""
    gxx = shutil.which("g++")
    if gxx is None:
        return None
    probe = subprocess.run(
        [gxx, "-std=c++20", "-fopenmp", "-fsyntax-only", "-x", "c++", "-"],
        input="#include <barrier>\n#include <omp.h>\nint main() { std::barrier<> b(1); }\n",
        capture_output=True,
        text=True,
    )
    return gxx if probe.returncode == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("large_tile_min_m", [512, 1], ids=["default-tiles", "128-tiles"])
def test_cuda_kernel_logic_on_host_emulation(tmp_path, large_tile_min_m):
    cu = _CSRC / "cuda" / "newton_schulz.cu"
    if not cu.exists():
        pytest.skip("csrc/ not found (an installed package without the sources)")
    gxx = _emulation_compiler()
    if gxx is None:
        pytest.skip("needs g++ with C++20 <barrier> and OpenMP")
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "emu.h").write_text(_EMU_HEADER)
    for name in ("cuda_runtime.h", "cuda_bf16.h", "cuda_fp16.h", "mma.h"):
        (inc / name).write_text('#pragma once\n#include "emu.h"\n')
    src, n = re.subn(
        r"(ns_gemm_\w+<[^>]*>)<<<grid, ([^,]+), 0, stream>>>\(p\)",
        r"emu_launch(\1, grid, \2, p)",
        cu.read_text(),
    )
    assert n == 2, "expected the two kernel launches of newton_schulz.cu"
    (tmp_path / "ns_emu.cpp").write_text(src)
    (tmp_path / "driver.cpp").write_text('#include "emu.h"\n' + _EMU_DRIVER)
    exe = tmp_path / "ns_emu"
    cmd = [
        gxx,
        "-std=c++20",
        "-O2",
        "-fopenmp",
        "-DK2_WITH_CUDA=1",
        f"-DK2_NS_LARGE_TILE_MIN_M={large_tile_min_m}",
        f"-I{inc}",
        f"-I{_CSRC / 'include'}",
        f"-I{_CSRC / 'cuda'}",
        "-o",
        str(exe),
        str(tmp_path / "driver.cpp"),
        str(tmp_path / "ns_emu.cpp"),
        str(_CSRC / "cpu" / "newton_schulz_cpu.cpp"),
        "-lpthread",
    ]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "failures: 0" in run.stdout

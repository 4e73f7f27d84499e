// fp32 linear layers on weights packed once, for CPUs with AVX2 + FMA and no AVX-512.
//
// Letters: M rows of x, K in features, N out features; NR = 16 columns of a panel (two AVX2 vectors),
// MR = 6 rows of a tile.
//
// Why: on a 2-core AMD EPYC Zen 1 (AVX2 + FMA, no AVX-512) oneDNN's fp32 linear on a reordered weight
// ran the default model's decode-sized GEMMs at about 70% of the core's FMA peak, and they are most of
// a step there (docs/performance.md). This is the register-blocked GEMM of BLIS (Van Zee and van de
// Geijn, "BLIS: A Framework for Rapidly Instantiating BLAS Functionality", ACM TOMS 2015; its Haswell
// sgemm micro-kernel is 6 x 16): the weight is packed once, at load time, into panels of NR columns
// laid out k-major ([ceil(N / NR)][K][NR], zero-padded past N), and each tile of MR rows x NR columns
// keeps its 12 accumulators in registers over the whole of K, reading per k two vectors of the panel
// and MR broadcast elements of x. x is read in place (its rows, not packed); rows are taken in blocks
// of about 256 KB of x so that the block stays in L2 while every panel streams past it. Threads split
// the panels (at::parallel_for on PyTorch's pool). On CPUs with AVX-512 oneDNN's kernels are twice as
// wide and stay in use (`cpu_gemm.py` picks the backend).
//
// Each output is sum_k x[m, k] w[n, k] accumulated in k order in fp32 by FMA (plus the bias, first):
// as close to the exact product as F.linear's (tested), not the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define LORAPLEX_GEMM_X86 1
#define LORAPLEX_AVX2_FMA __attribute__((target("avx2,fma")))
#endif

namespace {

constexpr int64_t kNR = 16, kMR = 6;
constexpr int64_t kBlockBytes = 256 << 10;  // x rows per block: about this many bytes of x (L2 on Zen 1: 512 KB)

int64_t num_panels(int64_t n) { return (n + kNR - 1) / kNR; }

#if defined(LORAPLEX_GEMM_X86)
// c [R, cols] (row stride ldc) = bias[:cols] + a [R, K] (row stride lda) @ panel b [K, NR], R <= MR, cols <= NR.
// bias: NR floats (zero-padded past N) or nullptr. With Prefetch, the K rows of the panel at `next` (64
// bytes each) are asked into L1 as the loop goes, one per k: the first tile of a panel brings in the next
// panel while it computes, so the tiles after it find it in cache (the weights of a step are cold: 30
// layers' worth; 64 rows of the default model's 30 layers, Zen 1: 474 -> 445 ms).
template <int R, bool Prefetch>
LORAPLEX_AVX2_FMA inline __attribute__((always_inline)) void tile(int64_t k, const float* a, int64_t lda,
                                                                  const float* b, const float* bias, float* c,
                                                                  int64_t ldc, int64_t cols, const float* next) {
  __m256 acc[R][2];
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    acc[i][0] = b0;
    acc[i][1] = b1;
  }
  for (int64_t j = 0; j < k; ++j, b += kNR) {
    if constexpr (Prefetch) _mm_prefetch(reinterpret_cast<const char*>(next + j * kNR), _MM_HINT_T0);
    const __m256 w0 = _mm256_load_ps(b), w1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i * lda + j);
      acc[i][0] = _mm256_fmadd_ps(x, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(x, w1, acc[i][1]);
    }
  }
  if (cols == kNR) {
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      _mm256_storeu_ps(c + i * ldc, acc[i][0]);
      _mm256_storeu_ps(c + i * ldc + 8, acc[i][1]);
    }
  } else {  // the last panel of an N that is not a multiple of NR
    alignas(32) float row[kNR];
#pragma GCC unroll 6  // unrolled like the loops above, or GCC keeps acc in memory and stores it every k
    for (int i = 0; i < R; ++i) {
      _mm256_store_ps(row, acc[i][0]);
      _mm256_store_ps(row + 8, acc[i][1]);
      std::memcpy(c + i * ldc, row, cols * sizeof(float));
    }
  }
}

template <bool Prefetch>
LORAPLEX_AVX2_FMA void tile_of(int64_t r, int64_t k, const float* a, int64_t lda, const float* b, const float* bias,
                               float* c, int64_t ldc, int64_t cols, const float* next) {
  switch (r) {
    case 6: return tile<6, Prefetch>(k, a, lda, b, bias, c, ldc, cols, next);
    case 5: return tile<5, Prefetch>(k, a, lda, b, bias, c, ldc, cols, next);
    case 4: return tile<4, Prefetch>(k, a, lda, b, bias, c, ldc, cols, next);
    case 3: return tile<3, Prefetch>(k, a, lda, b, bias, c, ldc, cols, next);
    case 2: return tile<2, Prefetch>(k, a, lda, b, bias, c, ldc, cols, next);
    case 1: return tile<1, Prefetch>(k, a, lda, b, bias, c, ldc, cols, next);
  }
}

// out [M, N] (row stride N) = x [M, K] (row stride lda) @ W^T (+ bias), for the panels [p0, p1).
LORAPLEX_AVX2_FMA void gemm_panels(const float* x, int64_t lda, int64_t m, int64_t k, const float* packed,
                                   const float* bias, int64_t n, float* out, int64_t p0, int64_t p1) {
  const int64_t block = std::max<int64_t>(kMR, kBlockBytes / (k * 4) / kMR * kMR);
  for (int64_t m0 = 0; m0 < m; m0 += block) {
    const int64_t m1 = std::min(m, m0 + block);
    for (int64_t p = p0; p < p1; ++p) {
      const float* b = packed + p * k * kNR;
      const float* bp = bias ? bias + p * kNR : nullptr;
      const int64_t cols = std::min(kNR, n - p * kNR);
      for (int64_t i = m0; i < m1; i += kMR) {
        const int64_t r = std::min(kMR, m1 - i);
        if (i == m0 && p + 1 < p1)
          tile_of<true>(r, k, x + i * lda, lda, b, bp, out + i * n + p * kNR, n, cols, b + k * kNR);
        else
          tile_of<false>(r, k, x + i * lda, lda, b, bp, out + i * n + p * kNR, n, cols, nullptr);
      }
    }
  }
}
#endif

}  // namespace

bool avx2_available();  // bgmv_cpu.cpp: the CPU has AVX2 and FMA

// Floats of gemm_avx2_pack's result for an [N, K] weight: N padded to whole panels.
int64_t gemm_avx2_floats(int64_t n, int64_t k) { return num_panels(n) * k * kNR; }

// weight [N, K] fp32 (an nn.Linear's) -> [ceil(N / NR) * K * NR] fp32 panels (layout above).
at::Tensor gemm_avx2_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "gemm_avx2_pack: weight must be a 2-D fp32 CPU tensor, got ", weight.sizes(), " ", weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = num_panels(n);
  // [panels, K, NR] <- w [N, K] padded to [panels * NR, K], viewed [panels, NR, K] and transposed
  at::Tensor padded = at::zeros({panels * kNR, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({panels, kNR, k}).transpose(1, 2).contiguous().view({-1});
}

// x [M, K] fp32 (rows may be strided), packed from gemm_avx2_pack of an [N, K] weight, bias [N] or None
// -> [M, N] = x @ weight^T (+ bias).
at::Tensor gemm_avx2_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(avx2_available(), "gemm_avx2_linear: this CPU has no AVX2 + FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "gemm_avx2_linear: x must be a 2-D fp32 CPU tensor");
  const at::Tensor a = x.stride(1) == 1 && x.stride(0) >= x.size(1) ? x : x.contiguous();
  const int64_t m = a.size(0), k = a.size(1), panels = num_panels(n);
  TORCH_CHECK(n > 0 && k > 0, "gemm_avx2_linear: empty weight");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.is_contiguous() && packed.numel() == panels * k * kNR,
              "gemm_avx2_linear: packed has ", packed.numel(), " floats, an [", n, ", ", k, "] weight packs to ",
              panels * k * kNR);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr<float>()) % 32 == 0,
              "gemm_avx2_linear: packed is not 32-byte aligned (a view or a copy of the packed tensor?)");
  at::Tensor padded_bias;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat, "gemm_avx2_linear: bias must be [N] fp32");
    padded_bias = at::zeros({panels * kNR}, a.options());
    padded_bias.narrow(0, 0, n).copy_(bias->reshape({n}));
  }
  at::Tensor out = at::empty({m, n}, a.options());
  if (m == 0) return out;
#if defined(LORAPLEX_GEMM_X86)
  const float* xa = a.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  const float* b = padded_bias.defined() ? padded_bias.data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  const int64_t lda = a.stride(0);
  // at least 16 tiles per task (a tile: up to MR rows x NR columns over K), so one row's GEMV splits
  // between threads past 16 panels (256 columns), and a thread's share is never a sliver
  const int64_t tiles_per_panel = (m + kMR - 1) / kMR;
  const int64_t grain = std::max<int64_t>(1, 16 / tiles_per_panel);
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    gemm_panels(xa, lda, m, k, w, b, n, y, p0, p1);
  });
#endif
  return out;
}

// fp32 linear layers on weights packed once: loraplex's register-blocked GEMM, one kernel for AVX2 + FMA
// and one for AVX-512.
//
// Letters: M rows of x, K in features, N out features; NR columns of a panel, MR rows of a tile.
//
// Why: oneDNN's fp32 linear on a reordered weight leaves a share of the FMA peak on the table at the
// default model's decode sizes, on AVX2-only CPUs (Zen 1) and on AVX-512 ones (Zen 4) alike, and these
// GEMMs are most of a step (docs/performance.md has the measurements). This is the register-blocked GEMM
// of BLIS (Van Zee and van de Geijn, "BLIS: A Framework for Rapidly Instantiating BLAS Functionality",
// ACM TOMS 2015): the weight is packed once, at load time, into panels of NR columns laid out k-major
// ([ceil(N / NR)][K][NR], zero-padded past N), and each tile of MR rows x NR columns keeps its
// accumulators in registers over the whole of K, reading per k the NR floats of the panel as vectors and
// MR broadcast elements of x. x is read in place (its rows, not packed); rows are taken in blocks of
// about 256 KB of x so that the block stays in L2 while every panel streams past it. Threads split the
// panels (at::parallel_for on PyTorch's pool).
//
//   isa      NR (vectors)        MR  accumulators   (BLIS's micro-kernels: Haswell 6 x 16, SKX 32 x 12)
//   avx2     16 (2 x 8 lanes)     6  12 of 16 ymm
//   avx512   48 (3 x 16 lanes)    8  24 of 32 zmm
//
// The weights of a step are cold (every layer's in turn), so while the tiles of panel p run, the next
// panel is prefetched into L1, spread over all the tiles of the row block: each asks for its share of the
// next panel, a line every few k, which keeps the requests below what the core's miss buffers take at
// once. Asked for by the first tile alone, avx512's 110 KB panel arrived late; so did avx2's 36 KB one
// where the core runs 256-bit FMAs at full width (our avx2 tiles on a Zen 4 EPYC, one thread, the 30
// layers' cold weights, scripts/gemm-bench --isa avx2: 92-96 -> 100-106 GFLOP/s at 64 rows, 96-101 ->
// 99-106 at 512, three runs in turns; about 110 with the weight in L2). The avx2 tile was first tuned
// on a Zen 1, whose half-width units take twice the cycles per k, so its first tile asked half as fast.
//
// Each output is sum_k x[m, k] w[n, k] accumulated in k order in fp32 by FMA (plus the bias, first):
// as close to the exact product as F.linear's (tested), not the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#define LORAPLEX_GEMM_X86 1
#define LORAPLEX_AVX2_FMA __attribute__((target("avx2,fma")))
#define LORAPLEX_AVX512 __attribute__((target("avx512f")))
#define LORAPLEX_INLINE inline __attribute__((always_inline))
#endif

// norm_act_cpu.cpp: o [n] = silu(g) x u, silu_mul's bits
void silu_mul_row(const float* g, const float* u, float* o, int64_t n);

namespace {

constexpr int64_t kBlockBytes = 256 << 10;  // x rows per block: about this many bytes of x (L2: 512 KB-1 MB)

struct Shape {  // one ISA's tile
  int64_t nr, mr;
};
constexpr Shape kAvx2{16, 6}, kAvx512{48, 8};

int64_t num_panels(int64_t n, int64_t nr) { return (n + nr - 1) / nr; }

#if defined(LORAPLEX_GEMM_X86)
// Prefetch into L1 the `Lines` 64-byte lines at next + j * step (bytes); nothing where Lines is 0.
template <int Lines>
LORAPLEX_INLINE void prefetch_lines(const float* next, int64_t j, int64_t step) {
  const char* p = reinterpret_cast<const char*>(next) + j * step;
#pragma GCC unroll 4
  for (int l = 0; l < Lines; ++l) _mm_prefetch(p + 64 * l, _MM_HINT_T0);
}

// Ask for the output line at p into L1. A tile stores its R output rows once, after the whole of K; asked
// for in its first k steps (a line a step, within the row's `cols` columns), they arrive long before the
// stores, which at prefill sizes otherwise found them in neither L1 nor L2 (a tile writes R partial rows
// ldc floats apart) and held up the tile's end. (An up tile of the SiLU x up epilogue asks for its
// scratch rows, which are in cache, as is the output its gate tile has just written.) On a Zen 4 EPYC: a
// scratch copy of this loop over the 30 layers' cold weights, one output buffer for all of them, 109.7 ->
// 113.0 GFLOP/s at 512 rows and 111.8 -> 113.4 at 64; scripts/gemm-bench, whose outputs come back warm
// from the allocator, +0.5%; the vllm preset's base-only run through the engine about 0.6% faster (faster
// in each of four pairs in turns, which is all the evidence there is at that size; docs/performance.md).
// A read prefetch: these functions' targets do not enable PREFETCHW, and a line no other core holds
// arrives exclusive anyway, so the store needs nothing more. Never faults, like any prefetch.
LORAPLEX_INLINE void prefetch_out(const float* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

// c [R, cols] (row stride ldc) = bias[:cols] + a [R, K] (row stride lda) @ panel b [K, NR], R <= MR,
// cols <= NR; bias: NR floats (zero-padded past N) or nullptr. AVX2: NR = 16, two ymm per row.
template <int R, int Lines>
LORAPLEX_AVX2_FMA LORAPLEX_INLINE void tile_avx2(int64_t k, const float* a, int64_t lda, const float* b,
                                                 const float* bias, float* c, int64_t ldc, int64_t cols,
                                                 const float* next, int64_t step) {
  __m256 acc[R][2];
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    acc[i][0] = b0;
    acc[i][1] = b1;
  }
  for (int64_t j = 0; j < k; ++j, b += 16) {
    prefetch_lines<Lines>(next, j, step);
    if (j < 2 * R) prefetch_out(c + (j >> 1) * ldc + std::min<int64_t>((j & 1) * 15, cols - 1));  // 1-2 lines
    const __m256 w0 = _mm256_load_ps(b), w1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i * lda + j);
      acc[i][0] = _mm256_fmadd_ps(x, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(x, w1, acc[i][1]);
    }
  }
  if (cols == 16) {
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      _mm256_storeu_ps(c + i * ldc, acc[i][0]);
      _mm256_storeu_ps(c + i * ldc + 8, acc[i][1]);
    }
  } else {  // the last panel of an N that is not a multiple of NR
    alignas(32) float row[16];
#pragma GCC unroll 6  // unrolled like the loops above, or GCC keeps acc in memory and stores it every k
    for (int i = 0; i < R; ++i) {
      _mm256_store_ps(row, acc[i][0]);
      _mm256_store_ps(row + 8, acc[i][1]);
      std::memcpy(c + i * ldc, row, cols * sizeof(float));
    }
  }
}

// The same for AVX-512: NR = 48, three zmm per row.
template <int R, int Lines>
LORAPLEX_AVX512 LORAPLEX_INLINE void tile_avx512(int64_t k, const float* a, int64_t lda, const float* b,
                                                 const float* bias, float* c, int64_t ldc, int64_t cols,
                                                 const float* next, int64_t step) {
  __m512 acc[R][3];
  __m512 b0[3];
#pragma GCC unroll 3
  for (int v = 0; v < 3; ++v) b0[v] = bias ? _mm512_loadu_ps(bias + 16 * v) : _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) acc[i][v] = b0[v];
  for (int64_t j = 0; j < k; ++j, b += 48) {
    prefetch_lines<Lines>(next, j, step);
    // 3 lines a row (where c is off a line's start, the row's 4th line is not asked for)
    if (j < 3 * R) prefetch_out(c + (j / 3) * ldc + std::min<int64_t>((j % 3) * 16, cols - 1));
    __m512 w[3];
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) w[v] = _mm512_load_ps(b + 16 * v);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512 x = _mm512_set1_ps(a[i * lda + j]);
#pragma GCC unroll 3
      for (int v = 0; v < 3; ++v) acc[i][v] = _mm512_fmadd_ps(x, w[v], acc[i][v]);
    }
  }
  if (cols == 48) {
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 3
      for (int v = 0; v < 3; ++v) _mm512_storeu_ps(c + i * ldc + 16 * v, acc[i][v]);
  } else {
    alignas(64) float row[48];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
#pragma GCC unroll 3
      for (int v = 0; v < 3; ++v) _mm512_store_ps(row + 16 * v, acc[i][v]);
      std::memcpy(c + i * ldc, row, cols * sizeof(float));
    }
  }
}

// One tile of r rows (1 <= r <= MR) with `lines` prefetched lines per k (0 <= lines <= NR / 16).
#define LORAPLEX_TILE_CASES(TILE, R)                                               \
  case R:                                                                          \
    switch (lines) {                                                               \
      case 0: return TILE<R, 0>(k, a, lda, b, bias, c, ldc, cols, next, step);     \
      case 1: return TILE<R, 1>(k, a, lda, b, bias, c, ldc, cols, next, step);     \
      case 2: return TILE<R, 2>(k, a, lda, b, bias, c, ldc, cols, next, step);     \
      default: return TILE<R, 3>(k, a, lda, b, bias, c, ldc, cols, next, step);    \
    }
#define LORAPLEX_TILE_ARGS                                                                              \
  int64_t r, int lines, int64_t k, const float *a, int64_t lda, const float *b, const float *bias, float *c, \
      int64_t ldc, int64_t cols, const float *next, int64_t step

LORAPLEX_AVX2_FMA void run_tile_avx2(LORAPLEX_TILE_ARGS) {
  switch (r) {
    LORAPLEX_TILE_CASES(tile_avx2, 6)
    LORAPLEX_TILE_CASES(tile_avx2, 5)
    LORAPLEX_TILE_CASES(tile_avx2, 4)
    LORAPLEX_TILE_CASES(tile_avx2, 3)
    LORAPLEX_TILE_CASES(tile_avx2, 2)
    LORAPLEX_TILE_CASES(tile_avx2, 1)
  }
}

LORAPLEX_AVX512 void run_tile_avx512(LORAPLEX_TILE_ARGS) {
  switch (r) {
    LORAPLEX_TILE_CASES(tile_avx512, 8)
    LORAPLEX_TILE_CASES(tile_avx512, 7)
    LORAPLEX_TILE_CASES(tile_avx512, 6)
    LORAPLEX_TILE_CASES(tile_avx512, 5)
    LORAPLEX_TILE_CASES(tile_avx512, 4)
    LORAPLEX_TILE_CASES(tile_avx512, 3)
    LORAPLEX_TILE_CASES(tile_avx512, 2)
    LORAPLEX_TILE_CASES(tile_avx512, 1)
  }
}
#undef LORAPLEX_TILE_CASES
#undef LORAPLEX_TILE_ARGS

// The output column of panel p's first column: p x NR, or with a gate/up weight packed interleaved
// (glu = I > 0, gemm_pack's), I apart: gate panels (even p) from column 0, up panels (odd p) from I; with
// `act`, both at (p / 2) x NR of the [M, I] output, where the up panel turns the gate's values into
// silu(gate) x up.
struct Columns {
  int64_t nr, glu;
  bool act;
  int64_t of(int64_t p) const {
    if (!glu) return p * nr;
    return (act || p % 2 == 0 ? 0 : glu) + p / 2 * nr;
  }
};

// out [M, ldo] = x [M, K] (row stride lda) @ W^T (+ bias), for the panels [p0, p1) (N columns in all, each
// panel's output columns from `columns`).
void gemm_panels(const Shape& s, const float* x, int64_t lda, int64_t m, int64_t k, const float* packed,
                 const float* bias, int64_t n, float* out, int64_t ldo, const Columns& columns, int64_t p0,
                 int64_t p1) {
  const auto run_tile = s.nr == kAvx512.nr ? run_tile_avx512 : run_tile_avx2;
  const int64_t block = std::max<int64_t>(s.mr, kBlockBytes / (k * 4) / s.mr * s.mr);
  const int64_t panel = k * s.nr;  // floats
  alignas(64) float up[kAvx512.mr * kAvx512.nr];  // an up panel's tile, before the epilogue
  for (int64_t m0 = 0; m0 < m; m0 += block) {
    const int64_t m1 = std::min(m, m0 + block);
    // the next panel's bytes, split between the first `askers` tiles: share bytes each, step bytes per k
    const int64_t askers = std::min((m1 - m0 + s.mr - 1) / s.mr, panel / 16);  // <= its lines
    const int64_t share = (panel * 4 / askers + 63) / 64 * 64;
    const int64_t step = (share + k - 1) / k;
    const int lines = static_cast<int>(std::min<int64_t>((step + 63) / 64, s.nr / 16));
    for (int64_t p = p0; p < p1; ++p) {
      const float* b = packed + p * panel;
      const float* bp = bias ? bias + p * s.nr : nullptr;
      const int64_t cols = std::min(s.nr, n - p * s.nr);
      const int64_t col = columns.of(p);
      const bool epilogue = columns.act && p % 2 == 1;
      for (int64_t i = m0, t = 0; i < m1; i += s.mr, ++t) {
        const int64_t r = std::min(s.mr, m1 - i);
        const bool asks = p + 1 < p1 && t < askers;
        const float* next = asks ? b + panel + t * (share / 4) : nullptr;
        float* c = out + i * ldo + col;
        if (!epilogue) {
          run_tile(r, asks ? lines : 0, k, x + i * lda, lda, b, bp, c, ldo, cols, next, step);
          continue;
        }
        run_tile(r, asks ? lines : 0, k, x + i * lda, lda, b, bp, up, s.nr, cols, next, step);
        for (int64_t j = 0; j < r; ++j) silu_mul_row(c + j * ldo, up + j * s.nr, c + j * ldo, cols);
      }
    }
  }
}
#endif

const Shape& shape_of(const std::string& isa, const char* what) {
  TORCH_CHECK(isa == "avx2" || isa == "avx512", what, ": isa must be \"avx2\" or \"avx512\", got \"", isa, "\"");
  return isa == "avx512" ? kAvx512 : kAvx2;
}

}  // namespace

bool avx2_available();    // bgmv_cpu.cpp: the CPU has AVX2 and FMA
bool avx512_available();  // bgmv_cpu.cpp: the CPU has AVX-512 F/BW/VL/DQ

// Floats of gemm_pack's result for an [N, K] weight and `isa`: N padded to whole panels.
int64_t gemm_floats(int64_t n, int64_t k, const std::string& isa) {
  const int64_t nr = shape_of(isa, "gemm_floats").nr;
  return num_panels(n, nr) * k * nr;
}

// weight [N, K] fp32 (an nn.Linear's) -> [ceil(N / NR) * K * NR] fp32 panels (layout above) for `isa`.
// glu = I > 0: weight is a fused gate/up projection ([gate; up], N = 2I, I a multiple of NR), packed with
// its panels interleaved (gate columns 0..NR-1, up columns 0..NR-1, gate NR..2NR-1, ...), as gemm_linear's
// glu calls expect.
at::Tensor gemm_pack(const at::Tensor& weight, const std::string& isa, int64_t glu) {
  const int64_t nr = shape_of(isa, "gemm_pack").nr;
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "gemm_pack: weight must be a 2-D fp32 CPU tensor, got ", weight.sizes(), " ", weight.scalar_type());
  at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = num_panels(n, nr);
  if (glu) {
    TORCH_CHECK(glu > 0 && n == 2 * glu && glu % nr == 0, "gemm_pack: glu = I needs a [2I, K] weight with I a ",
                "multiple of ", nr, ", got I = ", glu, " and ", w.sizes());
    w = w.view({2, glu / nr, nr, k}).transpose(0, 1).contiguous().view({n, k});
  }
  // [panels, K, NR] <- w [N, K] padded to [panels * NR, K], viewed [panels, NR, K] and transposed
  at::Tensor padded = at::zeros({panels * nr, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({panels, nr, k}).transpose(1, 2).contiguous().view({-1});
}

// x [M, K] fp32 (rows may be strided), packed from gemm_pack(weight, isa, glu) of an [N, K] weight, bias [N]
// or None -> [M, N] = x @ weight^T (+ bias); with act (glu only) -> [M, I] = silu(x @ gate^T) x (x @ up^T),
// each element as silu_mul computes it from the unfused product (the same bits), without the [M, 2I]
// product ever being written: each up tile's epilogue reads the gate tile its row block just stored
// (vLLM's CPU backend fuses no activation into its GEMMs; llama.cpp's ggml runs them as separate ops).
// Raises where the CPU lacks `isa`. The caller keeps the isa and glu a weight was packed for
// (cpu_gemm.py stores them with the packed copy): where N is a multiple of 48 the two isas' layouts
// have the same size, so a size check cannot tell them apart.
at::Tensor gemm_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::string& isa,
                       const c10::optional<at::Tensor>& bias, int64_t glu, bool act) {
  const Shape& s = shape_of(isa, "gemm_linear");
  TORCH_CHECK(s.nr == kAvx512.nr ? avx512_available() : avx2_available(), "gemm_linear: this CPU has no ",
              s.nr == kAvx512.nr ? "AVX-512" : "AVX2 + FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "gemm_linear: x must be a 2-D fp32 CPU tensor");
  TORCH_CHECK(glu == 0 || (glu > 0 && n == 2 * glu && glu % s.nr == 0), "gemm_linear: glu = ", glu,
              " does not fit N = ", n, " for ", isa);
  TORCH_CHECK(!act || glu, "gemm_linear: act needs a weight packed with glu");
  const at::Tensor a = x.stride(1) == 1 && x.stride(0) >= x.size(1) ? x : x.contiguous();
  const int64_t m = a.size(0), k = a.size(1), panels = num_panels(n, s.nr);
  TORCH_CHECK(n > 0 && k > 0, "gemm_linear: empty weight");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.is_contiguous() && packed.numel() == panels * k * s.nr,
              "gemm_linear: packed has ", packed.numel(), " floats, an [", n, ", ", k, "] weight packs to ",
              panels * k * s.nr, " for ", isa);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr<float>()) % 64 == 0,
              "gemm_linear: packed is not 64-byte aligned (a view or a copy of the packed tensor?)");
  at::Tensor padded_bias;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(!glu, "gemm_linear: no bias with glu (a gate/up projection has none)");
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat, "gemm_linear: bias must be [N] fp32");
    padded_bias = at::zeros({panels * s.nr}, a.options());
    padded_bias.narrow(0, 0, n).copy_(bias->reshape({n}));
  }
  const int64_t ldo = act ? glu : n;
  at::Tensor out = at::empty({m, ldo}, a.options());
  if (m == 0) return out;
#if defined(LORAPLEX_GEMM_X86)
  const float* xa = a.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  const float* b = padded_bias.defined() ? padded_bias.data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  const int64_t lda = a.stride(0);
  const Columns columns{s.nr, glu, act};
  // at least 16 tiles per task (a tile: up to MR rows x NR columns over K), so one row's GEMV splits
  // between threads past 16 panels, and a thread's share is never a sliver; with act, whole gate/up pairs
  const int64_t tiles_per_panel = (m + s.mr - 1) / s.mr;
  const int64_t unit = act ? 2 : 1;
  const int64_t grain = std::max<int64_t>(1, 16 / tiles_per_panel / unit);
  at::parallel_for(0, panels / unit, grain, [&](int64_t u0, int64_t u1) {
    gemm_panels(s, xa, lda, m, k, w, b, n, y, ldo, columns, u0 * unit, u1 * unit);
  });
#endif
  return out;
}

// Greedy decoding's lm_head without the fp32 logits: the argmax of x @ W^T found by a bf16 screen and an
// exact fp32 recheck of the few tokens the screen cannot rule out.
//
// Letters: M rows of x (hidden states), K hidden size, V vocab; NR = 48 columns of a panel, MR = 8 rows of
// a tile, K2 = ceil(K / 2) bf16 pairs.
//
// The fp32 logit f_j = sum_k x_k W_jk, as gemm_cpu.cpp's avx512 GEMM computes it (one FMA chain from 0
// in k order), is what greedy decoding takes the argmax of. The screen computes s_j from x and W rounded
// to bf16 (round to nearest even), their products summed in fp32 by vdpbf16ps, at twice the FMA rate of
// fp32 on the CPUs that have AVX512-BF16 and from half the weight bytes. With u = 2^-8 (bf16's unit
// roundoff: 8 significant bits), g_K(e) = K e / (1 - K e) (the bound on K roundings of unit roundoff e,
// Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 3.1; the screen's own sums
// are given e = 2^-23, twice fp32's, so a vdpbf16ps that rounds other than to nearest is covered too)
// and S_j = sum_k |x_k| |W_jk|:
//   |s_j - f_j| <= ((2u + u^2) + g_K(2^-23) (1 + u)^2 + g_K(2^-24)) S_j + A
//              <= c ||x||_2 ||W_j||_2 + A = B_j
// (Cauchy-Schwarz; c adds 2^-22 for the roundings of B_j, s_j + B_j and s_j - B_j, then 0.1%). A covers
// the subnormals vdpbf16ps flushes to zero: a product whose bf16 factor is subnormal is dropped (at most
// 2^-126 times the other factor, summed over k: 2^-126 sqrt(K) (||x|| + max_j ||W_j||)), and so is a
// subnormal partial sum (2^-126 each, 2K of them); A is twice their sum, at least 1e-30. So every token
// j with s_j + B_j below L = max_i (s_i - B_i) has f_j < f_i for some i, and the argmax of f is among
// the others: the candidates. Each candidate's f_j is then computed exactly as the GEMM does (the same
// FMA chain, so the same bits), and the first largest wins, as `logits.max(dim=-1)` picks. On the
// default model (SmolLM2, K = 576, ||x|| 40-63 and ||W_j|| 1.8-7.5 at its last layer; c = 0.0079) a row
// has a few candidates (docs/performance.md).
//
// While the panels go by, each row keeps a running L and the (column, s_j + B_j) of every column that
// is not below that row's L so far; a smaller L than the final one only keeps more, and the list is
// filtered by the final L at the end. No [M, V] logits are written or read again.
//
// A row is not screened (its token is -1; the caller computes its logits) when x holds a NaN, an Inf or
// a value beyond bf16's range, or ||x|| max_j ||W_j|| could come near fp32's range, where a logit may
// overflow: its logits decide what the caller reports (sampler.check_finite). A weight with a value
// beyond bf16's range is refused when packed.
//
// The GEMM is gemm_cpu.cpp's register-blocked one (BLIS) on bf16 pairs: the weight packed once in panels
// [ceil(V / NR)][K2][NR] of 32-bit bf16 pairs (W_j,2q in the low half), each tile of MR rows x NR
// columns keeping 24 zmm accumulators over the whole of K2 (vdpbf16ps with the row's pair broadcast),
// and the next panel prefetched a few lines per step, spread over the tiles of the panel.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define LORAPLEX_GREEDY_X86 1
#define LORAPLEX_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define LORAPLEX_FMA __attribute__((target("fma")))
#define LORAPLEX_INLINE inline __attribute__((always_inline))
#endif

bool avx512_bf16_available();  // bgmv_cpu.cpp

namespace {

constexpr int64_t kNR = 48, kMR = 8;
constexpr double kLimit = 1e36;  // ||x|| max ||W_j|| above this: the row is left to the fp32 logits
constexpr float kBf16Max = 0x1.fep127f;  // bf16's largest finite value (from 0x1.ffp127 on, rounding gives inf;
                                         // refusing all beyond it is the simple side of that line)

int64_t num_panels(int64_t v) { return (v + kNR - 1) / kNR; }

// The bits of fp32 v rounded to the nearest bf16, ties to even (c10::BFloat16's conversion, as the
// weight's `to(bfloat16)` in greedy_head_pack).
uint32_t bf16_bits(float v) { return c10::BFloat16(v).x; }

// c of the bound above, for K terms.
double bound_factor(int64_t k) {
  const double u = std::ldexp(1.0, -8);
  const auto g = [k](double e) { return k * e / (1.0 - k * e); };
  return ((2 * u + u * u) + g(std::ldexp(1.0, -23)) * (1 + u) * (1 + u) + g(std::ldexp(1.0, -24)) +
          std::ldexp(1.0, -22)) * 1.001;
}

// What one thread found over its panels, per row: the running L and the candidates (column, s + B) in
// column order.
struct Found {
  std::vector<float> floor;
  std::vector<std::vector<std::pair<int64_t, float>>> cands;
};

#if defined(LORAPLEX_GREEDY_X86)
template <int Lines>
LORAPLEX_INLINE void prefetch_lines(const char* next, int64_t j, int64_t step) {
#pragma GCC unroll 3
  for (int l = 0; l < Lines; ++l) _mm_prefetch(next + j * step + 64 * l, _MM_HINT_T0);
}

// The tile of rows i0 .. i0 + R - 1 and panel p: s by vdpbf16ps over the K2 pairs, then the screen's
// bookkeeping for its columns (col0 ..; cols valid).
template <int R, int Lines>
LORAPLEX_BF16 void tile(int64_t k2, const uint32_t* xp, const uint32_t* b, const float* wn, const float* cx,
                        const float* ax, int64_t col0, int64_t cols, const char* next, int64_t step, Found& f,
                        int64_t i0) {
  __m512 acc[R][3];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t q = 0; q < k2; ++q, b += kNR) {
    prefetch_lines<Lines>(next, q, step);
    __m512i w[3];
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) w[v] = _mm512_load_si512(b + 16 * v);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(xp[i * k2 + q]));
#pragma GCC unroll 3
      for (int v = 0; v < 3; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)xv, (__m512bh)w[v]);
    }
  }
  __m512 wv[3];
  __mmask16 valid[3];
#pragma GCC unroll 3
  for (int v = 0; v < 3; ++v) {
    wv[v] = _mm512_loadu_ps(wn + 16 * v);
    const int64_t left = std::clamp<int64_t>(cols - 16 * v, 0, 16);
    valid[v] = static_cast<__mmask16>((1u << left) - 1);
  }
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    if (cx[i0 + i] < 0) continue;  // a row left to the caller
    const __m512 c = _mm512_set1_ps(cx[i0 + i]);
    const __m512 tiny = _mm512_set1_ps(ax[i0 + i]);
    __m512 hi[3], lo = ninf;
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) {
      const __m512 bound = _mm512_fmadd_ps(c, wv[v], tiny);
      hi[v] = _mm512_mask_mov_ps(ninf, valid[v], _mm512_add_ps(acc[i][v], bound));
      lo = _mm512_mask_max_ps(lo, valid[v], lo, _mm512_sub_ps(acc[i][v], bound));
    }
    float& floor = f.floor[i0 + i];
    floor = std::max(floor, _mm512_reduce_max_ps(lo));
    const __m512 fl = _mm512_set1_ps(floor);
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) {
      uint32_t m = _mm512_cmp_ps_mask(hi[v], fl, _CMP_GE_OQ);
      if (!m) continue;
      alignas(64) float h[16];
      _mm512_store_ps(h, hi[v]);
      for (; m; m &= m - 1) {
        const int lane = __builtin_ctz(m);
        f.cands[i0 + i].emplace_back(col0 + 16 * v + lane, h[lane]);
      }
    }
  }
}

#define LORAPLEX_GREEDY_CASES(R)                                                 \
  case R:                                                                        \
    switch (lines) {                                                             \
      case 0: return tile<R, 0>(k2, xp, b, wn, cx, ax, col0, cols, next, step, f, i0); \
      case 1: return tile<R, 1>(k2, xp, b, wn, cx, ax, col0, cols, next, step, f, i0); \
      case 2: return tile<R, 2>(k2, xp, b, wn, cx, ax, col0, cols, next, step, f, i0); \
      default: return tile<R, 3>(k2, xp, b, wn, cx, ax, col0, cols, next, step, f, i0); \
    }

LORAPLEX_BF16 void run_tile(int64_t r, int lines, int64_t k2, const uint32_t* xp, const uint32_t* b,
                            const float* wn, const float* cx, const float* ax, int64_t col0, int64_t cols,
                            const char* next, int64_t step, Found& f, int64_t i0) {
  switch (r) {
    LORAPLEX_GREEDY_CASES(8)
    LORAPLEX_GREEDY_CASES(7)
    LORAPLEX_GREEDY_CASES(6)
    LORAPLEX_GREEDY_CASES(5)
    LORAPLEX_GREEDY_CASES(4)
    LORAPLEX_GREEDY_CASES(3)
    LORAPLEX_GREEDY_CASES(2)
    LORAPLEX_GREEDY_CASES(1)
  }
}
#undef LORAPLEX_GREEDY_CASES

// sum_q a[q] b[q] as one FMA chain from 0 in q order: an output of gemm_cpu.cpp's GEMM, to the bit.
LORAPLEX_FMA float fma_dot(const float* a, const float* b, int64_t k) {
  float s = 0.f;
  for (int64_t q = 0; q < k; ++q) s = std::fma(a[q], b[q], s);
  return s;
}

// Panels [p0, p1) for every row (x's rows as pairs xp [M, K2]), into f.
void screen(const uint32_t* xp, int64_t m, int64_t k2, const uint32_t* packed, const float* wn_padded,
            const float* cx, const float* ax, int64_t v, int64_t p0, int64_t p1, Found& f) {
  const int64_t panel = k2 * kNR;  // pairs
  const int64_t tiles = (m + kMR - 1) / kMR;
  const int64_t share = (panel * 4 / tiles + 63) / 64 * 64;  // bytes of the next panel each tile asks for
  const int64_t step = (share + k2 - 1) / k2;
  const int lines = static_cast<int>(std::min<int64_t>((step + 63) / 64, 3));
  for (int64_t p = p0; p < p1; ++p) {
    const uint32_t* b = packed + p * panel;
    const int64_t cols = std::min(kNR, v - p * kNR);
    for (int64_t i = 0, t = 0; i < m; i += kMR, ++t) {
      const bool asks = p + 1 < p1;
      const char* next = asks ? reinterpret_cast<const char*>(b + panel) + t * share : nullptr;
      run_tile(std::min(kMR, m - i), asks ? lines : 0, k2, xp + i * k2, b, wn_padded + p * kNR, cx, ax,
               p * kNR, cols, next, step, f, i);
    }
  }
}
#endif

}  // namespace

// weight [V, K] fp32 -> [ceil(V / 48), ceil(K / 2), 48] int32: its bf16 pairs (round to nearest even;
// W_j,2q in the low 16 bits, zeros past V and K), greedy_head's layout. Raises for another shape or
// dtype, an empty weight, or one with a value that is not finite or beyond bf16's range.
at::Tensor greedy_head_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "greedy_head_pack: weight must be a 2-D fp32 CPU tensor, got ", weight.sizes(), " ",
              weight.scalar_type());
  TORCH_CHECK(weight.numel() > 0, "greedy_head_pack: empty weight");
  TORCH_CHECK(at::isfinite(weight).all().item<bool>() && weight.abs().max().item<float>() <= kBf16Max,
              "greedy_head_pack: weight has a NaN, an Inf or a value beyond bf16's range");
  const at::Tensor w = weight.contiguous();
  const int64_t v = w.size(0), k = w.size(1), k2 = (k + 1) / 2, panels = num_panels(v);
  // [panels x NR, 2 K2] bf16 (zeros past V and K), as [.., K2] 32-bit pairs (the even k in the low half),
  // viewed [panels, NR, K2] and transposed: gemm_pack's layout, in pairs
  at::Tensor padded = at::zeros({panels * kNR, 2 * k2}, w.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, v).narrow(1, 0, k).copy_(w);
  return padded.view(at::kInt).view({panels, kNR, k2}).transpose(1, 2).contiguous();
}

// x [M, K] fp32 (rows may be strided), packed = greedy_head_pack(weight), norms [V] fp32 (each >= ||W_j||_2),
// weight [V, K] fp32 (the lm_head's, contiguous) -> (tokens [M] int64: each row's argmax of x @ weight^T as
// gemm_cpu.cpp's avx512 GEMM computes it, the first on a tie, or -1 for a row left to the caller (see
// above); candidates [M] int64: the tokens each row computed in fp32). Raises where the CPU has no
// AVX512-BF16, or for shapes that do not fit.
std::vector<at::Tensor> greedy_head(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& norms,
                                    const at::Tensor& weight) {
  TORCH_CHECK(avx512_bf16_available(), "greedy_head: this CPU has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1,
              "greedy_head: x must be a 2-D fp32 CPU tensor with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              "greedy_head: weight must be a contiguous fp32 [V, K] tensor with x's K = ", x.size(1),
              " columns, got ", weight.sizes());
  const int64_t m = x.size(0), k = x.size(1), v = weight.size(0), k2 = (k + 1) / 2, panels = num_panels(v);
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous() && packed.numel() == panels * k2 * kNR,
              "greedy_head: packed does not hold a [", v, ", ", k, "] weight (greedy_head_pack)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr<int32_t>()) % 64 == 0,
              "greedy_head: packed is not 64-byte aligned");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.numel() == v, "greedy_head: norms must be [V] fp32");
  TORCH_CHECK(v > 0 && k > 0, "greedy_head: empty weight");
  at::Tensor tokens = at::full({m}, -1, x.options().dtype(at::kLong));
  at::Tensor counts = at::zeros({m}, x.options().dtype(at::kLong));
  if (m == 0) return {tokens, counts};
#if defined(LORAPLEX_GREEDY_X86)
  std::vector<float> wn(panels * kNR, 0.f);
  const at::Tensor nc = norms.contiguous();
  std::memcpy(wn.data(), nc.data_ptr<float>(), v * sizeof(float));
  const double wmax = *std::max_element(wn.begin(), wn.end());
  const double c = bound_factor(k);
  // rows as bf16 pairs; cx[i] = c ||x_i|| rounded up and ax[i] = A (see above); rows left out get cx = -1
  std::vector<uint32_t> xp(m * k2, 0);
  std::vector<float> cx(m), ax(m);
  const float* xa = x.data_ptr<float>();
  const double sub = std::ldexp(1.0, -126), rk = std::sqrt(static_cast<double>(k));
  for (int64_t i = 0; i < m; ++i) {
    const float* row = xa + i * x.stride(0);
    double ss = 0;
    bool ok = true;
    for (int64_t j = 0; j < k; ++j) {
      ok &= std::isfinite(row[j]) && std::fabs(row[j]) <= kBf16Max;
      ss += static_cast<double>(row[j]) * row[j];
    }
    const double xn = std::sqrt(ss);
    ok &= xn * wmax < kLimit && c * xn * (1 + 1e-6) < 1e37;  // and c ||x|| a finite float (a huge K)
    cx[i] = ok ? static_cast<float>(c * xn * (1 + 1e-6)) : -1.f;
    ax[i] = ok ? static_cast<float>(std::max(1e-30, 2 * sub * (rk * (xn + wmax) + 2 * k))) : 0.f;
    if (!ok) continue;
    for (int64_t q = 0; q < k2; ++q)
      xp[i * k2 + q] = bf16_bits(row[2 * q]) | ((2 * q + 1 < k ? bf16_bits(row[2 * q + 1]) : 0u) << 16);
  }
  // the panels split in one range per thread, each range's findings kept apart, merged in column order
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), panels));
  std::vector<Found> found(parts);
  for (auto& f : found) {
    f.floor.assign(m, -std::numeric_limits<float>::infinity());
    f.cands.resize(m);
  }
  const uint32_t* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  at::parallel_for(0, parts, 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t)
      screen(xp.data(), m, k2, w, wn.data(), cx.data(), ax.data(), v, panels * t / parts, panels * (t + 1) / parts,
             found[t]);
  });
  // the exact recheck: each candidate's logit as the fp32 GEMM's FMA chain makes it
  const float* wf = weight.data_ptr<float>();
  int64_t* tok = tokens.data_ptr<int64_t>();
  int64_t* cnt = counts.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) {
    if (cx[i] < 0) continue;
    float floor = -std::numeric_limits<float>::infinity();
    for (const auto& f : found) floor = std::max(floor, f.floor[i]);
    const float* row = xa + i * x.stride(0);
    float best = -std::numeric_limits<float>::infinity();
    int64_t arg = -1, n = 0;
    for (const auto& f : found) {
      for (const auto& [j, hi] : f.cands[i]) {
        if (hi < floor) continue;
        const float s = fma_dot(row, wf + j * k, k);
        ++n;
        if (arg < 0 || s > best) best = s, arg = j;
      }
    }
    tok[i] = arg;
    cnt[i] = n;
  }
#endif
  return {tokens, counts};
}

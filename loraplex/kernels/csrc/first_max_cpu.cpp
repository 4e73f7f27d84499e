// The sampler's greedy pick from fp32 logits: each row's first largest value, in one pass over the row.
// Letters: B rows, V vocab.
//
//   first_max: logits [B, V], path -> [B] int64, the index of each row's first maximal element, as
//              `logits.max(dim=-1).indices` gives it for a row without NaN (ties go to the smaller index;
//              +0 and -0 are equal; -inf is a value like any other, so a row masked by a grammar works);
//              -1 for a row that holds a NaN, whose pick the caller leaves to PyTorch. path: "auto"
//              (AVX-512 where the CPU has it, else AVX2 + FMA, else scalar), or one of "avx512", "avx2",
//              "scalar" (tests run each path the CPU has; the same picks on every path).
//
// PyTorch's CPU reduction (`max_kernel_impl`) carries the index element by element in scalar code: 3-5 ms
// on [64, 49152] fp32 (a 64-row decode step's logits) on one Zen 4 core, where this takes 0.2 ms on
// AVX-512 and 0.4 ms on AVX2 with the logits in cache, as the lm_head leaves them (docs/performance.md).
// Each row runs four chains of 16 lanes (AVX-512) or 8 (AVX2), each keeping
// the largest value it has seen per lane and where: a strict comparison, so that within a lane the
// earlier index stays; the chains cover disjoint indices, and their lanes are then merged by value and,
// among equal values, by the smaller index, which is the first maximum of the row. Intrinsics rather
// than GCC's vector extensions: in an AVX-512F build a vector select whose mask is used twice (the value
// and its index here) is expanded lane by lane (docs/performance.md, the SiLU window).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LORAPLEX_FIRST_MAX_X86 1
#endif

bool avx512_available();  // bgmv_cpu.cpp: AVX-512 F/BW/VL/DQ
bool avx2_available();    // bgmv_cpu.cpp: AVX2 + FMA

namespace {

constexpr int kChains = 4;  // independent compare-and-select chains: a select waits on its compare

// Merges one lane's (value, index) into the running pick: larger value, or equal value at a smaller index.
inline void merge(float v, int64_t at, float& best, int64_t& best_at) {
  if (best_at < 0 || v > best || (v == best && at < best_at)) {
    best = v;
    best_at = at;
  }
}

// The scalar loop from index j on (the tail after the vector chains, or a whole row on other CPUs):
// indices above every chain's, so a strict comparison keeps the first maximum. Returns whether it saw a
// NaN.
inline bool scalar_from(const float* p, int64_t j, int64_t V, float& best, int64_t& best_at) {
  bool nan = false;
  for (; j < V; ++j) {
    const float v = p[j];
    nan = nan || v != v;
    if (best_at < 0 || v > best) {
      best = v;
      best_at = j;
    }
  }
  return nan;
}

#if LORAPLEX_FIRST_MAX_X86
__attribute__((target("avx512f"))) int64_t row_avx512(const float* p, int64_t V) {
  constexpr int64_t W = 16, step = kChains * W;
  float best = 0.f;
  int64_t best_at = -1, j = 0;
  __mmask16 nan = 0;
  if (V >= step) {
    __m512 top[kChains];
    __m512i at[kChains], next[kChains];
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i by = _mm512_set1_epi32(static_cast<int32_t>(step));
    for (int c = 0; c < kChains; ++c) {
      top[c] = _mm512_loadu_ps(p + c * W);
      next[c] = at[c] = _mm512_add_epi32(lanes, _mm512_set1_epi32(c * W));
      nan |= _mm512_cmp_ps_mask(top[c], top[c], _CMP_UNORD_Q);
    }
    for (j = step; j + step <= V; j += step) {
      for (int c = 0; c < kChains; ++c) {
        next[c] = _mm512_add_epi32(next[c], by);
        const __m512 v = _mm512_loadu_ps(p + j + c * W);
        const __mmask16 more = _mm512_cmp_ps_mask(v, top[c], _CMP_GT_OQ);
        top[c] = _mm512_mask_mov_ps(top[c], more, v);
        at[c] = _mm512_mask_mov_epi32(at[c], more, next[c]);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      }
    }
    alignas(64) float tv[W];
    alignas(64) int32_t ti[W];
    for (int c = 0; c < kChains; ++c) {
      _mm512_store_ps(tv, top[c]);
      _mm512_store_si512(ti, at[c]);
      for (int l = 0; l < W; ++l) merge(tv[l], ti[l], best, best_at);
    }
  }
  const bool tail_nan = scalar_from(p, j, V, best, best_at);
  return nan || tail_nan ? -1 : best_at;
}

__attribute__((target("avx2"))) int64_t row_avx2(const float* p, int64_t V) {
  constexpr int64_t W = 8, step = kChains * W;
  float best = 0.f;
  int64_t best_at = -1, j = 0;
  __m256 nan = _mm256_setzero_ps();
  if (V >= step) {
    __m256 top[kChains];
    __m256i at[kChains], next[kChains];
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i by = _mm256_set1_epi32(static_cast<int32_t>(step));
    for (int c = 0; c < kChains; ++c) {
      top[c] = _mm256_loadu_ps(p + c * W);
      next[c] = at[c] = _mm256_add_epi32(lanes, _mm256_set1_epi32(c * W));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(top[c], top[c], _CMP_UNORD_Q));
    }
    for (j = step; j + step <= V; j += step) {
      for (int c = 0; c < kChains; ++c) {
        next[c] = _mm256_add_epi32(next[c], by);
        const __m256 v = _mm256_loadu_ps(p + j + c * W);
        const __m256 more = _mm256_cmp_ps(v, top[c], _CMP_GT_OQ);
        top[c] = _mm256_blendv_ps(top[c], v, more);
        at[c] = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(at[c]), _mm256_castsi256_ps(next[c]), more));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
    }
    alignas(32) float tv[W];
    alignas(32) int32_t ti[W];
    for (int c = 0; c < kChains; ++c) {
      _mm256_store_ps(tv, top[c]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(ti), at[c]);
      for (int l = 0; l < W; ++l) merge(tv[l], ti[l], best, best_at);
    }
  }
  const bool tail_nan = scalar_from(p, j, V, best, best_at);
  return _mm256_movemask_ps(nan) != 0 || tail_nan ? -1 : best_at;
}
#endif

int64_t row_scalar(const float* p, int64_t V) {
  float best = 0.f;
  int64_t best_at = -1;
  return scalar_from(p, 0, V, best, best_at) ? -1 : best_at;
}

}  // namespace

at::Tensor first_max(const at::Tensor& logits, const std::string& path) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu() &&
                  logits.stride(1) == 1 && logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31) &&
                  !logits.is_neg(),
              "first_max: logits must be a 2-D fp32 CPU tensor with contiguous rows of 1 to 2^31 - 1 elements "
              "(not a lazily negated view)");
  int64_t (*row)(const float*, int64_t) = row_scalar;
  if (path == "auto") {
#if LORAPLEX_FIRST_MAX_X86
    if (avx512_available()) row = row_avx512;
    else if (avx2_available()) row = row_avx2;
#endif
  } else if (path == "avx512" || path == "avx2") {
    TORCH_CHECK(path == "avx512" ? avx512_available() : avx2_available(), "first_max: this CPU has no ", path);
#if LORAPLEX_FIRST_MAX_X86
    row = path == "avx512" ? row_avx512 : row_avx2;
#endif
  } else {
    TORCH_CHECK(path == "scalar", "first_max: no path '", path, "' (auto, scalar, avx2 or avx512)");
  }
  const int64_t B = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* p = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) o[b] = row(p + b * stride, V);
  });
  return out;
}

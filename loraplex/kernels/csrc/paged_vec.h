// Vectors of 16 fp32 lanes for the paged attention's vector loops (paged_decode_cpu.cpp, one query
// row per request; paged_prefill_cpu.cpp, tiles of prefill rows): GCC's vector extensions, which the
// compiler maps to one AVX-512 register, two AVX2 ones or four SSE ones in each target clone.
#pragma once

#include "paged_attention.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace loraplex_attention {
namespace vec {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));

#define LORAPLEX_INLINE static inline __attribute__((always_inline))

constexpr int kLanes = 16;

// Two-vector shuffles: GCC has had __builtin_shuffle since 4.7 (__builtin_shufflevector only since 12),
// clang has only __builtin_shufflevector.
#if defined(__clang__)
#define LORAPLEX_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define LORAPLEX_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vi16{__VA_ARGS__})
#endif

LORAPLEX_INLINE v16 load16(const float* p) {
  v16 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

LORAPLEX_INLINE v16 load16(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  vh16 h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<v16>(__builtin_convertvector(h, vu16) << 16);
}

LORAPLEX_INLINE v16 splat(float x) { return v16{} + x; }

// exp(x) for x <= 0, lane by lane: paged_attention_cpu.cpp's exp_nonpositive (Cephes' expf, within
// 1 ulp on [-87, 0]; 0 below -87.3 and for -inf; NaN stays NaN) on a vector.
LORAPLEX_INLINE v16 exp_nonpositive(v16 x) {
  v16 n;
  const v16 y = exp_reduced(x, n);
  const v16 clamped = n >= -126.f ? n : splat(-126.f);  // NaN: -126 (y is NaN then anyway)
  const v16 scale = reinterpret_cast<v16>((__builtin_convertvector(clamped, vi16) + 127) << 23);
  return x < -87.3f ? v16{} : y * scale;
}

// Every lane of the result: the max of v's 16 lanes (a butterfly: max with the lanes 8, 4, 2, 1 apart).
LORAPLEX_INLINE v16 all_max(v16 v) {
  v16 t = LORAPLEX_SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = v > t ? v : t;
  t = LORAPLEX_SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = v > t ? v : t;
  t = LORAPLEX_SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = v > t ? v : t;
  t = LORAPLEX_SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v > t ? v : t;
}

// The sum of v's 16 lanes, added in lane order: the loops keep running sums by lane and add them up once.
LORAPLEX_INLINE float lane_sum(v16 v) {
  float total = 0.f;
  for (int j = 0; j < kLanes; ++j) total += v[j];
  return total;
}

// Calls f(std::integral_constant<int, ND>{}) with ND = D / 16, the head dim in vectors, as a compile-time
// constant, so that each loop keeps its accumulators [ND] in registers. D / 16 must be 1, 2, 4, 8 or 16
// (decode_supported); any other D raises (the caller sends such tiles to `attend`, so it is a bug).
template <typename F>
inline void with_nd(int64_t D, F&& f) {
  switch (D % kLanes == 0 ? D / kLanes : 0) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 16: return f(std::integral_constant<int, 16>{});
  }
  TORCH_CHECK(false, "paged attention: the vector loops take D / 16 in {1, 2, 4, 8, 16}, got D = ", D);
}

}  // namespace vec
}  // namespace loraplex_attention

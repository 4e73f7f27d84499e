// Vectors of fp32 lanes for the paged attention's vector loops (paged_decode_cpu.cpp, one query row per
// request; paged_prefill_cpu.cpp, tiles of prefill rows) and the fused elementwise ops: GCC's vector
// extensions, of W = 16 lanes (one AVX-512 register) or W = 8 (one AVX2 register). The loops take W as
// a template argument and run W = 16 where the CPU has AVX-512, W = 8 where it has only AVX2: GCC has no
// register mode for a 16-lane vector without AVX-512, so in the AVX2 clone every v16 lived on the stack
// and each operation went through memory (scalar stores of a broadcast, then vector loads that cannot be
// forwarded from them): the 64-row decode of the vllm preset, 30 layers, took 293 ms there
// (docs/performance.md has the figures with W = 8).
#pragma once

#include "paged_attention.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace loraplex_attention {
namespace vec {

// The vector types of W lanes: f (fp32), i and u (32-bit integers), h (16-bit, for bf16 rows).
template <int W>
struct VecOf;
template <>
struct VecOf<16> {
  typedef float f __attribute__((vector_size(64)));
  typedef int32_t i __attribute__((vector_size(64)));
  typedef uint32_t u __attribute__((vector_size(64)));
  typedef uint16_t h __attribute__((vector_size(32)));
};
template <>
struct VecOf<8> {
  typedef float f __attribute__((vector_size(32)));
  typedef int32_t i __attribute__((vector_size(32)));
  typedef uint32_t u __attribute__((vector_size(32)));
  typedef uint16_t h __attribute__((vector_size(16)));
};

// The lanes of the fp32 vector type V.
template <typename V>
constexpr int lanes_of() { return static_cast<int>(sizeof(V) / sizeof(float)); }

typedef VecOf<16>::f v16;
typedef VecOf<16>::i vi16;
typedef VecOf<8>::f v8;
typedef VecOf<8>::i vi8;

#define LORAPLEX_INLINE static inline __attribute__((always_inline))

constexpr int kLanes = 16;

// Two-vector shuffles: GCC has had __builtin_shuffle since 4.7 (__builtin_shufflevector only since 12),
// clang has only __builtin_shufflevector.
#if defined(__clang__)
#define LORAPLEX_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#define LORAPLEX_SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define LORAPLEX_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vi16{__VA_ARGS__})
#define LORAPLEX_SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, vi8{__VA_ARGS__})
#endif

template <int W>
LORAPLEX_INLINE typename VecOf<W>::f load(const float* p) {
  typename VecOf<W>::f r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

template <int W>
LORAPLEX_INLINE typename VecOf<W>::f load(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  typename VecOf<W>::h h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<typename VecOf<W>::f>(__builtin_convertvector(h, typename VecOf<W>::u) << 16);
}

// v's lanes rounded to bf16 and widened back to fp32: round to nearest even, NaN to 0x7FC0, as
// c10::BFloat16's conversion (so a PyTorch bf16 op's result is the fp32 op's result through this, but
// for the bits of a NaN: PyTorch's vectorized ops may give 0xFFFF).
template <typename V>
LORAPLEX_INLINE V round_bf16(V v) {
  using U = typename VecOf<lanes_of<V>()>::u;
  const U u = reinterpret_cast<U>(v);
  const U rounded = (u + (((u >> 16) & 1u) + 0x7FFFu)) & 0xFFFF0000u;
  return reinterpret_cast<V>(v == v ? rounded : U{} + 0x7FC00000u);
}

// v as the storage type T holds it: itself for fp32, round_bf16 for bf16.
template <typename T, typename V>
LORAPLEX_INLINE V as_stored(V v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return round_bf16(v);
}

// A scalar as the storage type T holds it (the vector loops' tails): fp32 itself, bf16 rounded to
// nearest even as c10::BFloat16 rounds it, the same bits as round_bf16's lanes.
template <typename T>
inline float stored(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return static_cast<float>(c10::BFloat16(x));
}

// Stores v's W lanes at p: fp32 as they are; bf16 rounded (round_bf16) to their top 16 bits.
template <int W>
LORAPLEX_INLINE void store(float* p, typename VecOf<W>::f v) { std::memcpy(p, &v, sizeof v); }

template <int W>
LORAPLEX_INLINE void store(c10::BFloat16* p, typename VecOf<W>::f v) {
  using U = typename VecOf<W>::u;
  const typename VecOf<W>::h h =
      __builtin_convertvector(reinterpret_cast<U>(round_bf16(v)) >> 16, typename VecOf<W>::h);
  std::memcpy(p, &h, sizeof h);
}

template <typename V>
LORAPLEX_INLINE V splat(float x) { return V{} + x; }

// [0, 1, ..., W - 1]: each lane's index.
template <int W>
LORAPLEX_INLINE typename VecOf<W>::i lane_index() {
  typename VecOf<W>::i r{};
  for (int j = 0; j < W; ++j) r[j] = j;
  return r;
}

// 2^k lane by lane, built from its exponent bits: k integral and in [-126, 127] (a normal float).
template <typename V>
LORAPLEX_INLINE V pow2(V k) {
  using I = typename VecOf<lanes_of<V>()>::i;
  return reinterpret_cast<V>((__builtin_convertvector(k, I) + 127) << 23);
}

// exp(x) for x <= 0, lane by lane: paged_attention_cpu.cpp's exp_nonpositive (Cephes' expf, within
// 1 ulp on [-87, 0]; 0 below -87.3 and for -inf; NaN stays NaN) on a vector.
// Also gives exp's reduced form, exp(x) = y x 2^n (`exp_reduced`), for what the flush drops.
template <typename V>
LORAPLEX_INLINE V exp_nonpositive(V x, V& y, V& n) {
  y = exp_reduced(x, n);
  const V clamped = n >= -126.f ? n : splat<V>(-126.f);  // NaN: -126 (y is NaN then anyway)
  return x < -87.3f ? V{} : y * pow2(clamped);
}

template <typename V>
LORAPLEX_INLINE V exp_nonpositive(V x) {
  V y, n;
  return exp_nonpositive(x, y, n);
}

// Every lane of the result: the max of v's W lanes (a butterfly: max with the lanes W / 2, ..., 2, 1
// apart).
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

LORAPLEX_INLINE v8 all_max(v8 v) {
  v8 t = LORAPLEX_SHUFFLE8(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v = v > t ? v : t;
  t = LORAPLEX_SHUFFLE8(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v = v > t ? v : t;
  t = LORAPLEX_SHUFFLE8(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  return v > t ? v : t;
}

// The sum of v's lanes, added in lane order: the loops keep running sums by lane and add them up once.
template <typename V>
LORAPLEX_INLINE float lane_sum(V v) {
  float total = 0.f;
  for (int j = 0; j < lanes_of<V>(); ++j) total += v[j];
  return total;
}

// Whether the loops run on 16 lanes (the CPU has AVX-512F) or on 8 (AVX2); read once.
inline bool wide() {
#if defined(LORAPLEX_NO_AVX512)  // held to AVX2 (paged_attention.h)
  static const bool avx512 = false;
#else
  static const bool avx512 = __builtin_cpu_supports("avx512f");
#endif
  return avx512;
}

// Calls f(std::integral_constant<int, ND>{}) with ND = D / W, the head dim in vectors of W lanes, as a
// compile-time constant, so that each loop keeps its accumulators [ND] in registers. D / 16 must be 1, 2,
// 4, 8 or 16 (decode_supported); any other D raises (the caller sends such tiles to `attend`, so it is a
// bug).
template <int W, typename F>
inline void with_nd(int64_t D, F&& f) {
  constexpr int k = 16 / W;  // ND for D = 16
  switch (D % 16 == 0 ? D / W : 0) {
    case k: return f(std::integral_constant<int, k>{});
    case 2 * k: return f(std::integral_constant<int, 2 * k>{});
    case 4 * k: return f(std::integral_constant<int, 4 * k>{});
    case 8 * k: return f(std::integral_constant<int, 8 * k>{});
    case 16 * k: return f(std::integral_constant<int, 16 * k>{});
  }
  TORCH_CHECK(false, "paged attention: the vector loops take D / 16 in {1, 2, 4, 8, 16}, got D = ", D);
}

// Calls f(W, ND), both std::integral_constant<int>: W = 16 where wide(), else 8; ND = D / W (with_nd).
template <typename F>
inline void with_lanes(int64_t D, F&& f) {
  if (wide()) with_nd<16>(D, [&](auto nd) { f(std::integral_constant<int, 16>{}, nd); });
  else with_nd<8>(D, [&](auto nd) { f(std::integral_constant<int, 8>{}, nd); });
}

}  // namespace vec
}  // namespace loraplex_attention

// Shared by the paged attention's three loops: the general one (paged_attention_cpu.cpp: any tile of
// rows, any dtype and head dim), the decode one (paged_decode_cpu.cpp: one row per request, chunks of W
// keys) and the prefill one (paged_prefill_cpu.cpp: tiles of prefill rows, chunks of 2 W keys); W = 16
// lanes with AVX-512, 8 with AVX2 (paged_vec.h). Letters and layouts as in paged_attention_cpu.cpp.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

// The loops' hot functions are compiled for AVX-512, AVX2+FMA (GCC 12 and later; AVX2 alone before),
// AVX2 and plain x86-64, picked at load time. In target_clones a comma separates clones, so "avx2,fma"
// made two, AVX2 without FMA and FMA without AVX2, and an AVX2 CPU ran the first; GCC 12's
// "arch=x86-64-v3" is one clone with both (and F16C, BMI, MOVBE), tried after "avx512f" and before
// "avx2", which stays for a CPU (or VM) that shows AVX2 but hides one of x86-64-v3's other features.
// A build with LORAPLEX_NO_AVX512 (LORAPLEX_CPU_ISA=avx2, loraplex/isa.py) has no AVX-512 clone, so an
// AVX-512 CPU runs the AVX2 ones, as an AVX2-only CPU does.
#if defined(LORAPLEX_NO_AVX512)
#define LORAPLEX_AVX512_CLONE
#else
#define LORAPLEX_AVX512_CLONE "avx512f",
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define LORAPLEX_CLONES __attribute__((target_clones(LORAPLEX_AVX512_CLONE "arch=x86-64-v3", "avx2", "default")))
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LORAPLEX_CLONES __attribute__((target_clones(LORAPLEX_AVX512_CLONE "avx2", "default")))
#else
#define LORAPLEX_CLONES
#endif

namespace loraplex_attention {

// The body of exp(x) for x <= 0, from Cephes' expf: range reduction by ln 2 in two parts (n, returned,
// is x / ln 2 rounded to nearest: 1.5 x 2^23 drops the fraction), then a degree-5 polynomial for exp(r)
// on [-ln2/2, ln2/2]. exp(x) = the result x 2^n, which each caller builds in the exponent bits of its
// type (float, or a vector of floats: V is either, the same operations lane by lane).
template <typename V>
inline __attribute__((always_inline)) V exp_reduced(V x, V& n) {
  const V t = x * 1.44269504088896341f;
  n = (t + 12582912.f) - 12582912.f;
  const V r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  V y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  return y * r * r + r + 1.f;
}

template <typename T>
struct Args {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  const int64_t* tables;
  int64_t q_row, q_head;         // strides of q, in elements
  int64_t out_row, out_head;     // strides of out
  int64_t slot_stride, kv_head;  // strides of the caches
  int64_t table_stride, bs, D, G;
  float scale;
};

// The cache slot of key position pos of a request (its block table row `table`, blocks of bs slots).
inline int64_t slot_of(const int64_t* table, int64_t bs, int64_t pos) { return table[pos / bs] * bs + pos % bs; }

// Whether decode_rows takes this head dim: a multiple of 16 with D / 16 a power of two, up to 256.
bool decode_supported(int64_t D);

// Floats of one thread's scratch for decode_rows with nH query heads.
int64_t decode_scratch(int64_t nH, int64_t D);

// The decode work item a thread is likely to take after the current one (request seq over ctx keys, kv
// heads g0 .. g0 + ng - 1), whose first keys decode_rows asks into the cache during its last chunk; seq
// -1: none. A hint only: a wrong guess costs the prefetched lines, never a result.
struct Ahead {
  int64_t seq = -1, ctx = 0, g0 = 0, ng = 0;
};

// The decode of query row `row` of request `seq` over its keys 0 .. ctx - 1, kv heads g0 .. g0 + ng - 1
// (out[row, h] for their query heads), in fp32. scratch: decode_scratch floats, 64-byte aligned.
void decode_rows(const Args<float>& a, int64_t row, int64_t seq, int64_t ctx, int64_t g0, int64_t ng,
                 float* scratch, const Ahead& ahead);
void decode_rows(const Args<c10::BFloat16>& a, int64_t row, int64_t seq, int64_t ctx, int64_t g0, int64_t ng,
                 float* scratch, const Ahead& ahead);

// Floats of one thread's scratch for prefill_rows with M = n x G queries.
int64_t prefill_scratch(int64_t M, int64_t D);

// The tile of rows row0 .. row0 + n - 1 of request `seq` (row row0 + i over keys 0 .. ctx0 + i - 1), kv
// head g (out[row, h] for its query heads), in fp32 (paged_prefill_cpu.cpp). Takes the head dims
// decode_supported takes. scratch: prefill_scratch floats, 64-byte aligned.
void prefill_rows(const Args<float>& a, int64_t row0, int64_t n, int64_t seq, int64_t ctx0, int64_t g,
                  float* scratch);
void prefill_rows(const Args<c10::BFloat16>& a, int64_t row0, int64_t n, int64_t seq, int64_t ctx0, int64_t g,
                  float* scratch);

}  // namespace loraplex_attention

// Shared by the paged attention's two loops: the general one (paged_attention_cpu.cpp: any tile of rows)
// and the decode one (paged_decode_cpu.cpp: one row per request, 16 keys per vector). Letters and
// layouts as in paged_attention_cpu.cpp.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace loraplex_attention {

template <typename T>
struct Args {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  const int64_t* tables;
  int64_t q_row, q_head;         // strides of q and out, in elements
  int64_t slot_stride, kv_head;  // strides of the caches
  int64_t table_stride, bs, D, G;
  float scale;
};

// Whether decode_rows takes this head dim: a multiple of 16 with D / 16 a power of two, up to 256.
bool decode_supported(int64_t D);

// Floats of one thread's scratch for decode_rows with nH query heads.
int64_t decode_scratch(int64_t nH, int64_t D, int64_t G);

// The decode of query row `row` of request `seq` over its keys 0 .. ctx - 1, kv heads g0 .. g0 + ng - 1
// (out[row, h] for their query heads), in fp32. scratch: decode_scratch floats, 64-byte aligned.
void decode_rows(const Args<float>& a, int64_t row, int64_t seq, int64_t ctx, int64_t g0, int64_t ng,
                 float* scratch);
void decode_rows(const Args<c10::BFloat16>& a, int64_t row, int64_t seq, int64_t ctx, int64_t g0, int64_t ng,
                 float* scratch);

}  // namespace loraplex_attention

// Rotary position embedding (RoPE, Su et al., arXiv:2104.09864) in place, Hugging Face's rotate-half
// layout, fp32 or bf16: for each row t and each of the first `heads` heads of D columns,
//   x[i]       <- x[i] * cos[t, i] - x[i + D/2] * sin[t, i]                 (i < D/2)
//   x[i + D/2] <- x[i + D/2] * cos[t, i + D/2] + x[i] * sin[t, i + D/2]
// which is HF's q * cos + rotate_half(q) * sin, rounded the same way: each product and sum rounded on
// its own (no fused multiply-add), so the result equals PyTorch's four-op form bit for bit (tested).
// bf16 rows (with bf16 cos and sin, as HF casts them to q's dtype) round each product and each sum to
// bf16 as PyTorch's bf16 ops do, so they equal its form bit for bit too.
// Letters: T rows, D head dim. Inputs: x [T, >= heads x D] (the q and k columns of a fused qkv
// projection's output, rows may be strided), cos and sin [T, D] (the rows of each token's position).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "paged_vec.h"

#include <cstdint>

namespace {

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
LORAPLEX_CLONES void rope_rows(float* x, int64_t row_stride, const float* cos, const float* sin, int64_t begin,
                               int64_t end, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t t = begin; t < end; ++t) {
    const float* c = cos + t * D;
    const float* s = sin + t * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* p = x + t * row_stride + h * D;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = p[i], b = p[i + half];
        p[i] = a * c[i] - b * s[i];
        p[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

using loraplex_attention::vec::load;
using loraplex_attention::vec::round_bf16;
using loraplex_attention::vec::store;
using loraplex_attention::vec::stored;
using loraplex_attention::vec::VecOf;

// bf16 rows on vectors of W lanes, the last D / 2 mod W columns of each half one value at a time.
template <int W>
LORAPLEX_CLONES void rope_rows_bf16(c10::BFloat16* x, int64_t row_stride, const c10::BFloat16* cos,
                                    const c10::BFloat16* sin, int64_t begin, int64_t end, int64_t heads,
                                    int64_t D) {
  using V = typename VecOf<W>::f;
  const int64_t half = D / 2, hv = half / W * W;
  for (int64_t t = begin; t < end; ++t) {
    const c10::BFloat16* c = cos + t * D;
    const c10::BFloat16* s = sin + t * D;
    for (int64_t h = 0; h < heads; ++h) {
      c10::BFloat16* p = x + t * row_stride + h * D;
      for (int64_t i = 0; i < hv; i += W) {
        const V a = load<W>(p + i), b = load<W>(p + i + half);
        store<W>(p + i, round_bf16(a * load<W>(c + i)) - round_bf16(b * load<W>(s + i)));
        store<W>(p + i + half, round_bf16(b * load<W>(c + i + half)) + round_bf16(a * load<W>(s + i + half)));
      }
      for (int64_t i = hv; i < half; ++i) {
        const float a = p[i], b = p[i + half];
        using B = c10::BFloat16;
        p[i] = B(stored<B>(a * static_cast<float>(c[i])) - stored<B>(b * static_cast<float>(s[i])));
        p[i + half] = B(stored<B>(b * static_cast<float>(c[i + half])) +
                        stored<B>(a * static_cast<float>(s[i + half])));
      }
    }
  }
}
#pragma GCC pop_options

}  // namespace

void rope_inplace(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.device().is_cpu() && x.stride(1) == 1,
              "rope_inplace: x must be a 2-D fp32 or bf16 CPU tensor with contiguous rows");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && heads >= 0 && heads * head_dim <= x.size(1),
              "rope_inplace: ", heads, " heads of ", head_dim, " do not fit rows of ", x.size(1));
  TORCH_CHECK(x.size(0) <= 1 || x.stride(0) >= heads * head_dim,
              "rope_inplace: x is rotated in place, so its rows must not overlap");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == x.size(0) && t->size(1) == head_dim && t->is_contiguous() &&
                    t->scalar_type() == x.scalar_type(),
                "rope_inplace: cos and sin must be contiguous [T, D] of x's dtype");
  const int64_t stride = x.stride(0);
  if (x.scalar_type() == at::kBFloat16) {
    c10::BFloat16* px = x.data_ptr<c10::BFloat16>();
    const c10::BFloat16* pc = cos.data_ptr<c10::BFloat16>();
    const c10::BFloat16* ps = sin.data_ptr<c10::BFloat16>();
    at::parallel_for(0, x.size(0), 64, [&](int64_t begin, int64_t end) {
      if (loraplex_attention::vec::wide()) rope_rows_bf16<16>(px, stride, pc, ps, begin, end, heads, head_dim);
      else rope_rows_bf16<8>(px, stride, pc, ps, begin, end, heads, head_dim);
    });
    return;
  }
  float* px = x.data_ptr<float>();
  const float* pc = cos.data_ptr<float>();
  const float* ps = sin.data_ptr<float>();
  at::parallel_for(0, x.size(0), 64, [&](int64_t begin, int64_t end) {
    rope_rows(px, stride, pc, ps, begin, end, heads, head_dim);
  });
}

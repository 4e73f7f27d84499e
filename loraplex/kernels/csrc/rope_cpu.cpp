// Rotary position embedding (RoPE, Su et al., arXiv:2104.09864) in place, Hugging Face's rotate-half
// layout, fp32: for each row t and each of the first `heads` heads of D columns,
//   x[i]       <- x[i] * cos[t, i] - x[i + D/2] * sin[t, i]                 (i < D/2)
//   x[i + D/2] <- x[i + D/2] * cos[t, i + D/2] + x[i] * sin[t, i + D/2]
// which is HF's q * cos + rotate_half(q) * sin, rounded the same way: each product and sum rounded on
// its own (no fused multiply-add), so the result equals PyTorch's four-op form bit for bit (tested).
// Letters: T rows, D head dim. Inputs: x [T, >= heads x D] (the q and k columns of a fused qkv
// projection's output, rows may be strided), cos and sin [T, D] (the rows of each token's position).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

namespace {

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
#endif
void rope_rows(float* x, int64_t row_stride, const float* cos, const float* sin, int64_t begin, int64_t end,
               int64_t heads, int64_t D) {
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
#pragma GCC pop_options

}  // namespace

void rope_inplace(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1,
              "rope_inplace: x must be a 2-D fp32 CPU tensor with contiguous rows");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && heads >= 0 && heads * head_dim <= x.size(1),
              "rope_inplace: ", heads, " heads of ", head_dim, " do not fit rows of ", x.size(1));
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == x.size(0) && t->size(1) == head_dim && t->is_contiguous() &&
                    t->scalar_type() == at::kFloat,
                "rope_inplace: cos and sin must be contiguous fp32 [T, D]");
  float* px = x.data_ptr<float>();
  const float* pc = cos.data_ptr<float>();
  const float* ps = sin.data_ptr<float>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, x.size(0), 64, [&](int64_t begin, int64_t end) {
    rope_rows(px, stride, pc, ps, begin, end, heads, head_dim);
  });
}

// The decoder's elementwise chains in one pass each, fp32 or bf16 on the CPU (vLLM's fused_add_rms_norm
// and silu_and_mul do the same on the GPU). Letters: T rows, H hidden, I intermediate.
//
//   add_rms_norm: x [T, H] += r [T, H] (in place: the residual stream), then
//                 out [T, H] = x / sqrt(mean(x^2) + eps) * w [H]            (HF's LlamaRMSNorm)
//   silu_mul:     out [T, I] = silu(gu[:, :I]) * gu[:, I:2I], silu(g) = g / (1 + exp(-g))
//
// PyTorch runs the first as an add and F.rms_norm, which this build decomposes into pow, mean, add, rsqrt
// and two multiplies (a pass and a buffer each), the second as silu then mul; at the decode batches of the
// default model (64 rows of 576 or 1,536 floats) each op's fixed cost is most of its time. Each product
// and quotient is rounded on its own as in PyTorch's ops (no fused multiply-add: fp-contract=off, which
// GCC, the compiler scripts/install finds, honours); what can differ is the order in which the squares
// are summed (16 partial sums here) and exp (Cephes' expf, within 1 ulp, where PyTorch takes Sleef's),
// so results are within a few ulps of PyTorch's, not always its bits (tested against fp64).
//
// bf16 rows are rounded where HF's bf16 forms round (each PyTorch bf16 op computes in fp32 and rounds its
// result): the residual sum; the norm in fp32, rounded, then times the weight and rounded again
// (`weight * x.to(bf16)`); silu rounded, then times up and rounded. So a bf16 result can differ from
// PyTorch's only where the fp32 value before a rounding differs: a flip of the norm's rounding, then
// times a weight of mantissa above 1, is up to two bf16 ulps of the product (about one element in three
// million on random rows; tested). NaN is stored as 0x7FC0 (c10's conversion; PyTorch's vector ops may
// store another NaN).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "paged_vec.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace {

using loraplex_attention::vec::all_max;
using loraplex_attention::vec::as_stored;
using loraplex_attention::exp_reduced;
using loraplex_attention::vec::exp_nonpositive;
using loraplex_attention::vec::kLanes;
using loraplex_attention::vec::load;
using loraplex_attention::vec::pow2;
using loraplex_attention::vec::splat;
using loraplex_attention::vec::store;
using loraplex_attention::vec::stored;
using loraplex_attention::vec::VecOf;
using loraplex_attention::vec::wide;

// Both loops run on vectors of W lanes: 16 with AVX-512, 8 with AVX2 (paged_vec.h says why); the sum of
// squares keeps 16 running sums either way (two vectors of 8 with AVX2), added in the same order, so
// both give the same bits.

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

template <int W, typename T>
LORAPLEX_CLONES void add_rms_norm_rows(T* x, const T* r, const T* w, T* out, int64_t begin, int64_t end,
                                       int64_t H, int64_t x_row, int64_t r_row, float eps) {
  using V = typename VecOf<W>::f;
  constexpr int P = kLanes / W;  // vectors per 16 floats
  const int64_t Hv = H / kLanes * kLanes;
  for (int64_t t = begin; t < end; ++t) {
    T* xt = x + t * x_row;
    const T* rt = r + t * r_row;
    T* ot = out + t * H;
    V acc[P] = {};
    for (int64_t i = 0; i < Hv; i += kLanes) {
      for (int k = 0; k < P; ++k) {
        const V v = as_stored<T>(load<W>(xt + i + k * W) + load<W>(rt + i + k * W));
        store<W>(xt + i + k * W, v);
        acc[k] += v * v;
      }
    }
    float ss = 0.f;
    for (int k = 0; k < P; ++k)
      for (int j = 0; j < W; ++j) ss += acc[k][j];
    for (int64_t i = Hv; i < H; ++i) {
      const float v = stored<T>(static_cast<float>(xt[i]) + static_cast<float>(rt[i]));
      xt[i] = static_cast<T>(v);
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);  // torch.rsqrt's 1 / sqrt
    for (int64_t i = 0; i < Hv; i += W)
      store<W>(ot + i, as_stored<T>(load<W>(xt + i) * inv) * load<W>(w + i));  // store rounds the product
    for (int64_t i = Hv; i < H; ++i)
      ot[i] = static_cast<T>(stored<T>(stored<T>(static_cast<float>(xt[i]) * inv) * static_cast<float>(w[i])));
  }
}

// silu(g) from e = exp(-|g|) <= 1 (exp of a non-positive number, never overflowing): g / (1 + e) for
// g >= 0, PyTorch's own expression there; (g x e) / (1 + e) below, where PyTorch's exp(-g) can overflow
// to inf (its quotient is then -0). exp_nonpositive flushes e to 0 below -87.3, where exp(g) leaves the
// normal floats, but PyTorch's g / (1 + exp(-g)) is still a normal float (about -5e-37) down to
// -88.72 (exp(-g) overflows below it). So the numerator is built from exp's reduced form e = y x 2^n
// (`exp_reduced`), as below. NaN stays NaN.
//
// A span whose |g| are all at most 87.3 (a model's activations nearly always) never meets that window:
// e = y x 2^n is a normal float with n >= -126, so the general loop's selects pick y x 2^n and g x e,
// and the first loop computes just those, the same bits with about a third fewer operations (a 512 x
// 1536 SiLU x up 14% faster on a Zen 4 EPYC, medians of 21 in turns). Checking the span first costs a
// load, an and and a max per vector; a NaN lane is passed over by the max and gets the same NaN from
// either loop (y is NaN, whatever 2^n becomes).
template <int W, typename T>
LORAPLEX_CLONES void silu_mul_span(const T* g, const T* u, T* o, int64_t I) {
  using V = typename VecOf<W>::f;
  using U = typename VecOf<W>::u;
  const int64_t Iv = I / kLanes * kLanes;  // the same tail as with 16 lanes
  V big{};  // the largest |g| by lane
  for (int64_t i = 0; i < Iv; i += W) {
    const V a = reinterpret_cast<V>(reinterpret_cast<U>(load<W>(g + i)) & 0x7FFFFFFFu);
    big = a > big ? a : big;
  }
  if (Iv && all_max(big)[0] <= 87.3f) {
    for (int64_t i = 0; i < Iv; i += W) {
      const V gv = load<W>(g + i);
      V n;
      const V x = gv < 0.f ? gv : -gv;  // -|g|
      const V e = exp_reduced(x, n) * pow2(n);
      const V num = gv >= 0.f ? gv : gv * e;
      store<W>(o + i, as_stored<T>(num / (e + 1.f)) * load<W>(u + i));  // store rounds the product
    }
  } else {
    for (int64_t i = 0; i < Iv; i += W) {
      const V gv = load<W>(g + i);
      V y, n;
      const V x = gv < 0.f ? gv : -gv;  // -|g|
      const V e = exp_nonpositive(x, y, n);
      // g x e = (g x y) x 2^n with 2^n as two normal factors, 2^max(n, -126) and 2^(max(n, -128) -
      // max(n, -126)) (1, 1/2 or 1/4): g x y is rounded once and both scalings are exact while the
      // result is a normal float, so the same bits as g x e where e is not flushed, and PyTorch's value
      // (within a few ulps) in the window.
      // (Each select tests one comparison: GCC expands a select on a mask used twice lane by lane in
      // the avx512f clone, five times slower.)
      const V clamped = n >= -126.f ? n : splat<V>(-126.f);  // NaN: -126 (the lane takes g x e, NaN)
      const V lowest = n >= -128.f ? n : splat<V>(-128.f);
      const V scaled = ((gv * y) * pow2(clamped)) * pow2(lowest - clamped);
      // below -88.72 (PyTorch's exp(-g) is inf there): g x e, that is -0, and NaN for -inf
      const V num = gv >= 0.f ? gv : (x >= -88.72283172607421875f ? scaled : gv * e);
      store<W>(o + i, as_stored<T>(num / (e + 1.f)) * load<W>(u + i));  // store rounds the product
    }
  }
  for (int64_t i = Iv; i < I; ++i) {
    const float gi = static_cast<float>(g[i]);
    o[i] = static_cast<T>(stored<T>(stored<T>(gi / (1.f + std::exp(-gi))) * static_cast<float>(u[i])));
  }
}

template <int W, typename T>
void silu_mul_rows(const T* gu, T* out, int64_t begin, int64_t end, int64_t I, int64_t gu_row) {
  for (int64_t t = begin; t < end; ++t) silu_mul_span<W>(gu + t * gu_row, gu + t * gu_row + I, out + t * I, I);
}
#pragma GCC pop_options

}  // namespace

// o [n] = silu(g [n]) * u [n], as silu_mul computes each element (the same bits); o may be g or u.
// gemm_cpu.cpp's fused gate/up epilogue calls it on each row of a tile.
void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
  if (loraplex_attention::vec::wide()) silu_mul_span<16>(g, u, o, n);
  else silu_mul_span<8>(g, u, o, n);
}

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                  t.device().is_cpu() && t.stride(1) == 1,
              name, " must be a 2-D fp32 or bf16 CPU tensor with contiguous rows");
}

// Calls f(T{}) with T the C++ type of `dtype` (fp32 or bf16; check_rows let nothing else through).
template <typename F>
void with_storage(at::ScalarType dtype, F&& f) {
  if (dtype == at::kFloat) f(float{});
  else f(c10::BFloat16{});
}

}  // namespace

at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& r, const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm: x");
  check_rows(r, "add_rms_norm: r");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(r.size(0) == T && r.size(1) == H, "add_rms_norm: r must have x's shape");
  TORCH_CHECK(T <= 1 || x.stride(0) >= H, "add_rms_norm: x is written in place, so its rows must not overlap");
  TORCH_CHECK(r.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: x, r and weight must have one dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous() && weight.device().is_cpu(),
              "add_rms_norm: weight must be a contiguous CPU [H]");
  at::Tensor out = at::empty({T, H}, x.options());
  const int64_t xs = x.stride(0), rs = r.stride(0);
  with_storage(x.scalar_type(), [&](auto zero) {
    using S = decltype(zero);
    S* px = x.data_ptr<S>();
    const S* pr = r.data_ptr<S>();
    const S* pw = weight.data_ptr<S>();
    S* po = out.data_ptr<S>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      if (wide()) add_rms_norm_rows<16>(px, pr, pw, po, begin, end, H, xs, rs, static_cast<float>(eps));
      else add_rms_norm_rows<8>(px, pr, pw, po, begin, end, H, xs, rs, static_cast<float>(eps));
    });
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul: gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up must have an even number of columns");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const int64_t gs = gate_up.stride(0);
  with_storage(gate_up.scalar_type(), [&](auto zero) {
    using S = decltype(zero);
    const S* pg = gate_up.data_ptr<S>();
    S* po = out.data_ptr<S>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      if (wide()) silu_mul_rows<16>(pg, po, begin, end, I, gs);
      else silu_mul_rows<8>(pg, po, begin, end, I, gs);
    });
  });
  return out;
}

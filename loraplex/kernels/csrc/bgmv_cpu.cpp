// BGMV on the CPU: every row reads only its own adapter's weights, straight from the slot buffers.
//
// Letters: T rows, T_a rows with an adapter, V virtual slots, H_in / H_out_i in / out features.
// For each row q of `order` (T_a rows grouped by adapter), t = order[q], s = sid[q] its virtual slot,
// and each slice i with r = ranks_i[s] > 0 (A_i: [V page, H_in], BT_i: [V page, H_out_i], row s*page
// the adapter's first rank row; BT holds scale * B.T):
//     v[j]  = T(sum_h x[t, h] A_i[s*page + j, h])                      j < r, fp32 accumulation
//     y[t, off_i + c] = T(y[t, off_i + c] + T(sum_j v[j] BT_i[s*page + j, c]))
// the roundings of the embedding_bag path (v and the delta in the activations' dtype, then one add).
// Rows without an adapter are not in `order`, so they are neither read nor written. y is written in
// place, outside autograd (the engine runs under no_grad).
//
// Rows are split between threads in contiguous halves (at::parallel_for on PyTorch's own OpenMP
// pool); in adapter order each thread reads about half the adapters. A step's adapters are cold in
// cache (30 layers' weights in play, about 2 MB per q/k/v call at 45 rank-8 adapters), so before a
// segment computes, the next segment's weights are read once (`touch`), which streams them from
// memory faster than the compute's own scattered loads and prefetch hints did (q/k/v call of 64 rows
// over 46 adapters, 30 layers cycling: 98 -> 75 us with the bf16 pairs below; prefetch hints: no
// change). With bf16 weights on a CPU with AVX512-BF16, the shrink multiplies bf16 pairs
// (vdpbf16ps, what oneDNN's bf16 GEMMs use on such CPUs; it flushes bf16 subnormals to zero). The
// vector paths are picked at run time: AVX-512 for every dtype, else AVX2 + FMA for fp32 (8 lanes; on a
// 2-core AVX2-only EPYC, a 64-row decode step with 16 rank-8 adapters took 9-11% less on it than on the
// packed path that fp32 took there before, docs/performance.md). The scalar path is the same
// arithmetic, about 5x slower than the gathers, so `cpu_ext.get` offers the kernel only where a vector
// path takes the dtype. `max_lanes` caps the path (16, 8, 0: `cpu_ext.max_lanes`), so the tests run
// every path the CPU has, AVX2 on an AVX-512 CPU too.
// Every path runs one loop (`rows`); the vector paths' row loops are written once (bgmv_rows.inc) and
// compiled once per width, in a namespace with that width's intrinsics and target attribute (w16, w8),
// since GCC does not inline an intrinsic into a function compiled for another target.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define LORAPLEX_X86 1
#define LORAPLEX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#endif

namespace {

template <typename T>
struct Problem {
  const T* x;
  T* y;
  int64_t x_stride, y_stride, h_in, page;
  const int64_t* order;
  const int64_t* sid;
  std::vector<const T*> a, bt;
  std::vector<const int32_t*> ranks;
  std::vector<int64_t> h_out, offsets;
};

// ---- one loop for every path ----
// Path: a path's row work (Scalar, Avx512, Avx2 below), static functions; the vector paths carry their
// target attribute, so this loop, compiled for the baseline, calls them rather than inlining them:
//   to_fp32(xr, buf, h): the row xr converted into buf [h] (16-bit types only: fp32 rows are read in place);
//   shrink(xr, xf, a, h, r, v, bf16_pairs): v[j] = sum_h xf[h] a[j, h] for j < r, in fp32;
//   expand(v, b, r, n, y): y[c] = T(y[c] + T(sum_j v[j] b[j, c])) for c < n;
//   touch(ptr, bytes): bring the bytes into cache (nothing on the scalar path).
// Rows go in segments of one virtual slot each (`order` groups them by adapter); before a segment
// computes, the next one's weights are touched.
template <typename T, typename Path>
void rows(const Problem<T>& p, int64_t begin, int64_t end, bool bf16_pairs) {
  const size_t k = p.a.size();
  std::vector<float> buf(std::is_same_v<T, float> ? 0 : p.h_in), v;  // x rows in fp32 (16-bit types)
  std::vector<int64_t> starts;  // first row of each segment in [begin, end)
  for (int64_t q = begin; q < end; ++q)
    if (q == begin || p.sid[q] != p.sid[q - 1]) starts.push_back(q);
  const int64_t num_segments = starts.size();
  starts.push_back(end);
  for (int64_t g = 0; g < num_segments; ++g) {
    if (g + 1 < num_segments) {  // the next slot's A rows and BT rows of every slice
      const int64_t s = p.sid[starts[g + 1]];
      for (size_t i = 0; i < k; ++i) {
        const int64_t r = p.ranks[i][s];
        if (r <= 0) continue;
        Path::touch(p.a[i] + s * p.page * p.h_in, r * p.h_in * int64_t(sizeof(T)));
        Path::touch(p.bt[i] + s * p.page * p.h_out[i], r * p.h_out[i] * int64_t(sizeof(T)));
      }
    }
    const int64_t s = p.sid[starts[g]];
    for (int64_t q = starts[g]; q < starts[g + 1]; ++q) {
      const int64_t t = p.order[q];
      const T* xr = p.x + t * p.x_stride;
      const float* xf;
      if constexpr (std::is_same_v<T, float>) {
        xf = xr;
      } else {
        Path::to_fp32(xr, buf.data(), p.h_in);
        xf = buf.data();
      }
      for (size_t i = 0; i < k; ++i) {
        const int64_t r = p.ranks[i][s];
        if (r <= 0) continue;
        v.resize(r);
        Path::shrink(xr, xf, p.a[i] + s * p.page * p.h_in, p.h_in, r, v.data(), bf16_pairs);
        for (int64_t j = 0; j < r; ++j) v[j] = float(T(v[j]));
        Path::expand(v.data(), p.bt[i] + s * p.page * p.h_out[i], r, p.h_out[i], p.y + t * p.y_stride + p.offsets[i]);
      }
    }
  }
}

// ---- scalar path: the same arithmetic, one value at a time ----

struct Scalar {
  template <typename T>
  static void to_fp32(const T* xr, float* buf, int64_t h) {
    for (int64_t c = 0; c < h; ++c) buf[c] = float(xr[c]);
  }
  template <typename T>
  static void shrink(const T*, const float* xf, const T* a, int64_t h, int64_t r, float* v, bool) {
    for (int64_t j = 0; j < r; ++j) {
      float acc = 0.f;
      for (int64_t c = 0; c < h; ++c) acc += xf[c] * float(a[j * h + c]);
      v[j] = acc;
    }
  }
  template <typename T>
  static void expand(const float* v, const T* b, int64_t r, int64_t n, T* y) {
    for (int64_t c = 0; c < n; ++c) {
      float acc = 0.f;
      for (int64_t j = 0; j < r; ++j) acc += v[j] * float(b[j * n + c]);
      y[c] = T(float(y[c]) + float(T(acc)));
    }
  }
  static void touch(const void*, int64_t) {}
};

#ifdef LORAPLEX_X86
// ---- AVX-512 path: 16 fp32 lanes, loads and stores converting from / to the storage type ----

namespace w16 {
#define LORAPLEX_ROWS LORAPLEX_AVX512
constexpr int64_t W = 16;
using vf = __m512;

LORAPLEX_ROWS inline vf vzero() { return _mm512_setzero_ps(); }
LORAPLEX_ROWS inline vf vset1(float x) { return _mm512_set1_ps(x); }
LORAPLEX_ROWS inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
LORAPLEX_ROWS inline vf vor(vf a, vf b) { return _mm512_or_ps(a, b); }
LORAPLEX_ROWS inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
LORAPLEX_ROWS inline float vreduce(vf v) { return _mm512_reduce_add_ps(v); }

LORAPLEX_ROWS inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
LORAPLEX_ROWS inline vf vload(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
LORAPLEX_ROWS inline vf vload(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// fp32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0 (c10::BFloat16's conversion)
LORAPLEX_ROWS inline __m256i bf16_bits(vf v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
LORAPLEX_ROWS inline __m256i f16_bits(vf v) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

LORAPLEX_ROWS inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
LORAPLEX_ROWS inline void vstore(c10::BFloat16* p, vf v) { _mm256_storeu_si256((__m256i*)p, bf16_bits(v)); }
LORAPLEX_ROWS inline void vstore(c10::Half* p, vf v) { _mm256_storeu_si256((__m256i*)p, f16_bits(v)); }

// v rounded to the storage type and back (identity for fp32)
LORAPLEX_ROWS inline vf vround(vf v, const float*) { return v; }
LORAPLEX_ROWS inline vf vround(vf v, const c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16));
}
LORAPLEX_ROWS inline vf vround(vf v, const c10::Half*) { return _mm512_cvtph_ps(f16_bits(v)); }

#include "bgmv_rows.inc"
#undef LORAPLEX_ROWS

#define LORAPLEX_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512bf16")))

// shrink_row for bf16 x and a, multiplying bf16 pairs into fp32 sums (vdpbf16ps), 32 values a load.
// Not inlined: only this function may hold AVX512-BF16 instructions (called only where the CPU has them).
LORAPLEX_AVX512_BF16 __attribute__((noinline)) void shrink_row_bf16(const c10::BFloat16* x, const float* xf,
                                                                    const c10::BFloat16* a, int64_t h, int64_t r,
                                                                    float* v) {
  const int64_t hv = h - h % 32;
  int64_t j = 0;
  for (; j + 4 <= r; j += 4) {
    const c10::BFloat16 *a0 = a + j * h, *a1 = a0 + h, *a2 = a1 + h, *a3 = a2 + h;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t c = 0; c < hv; c += 32) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + c);
      s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_loadu_si512(a0 + c), xv);
      s1 = _mm512_dpbf16_ps(s1, (__m512bh)_mm512_loadu_si512(a1 + c), xv);
      s2 = _mm512_dpbf16_ps(s2, (__m512bh)_mm512_loadu_si512(a2 + c), xv);
      s3 = _mm512_dpbf16_ps(s3, (__m512bh)_mm512_loadu_si512(a3 + c), xv);
    }
    finish4(s0, s1, s2, s3, xf, a0, h, hv, v + j);
  }
  if (j < r) shrink_row(xf, a + j * h, h, r - j, v + j);
}
}  // namespace w16

struct Avx512 {
  template <typename T>
  static void to_fp32(const T* xr, float* buf, int64_t h) { w16::to_fp32(xr, buf, h); }
  template <typename T>
  static void shrink(const T* xr, const float* xf, const T* a, int64_t h, int64_t r, float* v, bool bf16_pairs) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (bf16_pairs) return w16::shrink_row_bf16(xr, xf, a, h, r, v);
    }
    w16::shrink_row(xf, a, h, r, v);
  }
  template <typename T>
  static void expand(const float* v, const T* b, int64_t r, int64_t n, T* y) { w16::expand_row(v, b, r, n, y); }
  static void touch(const void* ptr, int64_t bytes) { w16::touch(ptr, bytes); }
};

// ---- AVX2 path (fp32 only): 8 lanes, for CPUs without AVX-512 ----
// Only fp32: bf16 on such a CPU is slow in every kernel (its GEMMs run at about 1 GFLOP/s), so dtype
// "auto" serves fp32 there and bf16/fp16 steps keep the embedding_bag gathers.

namespace w8 {
#define LORAPLEX_ROWS __attribute__((target("avx2,fma")))
constexpr int64_t W = 8;
using vf = __m256;

LORAPLEX_ROWS inline vf vzero() { return _mm256_setzero_ps(); }
LORAPLEX_ROWS inline vf vset1(float x) { return _mm256_set1_ps(x); }
LORAPLEX_ROWS inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
LORAPLEX_ROWS inline vf vor(vf a, vf b) { return _mm256_or_ps(a, b); }
LORAPLEX_ROWS inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
LORAPLEX_ROWS inline float vreduce(vf v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
LORAPLEX_ROWS inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
LORAPLEX_ROWS inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
LORAPLEX_ROWS inline vf vround(vf v, const float*) { return v; }

#include "bgmv_rows.inc"
#undef LORAPLEX_ROWS
}  // namespace w8

struct Avx2 {
  static void shrink(const float*, const float* xf, const float* a, int64_t h, int64_t r, float* v, bool) {
    w8::shrink_row(xf, a, h, r, v);
  }
  static void expand(const float* v, const float* b, int64_t r, int64_t n, float* y) { w8::expand_row(v, b, r, n, y); }
  static void touch(const void* ptr, int64_t bytes) { w8::touch(ptr, bytes); }
};

bool has_avx2() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
}

// A build held to AVX2 (LORAPLEX_NO_AVX512, loraplex/isa.py) sees no AVX-512: every caller of these two
// (this kernel, the GEMM, the greedy pick, the lm_head's bf16 screen) takes its AVX2 path.
#if defined(LORAPLEX_NO_AVX512)
constexpr bool kAvx512Allowed = false;
#else
constexpr bool kAvx512Allowed = true;
#endif

bool has_avx512_bf16() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return kAvx512Allowed && __builtin_cpu_supports("avx512bf16");
  }();
  return yes;
}

bool has_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return kAvx512Allowed && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return yes;
}
#else
bool has_avx512() { return false; }
bool has_avx512_bf16() { return false; }
bool has_avx2() { return false; }
#endif

// The lanes of the path `run` takes: 16 (AVX-512, any dtype) where the CPU has it and max_lanes >= 16,
// else 8 (AVX2 + FMA, fp32 only) where the CPU has it and max_lanes >= 8, else 0 (scalar).
int64_t lanes_for(bool fp32, int64_t max_lanes) {
  if (max_lanes >= 16 && has_avx512()) return 16;
  if (max_lanes >= 8 && fp32 && has_avx2()) return 8;
  return 0;
}

template <typename T>
void run(at::Tensor& y, const at::Tensor& x, const at::Tensor& order, const at::Tensor& sid,
         const std::vector<at::Tensor>& A, const std::vector<at::Tensor>& BT, const std::vector<at::Tensor>& ranks,
         const std::vector<int64_t>& offsets, int64_t page, int64_t lanes) {
  Problem<T> p;
  p.x = x.data_ptr<T>();
  p.y = y.data_ptr<T>();
  p.x_stride = x.stride(0);
  p.y_stride = y.stride(0);
  p.h_in = x.size(1);
  p.page = page;
  p.order = order.data_ptr<int64_t>();
  p.sid = sid.data_ptr<int64_t>();
  for (size_t i = 0; i < A.size(); ++i) {
    p.a.push_back(A[i].data_ptr<T>());
    p.bt.push_back(BT[i].data_ptr<T>());
    p.ranks.push_back(ranks[i].data_ptr<int32_t>());
    p.h_out.push_back(BT[i].size(1));
    p.offsets.push_back(offsets[i]);
  }
  const int64_t n = order.numel();
  const int64_t grain = std::max<int64_t>(1, (n + at::get_num_threads() - 1) / at::get_num_threads());
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
#ifdef LORAPLEX_X86
    if (lanes == 16) return rows<T, Avx512>(p, begin, end, has_avx512_bf16());
    if constexpr (std::is_same_v<T, float>) {
      if (lanes == 8) return rows<T, Avx2>(p, begin, end, false);
    }
#endif
    rows<T, Scalar>(p, begin, end, false);
  });
}

}  // namespace

bool avx512_available() { return has_avx512(); }
bool avx2_available() { return has_avx2(); }
bool avx512_bf16_available() { return has_avx512() && has_avx512_bf16(); }
int64_t bgmv_lanes(bool fp32, int64_t max_lanes) { return lanes_for(fp32, max_lanes); }

void bgmv(at::Tensor y, at::Tensor x, at::Tensor order, at::Tensor sid, std::vector<at::Tensor> A,
          std::vector<at::Tensor> BT, std::vector<at::Tensor> ranks, std::vector<int64_t> offsets, int64_t page,
          int64_t max_lanes) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, "bgmv: unsupported dtype ", dtype);
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu() && order.device().is_cpu() && sid.device().is_cpu(),
              "bgmv: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && y.scalar_type() == dtype,
              "bgmv: x [T, H_in] and y [T, H] of one dtype expected");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "bgmv: x and y need contiguous rows");
  TORCH_CHECK(y.size(0) <= 1 || y.stride(0) >= y.size(1), "bgmv: rows of y overlap in memory");
  if (x.size(0) > 0 && x.size(1) > 0 && y.size(1) > 0) {  // x is read in place while y is written
    const auto span = [](const at::Tensor& t) {            // [first, last) byte of the rows
      const char* first = static_cast<const char*>(t.data_ptr());
      return std::make_pair(first, first + ((t.size(0) - 1) * t.stride(0) + t.size(1)) * t.element_size());
    };
    const auto xs = span(x), ys = span(y);
    TORCH_CHECK(xs.second <= ys.first || ys.second <= xs.first, "bgmv: x and y overlap in memory");
  }
  TORCH_CHECK(order.scalar_type() == at::kLong && sid.scalar_type() == at::kLong && order.is_contiguous() &&
                  sid.is_contiguous() && order.numel() == sid.numel(),
              "bgmv: order and sid must be contiguous int64 tensors of one length");
  TORCH_CHECK(page > 0 && page <= (int64_t(1) << 20) && A.size() == BT.size() && A.size() == ranks.size() && A.size() == offsets.size(),
              "bgmv: one A, BT, ranks and offset per slice");
  const int64_t* ord = order.data_ptr<int64_t>();
  const int64_t* sd = sid.data_ptr<int64_t>();
  std::vector<char> seen(x.size(0), 0);  // each row once: two threads never write one row
  for (int64_t q = 0; q < order.numel(); ++q) {
    TORCH_CHECK(ord[q] >= 0 && ord[q] < x.size(0) && !seen[ord[q]], "bgmv: row out of range or repeated");
    seen[ord[q]] = 1;
  }
  for (size_t i = 0; i < A.size(); ++i) {
    TORCH_CHECK(A[i].device().is_cpu() && BT[i].device().is_cpu() && ranks[i].device().is_cpu(),
                "bgmv: slice ", i, ": CPU tensors only");
    TORCH_CHECK(A[i].scalar_type() == dtype && BT[i].scalar_type() == dtype && A[i].is_contiguous() &&
                    BT[i].is_contiguous() && A[i].dim() == 2 && BT[i].dim() == 2 && A[i].size(1) == x.size(1) &&
                    A[i].size(0) == BT[i].size(0),
                "bgmv: slice ", i, ": A [V page, H_in] and BT [V page, H_out] contiguous in the dtype of x");
    // comparisons arranged so that no product or sum of caller values can overflow
    TORCH_CHECK(ranks[i].scalar_type() == at::kInt && ranks[i].is_contiguous() && A[i].size(0) % page == 0 &&
                    ranks[i].numel() == A[i].size(0) / page,
                "bgmv: slice ", i, ": ranks must be int32 [V] with V x page = rows of A");
    TORCH_CHECK(offsets[i] >= 0 && BT[i].size(1) <= y.size(1) && offsets[i] <= y.size(1) - BT[i].size(1),
                "bgmv: slice ", i, " runs past y");
    const int32_t* rk = ranks[i].data_ptr<int32_t>();
    for (int64_t q = 0; q < order.numel(); ++q) {
      TORCH_CHECK(sd[q] >= 0 && sd[q] < ranks[i].numel(), "bgmv: slot out of range");
      TORCH_CHECK(rk[sd[q]] <= A[i].size(0) - sd[q] * page, "bgmv: rank runs past the slot buffers");
    }
  }
  pybind11::gil_scoped_release no_gil;  // other Python threads (the server's event loop) run meanwhile
  const int64_t lanes = lanes_for(dtype == at::kFloat, max_lanes);
  if (dtype == at::kBFloat16) run<c10::BFloat16>(y, x, order, sid, A, BT, ranks, offsets, page, lanes);
  else if (dtype == at::kHalf) run<c10::Half>(y, x, order, sid, A, BT, ranks, offsets, page, lanes);
  else run<float>(y, x, order, sid, A, BT, ranks, offsets, page, lanes);
}

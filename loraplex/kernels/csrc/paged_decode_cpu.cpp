// The decode loop of the paged attention (one query row per request; see paged_attention_cpu.cpp for
// the semantics, the letters and the general loop it replaces for such rows), written for the CPU's
// vectors: W keys at a time (W = 16 fp32 lanes with AVX-512, 8 with AVX2; paged_vec.h).
//
// For each chunk of W keys of a request and each kv head, every one of its G query heads takes
//   scores: W dot products q . k_j, each summed over D as one vector of W partial sums, then the
//           W vectors reduced to one vector of W scores by a transpose-and-add tree (30 two-vector
//           shuffles and 15 adds at W = 16, where a horizontal sum per key took 4-5 dependent steps);
//   softmax: the online softmax of Milakov & Gimelshein (2018) on that vector, all in vectors: the
//           running max by a butterfly over the lanes, the running sum kept by lane (added up once at
//           the end), the accumulator rescaled once per chunk, exp as a vector;
//   P V:     the accumulators [D] of several query heads (up to 8 vectors in all with AVX-512) held in
//           registers while the chunk's W V rows are added into them, each V row loaded once for them.
// Each K and V row is read once per chunk for all G query heads of its kv head, in place from the cache
// (bf16 rows are widened as they are loaded). Sums run in another order than the general loop's, so the
// two differ in the last bits (both within fp32 rounding of fp64 attention, tested).
//
// The vectors are GCC's vector extensions, one register each in the clone that runs them.
#include "paged_attention.h"
#include "paged_vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace loraplex_attention {
namespace {

using namespace vec;

// out[j] = the sum of t[j]'s W lanes, j < W: log2(W) levels, each adding pairs of vectors after a
// shuffle that halves the lanes per key (8, 4, 2, 1 partial sums of each key at W = 16), keys in order.
LORAPLEX_INLINE v16 transpose_sum(const v16* t) {
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = LORAPLEX_SHUFFLE(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           LORAPLEX_SHUFFLE(t[2 * i], t[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = LORAPLEX_SHUFFLE(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           LORAPLEX_SHUFFLE(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = LORAPLEX_SHUFFLE(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           LORAPLEX_SHUFFLE(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return LORAPLEX_SHUFFLE(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         LORAPLEX_SHUFFLE(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// W = 8: three levels (vperm2f128, then vshufps twice with AVX2). They return their inputs in the order
// 0, 2, 4, 6, 1, 3, 5, 7, so the keys go in as 0, 4, 1, 5, 2, 6, 3, 7 and come out in order.
LORAPLEX_INLINE v8 transpose_sum(const v8* t) {
  const v8 x[8] = {t[0], t[4], t[1], t[5], t[2], t[6], t[3], t[7]};
  v8 a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = LORAPLEX_SHUFFLE8(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           LORAPLEX_SHUFFLE8(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    b[i] = LORAPLEX_SHUFFLE8(a[2 * i], a[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           LORAPLEX_SHUFFLE8(a[2 * i], a[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return LORAPLEX_SHUFFLE8(b[0], b[1], 0, 2, 8, 10, 4, 6, 12, 14) +
         LORAPLEX_SHUFFLE8(b[0], b[1], 1, 3, 9, 11, 5, 7, 13, 15);
}

// acc [B, ND] <- acc x corr + the sum over the chunk's keys j < nk of p[., j] x V_j, for B query heads of
// one kv head: their B x ND accumulators stay in registers and each V row is loaded once for all B.
// corr [B] and p [B] vectors (p lane j: key j's probability).
template <typename T, int ND, int B, typename V>
LORAPLEX_INLINE void add_pv(V* acc, const V* p, const V* corr, const T* const* vrow, int64_t head,
                            int64_t nk) {
  constexpr int W = lanes_of<V>();
  V o[B][ND];
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < ND; ++c) o[b][c] = acc[b * ND + c] * corr[b];
  for (int64_t j = 0; j < nk; ++j) {
    V vj[ND];
    for (int c = 0; c < ND; ++c) vj[c] = load<W>(vrow[j] + head + c * W);
    for (int b = 0; b < B; ++b) {
      const float pj = reinterpret_cast<const float*>(p + b)[j];
      for (int c = 0; c < ND; ++c) o[b][c] += pj * vj[c];
    }
  }
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < ND; ++c) acc[b * ND + c] = o[b][c];
}

// scratch (64-byte aligned), in vectors of W lanes: qf [H, ND], acc [H, ND], dots [G, W], p [G], mx [H]
// (the running max in every lane), sum [H] (running sums by lane, added up at the end), corr [G]; H =
// ng x G query heads of the item. PV query heads at a time go through add_pv.
template <typename T, int ND, int PV, int W>
LORAPLEX_CLONES void decode(const Args<T>& a, int64_t row, int64_t seq, int64_t ctx, int64_t g0, int64_t ng,
                            float* scratch) {
  using V = typename VecOf<W>::f;
  using VI = typename VecOf<W>::i;
  const int64_t G = a.G, H = ng * G, bs = a.bs;
  V* qf = reinterpret_cast<V*>(scratch);
  V* acc = qf + H * ND;
  V* dots = acc + H * ND;
  V* p = dots + G * W;
  V* mx = p + G;
  V* sum = mx + H;
  V* corr = sum + H;
  const V neg_inf = splat<V>(-std::numeric_limits<float>::infinity());
  for (int64_t h = 0; h < H; ++h) {
    const T* qr = a.q + row * a.q_row + (g0 * G + h) * a.q_head;
    for (int c = 0; c < ND; ++c) {
      qf[h * ND + c] = load<W>(qr + c * W) * a.scale;
      acc[h * ND + c] = V{};
    }
    mx[h] = neg_inf;
    sum[h] = V{};
  }
  const VI lane = lane_index<W>();
  const int64_t* table = a.tables + seq * a.table_stride;
  const int64_t row_bytes = a.D * static_cast<int64_t>(sizeof(T));  // one kv head's row of a slot
  const T* krow[W];
  const T* vrow[W];
  for (int64_t start = 0; start < ctx; start += W) {
    const int64_t nk = std::min<int64_t>(W, ctx - start);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t pos = start + j, slot = table[pos / bs] * bs + pos % bs;
      krow[j] = a.k + slot * a.slot_stride;
      vrow[j] = a.v + slot * a.slot_stride;
    }
    // The next chunk's slots, prefetched while this one is used (blocks are scattered, and the hardware's
    // prefetcher stops at page ends): each kv head's row of key j as that head reads key j here, so the
    // requests are spread over the chunk's work, and into L2 (locality 1). Asking for all of a chunk's
    // rows at once into L1, as this loop did before, held the core up at the miss buffers: 64 decodes of
    // 64-288 tokens, 30 layers cold, 84 -> 49 ms (docs/performance.md).
    const int64_t npf = std::max<int64_t>(0, std::min<int64_t>(W, ctx - start - W));
    const char* kpf[W];
    const char* vpf[W];
    for (int64_t j = 0; j < npf; ++j) {
      const int64_t pos = start + W + j, slot = table[pos / bs] * bs + pos % bs;
      kpf[j] = reinterpret_cast<const char*>(a.k + slot * a.slot_stride);
      vpf[j] = reinterpret_cast<const char*>(a.v + slot * a.slot_stride);
    }
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t head = (g0 + gi) * a.kv_head;
      const V* qg = qf + gi * G * ND;
      const int64_t head_bytes = head * static_cast<int64_t>(sizeof(T));
      for (int64_t j = 0; j < nk; ++j) {
        if (j < npf) {
          for (int64_t off = head_bytes; off < head_bytes + row_bytes; off += 64) {
            __builtin_prefetch(kpf[j] + off, 0, 1);
            __builtin_prefetch(vpf[j] + off, 0, 1);
          }
        }
        V kj[ND];
        for (int c = 0; c < ND; ++c) kj[c] = load<W>(krow[j] + head + c * W);
        for (int64_t m = 0; m < G; ++m) {
          V s = qg[m * ND] * kj[0];
          for (int c = 1; c < ND; ++c) s += qg[m * ND + c] * kj[c];
          dots[m * W + j] = s;
        }
      }
      // the online softmax on vectors, with no scalar chain over the W lanes: the max by a butterfly,
      // the sums kept by lane
      for (int64_t m = 0; m < G; ++m) {
        for (int64_t j = nk; j < W; ++j) dots[m * W + j] = V{};
        const int64_t qi = gi * G + m;
        const V s = lane < static_cast<int32_t>(nk) ? transpose_sum(dots + m * W) : neg_inf;
        const V best = all_max(mx[qi] > s ? mx[qi] : s);  // the running max, in every lane
        corr[m] = exp_nonpositive(mx[qi] - best);            // exp(-inf) = 0 on the first chunk
        p[m] = exp_nonpositive(s - best);
        mx[qi] = best;
        sum[qi] = sum[qi] * corr[m] + p[m];
      }
      V* am = acc + gi * G * ND;
      int64_t m = 0;
      for (; m + PV <= G; m += PV) add_pv<T, ND, PV, V>(am + m * ND, p + m, corr + m, vrow, head, nk);
      for (; m < G; ++m) add_pv<T, ND, 1, V>(am + m * ND, p + m, corr + m, vrow, head, nk);
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    T* o = a.out + row * a.q_row + (g0 * G + h) * a.q_head;
    const float inv = 1.f / lane_sum(sum[h]);
    const float* am = reinterpret_cast<const float*>(acc + h * ND);
    for (int64_t d = 0; d < ND * W; ++d) o[d] = T(am[d] * inv);
  }
}

// Query heads per P V block: enough independent accumulators (PV x ND vectors, one register each) to
// keep both FMA pipes busy through their latency, few enough to stay in registers with the V row's ND:
// 8, at most 4 heads (one head at D = 64 with AVX2's 8 lanes, 2 with AVX-512's 16). With AVX2 at D = 128
// and up, one head's ND accumulators already exceed the 16 registers and GCC spills some (not timed).
template <int ND>
constexpr int pv_heads() {
  return ND >= 8 ? 1 : 8 / ND > 4 ? 4 : 8 / ND;
}

template <typename T>
void dispatch(const Args<T>& a, int64_t row, int64_t seq, int64_t ctx, int64_t g0, int64_t ng, float* scratch) {
  with_lanes(a.D, [&](auto w, auto nd) {
    constexpr int ND = decltype(nd)::value;
    decode<T, ND, pv_heads<ND>(), decltype(w)::value>(a, row, seq, ctx, g0, ng, scratch);
  });
}

}  // namespace

bool decode_supported(int64_t D) {
  const int64_t nd = D / kLanes;
  return D % kLanes == 0 && (nd == 1 || nd == 2 || nd == 4 || nd == 8 || nd == 16);
}

int64_t decode_scratch(int64_t nH, int64_t D, int64_t G) {
  return 2 * nH * D + (G * kLanes + G + 2 * nH + G) * kLanes;
}

void decode_rows(const Args<float>& a, int64_t row, int64_t seq, int64_t ctx, int64_t g0, int64_t ng, float* scratch) {
  dispatch(a, row, seq, ctx, g0, ng, scratch);
}

void decode_rows(const Args<c10::BFloat16>& a, int64_t row, int64_t seq, int64_t ctx, int64_t g0, int64_t ng,
                 float* scratch) {
  dispatch(a, row, seq, ctx, g0, ng, scratch);
}

}  // namespace loraplex_attention

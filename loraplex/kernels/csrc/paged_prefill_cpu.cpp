// The prefill loop of the paged attention: a tile of n rows of one request (a prefill chunk, or part of
// one) and one kv head, written for the CPU's vectors. Semantics, letters and layouts as in
// paged_attention_cpu.cpp: row row0 + i attends the keys at positions 0 .. ctx0 + i - 1, read in place
// through the block table. M = n x G queries (the tile's rows times the query heads of the kv head),
// m = i x G + h.
//
// Flash attention's tiling (Dao et al. 2022) with the online softmax of Milakov & Gimelshein (2018):
// for each chunk of W keys (W = 16 fp32 lanes with AVX-512, 8 with AVX2; paged_vec.h),
//   K^T:     the chunk's W K rows are transposed into D vectors of W keys (a W x W transpose by
//            two-vector shuffles per W columns), once for all M queries;
//   scores:  8 queries at a time, s_m = sum over d of q[m, d] x K^T[d], one vector of W scores per
//            query made by D fused multiply-adds (one K^T load shared by 8 of them), no horizontal sums;
//            keys past a query's context are set to -inf by a lane select;
//   softmax: the running max and sum per query, the accumulator rescaled once per chunk, exp as a vector;
//   P V:     2 queries at a time (1 with AVX2's 16 registers) hold their accumulators [D] in registers
//            while the chunk's V rows are added in (one V load shared by both).
// So the products run at GEMM-like density (8 or 4 FMAs per load) with no score matrix in memory, no
// mask tensor and no padded copy of the context; the general loop (attend) did one dot product and one
// horizontal sum per (query, key). A query takes a chunk's keys only up to its own context, so a row
// never sees a later row's key; P V multiplies such keys by a probability of 0, and since they are the
// same request's own tokens of this step (already written), a NaN there is that request's own (see
// attention.py). fp32 or bf16 caches (bf16 widened as loaded), D = 16, 32, 64, 128 or 256 (with_nd).
#include "paged_attention.h"
#include "paged_vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace loraplex_attention {
namespace {

using namespace vec;

constexpr int kScoreQueries = 8;  // queries per score block: 8 accumulators of W lanes

// Queries per P V block: 2 x ND accumulators with AVX-512's 32 registers (4 measured the same), 1 (ND = 8
// at D = 64) with AVX2's 16. At D = 128 and up with AVX2 even one query's ND accumulators do not fit, and
// GCC spills some of them (read off the build; not timed: the default model has D = 64).
template <int W>
constexpr int pv_queries() { return W == 16 ? 2 : 1; }

// rows[r] <- column r of the 16 x 16 block rows[0..15] (row j lane d -> row d lane j): four levels, each
// swapping the off-diagonal s x s sub-blocks of every 2s x 2s block (s = 8, 4, 2, 1), two shuffles per
// pair of rows.
LORAPLEX_INLINE void transpose(v16* r) {
#define LORAPLEX_SWAP(s, LO, HI)                                   \
  for (int i = 0; i < 16; ++i) {                                   \
    if (i & (s)) continue;                                         \
    const v16 a = r[i], b = r[i + (s)];                            \
    r[i] = LORAPLEX_SHUFFLE(a, b, LO);                             \
    r[i + (s)] = LORAPLEX_SHUFFLE(a, b, HI);                       \
  }
#define LORAPLEX_L(...) __VA_ARGS__
  LORAPLEX_SWAP(8, LORAPLEX_L(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                LORAPLEX_L(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
  LORAPLEX_SWAP(4, LORAPLEX_L(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
                LORAPLEX_L(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
  LORAPLEX_SWAP(2, LORAPLEX_L(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
                LORAPLEX_L(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
  LORAPLEX_SWAP(1, LORAPLEX_L(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
                LORAPLEX_L(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#undef LORAPLEX_L
#undef LORAPLEX_SWAP
}

// The same for W = 8: rows[r] <- column r of the 8 x 8 block rows[0..7], three levels (s = 4, 2, 1;
// GCC makes the last one of vpermilps and vblendps with AVX2). Once per chunk, for all M queries.
LORAPLEX_INLINE void transpose(v8* r) {
#define LORAPLEX_SWAP8(s, LO, HI)                                  \
  for (int i = 0; i < 8; ++i) {                                    \
    if (i & (s)) continue;                                         \
    const v8 a = r[i], b = r[i + (s)];                             \
    r[i] = LORAPLEX_SHUFFLE8(a, b, LO);                            \
    r[i + (s)] = LORAPLEX_SHUFFLE8(a, b, HI);                      \
  }
#define LORAPLEX_L(...) __VA_ARGS__
  LORAPLEX_SWAP8(4, LORAPLEX_L(0, 1, 2, 3, 8, 9, 10, 11), LORAPLEX_L(4, 5, 6, 7, 12, 13, 14, 15))
  LORAPLEX_SWAP8(2, LORAPLEX_L(0, 1, 8, 9, 4, 5, 12, 13), LORAPLEX_L(2, 3, 10, 11, 6, 7, 14, 15))
  LORAPLEX_SWAP8(1, LORAPLEX_L(0, 8, 2, 10, 4, 12, 6, 14), LORAPLEX_L(1, 9, 3, 11, 5, 13, 7, 15))
#undef LORAPLEX_L
#undef LORAPLEX_SWAP8
}

// scratch (64-byte aligned), in vectors of W lanes: kt [D], qf [Mp, ND], acc [M, ND], p [Mp], mx [Mp] (the running
// max in every lane), sum [Mp] (running sums by lane, added up at the end), corr [Mp]; Mp = M rounded up
// to kScoreQueries (the padding queries are 0 and never used).
template <typename T, int ND, int W>
LORAPLEX_CLONES void prefill(const Args<T>& a, int64_t row0, int64_t n, int64_t seq, int64_t ctx0, int64_t g,
                             float* scratch) {
  using V = typename VecOf<W>::f;
  using VI = typename VecOf<W>::i;
  constexpr int kPvq = pv_queries<W>();
  constexpr int D = ND * W;
  const int64_t G = a.G, M = n * G, Mp = (M + kScoreQueries - 1) / kScoreQueries * kScoreQueries, bs = a.bs;
  V* kt = reinterpret_cast<V*>(scratch);
  float* qf = reinterpret_cast<float*>(kt + D);  // [Mp, D]
  V* acc = reinterpret_cast<V*>(qf + Mp * D);
  V* p = acc + M * ND;
  V* mx = p + Mp;
  V* sum = mx + Mp;
  V* corr = sum + Mp;
  for (int64_t m = 0; m < Mp; ++m) {
    V* qm = reinterpret_cast<V*>(qf + m * D);
    if (m < M) {
      const T* qr = a.q + (row0 + m / G) * a.q_row + (g * G + m % G) * a.q_head;
      for (int c = 0; c < ND; ++c) {
        qm[c] = load<W>(qr + c * W) * a.scale;
        acc[m * ND + c] = V{};
      }
    } else {
      for (int c = 0; c < ND; ++c) qm[c] = V{};
    }
    mx[m] = splat<V>(-std::numeric_limits<float>::infinity());
    sum[m] = V{};
  }
  const VI lane = lane_index<W>();
  const V neg_inf = splat<V>(-std::numeric_limits<float>::infinity());
  const int64_t* table = a.tables + seq * a.table_stride;
  const int64_t head = g * a.kv_head;
  const int64_t last = ctx0 + n - 1;  // keys the tile's last row attends
  const T* krow[W];
  const T* vrow[W];
  for (int64_t start = 0; start < last; start += W) {
    const int64_t nk = std::min<int64_t>(W, last - start);
    V rows[W];
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t pos = start + j, slot = table[pos / bs] * bs + pos % bs;
      krow[j] = a.k + slot * a.slot_stride + head;
      vrow[j] = a.v + slot * a.slot_stride + head;
    }
    for (int c = 0; c < ND; ++c) {
      for (int64_t j = 0; j < W; ++j) rows[j] = j < nk ? load<W>(krow[j] + c * W) : V{};
      transpose(rows);
      for (int d = 0; d < W; ++d) kt[c * W + d] = rows[d];
    }
    // queries before `first` see none of this chunk's keys (their rows end before it)
    const int64_t first = std::max<int64_t>(0, (start - ctx0 + 1) * G);
    for (int64_t m0 = first / kScoreQueries * kScoreQueries; m0 < M; m0 += kScoreQueries) {
      V s[kScoreQueries] = {};
      for (int d = 0; d < D; ++d) {
        const V kd = kt[d];
        for (int i = 0; i < kScoreQueries; ++i) s[i] += qf[(m0 + i) * D + d] * kd;
      }
      for (int i = 0; i < kScoreQueries && m0 + i < M; ++i) {
        const int64_t m = m0 + i;
        const int64_t limit = std::min(nk, ctx0 + m / G - start);  // this query's keys in the chunk
        if (limit <= 0) {
          corr[m] = splat<V>(1.f);
          p[m] = V{};
          continue;
        }
        const V sm = lane < static_cast<int32_t>(limit) ? s[i] : neg_inf;
        const V best = all_max(mx[m] > sm ? mx[m] : sm);  // the running max, in every lane
        corr[m] = exp_nonpositive(mx[m] - best);            // exp(-inf) = 0 on a query's first chunk
        p[m] = exp_nonpositive(sm - best);
        mx[m] = best;
        sum[m] = sum[m] * corr[m] + p[m];  // lane j: the running sum of the scores at lanes j
      }
    }
    for (int64_t m0 = first; m0 < M; m0 += kPvq) {
      const int nq = static_cast<int>(std::min<int64_t>(kPvq, M - m0));
      V o[kPvq][ND];
      for (int i = 0; i < kPvq; ++i)
        for (int c = 0; c < ND; ++c) o[i][c] = i < nq ? acc[(m0 + i) * ND + c] * corr[m0 + i] : V{};
      for (int64_t j = 0; j < nk; ++j) {
        V vj[ND];
        for (int c = 0; c < ND; ++c) vj[c] = load<W>(vrow[j] + c * W);
        for (int i = 0; i < kPvq; ++i) {
          const float pj = i < nq ? reinterpret_cast<const float*>(p + m0 + i)[j] : 0.f;
          for (int c = 0; c < ND; ++c) o[i][c] += pj * vj[c];
        }
      }
      for (int i = 0; i < nq; ++i)
        for (int c = 0; c < ND; ++c) acc[(m0 + i) * ND + c] = o[i][c];
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    T* out = a.out + (row0 + m / G) * a.q_row + (g * G + m % G) * a.q_head;
    const float inv = 1.f / lane_sum(sum[m]);
    const float* am = reinterpret_cast<const float*>(acc + m * ND);
    for (int64_t d = 0; d < D; ++d) out[d] = T(am[d] * inv);
  }
}

template <typename T>
void dispatch(const Args<T>& a, int64_t row0, int64_t n, int64_t seq, int64_t ctx0, int64_t g, float* scratch) {
  with_lanes(a.D, [&](auto w, auto nd) {
    prefill<T, decltype(nd)::value, decltype(w)::value>(a, row0, n, seq, ctx0, g, scratch);
  });
}

}  // namespace

int64_t prefill_scratch(int64_t M, int64_t D) {
  const int64_t Mp = (M + kScoreQueries - 1) / kScoreQueries * kScoreQueries;
  return D * kLanes + Mp * D + M * D + 4 * Mp * kLanes;
}

void prefill_rows(const Args<float>& a, int64_t row0, int64_t n, int64_t seq, int64_t ctx0, int64_t g,
                  float* scratch) {
  dispatch(a, row0, n, seq, ctx0, g, scratch);
}

void prefill_rows(const Args<c10::BFloat16>& a, int64_t row0, int64_t n, int64_t seq, int64_t ctx0, int64_t g,
                  float* scratch) {
  dispatch(a, row0, n, seq, ctx0, g, scratch);
}

}  // namespace loraplex_attention

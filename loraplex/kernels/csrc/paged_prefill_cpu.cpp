// The prefill loop of the paged attention: a tile of n rows of one request (a prefill chunk, or part of
// one) and one kv head, written for the CPU's vectors. Semantics, letters and layouts as in
// paged_attention_cpu.cpp: row row0 + i attends the keys at positions 0 .. ctx0 + i - 1, read in place
// through the block table. M = n x G queries (the tile's rows times the query heads of the kv head),
// m = i x G + h.
//
// Flash attention's tiling (Dao et al. 2022) with the online softmax of Milakov & Gimelshein (2018):
// for each chunk of 2 W keys (W = 16 fp32 lanes with AVX-512, 8 with AVX2; paged_vec.h),
//   K^T:     the chunk's K rows are transposed into D x 2 vectors of W keys (a W x W transpose by
//            two-vector shuffles per W columns), once for all M queries;
//   scores:  kQB queries at a time (4 with AVX2, 8 with AVX-512), s_m = sum over d of q[m, d] x K^T[d],
//            two vectors of W scores per query made by fused multiply-adds (each K^T load shared by the
//            kQB queries), no horizontal sums; keys past a query's context are set to -inf by a lane
//            select;
//   softmax: the running max and sum per query, the accumulator rescaled once per chunk, exp as a vector;
//   P V:     kPQ queries at a time (3, or 6 with AVX-512) hold 4 vectors each of their accumulators in
//            registers while the chunk's V rows are added in (one V load shared by the kPQ).
// So the products run at GEMM-like density with no score matrix in memory, no
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

// A chunk is kKV vectors of W keys. Scores: kQB queries x kKV vectors of accumulators, each K^T load
// shared by kQB queries and each query's broadcast by kKV vectors. P V: kPQ queries x 4 vectors of the
// head dim, each V load shared by kPQ queries. With AVX2 (Blocks<8>): 8 and 12 accumulators, within its
// 16 registers with the loaded vectors; 4 x 128 fresh tokens, 30 layers, AVX2-only EPYC, fp32
// (scripts/attn-bench): 141-168 ms with 8-key chunks, 8 x 1 score blocks and one query per P V block,
// 117-118 ms with these. With AVX-512's 32 registers (Blocks<16>) the blocks are twice as tall: 16 and 24
// accumulators (a few percent faster there, docs/performance.md).
constexpr int kKV = 2;
template <int W>
struct Blocks {
  static constexpr int QB = W == 16 ? 8 : 4;  // kQB
  static constexpr int PQ = W == 16 ? 6 : 3;  // kPQ
};
constexpr int kQBMax = Blocks<16>::QB, kPQMax = Blocks<16>::PQ;  // scratch is sized for the largest

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

// s[i][h] += sum over d of q[i, d] x kt[kKV d + h] for the kQB queries q (rows of D floats, scaled) and
// the chunk's first KV vectors of keys (KV <= kKV; the rest of s is left as it is): kQB x KV
// accumulators, each K^T load shared by the kQB queries and each query's broadcast by the KV vectors.
template <int KV, int D, typename V, int QB>
LORAPLEX_INLINE void scores(V (&s)[QB][kKV], const V* kt, const float* q) {
  for (int d = 0; d < D; ++d) {
    V kd[KV];
    for (int h = 0; h < KV; ++h) kd[h] = kt[kKV * d + h];
    for (int i = 0; i < QB; ++i) {
      const float qd = q[i * D + d];
      for (int h = 0; h < KV; ++h) s[i][h] += qd * kd[h];
    }
  }
}

// scratch (64-byte aligned), in vectors of W lanes: kt [D, kKV] (the chunk's K^T: kt[kKV d + h] holds keys
// hW .. hW + W - 1 at dim d), qf [Mp, ND], acc [Mp, ND], p [Mp, kKV], mx [Mp] (the running max in every
// lane), sum [Mp] (running sums by lane, added up at the end), corr [Mp]; Mp = M rounded up to kQB, plus
// kPQ (the padding queries are 0 and never written out).
template <typename T, int ND, int W>
LORAPLEX_CLONES void prefill(const Args<T>& a, int64_t row0, int64_t n, int64_t seq, int64_t ctx0, int64_t g,
                             float* scratch) {
  using V = typename VecOf<W>::f;
  using VI = typename VecOf<W>::i;
  constexpr int KC = kKV * W;
  constexpr int D = ND * W;
  constexpr int CB = ND < 4 ? ND : 4;
  constexpr int kQB = Blocks<W>::QB, kPQ = Blocks<W>::PQ;
  const int64_t G = a.G, M = n * G, Mp = (M + kQB - 1) / kQB * kQB + kPQ;
  V* kt = reinterpret_cast<V*>(scratch);
  float* qf = reinterpret_cast<float*>(kt + kKV * D);  // [Mp, D]
  V* acc = reinterpret_cast<V*>(qf + Mp * D);
  V* p = acc + Mp * ND;
  V* mx = p + kKV * Mp;
  V* sum = mx + Mp;
  V* corr = sum + Mp;
  for (int64_t m = 0; m < Mp; ++m) {
    V* qm = reinterpret_cast<V*>(qf + m * D);
    if (m < M) {
      const T* qr = a.q + (row0 + m / G) * a.q_row + (g * G + m % G) * a.q_head;
      for (int c = 0; c < ND; ++c) qm[c] = load<W>(qr + c * W) * a.scale;
    } else {
      for (int c = 0; c < ND; ++c) qm[c] = V{};
    }
    for (int c = 0; c < ND; ++c) acc[m * ND + c] = V{};
    for (int h = 0; h < kKV; ++h) p[kKV * m + h] = V{};
    corr[m] = V{};
    mx[m] = splat<V>(-std::numeric_limits<float>::infinity());
    sum[m] = V{};
  }
  const VI lane = lane_index<W>();
  const V neg_inf = splat<V>(-std::numeric_limits<float>::infinity());
  const int64_t* table = a.tables + seq * a.table_stride;
  const int64_t head = g * a.kv_head;
  const int64_t last = ctx0 + n - 1;  // keys the tile's last row attends
  const T* krow[KC];
  const T* vrow[KC];
  for (int64_t start = 0; start < last; start += KC) {
    const int64_t nk = std::min<int64_t>(KC, last - start);
    for (int64_t j = 0; j < KC; ++j) {
      const int64_t slot = slot_of(table, a.bs, start + std::min<int64_t>(j, nk - 1));  // past nk: key nk - 1
      krow[j] = a.k + slot * a.slot_stride + head;
      vrow[j] = a.v + slot * a.slot_stride + head;
    }
    // vectors of the chunk that hold a key: a chunk of at most W keys (a tile's last, on the diagonal:
    // every other 16-row tile of a fresh prompt with AVX-512) skips the second vector's transposes and
    // scores, which the mask below sets to -inf anyway (4 x 144 and 4 x 64 fresh tokens in 16-row
    // tiles, Zen 4: 4-7% faster, the same bits; docs/performance.md)
    const int used = nk <= W ? 1 : kKV;
    for (int h = 0; h < used; ++h) {
      for (int c = 0; c < ND; ++c) {
        V rows[W];
        for (int j = 0; j < W; ++j) rows[j] = load<W>(krow[h * W + j] + c * W);
        transpose(rows);
        for (int d = 0; d < W; ++d) kt[kKV * (c * W + d) + h] = rows[d];
      }
    }
    const int64_t first = std::max<int64_t>(0, (start - ctx0 + 1) * G);
    for (int64_t m0 = first / kQB * kQB; m0 < M; m0 += kQB) {
      V s[kQB][kKV] = {};
      if (used == 1) scores<1, D>(s, kt, qf + m0 * D);
      else scores<kKV, D>(s, kt, qf + m0 * D);
      for (int i = 0; i < kQB && m0 + i < M; ++i) {
        const int64_t m = m0 + i;
        const int64_t limit = std::min(nk, ctx0 + m / G - start);
        if (limit <= 0) {
          corr[m] = splat<V>(1.f);
          for (int h = 0; h < kKV; ++h) p[kKV * m + h] = V{};
          continue;
        }
        V hi = mx[m];
        for (int h = 0; h < kKV; ++h) {
          s[i][h] = lane + h * W < static_cast<int32_t>(limit) ? s[i][h] : neg_inf;
          hi = hi > s[i][h] ? hi : s[i][h];
        }
        const V best = all_max(hi);
        corr[m] = exp_nonpositive(mx[m] - best);
        V tot = sum[m] * corr[m];
        for (int h = 0; h < kKV; ++h) {
          const V e = exp_nonpositive(s[i][h] - best);
          p[kKV * m + h] = e;
          tot += e;
        }
        mx[m] = best;
        sum[m] = tot;
      }
    }
    for (int64_t m0 = first; m0 < M; m0 += kPQ) {
      // queries past M: padding (p = 0, corr = 0, acc = 0; written back, never read out)
      const float* pm[kPQ];
      for (int i = 0; i < kPQ; ++i) pm[i] = reinterpret_cast<const float*>(p + kKV * (m0 + i));
      for (int c0 = 0; c0 < ND; c0 += CB) {
        V o[kPQ][CB];
        for (int i = 0; i < kPQ; ++i)
          for (int c = 0; c < CB; ++c) o[i][c] = acc[(m0 + i) * ND + c0 + c] * corr[m0 + i];
        for (int64_t j = 0; j < nk; ++j) {
          float pj[kPQ];
          for (int i = 0; i < kPQ; ++i) pj[i] = pm[i][j];
          for (int c = 0; c < CB; ++c) {
            const V v = load<W>(vrow[j] + (c0 + c) * W);
            for (int i = 0; i < kPQ; ++i) o[i][c] += pj[i] * v;
          }
        }
        for (int i = 0; i < kPQ; ++i)
          for (int c = 0; c < CB; ++c) acc[(m0 + i) * ND + c0 + c] = o[i][c];
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    T* out = a.out + (row0 + m / G) * a.out_row + (g * G + m % G) * a.out_head;
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
  const int64_t Mp = (M + kQBMax - 1) / kQBMax * kQBMax + kPQMax;  // at least any Blocks<W>'s Mp
  return kKV * D * kLanes + 2 * Mp * D + (kKV + 3) * Mp * kLanes;
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

// The decode loop of the paged attention (one query row per request; see paged_attention_cpu.cpp for
// the semantics, the letters and the general loop it replaces for such rows), written for the CPU's
// vectors: chunks of W keys (W = 16 fp32 lanes with AVX-512, 8 with AVX2; paged_vec.h).
//
// One work item is a decode row and its kv heads g0 .. g0 + ng - 1 (all of them on one thread), and H =
// ng x G query heads. For each chunk of W keys:
//   scores:  four keys at a time, and for each four their kv heads in address order (the K row of a
//            key is its ng heads side by side), each kv head's G query heads in blocks of up to 3
//            (qk_keys4): 3 x 4 accumulators of W partial sums over D, one per query head and key, each K
//            vector loaded once for the 3 heads and each query vector once for the 4 keys; the W vectors
//            of partial sums per head are reduced to one vector of W scores by a transpose-and-add tree
//            (14 two-vector shuffles and 7 adds at W = 8). Reading the rows in address order, rather
//            than one kv head of W keys at a time (rows 768 bytes apart), took 64 decodes over 30 cold
//            layers from 36.3-43.0 to 32.7 ms on a Zen 4 EPYC (AVX-512; scripts/attn-bench, best of 5 in
//            two alternating runs, blocks laid out as the engine hands them out; 40.3-42.4 to 38.1-39.9
//            ms with the blocks shuffled). One key at a time, the query vectors were loaded again for
//            every key (36 query heads' vectors do not fit the registers): 18 loads per 12 FMAs;
//   softmax: the online softmax of Milakov & Gimelshein (2018) on that vector, in vectors: the running
//            max by a butterfly over the lanes, the running sum kept by lane (added up once at the end),
//            the accumulator rescaled once per chunk, exp as a vector;
//   P V:     for each kv head, its query heads in blocks of up to 3 (pv_block): 4 vectors of the head
//            dim for each head of the block (8 for a block of one) held in registers while the chunk's V
//            rows are added in, each V vector loaded once for the block.
// While a chunk is computed, the next chunk's K and V rows (the item's heads) are asked into L2, a
// couple of 64-byte lines at a time between the loops' steps (Prefetcher): blocks are scattered, and
// the hardware's prefetcher does not cross into them; spreading the requests over the chunk's work keeps
// the core from waiting at the miss buffers, where asking for a whole chunk at once held it up. 64
// decodes of the vllm preset (contexts 64-288), 30 layers cold, AVX2-only EPYC (scripts/attn-bench):
// 132-147 ms with the previous loop (one head at a time, a dot product as one FMA chain), 90-103 ms with
// this one; a plain read of the same K/V takes 70-80 ms (docs/performance.md). The rate (lines a step)
// comes from the count of steps a whole chunk takes (chunk_steps), so the first chunk covers the second
// too; after it, from the previous chunk's count. During an item's last chunk, the first chunk of the
// item the thread is likely to take next (Ahead) is asked for the same way: the first chunk of an item
// was otherwise read cold, a twelfth of a 64-row step's K/V at the vllm preset's contexts. 64 decodes
// over 30 cold layers on a Zen 4 EPYC (scripts/attn-bench with two builds in turns, medians of 15):
// 33.1 ms before, 29.1 ms with both changes (31.4 with four keys at a time alone), against 20.7 ms for
// a plain read of the caches. K and V rows are read in place from the
// cache (bf16 rows widened as they are loaded); keys past a row's context are never read (a chunk's
// missing keys repeat its last key, masked to -inf). Sums run in another order than the general loop's,
// so the two differ in the last bits (both within fp32 rounding of fp64 attention, tested).
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

// The next chunk's K and V rows (in an item's last chunk, the first chunk of the item expected next),
// asked into L2 (locality 1) a few 64-byte lines per step() as the loops go: rows 2j and 2j + 1 are key
// j's K and V (span bytes each, the item's heads). `per` lines a step, set so that a chunk's steps cover
// the next chunk's lines: from the previous chunk's count of steps, or for the first chunk from
// chunk_steps.
struct Prefetcher {
  const char* row[2 * kLanes];
  int64_t rows = 0, r = 0, off = 0, span = 0, steps = 0;
  int64_t per = 1;
  inline __attribute__((always_inline)) void step() {
    ++steps;
    for (int64_t i = 0; i < per && r < rows; ++i) {
      __builtin_prefetch(row[r] + off, 0, 1);
      off += 64;
      if (off >= span) {
        off = 0;
        ++r;
      }
    }
  }
};

// The cache slots of a request's keys pos, pos + 1, ... (block table `table`, blocks of bs slots): one
// division, then (block, offset) walked forward, where slot_of divides for every key (two 64-bit
// divisions a key and chunk, with the prefetch rows). In scripts/attn-bench's alternating runs on a
// Zen 4 EPYC: 32.4-35.0 against 35.2-44.1 ms, within that VM's noise.
struct SlotWalk {
  const int64_t* table;
  int64_t bs, blk, off;
  SlotWalk(const int64_t* t, int64_t block_size, int64_t pos)
      : table(t), bs(block_size), blk(pos / block_size), off(pos % block_size) {}
  inline __attribute__((always_inline)) int64_t next() {
    const int64_t slot = table[blk] * bs + off;
    if (++off == bs) off = 0, ++blk;
    return slot;
  }
};

// The P V blocks' width for MH query heads: head-dim vectors per pv_block pass (MH x CB accumulators),
// within the registers at MH = 3.
template <int ND, int MH>
constexpr int pv_cols() { return ND < (MH == 1 ? 8 : 4) ? ND : (MH == 1 ? 8 : 4); }

// dots[m x W + i] (m < MH, i < 4: vectors of W partial sums over D) = q_m . k_i for MH query heads of one
// kv head (q: [MH, ND] vectors, scaled) and four keys (k[i]: key i's row of the kv head), 4 MH
// accumulators over the ND vectors: each q vector is loaded once for the four keys (4 K + MH q loads per
// 4 MH FMAs). Four Prefetcher steps, one per key, spread over the ND vectors.
template <typename T, int ND, int W, int MH>
LORAPLEX_INLINE void qk_keys4(const typename VecOf<W>::f* q, const T* const* k, typename VecOf<W>::f* dots,
                              Prefetcher& pf) {
  using V = typename VecOf<W>::f;
  V s[MH][4];
  for (int m = 0; m < MH; ++m)
    for (int i = 0; i < 4; ++i) s[m][i] = V{};
  for (int c = 0; c < ND; ++c) {
    for (int t = (c * 4) / ND; t < ((c + 1) * 4) / ND; ++t) pf.step();
    V kc[4];
    for (int i = 0; i < 4; ++i) kc[i] = load<W>(k[i] + c * W);
    for (int m = 0; m < MH; ++m) {
      const V qm = q[m * ND + c];
      for (int i = 0; i < 4; ++i) s[m][i] += qm * kc[i];
    }
  }
  for (int m = 0; m < MH; ++m)
    for (int i = 0; i < 4; ++i) dots[m * W + i] = s[m][i];
}

// acc[m] <- acc[m] x corr[m] + sum over j < nk of p[m][j] V_j (vr[j] + head: key j's V row of the kv
// head), m < MH query heads of one kv head (acc: [MH, ND] vectors; p: MH vectors of W probabilities):
// CB vectors of the head dim at a time, so MH x CB accumulators stay in registers and each V vector is
// loaded once for the MH heads.
template <typename T, int ND, int W, int MH>
LORAPLEX_INLINE void pv_block(typename VecOf<W>::f* acc, const typename VecOf<W>::f* corr,
                              const typename VecOf<W>::f* p, int64_t nk, const T* const* vr, int64_t head,
                              Prefetcher& pf) {
  using V = typename VecOf<W>::f;
  constexpr int CB = pv_cols<ND, MH>();
  for (int c0 = 0; c0 < ND; c0 += CB) {
    V o[MH][CB];
    for (int m = 0; m < MH; ++m)
      for (int c = 0; c < CB; ++c) o[m][c] = acc[m * ND + c0 + c] * corr[m];
    for (int64_t j = 0; j < nk; ++j) {
      pf.step();
      float pj[MH];
      for (int m = 0; m < MH; ++m) pj[m] = reinterpret_cast<const float*>(p + m)[j];
      for (int c = 0; c < CB; ++c) {
        const V v = load<W>(vr[j] + head + (c0 + c) * W);
        for (int m = 0; m < MH; ++m) o[m][c] += pj[m] * v;
      }
    }
    for (int m = 0; m < MH; ++m)
      for (int c = 0; c < CB; ++c) acc[m * ND + c0 + c] = o[m][c];
  }
}

// The Prefetcher steps that one chunk of W keys takes in `decode` for a block of MH query heads
// (qk_keys4's one per key, pv_block's one per key and pv_cols vectors), and for ng kv heads of G
// query heads each, in blocks of 3 then 2 or 1 as the loops below run them.
template <int ND, int W, int MH>
constexpr int64_t block_steps() { return W + ND / pv_cols<ND, MH>() * W; }
template <int ND, int W>
constexpr int64_t chunk_steps(int64_t G, int64_t ng) {
  const int64_t rest = G % 3;
  return ng * ((G / 3) * block_steps<ND, W, 3>() +
               (rest == 2 ? block_steps<ND, W, 2>() : rest == 1 ? block_steps<ND, W, 1>() : 0));
}

// scratch (64-byte aligned), in vectors of W lanes: qf [H, ND] (scaled queries), acc [H, ND], dots
// [H, W], p [H], mx [H] (the running max in every lane), sum [H] (running sums by lane, added up at the
// end), corr [H].
template <typename T, int ND, int W>
LORAPLEX_CLONES void decode(const Args<T>& a, int64_t row, int64_t seq, int64_t ctx, int64_t g0, int64_t ng,
                            float* scratch, const Ahead& ahead) {
  using V = typename VecOf<W>::f;
  using VI = typename VecOf<W>::i;
  const int64_t G = a.G, H = ng * G;
  V* qf = reinterpret_cast<V*>(scratch);
  V* acc = qf + H * ND;
  V* dots = acc + H * ND;
  V* p = dots + H * W;
  V* mx = p + H;
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
  const int64_t first = g0 * a.kv_head;  // the item's heads: elements first .. first + ng x kv_head of a slot
  Prefetcher pf;
  pf.span = ng * a.kv_head * static_cast<int64_t>(sizeof(T));
  pf.steps = chunk_steps<ND, W>(G, ng);  // sets the first chunk's rate below
  const T* kr[W];
  const T* vr[W];
  for (int64_t start = 0; start < ctx; start += W) {
    const int64_t nk = std::min<int64_t>(W, ctx - start);
    SlotWalk keys{table, a.bs, start};
    int64_t slot = 0;
    for (int64_t j = 0; j < W; ++j) {
      if (j < nk) slot = keys.next();  // past nk: key nk - 1 again
      kr[j] = a.k + slot * a.slot_stride + first;
      vr[j] = a.v + slot * a.slot_stride + first;
    }
    // the next chunk's rows, spread over this chunk's steps (next > 0 only after a whole chunk, nk = W)
    const int64_t next = std::max<int64_t>(0, std::min<int64_t>(W, ctx - start - W));
    pf.rows = pf.r = pf.off = 0;
    for (int64_t j = 0; j < next; ++j) {
      slot = keys.next();
      pf.row[pf.rows++] = reinterpret_cast<const char*>(a.k + slot * a.slot_stride + first);
      pf.row[pf.rows++] = reinterpret_cast<const char*>(a.v + slot * a.slot_stride + first);
    }
    if (next == 0 && ahead.seq >= 0 && ahead.ng == ng) {  // the last chunk: the next item's first chunk
      SlotWalk later{a.tables + ahead.seq * a.table_stride, a.bs, 0};
      const int64_t heads = ahead.g0 * a.kv_head;
      for (int64_t j = 0; j < std::min<int64_t>(W, ahead.ctx); ++j) {
        const int64_t at = later.next();
        pf.row[pf.rows++] = reinterpret_cast<const char*>(a.k + at * a.slot_stride + heads);
        pf.row[pf.rows++] = reinterpret_cast<const char*>(a.v + at * a.slot_stride + heads);
      }
    }
    if (pf.steps > 0) pf.per = std::max<int64_t>(1, (pf.rows * ((pf.span + 63) / 64) + pf.steps - 1) / pf.steps);
    pf.steps = 0;
    // the scores four keys at a time, their rows of the item's heads in address order; each kv head's G
    // query heads in blocks of 3, then 2 or 1 (no lambdas here: they would not be compiled for the
    // clone's target)
    for (int64_t j = 0; j < W; j += 4) {
      for (int64_t gi = 0; gi < ng; ++gi) {
        const T* k[4] = {kr[j] + gi * a.kv_head, kr[j + 1] + gi * a.kv_head, kr[j + 2] + gi * a.kv_head,
                         kr[j + 3] + gi * a.kv_head};
        int64_t h = gi * G;
        for (; h + 3 <= (gi + 1) * G; h += 3) qk_keys4<T, ND, W, 3>(qf + h * ND, k, dots + h * W + j, pf);
        if ((gi + 1) * G - h == 2) qk_keys4<T, ND, W, 2>(qf + h * ND, k, dots + h * W + j, pf);
        else if ((gi + 1) * G - h == 1) qk_keys4<T, ND, W, 1>(qf + h * ND, k, dots + h * W + j, pf);
      }
    }
    // the online softmax on vectors, with no scalar chain over the W lanes: the max by a butterfly, the
    // sums kept by lane
    for (int64_t h = 0; h < H; ++h) {
      const V s = lane < static_cast<int32_t>(nk) ? transpose_sum(dots + h * W) : neg_inf;
      const V best = all_max(mx[h] > s ? mx[h] : s);  // the running max, in every lane
      corr[h] = exp_nonpositive(mx[h] - best);          // exp(-inf) = 0 on the first chunk
      p[h] = exp_nonpositive(s - best);
      mx[h] = best;
      sum[h] = sum[h] * corr[h] + p[h];
    }
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t head = gi * a.kv_head;
      int64_t h = gi * G;
      for (; h + 3 <= (gi + 1) * G; h += 3) pv_block<T, ND, W, 3>(acc + h * ND, corr + h, p + h, nk, vr, head, pf);
      if ((gi + 1) * G - h == 2) pv_block<T, ND, W, 2>(acc + h * ND, corr + h, p + h, nk, vr, head, pf);
      else if ((gi + 1) * G - h == 1) pv_block<T, ND, W, 1>(acc + h * ND, corr + h, p + h, nk, vr, head, pf);
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    T* o = a.out + row * a.out_row + (g0 * G + h) * a.out_head;
    const float inv = 1.f / lane_sum(sum[h]);
    const float* am = reinterpret_cast<const float*>(acc + h * ND);
    for (int64_t d = 0; d < ND * W; ++d) o[d] = T(am[d] * inv);
  }
}

template <typename T>
void dispatch(const Args<T>& a, int64_t row, int64_t seq, int64_t ctx, int64_t g0, int64_t ng, float* scratch,
              const Ahead& ahead) {
  with_lanes(a.D, [&](auto w, auto nd) {
    constexpr int ND = decltype(nd)::value;
    decode<T, ND, decltype(w)::value>(a, row, seq, ctx, g0, ng, scratch, ahead);
  });
}

}  // namespace

bool decode_supported(int64_t D) {
  const int64_t nd = D / kLanes;
  return D % kLanes == 0 && (nd == 1 || nd == 2 || nd == 4 || nd == 8 || nd == 16);
}

int64_t decode_scratch(int64_t nH, int64_t D) {
  return 2 * nH * D + (nH * kLanes + 4 * nH) * kLanes;  // qf, acc; dots, p, mx, sum, corr (W <= kLanes)
}

void decode_rows(const Args<float>& a, int64_t row, int64_t seq, int64_t ctx, int64_t g0, int64_t ng, float* scratch,
                 const Ahead& ahead) {
  dispatch(a, row, seq, ctx, g0, ng, scratch, ahead);
}

void decode_rows(const Args<c10::BFloat16>& a, int64_t row, int64_t seq, int64_t ctx, int64_t g0, int64_t ng,
                 float* scratch, const Ahead& ahead) {
  dispatch(a, row, seq, ctx, g0, ng, scratch, ahead);
}

}  // namespace loraplex_attention

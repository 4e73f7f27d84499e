// Paged attention on the CPU: every query row reads its request's K/V in place through the block
// table, for decodes and prefill chunks alike; no gather into a padded copy and no mask tensor.
//
// Letters: T query rows of the step, nH query heads, nKV key/value heads (G = nH / nKV query heads
// share one), D head dim, N_seq requests in the step, W blocks per block table row, bs block size.
// Inputs: q [T, nH, D]; k_cache, v_cache [num_slots, nKV, D] (slot = block * bs + offset, this step's
// K/V already written); block_tables [N_seq, W] int64; tiles [N_tiles, 4] int64, each
// (row0, n, seq, ctx0): rows row0 .. row0 + n - 1 of request `seq`, where row row0 + i attends the keys
// at positions 0 .. ctx0 + i - 1 (a decode: n = 1, ctx0 = its length; a prefill chunk starting at
// position c: ctx0 = c + 1 for its first row, so the chunk is causal and sees the earlier chunks).
// Optionally k, v [T', nKV, D] and slot_mapping [T'] int64: this step's K/V, written to the caches first
// (k_cache[slot_mapping[t]] = k[t]), in the same call rather than two index_copy_ calls a layer.
// q and out may have rows of any stride (q is a view of the fused q/k/v projection's output).
// Output: out [T, nH, D], out[t, h] = softmax(q[t, h] . K^T / sqrt(D)) V over the row's keys, with
// kv head g = h / G (GQA, as Hugging Face's repeat_kv).
//
// Tiles of fp32 or bf16 caches with D = 16, 32, 64, 128 or 256 go to the vector loops: decodes (one row) to
// paged_decode_cpu.cpp's, prefill tiles to paged_prefill_cpu.cpp's; every other tile (fp16, other head
// dims) to `attend` below, where one work item is a tile of rows times one
// kv head (or all of them): its n x G queries are scaled into fp32, then each block of bs keys is read
// once for all of them (flash attention's tiling, Dao et al. 2022, with the online softmax of Milakov & Gimelshein 2018: a running max and sum per query, the accumulator
// rescaled once per block). Scores, softmax and P V run in fp32 whatever the cache's dtype (bf16 K/V
// are widened as they are read). No slot past a tile's last row's context is read, so whatever an
// unused slot holds (even NaN) cannot enter a product; within a tile, `attend` and the decode loop read
// only a row's own keys, and the prefill loop multiplies a later row's keys (this step's own, already
// written) by a probability of 0. Work items are spread over PyTorch's own
// OpenMP pool (at::parallel_for). The hot loop is compiled for AVX-512, AVX2+FMA and plain x86-64 and
// picked at load time (GCC's target_clones), so one build runs on both CPU families.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "paged_attention.h"
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

using loraplex_attention::Args;

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxQueries = 256;  // n x G per work item (Python cuts tiles to fit)
constexpr int64_t kMaxBlock = 64;
constexpr int64_t kScratch = 2 * kMaxQueries * kMaxHeadDim + 2 * kMaxBlock * kMaxHeadDim + 2 * kMaxQueries + kMaxBlock;


// exp(x) for x <= 0 (a score minus its running max), vectorizable: Cephes' expf (range reduction by
// ln 2 in two parts, a degree-5 polynomial on [-ln2/2, ln2/2], 2^n built in the exponent bits), within
// 1 ulp of exp on [-87, 0] (checked against fp64); 0 below -87.3 (2^-126), NaN stays NaN. The loops
// that call it run through `#pragma omp simd`, where a call to std::exp would stay one scalar call per
// element.
static inline float exp_nonpositive(float x) {
  float n;
  const float y = loraplex_attention::exp_reduced(x, n);
  const int32_t bits = (static_cast<int32_t>(!(n >= -126.f) ? -126.f : n) + 127) << 23;  // NaN: y is NaN anyway
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.3f ? 0.f : y * scale;
}

// One tile (rows row0 .. row0 + n - 1 of request seq) and the kv heads g0 .. g0 + ng - 1. Taking every
// kv head of a decode in one work item reads each block of the cache front to back once (its slots hold
// all heads side by side), where one head per item read a third of every slot and skipped the rest;
// the next block is prefetched while this one is used (blocks are scattered, so the hardware's
// prefetcher, which stops at page ends, does not find it).
// scratch: kScratch floats, one buffer per thread; ng x n x G <= kMaxQueries.
template <typename T>
LORAPLEX_CLONES void attend(const Args<T>& a, int64_t row0, int64_t n, int64_t seq, int64_t ctx0, int64_t g0,
                            int64_t ng, float* scratch) {
  const int64_t D = a.D, G = a.G, M = n * G, bs = a.bs;
  float* qf = scratch;                // [ng, M, D] the queries, scaled
  float* acc = qf + kMaxQueries * D;  // [ng, M, D] running sum of p V
  float* kf = acc + kMaxQueries * D;  // [bs, D] one block of one head's K, widened (not fp32 caches)
  float* vf = kf + kMaxBlock * D;     // [bs, D] and of V
  float* mx = vf + kMaxBlock * D;     // [ng, M] running max of the scores
  float* sum = mx + kMaxQueries;      // [ng, M] running sum of exp(score - max)
  float* s = sum + kMaxQueries;       // [bs] one query's scores in the block, then their exp
  const float* krow[kMaxBlock];
  const float* vrow[kMaxBlock];
  for (int64_t gi = 0; gi < ng; ++gi) {
    for (int64_t m = 0; m < M; ++m) {
      const T* qr = a.q + (row0 + m / G) * a.q_row + ((g0 + gi) * G + m % G) * a.q_head;
      float* qm = qf + (gi * M + m) * D;
      for (int64_t d = 0; d < D; ++d) qm[d] = float(qr[d]) * a.scale;
      float* am = acc + (gi * M + m) * D;
      for (int64_t d = 0; d < D; ++d) am[d] = 0.f;
      mx[gi * M + m] = -std::numeric_limits<float>::infinity();
      sum[gi * M + m] = 0.f;
    }
  }
  const int64_t last = ctx0 + n - 1;  // keys the tile's last row attends
  const int64_t* table = a.tables + seq * a.table_stride;
  const int64_t slot_bytes = a.slot_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t start = 0; start < last; start += bs) {
    const int64_t nk = std::min(bs, last - start);
    const int64_t base = table[start / bs] * bs;
    if (start + bs < last) {
      const int64_t next = table[start / bs + 1] * bs;
      const char* kn = reinterpret_cast<const char*>(a.k + next * a.slot_stride);
      const char* vn = reinterpret_cast<const char*>(a.v + next * a.slot_stride);
      for (int64_t off = 0; off < std::min(bs, last - start - bs) * slot_bytes; off += 64) {
        __builtin_prefetch(kn + off);
        __builtin_prefetch(vn + off);
      }
    }
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t g = g0 + gi;
      for (int64_t j = 0; j < nk; ++j) {
        const T* kr = a.k + (base + j) * a.slot_stride + g * a.kv_head;
        const T* vr = a.v + (base + j) * a.slot_stride + g * a.kv_head;
        if constexpr (std::is_same<T, float>::value) {  // read in place
          krow[j] = kr;
          vrow[j] = vr;
        } else {
          float* kj = kf + j * D;
          float* vj = vf + j * D;
          for (int64_t d = 0; d < D; ++d) kj[d] = float(kr[d]);
          for (int64_t d = 0; d < D; ++d) vj[d] = float(vr[d]);
          krow[j] = kj;
          vrow[j] = vj;
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        const int64_t limit = std::min(nk, ctx0 + m / G - start);  // this query's keys in the block
        if (limit <= 0) continue;
        const int64_t qi = gi * M + m;
        const float* qm = qf + qi * D;
        float best = mx[qi];
        for (int64_t j = 0; j < limit; ++j) {
          const float* kj = krow[j];
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qm[d] * kj[d];
          s[j] = dot;
          best = std::max(best, dot);
        }
        const float corr = std::exp(mx[qi] - best);  // exp(-inf) = 0 on the first block
        float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
        for (int64_t j = 0; j < limit; ++j) {
          s[j] = exp_nonpositive(s[j] - best);
          block_sum += s[j];
        }
        float* am = acc + qi * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) am[d] *= corr;
        for (int64_t j = 0; j < limit; ++j) {
          const float p = s[j];
          const float* vj = vrow[j];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) am[d] += p * vj[d];
        }
        mx[qi] = best;
        sum[qi] = sum[qi] * corr + block_sum;
      }
    }
  }
  for (int64_t gi = 0; gi < ng; ++gi) {
    for (int64_t m = 0; m < M; ++m) {
      T* o = a.out + (row0 + m / G) * a.out_row + ((g0 + gi) * G + m % G) * a.out_head;
      const float inv = 1.f / sum[gi * M + m];
      const float* am = acc + (gi * M + m) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = T(am[d] * inv);
    }
  }
}

// One work item: a tile and its kv heads g0 .. g0 + ng - 1, and what it costs (query heads x keys read).
struct Item {
  int64_t tile, g0, ng;
  double cost;
};

template <typename T>
void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& tiles, int64_t bs, double scale) {
  const int64_t nkv = k_cache.size(1), nh = q.size(1);
  const Args<T> a{q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), out.data_ptr<T>(),
            block_tables.data_ptr<int64_t>(), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1),
            block_tables.stride(0), bs, q.size(2), nh / nkv, float(scale)};
  const int64_t* tl = tiles.data_ptr<int64_t>();
  const int64_t ntiles = tiles.size(0), threads = at::get_num_threads();
  constexpr bool vector_dtype = std::is_same<T, float>::value || std::is_same<T, c10::BFloat16>::value;
  const bool vectors = vector_dtype && loraplex_attention::decode_supported(a.D);
  // A tile's kv heads go in one work item where its queries fit the scratch and there are at least as many
  // tiles as threads (a decode's slot holds all heads side by side, read front to back once), else one kv
  // head per item (prefill tiles on the vector loop; tiles cut to kMaxQueries / G rows; a small batch on
  // many threads, which would otherwise leave threads idle).
  std::vector<Item> items;
  int64_t floats = 0;
  for (int64_t i = 0; i < ntiles; ++i) {
    const int64_t n = tl[4 * i + 1], keys = tl[4 * i + 3] + n - 1;
    const bool prefill_loop = vectors && n > 1;
    const int64_t ng = !prefill_loop && n * nh <= kMaxQueries && ntiles >= threads ? nkv : 1;
    for (int64_t g0 = 0; g0 < nkv; g0 += ng) items.push_back({i, g0, ng, double(n * a.G * ng) * double(keys)});
    if (vectors && n == 1) floats = std::max(floats, loraplex_attention::decode_scratch(nh, a.D));
    else if (prefill_loop) floats = std::max(floats, loraplex_attention::prefill_scratch(n * a.G, a.D));
    else floats = std::max(floats, kScratch);
  }
  // Largest first, each thread taking the next item when it is done with one: prefill tiles cost up to
  // hundreds of decodes, so an even split by count (at::parallel_for's) would leave a thread idle.
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, static_cast<int64_t>(items.size()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // on the heap (too large for an OpenMP thread's stack), uninitialised (every loop writes before it reads)
    std::unique_ptr<float[]> buffer(new float[floats + 16]);
    float* scratch = buffer.get() + (16 - reinterpret_cast<uintptr_t>(buffer.get()) / sizeof(float) % 16) % 16;
    for (int64_t w = next++; w < static_cast<int64_t>(items.size()); w = next++) {
      const Item& it = items[w];
      const int64_t* t = tl + it.tile * 4;
      if constexpr (vector_dtype) {
        if (vectors && t[1] == 1) {
          // the item this thread likely takes next: with one worker the next one, with more a guess (each
          // takes the next free item as it finishes one)
          loraplex_attention::Ahead ahead;
          const int64_t w2 = w + workers;
          if (w2 < static_cast<int64_t>(items.size())) {
            const Item& nx = items[w2];
            const int64_t* t2 = tl + nx.tile * 4;
            if (t2[1] == 1) ahead = {t2[2], t2[3], nx.g0, nx.ng};
          }
          loraplex_attention::decode_rows(a, t[0], t[2], t[3], it.g0, it.ng, scratch, ahead);
          continue;
        }
        if (vectors) {
          loraplex_attention::prefill_rows(a, t[0], t[1], t[2], t[3], it.g0, scratch);
          continue;
        }
      }
      attend<T>(a, t[0], t[1], t[2], t[3], it.g0, it.ng, scratch);
    }
  });
}

}  // namespace

// k_cache[slot_mapping[t]] = k[t], v_cache[...] = v[t] for each of this step's T' rows (heads of a row side
// by side in both: one copy of nKV x D elements, else one per head). Rows past the first that write a
// slot again win, as with index_copy_.
template <typename T>
void write_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots, const at::Tensor& k_cache,
                 const at::Tensor& v_cache) {
  const int64_t rows = k.size(0), nkv = k.size(1), D = k.size(2);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (const auto& [src, dst] : {std::pair{&k, &k_cache}, std::pair{&v, &v_cache}}) {
    const T* from = src->template data_ptr<T>();
    T* to = dst->template data_ptr<T>();
    const bool whole = src->stride(1) == D && dst->stride(1) == D;
    for (int64_t t = 0; t < rows; ++t) {
      const T* row = from + t * src->stride(0);
      T* slot = to + sl[t] * dst->stride(0);
      if (whole) {
        std::memcpy(slot, row, nkv * D * sizeof(T));
        continue;
      }
      for (int64_t g = 0; g < nkv; ++g) std::memcpy(slot + g * dst->stride(1), row + g * src->stride(1), D * sizeof(T));
    }
  }
}

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor tiles, int64_t block_size, double scale, const c10::optional<at::Tensor>& k,
                     const c10::optional<at::Tensor>& v, c10::optional<at::Tensor> slot_mapping) {
  // Private copies of the indices: the checks below hold for what the kernel reads, even if another
  // Python thread writes the caller's tensors once the GIL is released.
  block_tables = block_tables.clone();
  tiles = tiles.clone();
  const bool writes = k.has_value() && k->defined();
  TORCH_CHECK(writes == (v.has_value() && v->defined()) && writes == (slot_mapping.has_value() && slot_mapping->defined()),
              "paged_attention: k, v and slot_mapping go together");
  if (writes) slot_mapping = slot_mapping->clone();
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "paged_attention: unsupported dtype ", dtype);
  for (const auto* t : {&out, &q, &k_cache, &v_cache, &block_tables, &tiles})
    TORCH_CHECK(t->device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && out.scalar_type() == dtype && out.stride(2) == 1,
              "paged_attention: q and out [T, nH, D] of one dtype expected (out's head dims contiguous)");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides() &&
                  k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "paged_attention: caches [num_slots, nKV, D] of one layout in the dtype of q expected");
  const int64_t nh = q.size(1), nkv = k_cache.size(1), D = q.size(2);
  TORCH_CHECK(k_cache.size(2) == D && nkv > 0 && nh > 0 && nh % nkv == 0,
              "paged_attention: head counts or dims disagree");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && D <= kMaxHeadDim,
              "paged_attention: contiguous head dims of at most ", kMaxHeadDim, " expected");
  TORCH_CHECK(block_size > 0 && block_size <= kMaxBlock, "paged_attention: block size in [1, ", kMaxBlock, "]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "paged_attention: block_tables [N_seq, W] int64 with contiguous rows expected");
  TORCH_CHECK(tiles.scalar_type() == at::kLong && tiles.dim() == 2 && tiles.size(1) == 4 && tiles.is_contiguous(),
              "paged_attention: tiles [N_tiles, 4] int64 expected");
  // Every index the kernel will follow, checked once here (on the private copies), so it cannot read or
  // write out of bounds.
  const int64_t T_ = q.size(0), G = nh / nkv, W = block_tables.size(1), nseq = block_tables.size(0);
  const int64_t num_blocks = k_cache.size(0) / block_size;
  const int64_t* tl = tiles.data_ptr<int64_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < tiles.size(0); ++i) {
    const int64_t row0 = tl[4 * i], n = tl[4 * i + 1], seq = tl[4 * i + 2], ctx0 = tl[4 * i + 3];
    TORCH_CHECK(n >= 1 && n <= T_ && row0 >= 0 && row0 <= T_ - n && n <= kMaxQueries / G, "paged_attention: tile ",
                i, " has rows out of range (at most ", kMaxQueries, " queries, rows x heads per kv head, a tile)");
    TORCH_CHECK(seq >= 0 && seq < nseq && ctx0 >= 1 && ctx0 <= W * block_size && ctx0 + n - 1 <= W * block_size,
                "paged_attention: tile ", i, " has a request or context out of range");
    const int64_t used = (ctx0 + n - 1 + block_size - 1) / block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int64_t blk = bt[seq * block_tables.stride(0) + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_attention: tile ", i, " reads block ", blk,
                  " outside the cache");
    }
  }
  if (writes) {  // this step's K/V, written before any tile reads them
    for (const auto* t : {&*k, &*v})
      TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->sizes() == k->sizes() && t->size(1) == nkv &&
                      t->size(2) == D && t->stride(2) == 1 && t->scalar_type() == dtype,
                  "paged_attention: k and v [T', nKV, D] in the caches' dtype with contiguous head dims expected");
    TORCH_CHECK(slot_mapping->device().is_cpu() && slot_mapping->scalar_type() == at::kLong &&
                    slot_mapping->dim() == 1 && slot_mapping->numel() == k->size(0),
                "paged_attention: slot_mapping [T'] int64 expected, one slot per row of k");
    const int64_t* sl = slot_mapping->data_ptr<int64_t>();
    for (int64_t t = 0; t < slot_mapping->numel(); ++t)
      TORCH_CHECK(sl[t] >= 0 && sl[t] < k_cache.size(0), "paged_attention: row ", t, " writes slot ", sl[t],
                  " outside the cache");
  }
  pybind11::gil_scoped_release no_gil;
  if (writes) {
    if (dtype == at::kBFloat16) write_cache<c10::BFloat16>(*k, *v, *slot_mapping, k_cache, v_cache);
    else if (dtype == at::kHalf) write_cache<c10::Half>(*k, *v, *slot_mapping, k_cache, v_cache);
    else write_cache<float>(*k, *v, *slot_mapping, k_cache, v_cache);
  }
  if (dtype == at::kBFloat16) run<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, tiles, block_size, scale);
  else if (dtype == at::kHalf) run<c10::Half>(out, q, k_cache, v_cache, block_tables, tiles, block_size, scale);
  else run<float>(out, q, k_cache, v_cache, block_tables, tiles, block_size, scale);
}

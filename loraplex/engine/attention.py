"""Attention over the paged KV cache, for a step that mixes decodes and prefill chunks.

Letters: T tokens in the step, N requests in the step, W blocks per block table row, B_d decode
requests, C longest context among them (tokens), nH query heads, nKV key/value heads, G = nH / nKV,
D head dim.

Rows of a step are laid out decodes first, then each prefill chunk; requests (block table rows) in the
same order:

    rows:   [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]     num_decode_tokens = 3
    slots:  slot_mapping[t] = block_table[pos // block_size] * block_size + pos % block_size

Each new token's K/V is written to its slot first; then every query reads its request's K/V through
its block table, so a prefill chunk sees the earlier chunks of its prompt (vLLM's semantics for paged
attention: query row i of a request with c tokens computed before this step attends positions
0 .. c + i).

On the CPU every row goes to the compiled kernel (`kernels/csrc/paged_attention_cpu.cpp`) in one call,
which reads K/V in place through the block table, in fp32: no gather, no padded copy, no mask. A decode
row runs its vector loop (`paged_decode_cpu.cpp`: chunks of 16 keys with AVX-512, 8 with AVX2, the
query heads of a kv head in register blocks sharing each K/V load, the next chunk prefetched as it
goes); a tile of prefill rows the prefill loop (`paged_prefill_cpu.cpp`: flash attention over chunks
of 32 keys with AVX-512, 16 with AVX2, K transposed once per chunk for all the tile's queries).
Against `_prefill_matmul` (two bmm GEMMs and a softmax per tile, which stays for other dtypes and head
dims, and under PREFILL_KERNEL = False), the 64 prompts of the vllm preset, one layer, fp32, one thread,
2-core AMD EPYC (avx2 avx512f avx512_bf16): 64-76 ms -> 22-25 ms. Elsewhere,
or where the kernel could not be built (`kernels/cpu_ext.py` logs why), the PyTorch path gathers each
request's context and calls `scaled_dot_product_attention` with a mask; the two agree to fp32
rounding, which the tests check. The gather reads a request's position 0 for the masked positions past
its length, so whatever a stale slot holds (NaN, from a row whose adapter overflowed) never meets the
mask: sdpa adds the mask to the scores, and NaN + -inf is NaN. Within one prefill chunk the GEMMs do
multiply the masked (later) positions by a probability of 0, so a NaN in that chunk's own K/V reaches
its earlier rows too; that is the same request, which the engine ends alone for its NaN logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_ext, cpu_gemm

MAX_QUERIES_PER_TILE = 256  # n x G queries of one work item (kMaxQueries in the kernel)
# fp32 prefill chunks with at least this many scores per head (rows x context) take oneDNN's matmuls;
# smaller ones lose to the per-call overhead (0.4x at 32 fresh tokens, 1.03x at 144; docs/performance.md)
ONEDNN_MIN_SCORES = 128 * 128
# Off: every chunk's context length is a new oneDNN shape, and each primitive oneDNN keeps (up to 1024)
# holds a buffer of its M x K (`cpu_gemm.bucket_rows`), so a serving engine's memory would grow without a
# bound we set; bmm has no such cache. The path stays tested for when keys can be bucketed too.
ONEDNN_PREFILL = False
PREFILL_KERNEL = True  # prefill tiles on the kernel's prefill loop where `vector_loops` holds
ROWS_PER_TILE = 16  # prefill rows a work item takes: 16 x G queries share each block of K/V read


@dataclass
class PrefillChunk:
    """One request's prefill chunk: rows [start, start + num_tokens) of the step, block table row `seq`,
    `num_computed` tokens of the request computed before this step (0: the chunk is the whole context)."""

    start: int
    num_tokens: int
    seq: int = 0
    num_computed: int = 0


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer.

    slot_mapping: [T] int64 KV cache slot of each row's token. block_tables: [N, W] int64 blocks of each
    request (decodes first, then the prefill chunks), padded with block 0; context_lens: tokens each
    request attends to after this step (its computed tokens plus those of this step).
    """

    slot_mapping: torch.Tensor
    block_size: int = 16
    num_decode_tokens: int = 0
    block_tables: torch.Tensor | None = None
    context_lens: list[int] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    _tiles: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _decode: tuple | None = field(default=None, init=False, repr=False)

    def tiles(self, group: int) -> torch.Tensor:
        """[N_tiles, 4] int64 (row0, n, seq, ctx0) for the kernel with `group` query heads per kv head:
        a decode is one tile; a prefill chunk is cut into tiles of at most ROWS_PER_TILE rows (fewer when
        G is large). Built on first use, once per step."""
        if group not in self._tiles:
            per_tile = max(1, min(ROWS_PER_TILE, MAX_QUERIES_PER_TILE // group))
            rows = [(p.start + i, min(per_tile, p.num_tokens - i), p.seq, p.num_computed + i + 1)
                    for p in self.prefills for i in range(0, p.num_tokens, per_tile)]
            prefill = torch.tensor(rows, dtype=torch.int64).view(-1, 4)
            self._tiles[group] = torch.cat([self.decode_tiles(), prefill])
        return self._tiles[group]

    def decode_tiles(self) -> torch.Tensor:
        """[B_d, 4] int64: the kernel's tiles of the decode rows alone (one each). Built once per step."""
        if -1 not in self._tiles:
            self._tiles[-1] = torch.tensor([(i, 1, i, self.context_lens[i]) for i in range(self.num_decode_tokens)],
                                           dtype=torch.int64).view(-1, 4)
        return self._tiles[-1]

    def row_tiles(self, rows: list[int]) -> torch.Tensor:
        """[B, 4] int64: one tile (b, 1, seq, ctx) for each step row rows[b], a query block of its own
        attending its request's positions 0 .. ctx - 1 (`paged_attention_rows`). Raises IndexError for a
        row outside the step."""
        tiles = []
        for b, r in enumerate(rows):
            if 0 <= r < self.num_decode_tokens:
                tiles.append((b, 1, r, self.context_lens[r]))
                continue
            p = next((p for p in self.prefills if p.start <= r < p.start + p.num_tokens), None)
            if p is None:
                raise IndexError(f"row {r} is not in this step")
            tiles.append((b, 1, p.seq, p.num_computed + r - p.start + 1))
        return torch.tensor(tiles, dtype=torch.int64).view(-1, 4)

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For the PyTorch path: ([B_d, C] cache slot of each decode's positions, [B_d, 1, 1, C] bool mask,
        True on each request's positions 0..len-1). Built on first use, once per step."""
        if self._decode is None:
            nd = self.num_decode_tokens
            slots, valid = self.context_slots(range(nd), max(self.context_lens[:nd]))
            self._decode = (slots, valid[:, None, None, :])
        return self._decode

    def chunk_context(self, p: PrefillChunk, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V [C, nKV, D] a prefill chunk attends: its own rows `k`, `v` [L, nKV, D] when it is
        the whole context, else its request's positions 0..C-1 gathered from the caches."""
        if p.num_computed == 0:
            return k, v
        slots, _ = self.context_slots([p.seq], p.num_computed + p.num_tokens)
        return _gather(k_cache, slots)[0], _gather(v_cache, slots)[0]

    def context_slots(self, seqs, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([len(seqs), width] slot of each position of these requests, the slot of position 0 past the
        request's length; [len(seqs), width] bool, True on positions 0..len-1)."""
        seqs = list(seqs)
        bs, tables = self.block_size, self.block_tables[seqs]
        pos = torch.arange(width, device=tables.device)
        slots = tables[:, pos // bs] * bs + pos % bs
        lens = torch.tensor([self.context_lens[s] for s in seqs], device=tables.device)
        valid = pos[None, :] < lens[:, None]
        return torch.where(valid, slots, slots[:, :1]), valid


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                    attn: AttentionMetadata) -> torch.Tensor:
    """Write this step's K/V to the cache, then attend. q [T, nH, D]; k, v [T, nKV, D];
    kv_cache: (k_cache, v_cache) each [num_slots, nKV, D]. Returns [T, nH, D] in q's dtype."""
    k_cache, v_cache = kv_cache
    group = q.shape[1] // k_cache.shape[1]
    ext = cpu_ext.load() if q.device.type == "cpu" and group <= MAX_QUERIES_PER_TILE else None
    if ext is not None and vector_loops(q.dtype, q.shape[-1]) and PREFILL_KERNEL:
        # every row in one call, which writes this step's K/V first and reads q in place (rows strided
        # within the q/k/v projection's output)
        out = torch.empty(q.shape, dtype=q.dtype)
        ext.paged_attention(out, q, k_cache, v_cache, attn.block_tables, attn.tiles(group), attn.block_size,
                            q.shape[-1] ** -0.5, k, v, attn.slot_mapping)
        return out
    k_cache.index_copy_(0, attn.slot_mapping, k)
    v_cache.index_copy_(0, attn.slot_mapping, v)
    if ext is None:
        return _paged_attention_torch(q, k, v, k_cache, v_cache, attn)
    q = q.contiguous()
    out = torch.empty_like(q)
    nd = attn.num_decode_tokens
    if nd:
        ext.paged_attention(out, q, k_cache, v_cache, attn.block_tables, attn.decode_tiles(), attn.block_size,
                            q.shape[-1] ** -0.5)
    for p in attn.prefills:
        rows = slice(p.start, p.start + p.num_tokens)
        out[rows] = _prefill_matmul(q[rows], k[rows], v[rows], k_cache, v_cache, attn, p)
    return out


def rows_kernel(device: torch.device, heads: int, kv_heads: int, head_dim: int):
    """The compiled CPU module if `paged_attention_rows` runs for these shapes (a CPU step, at most
    MAX_QUERIES_PER_TILE query heads per kv head, D <= 256; the kernels built), else None."""
    if device.type != "cpu" or heads // kv_heads > MAX_QUERIES_PER_TILE or head_dim > 256:
        return None
    return cpu_ext.load()


def paged_attention_rows(q: torch.Tensor, rows: list[int], k: torch.Tensor, v: torch.Tensor,
                         kv_cache: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata) -> torch.Tensor:
    """`paged_attention` for the step rows `rows` [B] alone: every row's K/V k, v [T, nKV, D] is written
    (later layers and steps read it), but only q [B, nH, D], the queries of those rows, attend, each as a
    decode does (`row_tiles`: the kernel's decode loop where `vector_loops` holds, its general loop
    elsewhere). Returns [B, nH, D]. Only where `rows_kernel` gives the module (the caller checks first).
    The last layer of a step that samples a few rows needs no other row's output. Each row's value is its
    row of `paged_attention` to the dtype's rounding: a prefill row goes through the decode loop instead
    of its tile of the prefill loop, which sums in another order."""
    ext = rows_kernel(q.device, q.shape[1], kv_cache[0].shape[1], q.shape[-1])
    if ext is None:
        raise RuntimeError("paged_attention_rows: the compiled CPU kernel does not take this step")
    out = torch.empty(q.shape, dtype=q.dtype)
    ext.paged_attention(out, q, kv_cache[0], kv_cache[1], attn.block_tables, attn.row_tiles(rows), attn.block_size,
                        q.shape[-1] ** -0.5, k, v, attn.slot_mapping)
    return out


def vector_loops(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the compiled kernel runs its vector loops for this cache dtype and head dim (fp32 or bf16;
    D a multiple of 16 with D / 16 a power of two, up to 256), as `decode_supported` in the kernel says."""
    return dtype in (torch.float32, torch.bfloat16) and head_dim % 16 == 0 and head_dim // 16 in (1, 2, 4, 8, 16)


def _prefill_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    attn: AttentionMetadata, p: PrefillChunk) -> torch.Tensor:
    """One prefill chunk's attention as two batched GEMMs per tile of query rows: S = Q K^T / sqrt(D) over
    the request's context up to the tile's last row (scores [nKV, G x L_t, keys] in fp32), the causal
    triangle of the tile's own keys set to -inf, softmax, S V. q [L, nH, D], k, v [L, nKV, D] (this
    chunk's, already in the cache). Returns [L, nH, D].

    The path for prefill chunks the vector loops do not take (fp16, other head dims; or
    PREFILL_KERNEL off). It beats PyTorch's sdpa and the kernel's general loop (`attend`) at prefill
    shapes, because the products run in MKL's GEMMs: 512 fresh tokens of the default model, 30 layers,
    fp32, one thread, AVX-512: 380 ms with sdpa's causal flash kernel, 500 ms with `attend`'s tiles,
    225 ms here; the kernel's prefill loop is about 3x faster again (module docstring). K and V
    go to the GEMMs as strided views of [C, nKV, D] (no transposed copy), the mask covers only the tile's
    last n keys (the earlier ones are all visible to every row of the tile), and the output is written
    through a view of `out`: 300 + 212 fresh tokens in two chunks, 30 layers: 224 -> 192 ms. Tiles of
    at most 128 rows keep the scores under about 64 MiB."""
    L, nh, d = q.shape
    nkv = k_cache.shape[1]
    g = nh // nkv
    context = p.num_computed + L
    kc, vc = attn.chunk_context(p, k, v, k_cache, v_cache)  # [C, nKV, D]
    kh = kc.float().transpose(0, 1)  # [nKV, C, D], a view: rows nKV x D apart
    vh = vc.float().transpose(0, 1)
    out = torch.empty_like(q)
    per_tile = max(1, min(128, (16 << 20) // (nh * context)))
    qf = q.float()
    if (ONEDNN_PREFILL and q.dtype == torch.float32 and L * context >= ONEDNN_MIN_SCORES
            and cpu_gemm.onednn_unpacked()):
        _prefill_onednn(qf, kh, vh, out, p.num_computed, per_tile)
        return out
    for i0 in range(0, L, per_tile):
        n = min(per_tile, L - i0)
        keys = p.num_computed + i0 + n  # the tile's last row sees keys 0 .. keys-1; row r sees keys-n+r
        qt = qf[i0:i0 + n].view(n, nkv, g, d).transpose(0, 1).reshape(nkv, n * g, d)  # [nKV, n G, D]
        s = torch.bmm(qt, kh[:, :keys].transpose(1, 2)).mul_(d ** -0.5)  # [nKV, n G, keys]
        s.view(nkv, n, g, keys)[..., keys - n:].add_(_causal_bias(n, q.device)[None, :, None, :])
        o = torch.bmm(s.softmax(-1), vh[:, :keys])  # [nKV, n G, D]
        out[i0:i0 + n].view(n, nkv, g, d).transpose(0, 1).copy_(o.view(nkv, n, g, d))
    return out


def _prefill_onednn(q: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, out: torch.Tensor, num_computed: int,
                    per_tile: int) -> None:
    """`_prefill_matmul`'s tiles with each kv head's two products as oneDNN matmuls
    (`torch.ops.mkldnn._linear_pointwise`, the op of `kernels/cpu_gemm.py`), fp32: where PyTorch's MKL
    runs its AVX2 code (AMD CPUs) oneDNN's are 1.4-2x faster at these shapes (docs/performance.md). Each
    head's scores are softmaxed and multiplied by V before the next head's are made, so they stay in
    cache. Measured against the bmm path on a 2-core AMD EPYC (Zen 5), one thread, one layer: 1.03x at 144
    fresh tokens, 2x at 256 and 512, 1.3-1.5x for chunks continuing at 150-300. q [L, nH, D] fp32; kh,
    vh [nKV, C, D] (views); out [L, nH, D], written here."""
    L, nh, d = q.shape
    nkv = kh.shape[0]
    g = nh // nkv
    linear = torch.ops.mkldnn._linear_pointwise
    k = kh.contiguous()  # [nKV, C, D]: QK^T = linear(Q, K)
    vt = vh.transpose(1, 2).contiguous()  # [nKV, D, C]: P V = linear(P, V^T)
    qs = (q * d**-0.5).view(L, nkv, g, d).transpose(0, 1)  # [nKV, L, G, D], scaled once
    for i0 in range(0, L, per_tile):
        n = min(per_tile, L - i0)
        keys = num_computed + i0 + n  # the tile's last row sees keys 0 .. keys-1; row r sees keys-n+r
        bias = _causal_bias(n, q.device)[:, None, :]  # [n, 1, n]
        for h in range(nkv):
            s = linear(qs[h, i0:i0 + n].reshape(n * g, d), k[h, :keys], None, "none", [], "")  # [n G, keys]
            s.view(n, g, keys)[..., keys - n:].add_(bias)
            v = vt[h] if keys == vt.shape[2] else vt[h, :, :keys].contiguous()  # [D, keys]
            o = linear(torch.softmax(s, -1), v, None, "none", [], "")  # [n G, D]
            out[i0:i0 + n].view(n, nkv, g, d)[:, h].copy_(o.view(n, g, d))


_CAUSAL_BIAS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _causal_bias(n: int, device: torch.device) -> torch.Tensor:
    """[n, n] fp32, -inf above the diagonal (key j after row i) and 0 elsewhere, cached per size. Added to
    the scores rather than written by masked_fill_, which took 6-8x as long on the strided view of a
    tile's own keys (docs/performance.md); a NaN score at a masked position stays NaN this way, which
    the chunk's own NaN K/V would spread to its earlier rows through P V anyway (module docstring)."""
    key = (n, device)
    if key not in _CAUSAL_BIAS:
        upper = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
        _CAUSAL_BIAS[key] = torch.zeros(n, n, device=device).masked_fill_(upper, float("-inf"))
    return _CAUSAL_BIAS[key]


def _paged_attention_torch(q, k, v, k_cache, v_cache, attn: AttentionMetadata) -> torch.Tensor:
    """The same attention in PyTorch: each request's context gathered by position, then sdpa with a mask
    (a fresh prompt attends its own K/V with a causal mask)."""
    out = torch.empty_like(q)
    nd = attn.num_decode_tokens
    if nd:
        slots, mask = attn.decode_inputs()
        kd = _gather(k_cache, slots).transpose(1, 2)  # [B_d, nKV, C, D]
        vd = _gather(v_cache, slots).transpose(1, 2)
        qd = q[:nd].unsqueeze(2)  # [B_d, nH, 1, D]
        out[:nd] = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True).squeeze(2)
    for p in attn.prefills:
        rows = slice(p.start, p.start + p.num_tokens)
        qp = q[rows].transpose(0, 1)  # [nH, L, D]
        if p.num_computed == 0:
            kp, vp = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [nKV, L, D]
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
        else:
            context = p.num_computed + p.num_tokens
            kc, vc = attn.chunk_context(p, k[rows], v[rows], k_cache, v_cache)
            kp, vp = kc.transpose(0, 1), vc.transpose(0, 1)  # [nKV, C, D]
            i = torch.arange(p.num_tokens, device=q.device)[:, None]
            j = torch.arange(context, device=q.device)[None, :]
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=j <= p.num_computed + i, enable_gqa=True)
        out[rows] = o.transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [num_slots, nKV, D], slots [B, C] -> [B, C, nKV, D]."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


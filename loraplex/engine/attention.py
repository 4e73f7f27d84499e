"""Attention over the paged KV cache, for a step that mixes decodes and prefill chunks.

Letters: T tokens in the step, B_d decode requests, C longest context among them (tokens), nH query
heads, nKV key/value heads, D head dim.

Rows of a step are laid out decodes first, then each prefill chunk:

    rows:   [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]     num_decode_tokens = 3
    slots:  slot_mapping[t] = block_table[pos // block_size] * block_size + pos % block_size

Each new token's K/V is written to its slot first; then every query reads its request's K/V through
its block table, gathering whole blocks (one index per block, not per token: a block's tokens are
contiguous in the cache), so a prefill chunk sees the earlier chunks of its prompt. Positions past a
request's length (the tail of its last block, padding blocks) are masked out.

Decodes in bf16/fp16 on CPU bypass `scaled_dot_product_attention` (its CPU flash kernel is several
times slower than two matmuls at decode shapes): `_decode_attention_cpu` gathers their context per
position and kv head (`AttentionMetadata.decode_rows`), straight into the [B_d, nKV, C, D] layout the
matmuls read, and computes in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One request's prefill chunk: rows [start, start + num_tokens) of the step.

    block_table: [N_b] int64 blocks holding the chunk's context (earlier chunks and itself), or None
    when the chunk is the whole context (attend to the fresh K/V with a causal mask). mask:
    [L, N_b * block_size] bool, True where query i may attend key j (j <= num_computed + i).
    """

    start: int
    num_tokens: int
    block_table: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer.

    slot_mapping: [T] int64 KV cache slot of each row's token. decode_block_tables: [B_d, N_b] int64
    blocks of each decode request, padded with block 0; decode_mask: [B_d, 1, 1, N_b * block_size]
    bool, True on the request's positions 0..len-1.
    """

    slot_mapping: torch.Tensor
    block_size: int = 16
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    _decode_rows: torch.Tensor | None = field(default=None, init=False, repr=False)

    def decode_rows(self, num_kv_heads: int) -> torch.Tensor:
        """[B_d * nKV * C] int64: for each decode request, kv head and context position (in that order),
        its row in a cache viewed as [num_slots * nKV, D]; built on first use, once per step. Positions
        past a request's length read its position 0 instead, so whatever their slots hold (even NaN)
        never enters a product."""
        if self._decode_rows is None:
            bt, bs = self.decode_block_tables, self.block_size
            pos = torch.arange(bt.shape[1] * bs, device=bt.device)
            slots = bt.repeat_interleave(bs, 1) * bs + pos % bs  # [B_d, C]
            slots = torch.where(self.decode_mask.reshape(slots.shape), slots, slots[:, :1])
            heads = torch.arange(num_kv_heads, device=bt.device)
            self._decode_rows = (slots[:, None, :] * num_kv_heads + heads[:, None]).view(-1)  # [B_d, nKV, C]
        return self._decode_rows


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                    attn: AttentionMetadata) -> torch.Tensor:
    """Write this step's K/V to the cache, then attend. q [T, nH, D]; k, v [T, nKV, D];
    kv_cache: (k_cache, v_cache) each [num_slots, nKV, D]. Returns [T, nH, D]."""
    k_cache, v_cache = kv_cache
    k_cache.index_copy_(0, attn.slot_mapping, k)
    v_cache.index_copy_(0, attn.slot_mapping, v)
    out = torch.empty_like(q)
    nd = attn.num_decode_tokens
    if nd and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        out[:nd] = _decode_attention_cpu(q[:nd], k_cache, v_cache, attn)
    elif nd:
        kd = _gather_blocks(k_cache, attn.decode_block_tables, attn.block_size).transpose(1, 2)  # [B_d, nKV, C, D]
        vd = _gather_blocks(v_cache, attn.decode_block_tables, attn.block_size).transpose(1, 2)
        qd = q[:nd].unsqueeze(2)  # [B_d, nH, 1, D]
        out[:nd] = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=attn.decode_mask, enable_gqa=True).squeeze(2)
    for p in attn.prefills:
        rows = slice(p.start, p.start + p.num_tokens)
        qp = q[rows].transpose(0, 1)  # [nH, L, D]
        if p.block_table is None:
            kp, vp = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [nKV, L, D]
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
        else:
            kp = _gather_blocks(k_cache, p.block_table[None], attn.block_size)[0].transpose(0, 1)  # [nKV, C, D]
            vp = _gather_blocks(v_cache, p.block_table[None], attn.block_size)[0].transpose(0, 1)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, enable_gqa=True)
        out[rows] = o.transpose(0, 1)
    return out


def _decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          attn: AttentionMetadata) -> torch.Tensor:
    """GQA decode attention, all in fp32 (scores, softmax, P @ V). q [B_d, nH, D]; k_cache, v_cache
    [num_slots, nKV, D]. Returns [B_d, nH, D] in q's dtype.

    Its error is below that of sdpa's own bf16 kernel; bf16 matmuls would be a little faster but round
    the scores to bf16 before the softmax."""
    (b, nh, d), nkv = q.shape, k_cache.shape[1]
    rows = attn.decode_rows(nkv)
    k = k_cache.view(-1, d).index_select(0, rows).view(b, nkv, -1, d).float()  # [B_d, nKV, C, D]
    v = v_cache.view(-1, d).index_select(0, rows).view(b, nkv, -1, d).float()
    s = (q.view(b, nkv, nh // nkv, d).float() * d ** -0.5) @ k.transpose(2, 3)  # [B_d, nKV, nH / nKV, C]
    s = torch.where(attn.decode_mask, s, float("-inf"))
    return (s.softmax(-1) @ v).view(b, nh, d).to(q.dtype)


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache [num_blocks * block_size, nKV, D], block_tables [B, N_b] -> [B, N_b * block_size, nKV, D]."""
    num_seqs, num_blocks = block_tables.shape
    blocks = cache.view(-1, block_size, *cache.shape[1:]).index_select(0, block_tables.reshape(-1))
    return blocks.view(num_seqs, num_blocks * block_size, *cache.shape[1:])

"""Attention over the paged KV cache, for a step that mixes decodes and prefill chunks.

Letters: T tokens in the step, B_d decode requests, C longest context among them (tokens), nH query
heads, nKV key/value heads, D head dim.

Rows of a step are laid out decodes first, then each prefill chunk:

    rows:   [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]     num_decode_tokens = 3
    slots:  slot_mapping[t] = block_table[pos // block_size] * block_size + pos % block_size

Each new token's K/V is written to its slot first; then every query reads its request's K/V through
the block table (gathered slot indices), so a prefill chunk sees the earlier chunks of its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One request's prefill chunk: rows [start, start + num_tokens) of the step.

    context_slots: [C] slot of every token the chunk attends to (earlier chunks and itself), or None
    when the chunk is the whole context (attend to the fresh K/V with a causal mask). mask: [L, C]
    bool, True where query i may attend key j (j <= num_computed + i).
    """

    start: int
    num_tokens: int
    context_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer.

    slot_mapping: [T] int64 KV cache slot of each row's token. decode_slots: [B_d, C] int64 slots of
    each decode request's context, padded with slot 0; decode_mask: [B_d, 1, 1, C] bool, False on
    padding.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                    attn: AttentionMetadata) -> torch.Tensor:
    """Write this step's K/V to the cache, then attend. q [T, nH, D]; k, v [T, nKV, D];
    kv_cache: (k_cache, v_cache) each [num_slots, nKV, D]. Returns [T, nH, D]."""
    k_cache, v_cache = kv_cache
    k_cache.index_copy_(0, attn.slot_mapping, k)
    v_cache.index_copy_(0, attn.slot_mapping, v)
    out = torch.empty_like(q)
    nd = attn.num_decode_tokens
    if nd:
        kd = k_cache[attn.decode_slots].transpose(1, 2)  # [B_d, nKV, C, D]
        vd = v_cache[attn.decode_slots].transpose(1, 2)
        qd = q[:nd].unsqueeze(2)  # [B_d, nH, 1, D]
        out[:nd] = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=attn.decode_mask, enable_gqa=True).squeeze(2)
    for p in attn.prefills:
        rows = slice(p.start, p.start + p.num_tokens)
        qp = q[rows].transpose(0, 1)  # [nH, L, D]
        if p.context_slots is None:
            kp, vp = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [nKV, L, D]
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
        else:
            kp = k_cache[p.context_slots].transpose(0, 1)  # [nKV, C, D]
            vp = v_cache[p.context_slots].transpose(0, 1)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, enable_gqa=True)
        out[rows] = o.transpose(0, 1)
    return out

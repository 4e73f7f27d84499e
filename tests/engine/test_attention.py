"""Decode attention over the paged KV cache in bf16/fp16 on CPU (`_decode_attention_cpu`) against
`F.scaled_dot_product_attention` in fp32 math on each request's own K/V: GQA, ragged lengths, padding
blocks, and NaN in every cache slot no request has written."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from loraplex.engine.attention import AttentionMetadata, paged_attention

NH, NKV, D, BLOCK = 9, 3, 64, 4
LENGTHS = [1, 3, 4, 5, 11, 16, 17]  # context after this step's token: one position, block ends, ragged tails


def decode_step(lengths: list[int], dtype: torch.dtype, gen: torch.Generator):
    """A cache [num_slots, nKV, D] full of NaN but for positions 0..len-2 of each request, whose blocks
    are scattered and never block 0 (the padding block, so padding reads NaN); this step's q [B_d, nH, D]
    and k, v [B_d, nKV, D]; the metadata as ModelRunner.prepare builds it; and each request's full K, V
    [len, nKV, D] (fp32, the values the cache holds in `dtype`)."""
    width = -(-max(lengths) // BLOCK)
    num_blocks = 1 + sum(-(-n // BLOCK) for n in lengths) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # never block 0
    caches = [torch.full((num_blocks * BLOCK, NKV, D), float("nan"), dtype=dtype) for _ in range(2)]
    tables, slots, kv = [], [], []
    for n in lengths:
        blocks = [order.pop() for _ in range(-(-n // BLOCK))]
        pos_slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        k, v = (torch.randn(n, NKV, D, generator=gen).to(dtype) for _ in range(2))
        caches[0][pos_slots[:-1]], caches[1][pos_slots[:-1]] = k[:-1], v[:-1]
        tables.append(blocks + [0] * (width - len(blocks)))
        slots.append(pos_slots[-1])
        kv.append((k.float(), v.float()))
    q = torch.randn(len(lengths), NH, D, generator=gen).to(dtype)
    k_new = torch.stack([k[-1] for k, _ in kv]).to(dtype)
    v_new = torch.stack([v[-1] for _, v in kv]).to(dtype)
    c = width * BLOCK
    attn = AttentionMetadata(slot_mapping=torch.stack(slots), block_size=BLOCK, num_decode_tokens=len(lengths),
                             decode_block_tables=torch.tensor(tables),
                             decode_mask=(torch.arange(c)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :])
    return q, k_new, v_new, tuple(caches), attn, kv


def reference(q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """fp32 math attention of each request's query [nH, D] over its own K, V [len, nKV, D] -> [B_d, nH, D]."""
    out = []
    with sdpa_kernel(SDPBackend.MATH):
        for qb, (k, v) in zip(q.float(), kv, strict=True):
            o = F.scaled_dot_product_attention(qb[:, None], k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True)
            out.append(o[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_matches_fp32_sdpa_and_ignores_garbage(dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v, cache, attn, kv = decode_step(LENGTHS, dtype, gen)
    out = paged_attention(q, k, v, cache, attn)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), reference(q, kv), atol=1e-2, rtol=1e-2)
    # this step's K/V went to their slots
    assert torch.equal(cache[0][attn.slot_mapping], k) and torch.equal(cache[1][attn.slot_mapping], v)
    # a request of length 1 attends only to its own new token: the output is exactly its V, per group
    expected = v[0].float().repeat_interleave(NH // NKV, dim=0)
    torch.testing.assert_close(out[0].float(), expected, atol=0, rtol=0)


def test_decode_rows_shared_by_layers():
    """The gather index is built once per step and serves every layer, each with its own cache."""
    q, k, v, cache, attn, kv = decode_step(LENGTHS, torch.bfloat16, torch.Generator().manual_seed(1))
    # a second layer: same blocks, other values (exact scalings of the first layer's)
    q2, k2, v2 = -q, k * 2, v * -0.5
    cache2, kv2 = (cache[0] * 2, cache[1] * -0.5), [(kk * 2, vv * -0.5) for kk, vv in kv]
    out = paged_attention(q, k, v, cache, attn)
    rows = attn.decode_rows(NKV)
    out2 = paged_attention(q2, k2, v2, cache2, attn)
    assert attn.decode_rows(NKV) is rows
    torch.testing.assert_close(out.float(), reference(q, kv), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out2.float(), reference(q2, kv2), atol=1e-2, rtol=1e-2)

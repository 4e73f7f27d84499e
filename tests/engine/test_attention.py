"""Paged attention over a step that mixes decodes, fresh prompts and continued prefill chunks, by the
compiled CPU kernel and by the PyTorch path, against softmax attention in fp64 on each request's own
K/V: GQA, ragged lengths, block ends, tiles cut from long chunks, scattered blocks, and NaN in every
cache slot no request has written (padding reads block 0, which holds NaN too)."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import attention
from loraplex.engine.attention import AttentionMetadata, PrefillChunk, paged_attention
from loraplex.kernels import cpu_ext
from tests.helpers import built_cpu_ext

BLOCK = 4
# (tokens computed before the step, tokens of this step): decodes first, as ModelRunner lays them out
# (3, 17): a chunk whose last tile has one row (16 + 1 with G = 3, 8 + 8 + 1 with G = 32), which the
# kernel runs as a prefill tile of n = 1, not as a decode
STEP = [(0, 1), (2, 1), (3, 1), (4, 1), (10, 1), (15, 1), (16, 1), (0, 7), (5, 3), (8, 37), (0, 40), (3, 17)]


def make_step(step, nh: int, nkv: int, d: int, dtype: torch.dtype, gen: torch.Generator, block: int = BLOCK):
    """Caches full of NaN but for the earlier tokens of each request, in scattered blocks (never block
    0); q, k, v of this step's rows; the metadata as ModelRunner.prepare builds it; each request's full
    K, V [len, nKV, D] in fp64 (the values the cache holds in `dtype`) and its first row."""
    lengths = [c + n for c, n in step]
    width = -(-max(lengths) // block) + 1  # one padding block more than needed
    num_blocks = 1 + sum(-(-n // block) for n in lengths) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    caches = [torch.full((num_blocks * block, nkv, d), float("nan"), dtype=dtype) for _ in range(2)]
    tables, slots, qs, ks, vs, full, prefills = [], [], [], [], [], [], []
    row = 0
    for seq, (c, n) in enumerate(step):
        blocks = [order.pop() for _ in range(-(-(c + n) // block))]
        pos_slots = torch.tensor([blocks[p // block] * block + p % block for p in range(c + n)])
        k, v = (torch.randn(c + n, nkv, d, generator=gen).to(dtype) for _ in range(2))
        caches[0][pos_slots[:c]], caches[1][pos_slots[:c]] = k[:c], v[:c]
        tables.append(blocks + [0] * (width - len(blocks)))
        slots.append(pos_slots[c:])
        qs.append(torch.randn(n, nh, d, generator=gen).to(dtype))
        ks.append(k[c:])
        vs.append(v[c:])
        full.append((k.double(), v.double(), row))
        if n > 1:
            prefills.append(PrefillChunk(row, n, seq, c))
        row += n
    attn = AttentionMetadata(slot_mapping=torch.cat(slots), block_size=block,
                             num_decode_tokens=sum(n == 1 for _, n in step), block_tables=torch.tensor(tables),
                             context_lens=lengths, prefills=prefills)
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), tuple(caches), attn, full


def reference(q: torch.Tensor, step, full, nkv: int) -> torch.Tensor:
    """Causal softmax attention in fp64: row i of a request with c earlier tokens sees positions 0..c+i."""
    out = torch.empty(q.shape, dtype=torch.float64)
    g = q.shape[1] // nkv
    for (c, n), (k, v, row) in zip(step, full, strict=True):
        for i in range(n):
            qi = q[row + i].double().view(nkv, g, -1)  # [nKV, G, D]
            kk, vv = k[:c + i + 1].transpose(0, 1), v[:c + i + 1].transpose(0, 1)  # [nKV, L, D]
            s = qi @ kk.transpose(1, 2) / q.shape[-1] ** 0.5
            out[row + i] = (s.softmax(-1) @ vv).reshape(q.shape[1:])
    return out


@pytest.fixture(params=["kernel", "kernel-decodes", "torch"])
def path(request, monkeypatch):
    """kernel: every row through the compiled kernel (prefill tiles on its vector loop where the dtype and
    head dim allow); kernel-decodes: decodes there, prefill chunks through `_prefill_matmul`; torch: the
    PyTorch path."""
    if request.param.startswith("kernel"):
        built_cpu_ext()
        monkeypatch.setattr(attention, "PREFILL_KERNEL", request.param == "kernel")
    else:
        monkeypatch.setattr(attention.cpu_ext, "load", lambda: None)
    return request.param


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 3e-6), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 1, 32), (16, 2, 64), (4, 4, 128), (8, 2, 16), (2, 1, 256),
                                   (4, 2, 80)],
                         ids=["gqa", "mqa-32", "gqa-8", "mha", "d16", "d256", "d80-general-loop"])
def test_mixed_step_matches_fp64_attention(path, dtype, tol, heads):
    nh, nkv, d = heads
    gen = torch.Generator().manual_seed(0)
    q, k, v, caches, attn, full = make_step(STEP, nh, nkv, d, dtype, gen)
    out = paged_attention(q, k, v, caches, attn)
    assert out.dtype == dtype and out.shape == q.shape
    want = reference(q, STEP, full, nkv)
    assert torch.isfinite(out).all()
    err = (out.double() - want).abs().max().item()
    assert err <= tol, (path, err)
    # this step's K/V landed in their slots
    assert torch.equal(caches[0][attn.slot_mapping], k) and torch.equal(caches[1][attn.slot_mapping], v)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 1, 32), (32, 8, 32)], ids=["gqa", "mqa-32", "gqa-32-8"])
def test_kernel_alone_attends_prefill_tiles_too(heads, dtype, tol, threads):
    """Every row of the mixed step through the compiled kernel in one call, as the engine sends it:
    decodes on the decode loop (one work item takes every kv head of a decode), prefill tiles on the
    prefill loop (one kv head per item), largest items first, taken by 1 or 2 threads."""
    nh, nkv, d = heads
    q, k, v, caches, attn, full = make_step(STEP, nh, nkv, d, dtype, torch.Generator().manual_seed(2))
    caches[0][attn.slot_mapping], caches[1][attn.slot_mapping] = k, v
    out = torch.full_like(q, float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_ext.load().paged_attention(out, q, caches[0], caches[1], attn.block_tables, attn.tiles(nh // nkv),
                                       BLOCK, d ** -0.5)
    finally:
        torch.set_num_threads(before)
    assert (out.double() - reference(q, STEP, full, nkv)).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_the_steps_kv_and_reads_q_in_place_from_the_fused_projection(dtype):
    """Given k, v and slot_mapping, the kernel writes them to their slots before any tile reads them, as
    index_copy_ does, and reads q, k and v as the engine passes them: views of one [T, (nH + 2 nKV) D]
    projection output, rows strided. Same bits as the two index_copy_ calls and a contiguous q."""
    nh, nkv, d = 9, 3, 64
    q, k, v, caches, attn, full = make_step(STEP, nh, nkv, d, dtype, torch.Generator().manual_seed(4))
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # as Attention.forward's qkv_proj output
    qs, ks, vs = (t.view(-1, n, d) for t, n in zip(qkv.split([nh * d, nkv * d, nkv * d], dim=1), (nh, nkv, nkv), strict=True))
    assert qs.stride(0) == (nh + 2 * nkv) * d and not qs.is_contiguous()
    ext = cpu_ext.load()
    want_caches = [c.clone() for c in caches]
    want_caches[0].index_copy_(0, attn.slot_mapping, k)
    want_caches[1].index_copy_(0, attn.slot_mapping, v)
    want = torch.empty_like(q)
    ext.paged_attention(want, q, *want_caches, attn.block_tables, attn.tiles(nh // nkv), BLOCK, d ** -0.5)
    out = torch.empty_like(q)
    ext.paged_attention(out, qs, *caches, attn.block_tables, attn.tiles(nh // nkv), BLOCK, d ** -0.5, ks, vs,
                        attn.slot_mapping)
    assert torch.equal(caches[0].isnan(), want_caches[0].isnan())  # the unwritten slots stay NaN
    assert torch.equal(caches[0].nan_to_num(), want_caches[0].nan_to_num())
    assert torch.equal(caches[1].nan_to_num(), want_caches[1].nan_to_num())
    assert torch.equal(out, want)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert (out.double() - reference(q, STEP, full, nkv)).abs().max().item() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_rows_alone_attend_as_in_the_whole_step_and_every_rows_kv_is_written(dtype, tol):
    """`paged_attention_rows` (the last layer's sampled rows): the chosen rows' queries alone, each a
    query block of its own (decode rows, a chunk's middle and last rows), attend as they do in the whole
    step to the fp64 reference's tolerance, and every row's K/V is written as `paged_attention` writes it;
    `row_tiles` raises for a row outside the step."""
    if not built_cpu_ext():
        pytest.skip("the compiled CPU kernels are not built")
    nh, nkv, d = 9, 3, 64
    q, k, v, caches, attn, full = make_step(STEP, nh, nkv, d, dtype, torch.Generator().manual_seed(6))
    whole_caches = tuple(c.clone() for c in caches)
    whole = paged_attention(q, k, v, whole_caches, attn)
    rows = [0, 6, attn.prefills[0].start + 6, attn.prefills[2].start + 20, q.shape[0] - 1]
    assert attn.row_tiles(rows).tolist()[2:] == [[2, 1, 7, 7], [3, 1, 9, 29], [4, 1, 11, 20]]
    out = attention.paged_attention_rows(q[rows], rows, k, v, caches, attn)
    for c, w in zip(caches, whole_caches, strict=True):
        assert torch.equal(c.isnan(), w.isnan()) and torch.equal(c.nan_to_num(), w.nan_to_num())
    ref = reference(q, STEP, full, nkv)[rows]
    assert (out.double() - ref).abs().max().item() < tol
    assert (whole[rows].double() - ref).abs().max().item() < tol
    with pytest.raises(IndexError, match=f"row {q.shape[0]} is not in this step"):
        attn.row_tiles([q.shape[0]])


def test_kernel_refuses_a_cache_write_it_cannot_do():
    ext = cpu_ext.load()
    q, cache = torch.zeros(1, 9, 64), torch.zeros(8 * BLOCK, 3, 64)
    args = (torch.empty_like(q), q, cache, cache, torch.tensor([[1]]), torch.tensor([[0, 1, 0, 2]]), BLOCK, 0.125)
    k = torch.ones(1, 3, 64)
    with pytest.raises(RuntimeError, match="k, v and slot_mapping go together"):
        ext.paged_attention(*args, k, None, torch.tensor([5]))
    with pytest.raises(RuntimeError, match="row 0 writes slot 32 outside the cache"):
        ext.paged_attention(*args, k, k, torch.tensor([8 * BLOCK]))
    with pytest.raises(RuntimeError, match="one slot per row of k"):
        ext.paged_attention(*args, k, k, torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match=r"k and v \[T', nKV, D\]"):
        ext.paged_attention(*args, k, torch.ones(1, 3, 64, dtype=torch.bfloat16), torch.tensor([5]))
    assert not cache.any()  # nothing written by a refused call


def test_kernel_and_torch_path_agree_to_fp32_rounding(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    q, k, v, caches, attn, _ = make_step(STEP, 9, 3, 64, torch.float32, gen)
    assert cpu_ext.load() is not None
    fast = paged_attention(q, k, v, caches, attn)
    monkeypatch.setattr(attention.cpu_ext, "load", lambda: None)
    slow = paged_attention(q, k, v, caches, attn)
    assert (fast - slow).abs().max().item() < 1e-6


def test_long_chunks_are_cut_into_tiles():
    attn = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), block_size=BLOCK, num_decode_tokens=2,
                             context_lens=[5, 9, 40], prefills=[PrefillChunk(2, 37, 2, 3)])
    tiles = attn.tiles(3).tolist()
    assert tiles == [[0, 1, 0, 5], [1, 1, 1, 9], [2, 16, 2, 4], [18, 16, 2, 20], [34, 5, 2, 36]]
    assert attn.tiles(64).tolist()[2:4] == [[2, 4, 2, 4], [6, 4, 2, 8]]  # 4 rows x 64 heads = 256 queries


def test_kernel_refuses_indices_outside_the_cache():
    ext = cpu_ext.load()
    q = torch.zeros(1, 9, 64)
    cache = torch.zeros(8 * BLOCK, 3, 64)
    tables = torch.tensor([[9]])  # block 9 of 8
    with pytest.raises(RuntimeError, match="outside the cache"):
        ext.paged_attention(torch.empty_like(q), q, cache, cache, tables, torch.tensor([[0, 1, 0, 2]]), BLOCK, 0.125)
    with pytest.raises(RuntimeError, match="context out of range"):  # 5 keys of a 1-block table
        ext.paged_attention(torch.empty_like(q), q, cache, cache, torch.tensor([[1]]), torch.tensor([[0, 1, 0, 5]]),
                            BLOCK, 0.125)
    with pytest.raises(RuntimeError, match="rows out of range"):
        ext.paged_attention(torch.empty_like(q), q, cache, cache, torch.tensor([[1]]), torch.tensor([[0, 2, 0, 1]]),
                            BLOCK, 0.125)


@pytest.mark.parametrize("backend", ["onednn", "mkl"])
def test_long_prefill_chunks_match_fp64_attention(backend, monkeypatch):
    """Chunks with enough scores take oneDNN's matmuls (fp32, `cpu_gemm.backend` onednn), the others
    the bmm path: a fresh prompt of 130 tokens (two tiles, the second seeing the first) and a chunk of
    100 continuing at 100, beside decodes, in block-16 caches."""
    from loraplex.kernels import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "backend", backend)
    monkeypatch.setattr(attention, "ONEDNN_PREFILL", True)
    monkeypatch.setattr(attention, "PREFILL_KERNEL", False)
    calls = []
    real = attention._prefill_onednn
    monkeypatch.setattr(attention, "_prefill_onednn", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    step = [(0, 1), (20, 1), (0, 130), (100, 100), (3, 9)]
    q, k, v, caches, attn, full = make_step(step, 9, 3, 64, torch.float32, torch.Generator().manual_seed(4), block=16)
    out = paged_attention(q, k, v, caches, attn)
    err = (out.double() - reference(q, step, full, 3)).abs().max().item()
    assert err <= 2e-6, err
    assert calls == ([130, 100] if backend == "onednn" else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_decodes_with_peaked_scores_match_fp64_attention(dtype, monkeypatch):
    """Decodes over 20 chunks of 16 keys (the online softmax rescales its sums at every chunk), and
    prefill chunks of 40 rows continuing at 100 and 70 fresh rows (tiles on the prefill loop), with
    queries scaled by 30, so most exps underflow and the max moves between chunks. Scores of up to ~250
    carry fp32 rounding of ~1e-5 into the softmax, so the kernel is held to the error of the PyTorch
    path (sdpa) on the same inputs."""
    step = [(300, 1), (317, 1), (15, 1), (16, 1), (100, 40), (0, 70)]
    q, k, v, caches, attn, full = make_step(step, 9, 3, 64, dtype, torch.Generator().manual_seed(6), block=16)
    q = (q.float() * 30).to(dtype)
    want = reference(q, step, full, 3)
    err = (paged_attention(q, k, v, caches, attn).double() - want).abs().max().item()
    monkeypatch.setattr(attention.cpu_ext, "load", lambda: None)
    torch_err = (paged_attention(q, k, v, caches, attn).double() - want).abs().max().item()
    assert err <= 2 * torch_err + 1e-6, (err, torch_err)
    assert torch_err < (1e-4 if dtype == torch.float32 else 5e-2)

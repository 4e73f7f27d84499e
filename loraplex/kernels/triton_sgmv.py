"""Triton SGMV kernels: multi-adapter LoRA shrink and expand over segments of same-slot rows.

Letters: T rows, S physical adapter slots, R max rank of a slice's buffers, V = S x R / page
virtual slots of `page` rank rows each (see `LoRAWeights`), H_in / H_out in / out features, n slices
(q, k, v of a fused qkv projection; gate and up) sharing x and one launch per kernel.

Semantics, for slice i, row t with virtual slot s = slot_ids[t] >= 0 and r = ranks_i[s], where the
adapter's rows start at flat rank row p = s x page_i, that is physical slot p // R_i, row p % R_i:
    shrink:  v[i, t, :r] = x[t] @ A_i.view(S x R, H_in)[p:p+r].T
    expand:  y[t, off_i:off_i+H_out_i] += scales_i[s] * v[i, t, :r] @ B_i[p // R_i, :, p % R_i:p % R_i + r].T
With page == R a virtual slot is a physical slot: A_i[s, :r] and B_i[s, :, :r].

Grid: one program per row tile (`LoRAMeta.row_tiles`: a segment cut into runs of `block_m` rows)
times, for shrink, slice x split-K part, and for expand, a column block of one slice. Unlike a
grid over every slot padded to the max rank, only rows with an adapter get programs, and each
program loops over rank blocks up to its slot's own rank, so a rank-8 adapter next to a rank-64
one reads 8 rows of A. `block_m == 1` (decode: a segment per request) is a BGMV-like variant that
multiplies vectors on CUDA cores; taller tiles use tl.dot.

Slices travel as a table of raw device addresses (`_slice_table`), not a stacked copy of their
buffers, so a launch costs no copy of the adapters' weights.

One file (over 350 lines): the two kernels, their launchers and the slice table share one layout of
the metadata and the buffers, and are read together.

Invariants: a row without an adapter, and a row whose slot has rank 0 in a slice, is never written;
every load is masked to the adapter's own r rank rows, so NaN in rows beyond its rank, in rows no
adapter owns, or in a neighbouring adapter's pages of the same physical slot cannot leak.

Longer than our usual file (about 370 lines) on purpose: the two kernels, their launchers and the
argument checks that keep the raw addresses safe are one unit (STYLE.md's three parts of a kernel),
read and changed together.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.kernels.metadata import LoRAMeta
from loraplex.kernels.weights import LoRAWeights

DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
MIN_DOT = 16  # tl.dot needs every tile side >= 16


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of one launch (all powers of two).

    block_m: rows per program (1: one row per program, no tl.dot). block_k: H_in columns per shrink
    step. split_k: shrink programs sharing one row tile's H_in (they add fp32 partials atomically).
    block_n: H_out columns per expand program. block_r: rank columns per step of the rank loop.
    """

    block_m: int
    block_k: int
    split_k: int
    block_n: int
    block_r: int
    num_warps: int


# The one tile table, keyed by the step's longest segment: the first row whose bound is >= it wins.
# Decode (a row per segment) is bound by reading each adapter's weights once; split-K and wide
# column blocks give it enough programs. Untuned starting points: bench/lora_kernels.py measures them.
TILE_TABLE: tuple[tuple[int, TileConfig], ...] = (
    (1, TileConfig(block_m=1, block_k=512, split_k=4, block_n=256, block_r=16, num_warps=4)),
    (16, TileConfig(block_m=16, block_k=128, split_k=4, block_n=128, block_r=16, num_warps=4)),
    (128, TileConfig(block_m=32, block_k=64, split_k=2, block_n=128, block_r=32, num_warps=4)),
    (sys.maxsize, TileConfig(block_m=64, block_k=64, split_k=1, block_n=128, block_r=64, num_warps=8)),
)


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    # The interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584), so it gets
    # fp32 operands: the same products a bf16 MMA forms, accumulated in fp32.
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _sgmv_shrink_kernel(x_ptr, v_ptr, row_order_ptr, tiles_ptr, a_ptrs, rank_ptrs, pages,
                        h_in, stride_xt, stride_vs, stride_vt,
                        W_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr,
                        PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    sl = tl.program_id(1) // SPLIT_K
    k_first = (tl.program_id(1) % SPLIT_K) * BLOCK_K
    slot = tl.load(tiles_ptr + tile * 3)
    first = tl.load(tiles_ptr + tile * 3 + 1)
    end = tl.load(tiles_ptr + tile * 3 + 2)
    rank = tl.load(tl.load(rank_ptrs + sl).to(tl.pointer_type(tl.int32)) + slot)
    # The adapter's rank rows start at flat row slot x page of A viewed as [S x R, H_in].
    a_ptr = tl.load(a_ptrs + sl).to(tl.pointer_type(W_DTYPE)) + slot * tl.load(pages + sl) * h_in
    v_ptr += sl * stride_vs
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    if BLOCK_M == 1:
        row = tl.load(row_order_ptr + first)
        for r0 in range(0, rank, BLOCK_R):
            r = r0 + offs_r
            acc = tl.zeros((BLOCK_R,), tl.float32)
            for k0 in range(k_first, h_in, SPLIT_K * BLOCK_K):
                k = k0 + offs_k
                xk = tl.load(x_ptr + row * stride_xt + k, mask=k < h_in, other=0.0).to(tl.float32)
                a = tl.load(a_ptr + r[:, None] * h_in + k[None, :],
                            mask=(r[:, None] < rank) & (k[None, :] < h_in), other=0.0)  # [BLOCK_R, BLOCK_K]
                acc += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
            if SPLIT_K == 1:
                tl.store(v_ptr + row * stride_vt + r, acc, mask=r < rank)
            else:
                tl.atomic_add(v_ptr + row * stride_vt + r, acc, mask=r < rank)
    else:
        pos = first + tl.arange(0, BLOCK_M)
        row_mask = pos < end
        rows = tl.load(row_order_ptr + pos, mask=row_mask, other=0)
        for r0 in range(0, rank, BLOCK_R):
            r = r0 + offs_r
            acc = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
            for k0 in range(k_first, h_in, SPLIT_K * BLOCK_K):
                k = k0 + offs_k
                xt = tl.load(x_ptr + rows[:, None] * stride_xt + k[None, :],
                             mask=row_mask[:, None] & (k[None, :] < h_in), other=0.0)  # [BLOCK_M, BLOCK_K]
                at = tl.load(a_ptr + r[None, :] * h_in + k[:, None],
                             mask=(r[None, :] < rank) & (k[:, None] < h_in), other=0.0)  # [BLOCK_K, BLOCK_R]
                acc = _dot(xt, at, acc, DOT_F32, PRECISION)
            v_tile = v_ptr + rows[:, None] * stride_vt + r[None, :]
            if SPLIT_K == 1:
                tl.store(v_tile, acc, mask=row_mask[:, None] & (r[None, :] < rank))
            else:
                tl.atomic_add(v_tile, acc, mask=row_mask[:, None] & (r[None, :] < rank))


@triton.jit
def _sgmv_expand_kernel(y_ptr, v_ptr, row_order_ptr, tiles_ptr, col_blocks_ptr, b_ptrs, rank_ptrs,
                        scale_ptrs, r_maxs, pages, h_outs, y_offs, stride_yt, stride_vs, stride_vt,
                        W_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    sl = tl.load(col_blocks_ptr + tl.program_id(1) * 2)
    n = tl.load(col_blocks_ptr + tl.program_id(1) * 2 + 1) + tl.arange(0, BLOCK_N)
    slot = tl.load(tiles_ptr + tile * 3)
    first = tl.load(tiles_ptr + tile * 3 + 1)
    end = tl.load(tiles_ptr + tile * 3 + 2)
    rank = tl.load(tl.load(rank_ptrs + sl).to(tl.pointer_type(tl.int32)) + slot)
    if rank > 0:  # a slice this adapter does not touch keeps y as it is, -0.0 included
        scale = tl.load(tl.load(scale_ptrs + sl).to(tl.pointer_type(tl.float32)) + slot)
        r_max = tl.load(r_maxs + sl)
        h_out = tl.load(h_outs + sl)
        # Physical slot p // R, rank columns from p % R, for the adapter's first flat rank row p.
        p = slot * tl.load(pages + sl)
        b_ptr = tl.load(b_ptrs + sl).to(tl.pointer_type(W_DTYPE)) + (p // r_max) * h_out * r_max + p % r_max
        y_ptr += tl.load(y_offs + sl)
        v_ptr += sl * stride_vs
        n_mask = n < h_out
        offs_r = tl.arange(0, BLOCK_R)
        if BLOCK_M == 1:
            row = tl.load(row_order_ptr + first)
            acc = tl.zeros((BLOCK_N,), tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                r = r0 + offs_r
                vr = tl.load(v_ptr + row * stride_vt + r, mask=r < rank, other=0.0)  # [BLOCK_R] fp32
                b = tl.load(b_ptr + n[:, None] * r_max + r[None, :],
                            mask=n_mask[:, None] & (r[None, :] < rank), other=0.0)  # [BLOCK_N, BLOCK_R]
                acc += tl.sum(b.to(tl.float32) * vr[None, :], axis=1)
            y_row = y_ptr + row * stride_yt + n
            y = tl.load(y_row, mask=n_mask).to(tl.float32)
            tl.store(y_row, (y + scale * acc).to(y_ptr.dtype.element_ty), mask=n_mask)
        else:
            pos = first + tl.arange(0, BLOCK_M)
            row_mask = pos < end
            rows = tl.load(row_order_ptr + pos, mask=row_mask, other=0)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                r = r0 + offs_r
                vt = tl.load(v_ptr + rows[:, None] * stride_vt + r[None, :],
                             mask=row_mask[:, None] & (r[None, :] < rank), other=0.0)  # [BLOCK_M, BLOCK_R]
                bt = tl.load(b_ptr + n[None, :] * r_max + r[:, None],
                             mask=(r[:, None] < rank) & n_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
                # v goes to the weights' dtype for the MMA, as in Punica; fp32 v would need an fp32 MMA.
                acc = _dot(vt.to(W_DTYPE), bt, acc, DOT_F32, PRECISION)
            y_tile = y_ptr + rows[:, None] * stride_yt + n[None, :]
            mask = row_mask[:, None] & n_mask[None, :]
            y = tl.load(y_tile, mask=mask).to(tl.float32)
            tl.store(y_tile, (y + scale * acc).to(y_ptr.dtype.element_ty), mask=mask)


INTERPRETED = type(_sgmv_shrink_kernel).__name__ == "InterpretedFunction"
_slice_cache: dict[tuple, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}
_SLICE_CACHE_SIZE = 256


def pick_tiles(meta: LoRAMeta) -> TileConfig:
    """The TILE_TABLE row for this step's longest segment."""
    return next(cfg for bound, cfg in TILE_TABLE if meta.max_seg_len <= bound)


def _slice_table(slices: Sequence[LoRAWeights], offsets: Sequence[int], device: torch.device):
    """int64 [8, n] rows: A, B, ranks, scales addresses, R, H_out, y offset, page per slice; and a dict
    of column-block tables, filled by `_col_blocks`. Cached: the slot buffers live as long as the model."""
    key = (tuple((w.A.data_ptr(), w.B.data_ptr(), w.ranks.data_ptr(), w.scales.data_ptr(), *w.B.shape, w.page)
                 for w in slices), tuple(offsets), device)
    if key not in _slice_cache:
        if len(_slice_cache) >= _SLICE_CACHE_SIZE:
            _slice_cache.clear()
        rows = [[w.A.data_ptr(), w.B.data_ptr(), w.ranks.data_ptr(), w.scales.data_ptr(), w.A.shape[1],
                 w.B.shape[1], off, w.page] for w, off in zip(slices, offsets, strict=True)]
        _slice_cache[key] = (torch.tensor(rows, dtype=torch.int64, device=device).T.contiguous(), {})
    return _slice_cache[key]


def _col_blocks(slices: Sequence[LoRAWeights], blocks: dict[int, torch.Tensor], block_n: int,
                device: torch.device) -> torch.Tensor:
    """int32 [num_blocks, 2] (slice, first column): every slice's H_out cut into block_n columns."""
    if block_n not in blocks:
        cols = [(i, n0) for i, w in enumerate(slices) for n0 in range(0, w.B.shape[1], block_n)]
        blocks[block_n] = torch.tensor(cols, dtype=torch.int32, device=device).reshape(-1, 2)
    return blocks[block_n]


def _check_rows(name: str, t: torch.Tensor, meta: LoRAMeta) -> None:
    """ValueError unless t is a [T, H] matrix of the step's rows, on a device these kernels run on."""
    if t.dim() != 2 or t.stride(1) != 1 or t.dtype not in DTYPES:
        raise ValueError(f"{name} must be [T, H] fp32/fp16/bf16 with contiguous rows, got {t.dtype} "
                         f"shape {tuple(t.shape)} stride {t.stride()}")
    if t.shape[0] != meta.num_tokens:
        raise ValueError(f"{name} has {t.shape[0]} rows but the metadata {meta.num_tokens}")
    if INTERPRETED != (t.device.type == "cpu"):
        raise ValueError(f"Triton LoRA kernels got {t.device.type} tensors but the Triton interpreter is "
                         f"{'on' if INTERPRETED else 'off'}: use CUDA tensors, or CPU tensors with "
                         "TRITON_INTERPRET=1 set before loraplex.kernels.triton_sgmv is imported")
    if meta.row_order.device != t.device:
        raise ValueError(f"metadata on {meta.row_order.device} but {name} on {t.device}")


def _check_slices(slices: Sequence[LoRAWeights], meta: LoRAMeta, device: torch.device,
                  dtype: torch.dtype, h_in: int | None) -> None:
    """ValueError unless every slice's buffers fit x's width and dtype, the device, and the metadata."""
    if not slices:
        raise ValueError("need at least one LoRA slice")
    for i, w in enumerate(slices):
        if w.A.dim() != 3 or w.B.dim() != 3 or (h_in is not None and w.A.shape[2] != h_in) \
                or (w.B.shape[0], w.B.shape[2]) != tuple(w.A.shape[:2]):
            raise ValueError(f"slice {i}: A{tuple(w.A.shape)} B{tuple(w.B.shape)} do not fit H_in={h_in} "
                             "(want A [S, R, H_in], B [S, H_out, R])")
        if w.A.dtype != dtype or w.B.dtype != dtype:
            raise ValueError(f"slice {i}: weights {w.A.dtype}/{w.B.dtype} but x {dtype}")
        if not (w.A.is_contiguous() and w.B.is_contiguous()):
            raise ValueError(f"slice {i}: A and B must be contiguous")
        max_rank = w.A.shape[1]
        if not isinstance(w.page, int) or w.page < 1 or max_rank % w.page:
            raise ValueError(f"slice {i}: page {w.page} must be a positive divisor of the max rank {max_rank}")
        num_virtual = w.num_virtual_slots
        if w.ranks.dtype != torch.int32 or w.scales.dtype != torch.float32 or w.ranks.shape != (num_virtual,) \
                or w.scales.shape != (num_virtual,) or not (w.ranks.is_contiguous() and w.scales.is_contiguous()):
            raise ValueError(f"slice {i}: ranks must be contiguous int32 [V] and scales fp32 [V], "
                             f"V={num_virtual} virtual slots of page {w.page}")
        if any(t.device != device for t in (w.A, w.B, w.ranks, w.scales)):
            raise ValueError(f"slice {i}: buffers not all on {device}")
        if max(meta.seg_slots_list, default=-1) >= num_virtual:
            raise ValueError(f"slice {i}: metadata uses virtual slot {max(meta.seg_slots_list)} of {num_virtual}")
        if len(w.ranks_list) == num_virtual:
            for s in meta.seg_slots_list:
                phys, row = w.locate(s)
                if row + w.ranks_list[s] > max_rank:
                    raise ValueError(f"slice {i}: rank {w.ranks_list[s]} of virtual slot {s} runs past physical "
                                     f"slot {phys} (starts at rank row {row} of {max_rank})")


def _check_offsets(y: torch.Tensor, slices: Sequence[LoRAWeights], offsets: Sequence[int]) -> None:
    if len(offsets) != len(slices) or any(off < 0 or off + w.B.shape[1] > y.shape[1]
                                         for w, off in zip(slices, offsets, strict=True)):
        raise ValueError(f"offsets {list(offsets)} do not place slices of widths "
                         f"{[w.B.shape[1] for w in slices]} inside y of width {y.shape[1]}")


def _dot_args(dtype: torch.dtype) -> dict:
    # fp32 inputs keep fp32 products (the default tf32 would round them to 10 mantissa bits).
    return {"W_DTYPE": DTYPES[dtype], "DOT_F32": INTERPRETED, "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def _block_r(slices: Sequence[LoRAWeights], tiles: TileConfig) -> int:
    return max(MIN_DOT, min(tiles.block_r, triton.next_power_of_2(max(w.A.shape[1] for w in slices))))


def _launch_shrink(x, slices, meta, tiles: TileConfig) -> torch.Tensor:
    h_in = x.shape[1]
    block_k = max(MIN_DOT, min(tiles.block_k, triton.next_power_of_2(h_in)))
    split_k = min(tiles.split_k, triton.cdiv(h_in, block_k))
    alloc = torch.zeros if split_k > 1 else torch.empty  # split-K programs add into v
    v = alloc(len(slices), x.shape[0], max(w.A.shape[1] for w in slices), dtype=torch.float32,
              device=x.device)  # [n, T, R]
    table, _ = _slice_table(slices, [0] * len(slices), x.device)
    row_tiles = meta.row_tiles(tiles.block_m)
    grid = (row_tiles.shape[0], len(slices) * split_k)
    _sgmv_shrink_kernel[grid](
        x, v, meta.row_order, row_tiles, table[0], table[2], table[7], h_in, x.stride(0), v.stride(0),
        v.stride(1), BLOCK_M=tiles.block_m, BLOCK_K=block_k, BLOCK_R=_block_r(slices, tiles),
        SPLIT_K=split_k, num_warps=tiles.num_warps, **_dot_args(x.dtype))
    return v


def _launch_expand(y, v, slices, meta, offsets, tiles: TileConfig) -> torch.Tensor:
    table, blocks = _slice_table(slices, offsets, y.device)
    block_n = max(MIN_DOT, min(tiles.block_n, triton.next_power_of_2(max(w.B.shape[1] for w in slices))))
    col_blocks = _col_blocks(slices, blocks, block_n, y.device)
    row_tiles = meta.row_tiles(tiles.block_m)
    grid = (row_tiles.shape[0], col_blocks.shape[0])
    _sgmv_expand_kernel[grid](
        y, v, meta.row_order, row_tiles, col_blocks, table[1], table[2], table[3], table[4], table[7],
        table[5], table[6], y.stride(0), v.stride(0), v.stride(1), BLOCK_M=tiles.block_m, BLOCK_N=block_n,
        BLOCK_R=_block_r(slices, tiles), num_warps=tiles.num_warps, **_dot_args(slices[0].B.dtype))
    return y


def sgmv_shrink(x: torch.Tensor, slices: Sequence[LoRAWeights], meta: LoRAMeta,
                tiles: TileConfig | None = None) -> torch.Tensor:
    """Semantics: v[i, t, :r] = x[t] @ A_i[s, :r].T for s = slot[t] >= 0 a virtual slot, r = ranks_i[s]
    (A_i[s] is the adapter's rows, `LoRAWeights.a_rows`: flat rows s x page_i .. + r of A_i).

    x: [T, H_in]; slices: n LoRAWeights with A [S, R_i, H_in], ranks and scales [V_i]; meta: the step's segments; tiles:
    override of the TILE_TABLE choice (tests, tuning). Returns v: [n, T, max R_i] fp32, written only
    at rows with an adapter and columns below their rank. ValueError on a mismatch (including a
    virtual slot id >= V_i, or an adapter whose rank runs past its physical slot).
    """
    _check_rows("x", x, meta)
    _check_slices(slices, meta, x.device, x.dtype, x.shape[1])
    return _launch_shrink(x, slices, meta, tiles or pick_tiles(meta))


def sgmv_expand(y: torch.Tensor, v: torch.Tensor, slices: Sequence[LoRAWeights], meta: LoRAMeta,
                offsets: Sequence[int], tiles: TileConfig | None = None) -> torch.Tensor:
    """Semantics: y[t, off_i:off_i+H_out_i] += scales_i[s] * v[i, t, :r] @ B_i[s, :, :r].T, s = slot[t]
    a virtual slot (B_i[s] is the adapter's columns, `LoRAWeights.b_cols`).

    y: [T, H_total] updated in place (fp32, fp16 or bf16); v: [n, T, >= max R_i] fp32 from
    `sgmv_shrink`; slices: n LoRAWeights with B [S, H_out_i, R_i]; offsets: n column offsets into y.
    Returns y. ValueError on a mismatch.
    """
    _check_rows("y", y, meta)
    _check_slices(slices, meta, y.device, slices[0].A.dtype if slices else y.dtype, None)
    _check_offsets(y, slices, offsets)
    if v.dtype != torch.float32 or not v.is_contiguous() or v.device != y.device or v.dim() != 3 \
            or tuple(v.shape[:2]) != (len(slices), y.shape[0]) or v.shape[2] < max(w.B.shape[2] for w in slices):
        raise ValueError(f"v must be contiguous fp32 [n={len(slices)}, T={y.shape[0]}, R] on {y.device}, got "
                         f"{v.dtype} {tuple(v.shape)} on {v.device}")
    return _launch_expand(y, v, slices, meta, offsets, tiles or pick_tiles(meta))


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, slices: Sequence[LoRAWeights], meta: LoRAMeta,
                    offsets: Sequence[int], tiles: TileConfig | None = None) -> torch.Tensor:
    """Triton `add_lora`: one shrink and one expand launch for all slices (semantics in lora_ops).

    y: [T, H_total]; x: [T, H_in]; slices: n LoRAWeights; offsets: n column offsets into y; tiles:
    override of the TILE_TABLE choice. Returns y. Checks once, then launches both kernels.
    """
    if not meta.has_lora:
        return y
    _check_rows("x", x, meta)
    _check_rows("y", y, meta)
    _check_slices(slices, meta, x.device, x.dtype, x.shape[1])
    _check_offsets(y, slices, offsets)
    tiles = tiles or pick_tiles(meta)
    v = _launch_shrink(x, slices, meta, tiles)  # [n, T, R]
    return _launch_expand(y, v, slices, meta, offsets, tiles)

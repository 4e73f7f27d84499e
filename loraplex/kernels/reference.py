"""PyTorch reference of the multi-adapter LoRA ops; also the CPU path of the engine.

Letters: T rows, S adapter slots, R max rank, H_in / H_out the projection's in / out features,
N sum over active slots of their rank (the packed path's inner size).

Semantics (Punica, arXiv:2310.18547), for row t with slot s = slot_ids[t] >= 0 and r = ranks[s]:
    shrink:  v[t, :r] = x[t] @ A[s, :r].T
    expand:  y[t, off:off+H_out] += scales[s] * v[t, :r] @ B[s, :, :r].T
Rows with slot -1 are never written, so they keep exactly the base model's output.
"""

from __future__ import annotations

import torch

from loraplex.kernels.metadata import LoRAMeta

# One block-diagonal expand for adjacent slices saves matmul calls but multiplies k x the FLOPs; on a
# 2-core CPU it pays while N (columns per slice) is small.
BLOCK_DIAGONAL_MAX_COLUMNS = 32


def lora_shrink_ref(x: torch.Tensor, A: torch.Tensor, ranks: list[int], meta: LoRAMeta,
                    v: torch.Tensor) -> torch.Tensor:
    """v[rows of slot s, :r_s] = x[rows] @ A[s, :r_s].T, segment by segment; fp32 accumulation.

    x: [T, H_in]; A: [S, R, H_in]; ranks: host list [S]; v: [T, R] output (fp32 or x.dtype). Only
    rows with an adapter and columns below their slot's rank are written. Returns v.
    """
    for slot, start, n in zip(meta.seg_slots_list, meta.seg_starts_list, meta.seg_lens_list, strict=True):
        r = ranks[slot]
        if r == 0:
            continue
        rows = meta.row_order[start:start + n]
        xs = x.index_select(0, rows).float()  # [n, H_in]
        v[rows, :r] = (xs @ A[slot, :r].float().T).to(v.dtype)  # [n, r]
    return v


def lora_expand_ref(y: torch.Tensor, v: torch.Tensor, B: torch.Tensor, ranks: list[int],
                    scales: list[float], meta: LoRAMeta, offset: int = 0) -> torch.Tensor:
    """y[rows of slot s, offset:offset+H_out] += scales[s] * v[rows, :r_s] @ B[s, :, :r_s].T.

    y: [T, H_total] updated in place; v: [T, R]; B: [S, H_out, R]; ranks, scales: host lists [S].
    Accumulates in fp32, adds once in y.dtype. Returns y.
    """
    h_out = B.shape[1]
    for slot, start, n in zip(meta.seg_slots_list, meta.seg_starts_list, meta.seg_lens_list, strict=True):
        r = ranks[slot]
        if r == 0:
            continue
        rows = meta.row_order[start:start + n]
        delta = (v.index_select(0, rows)[:, :r].float() @ B[slot, :, :r].float().T) * scales[slot]  # [n, H_out]
        y[rows, offset:offset + h_out] += delta.to(y.dtype)
    return y


def add_lora_segmented(y: torch.Tensor, x: torch.Tensor, slices, meta: LoRAMeta,
                       offsets: list[int]) -> torch.Tensor:
    """Reference `add_lora`: shrink then expand for each slice, one segment at a time (fp32 maths)."""
    for w, off in zip(slices, offsets, strict=True):
        v = torch.zeros(x.shape[0], w.A.shape[1], dtype=torch.float32, device=x.device)  # [T, R]
        lora_shrink_ref(x, w.A, w.ranks_list, meta, v)
        lora_expand_ref(y, v, w.B, w.ranks_list, w.scales_list, meta, off)
    return y


def _packed_columns(meta: LoRAMeta, device: torch.device):
    """Columns of the packed path: for each active slot, ranks 0..slot_ranks[s]-1 (cached on meta)."""
    if meta._packed is None:
        s_idx: list[int] = []
        r_idx: list[int] = []
        for slot in meta.seg_slots_list:
            r = meta.slot_ranks[slot]
            s_idx += [slot] * r
            r_idx += list(range(r))
        s_t = torch.tensor(s_idx, dtype=torch.int64, device=device)  # [N]
        # rows: [T_a] rows with an adapter, or None when every row has one (then in their own order).
        rows = meta.row_order.to(device) if meta.row_order.numel() < meta.num_tokens else None
        slot_ids = meta.slot_ids.to(device=device, dtype=torch.int64)
        # mask[i, n]: column n belongs to the slot of row i (of rows[i] when rows is given).
        mask = (slot_ids if rows is None else slot_ids[rows])[:, None] == s_t[None, :]  # [T_a, N]
        meta._packed = {"s": s_t, "r": torch.tensor(r_idx, dtype=torch.int64, device=device), "mask": mask,
                        "rows": rows, "all_same": len(meta.seg_slots_list) == 1}
    return meta._packed


def add_lora_packed(y: torch.Tensor, x: torch.Tensor, slices, meta: LoRAMeta,
                    offsets: list[int]) -> torch.Tensor:
    """CPU fast path: every slice's active A rows in one shrink matmul, masked per row, and one expand
    matmul per slice (one for all slices when their outputs are adjacent in y).

    Two matmuls per projection however many adapters are in the step, at the price of computing every
    row against every active adapter's rank (T x N x (H_in + H_out) FLOPs); cheaper than one small
    matmul pair per segment on a CPU when T is small. The maths stays in x.dtype (bf16 on a bf16
    engine, like PEFT on a bf16 model) with the scaling folded into A. Needs `meta.slot_ranks` and slot
    buffers whose rank padding is zero (the engine's are). Masking is by assignment (`torch.where`) so
    no value of another adapter, NaN included, reaches a row; only rows with an adapter are read and
    written, so the others keep their bits (y + 0.0 would turn -0.0 into 0.0).
    """
    cols = _packed_columns(meta, x.device)
    s_idx, r_idx, mask, rows = cols["s"], cols["r"], cols["mask"], cols["rows"]
    xs = x if rows is None else x.index_select(0, rows)  # [T_a, H_in]; every row when rows is None
    a, bs = _packed_weights(slices, meta, s_idx, r_idx)
    v = xs @ a.T  # [T_a, k N], k = len(slices)
    if not cols["all_same"]:
        key = ("mask", len(slices))
        if key not in cols:
            cols[key] = mask.repeat(1, len(slices))  # [T_a, k N]
        v = torch.where(cols[key], v, torch.zeros((), dtype=v.dtype))
    adjacent = all(o + b.shape[1] == nxt for o, b, nxt in zip(offsets, bs, offsets[1:], strict=False))
    if len(slices) > 1 and adjacent and a.shape[0] // len(slices) <= BLOCK_DIAGONAL_MAX_COLUMNS:
        bs = [_block_diagonal(bs, slices)]
        offsets = offsets[:1]
    n = v.shape[1] // len(bs)
    for i, (b, off) in enumerate(zip(bs, offsets, strict=True)):
        delta = (v[:, i * n:(i + 1) * n] @ b).to(y.dtype)  # [T_a, H_out]
        if rows is None:
            y[:, off:off + b.shape[1]] += delta
        else:
            y[:, off:off + b.shape[1]].index_add_(0, rows, delta)
    return y


def _packed_weights(slices, meta: LoRAMeta, s_idx: torch.Tensor, r_idx: torch.Tensor):
    """The active slots' A rows of every slice, scaled and stacked ([k N, H_in]), and each slice's B
    columns ([N, H_out] each). Cached on the first slice: they change only when the active slots or
    their contents do, so a steady batch reuses them step after step."""
    key = (tuple(meta.seg_slots_list), tuple(meta.slot_ranks[s] for s in meta.seg_slots_list),
           tuple((id(w), w.version) for w in slices))
    w0 = slices[0]
    if w0.packed_cache is None or w0.packed_cache[0] != key:
        a = torch.cat([w.A[s_idx, r_idx] * w.scales[s_idx].to(w.A.dtype)[:, None] for w in slices])
        bs = [w.B[s_idx, :, r_idx].contiguous() for w in slices]
        w0.packed_cache = (key, a.contiguous(), bs, {})
    return w0.packed_cache[1], w0.packed_cache[2]


def _block_diagonal(bs: list[torch.Tensor], slices) -> torch.Tensor:
    """[k N, sum H_out]: slice i's B in rows i*N.. and its own output columns, zeros elsewhere."""
    extra = slices[0].packed_cache[3]
    if "bd" not in extra:
        n, width = bs[0].shape[0], sum(b.shape[1] for b in bs)
        bd = bs[0].new_zeros(n * len(bs), width)
        col = 0
        for i, b in enumerate(bs):
            bd[i * n:(i + 1) * n, col:col + b.shape[1]] = b
            col += b.shape[1]
        extra["bd"] = bd
    return extra["bd"]


def add_lora_gathered(y: torch.Tensor, x: torch.Tensor, slices, meta: LoRAMeta,
                      offsets: list[int]) -> torch.Tensor:
    """CPU path for many distinct adapters (BGMV's shape, Punica): each row's own A and B gathered
    into per-row stacks, then two batched matmuls per slice.

    FLOPs are the minimum (T_a x R x (H_in + H_out)); the price is copying T_a x R x (H_in + H_out)
    weights per slice and step, cheaper than one small matmul pair per segment once most segments
    hold a row or two (decode over many adapters), and cheaper than the packed path once N is large.
    R is the largest rank in the step; the zero padding of smaller ranks adds nothing.
    """
    rows = meta.row_order  # [T_a] rows with an adapter, grouped by slot
    sid = meta.slot_ids.to(torch.int64).index_select(0, rows)  # [T_a]
    r = max(meta.slot_ranks[s] for s in meta.seg_slots_list) if meta.slot_ranks else slices[0].A.shape[1]
    xs = x.index_select(0, rows)[:, None, :]  # [T_a, 1, H_in]
    for w, off in zip(slices, offsets, strict=True):
        a = w.A[:, :r].index_select(0, sid)  # [T_a, r, H_in]
        v = torch.bmm(xs, a.transpose(1, 2))  # [T_a, 1, r]
        v = v * w.scales.to(v.dtype).index_select(0, sid)[:, None, None]
        b = w.B[:, :, :r].index_select(0, sid)  # [T_a, H_out, r]
        delta = torch.bmm(v, b.transpose(1, 2))[:, 0].to(y.dtype)  # [T_a, H_out]
        y[:, off:off + b.shape[1]].index_add_(0, rows, delta)
    return y

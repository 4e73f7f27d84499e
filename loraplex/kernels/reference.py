"""The fp32 reference of the multi-adapter LoRA ops: one matmul pair per segment, the truth the other
paths are tested against (and the dispatch's fallback where no faster path applies).

Letters: T rows, R max rank, H_in / H_out the projection's in / out features. Slot ids are virtual slots
(`LoRAWeights`).

Semantics (Punica, arXiv:2310.18547), for row t with virtual slot s = slot_ids[t] >= 0, r = ranks[s],
A_s = w.a_rows(s, r) [r, H_in] and B_s = w.b_cols(s, r) [H_out, r]:
    shrink:  v[t, :r] = x[t] @ A_s.T
    expand:  y[t, off:off+H_out] += scales[s] * v[t, :r] @ B_s.T
Rows with slot -1 are never written, so they keep exactly the base model's output.
"""

from __future__ import annotations

import torch

from loraplex.kernels.metadata import LoRAMeta


def lora_shrink_ref(x: torch.Tensor, w, meta: LoRAMeta, v: torch.Tensor) -> torch.Tensor:
    """v[rows of slot s, :r_s] = x[rows] @ A_s[:r_s].T, segment by segment; fp32 accumulation.

    x: [T, H_in]; w: the slice's LoRAWeights (A_s = `w.a_rows(s, r_s)`, r_s = `w.ranks_list[s]`);
    v: [T, R] output (fp32 or x.dtype). Only rows with an adapter and columns below their slot's rank
    are written. Returns v.
    """
    for slot, start, n in zip(meta.seg_slots_list, meta.seg_starts_list, meta.seg_lens_list, strict=True):
        r = w.ranks_list[slot]
        if r == 0:
            continue
        rows = meta.row_order[start:start + n]
        xs = x.index_select(0, rows).float()  # [n, H_in]
        v[rows, :r] = (xs @ w.a_rows(slot, r).float().T).to(v.dtype)  # [n, r]
    return v


def lora_expand_ref(y: torch.Tensor, v: torch.Tensor, w, meta: LoRAMeta, offset: int = 0) -> torch.Tensor:
    """y[rows of slot s, offset:offset+H_out] += scale_s * v[rows, :r_s] @ B_s[:, :r_s].T.

    y: [T, H_total] updated in place; v: [T, R]; w: the slice's LoRAWeights (B_s = `w.b_cols(s, r_s)`,
    scale_s = `w.scales_list[s]`). Accumulates in fp32, adds once in y.dtype. Returns y.
    """
    h_out = w.B.shape[1]
    for slot, start, n in zip(meta.seg_slots_list, meta.seg_starts_list, meta.seg_lens_list, strict=True):
        r = w.ranks_list[slot]
        if r == 0:
            continue
        rows = meta.row_order[start:start + n]
        delta = (v.index_select(0, rows)[:, :r].float() @ w.b_cols(slot, r).float().T) * w.scales_list[slot]
        y[rows, offset:offset + h_out] += delta.to(y.dtype)  # delta: [n, H_out]
    return y


def add_lora_segmented(y: torch.Tensor, x: torch.Tensor, slices, meta: LoRAMeta,
                       offsets: list[int]) -> torch.Tensor:
    """Reference `add_lora`: shrink then expand for each slice, one segment at a time (fp32 maths)."""
    for w, off in zip(slices, offsets, strict=True):
        v = torch.zeros(x.shape[0], w.A.shape[1], dtype=torch.float32, device=x.device)  # [T, R]
        lora_shrink_ref(x, w, meta, v)
        lora_expand_ref(y, v, w, meta, off)
    return y

"""CPU path for few adapters in a step: "packed" (every row against all N active rank columns, two
matmuls per projection) and its fused form, where the shrink runs inside the base projection's GEMM.

Letters: T rows (T_a those with an adapter), N the sum over active slots of their rank, k slices of a
fused projection, E = extra GEMM columns, H_in / H_out a projection's in / out features.

Fused shrink: the step's chosen adapters' A rows sit under the base weight (`FusedShrink`), so one
F.linear returns the base output and those adapters' v together; extra GEMM columns cost far less than
a separate small matmul or a gather per row on a CPU (docs/kernels.md). Columns are laid out by (page,
slice, rank row in page) over the step's adapters' pages in slot order.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels import cpu_gemm
from loraplex.kernels.metadata import LoRAMeta
from loraplex.kernels.weights import LoRAWeights

# One block-diagonal expand for adjacent slices saves matmul calls but multiplies k x the FLOPs; on a
# 2-core CPU it pays while N (columns per slice) is small.
BLOCK_DIAGONAL_MAX_COLUMNS = 32


def _add_at(y: torch.Tensor, off: int, delta: torch.Tensor, rows: torch.Tensor | None) -> None:
    """y[rows, off:off + width] += delta ([len(rows), width], rows distinct); every row of y when rows
    is None. Picked rows are read, added to and written back (`index_put_`), not `index_add_`: on
    CPU, bf16 `index_add_` rewrote the NaN payload of rows it did not touch (0x7FC1 -> 0xFFFF) and was
    slower (docs/kernels.md); the sums are bit-identical."""
    ys = y[:, off:off + delta.shape[1]]
    if rows is None:
        ys += delta
    else:
        ys.index_put_((rows,), ys.index_select(0, rows) + delta)


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
                    offsets: list[int], cache: MutableMapping | None = None) -> torch.Tensor:
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
    entry = _packed_weights(slices, meta, s_idx, r_idx, cache)
    a, bs = entry[1], entry[2]
    v = xs @ a.T  # [T_a, k N], k = len(slices)
    if not cols["all_same"]:
        key = ("mask", len(slices))
        if key not in cols:
            cols[key] = mask.repeat(1, len(slices))  # [T_a, k N]
        v = torch.where(cols[key], v, torch.zeros((), dtype=v.dtype))
    adjacent = all(o + b.shape[1] == nxt for o, b, nxt in zip(offsets, bs, offsets[1:], strict=False))
    if len(slices) > 1 and adjacent and a.shape[0] // len(slices) <= BLOCK_DIAGONAL_MAX_COLUMNS:
        bs = [_block_diagonal(bs, entry[3])]
        offsets = offsets[:1]
    n = v.shape[1] // len(bs)
    for i, (b, off) in enumerate(zip(bs, offsets, strict=True)):
        _add_at(y, off, (v[:, i * n:(i + 1) * n] @ b).to(y.dtype), rows)  # delta [T_a, H_out]
    return y


def _packed_weights(slices, meta: LoRAMeta, s_idx: torch.Tensor, r_idx: torch.Tensor,
                    cache: MutableMapping | None) -> tuple:
    """(key, the active slots' A rows of every slice scaled and stacked [k N, H_in], each slice's B
    columns [N, H_out] each, a dict for derived weights). Kept in `cache` under the first slice (the
    `CPULoRA`'s): they change only when the active slots or their contents do, so a steady batch
    reuses them step after step; None: made for this call only."""
    key = (tuple(meta.seg_slots_list), tuple(meta.slot_ranks[s] for s in meta.seg_slots_list),
           tuple((id(w), w.version) for w in slices))
    w0 = slices[0]
    entry = None if cache is None else cache.get(w0)
    if entry is None or entry[0] != key:
        a, bs = [], []
        for w in slices:
            rows = s_idx * w.page + r_idx  # [N] rank rows of A viewed as [S x R, H_in]
            a.append(w.A.view(-1, w.A.shape[2])[rows] * w.scales[s_idx].to(w.A.dtype)[:, None])
            bs.append(w.B[rows // w.A.shape[1], :, rows % w.A.shape[1]].contiguous())  # [N, H_out]
        entry = (key, torch.cat(a).contiguous(), bs, {})
        if cache is not None:
            cache[w0] = entry
    return entry


def _block_diagonal(bs: list[torch.Tensor], extra: dict) -> torch.Tensor:
    """[k N, sum H_out]: slice i's B in rows i*N.. and its own output columns, zeros elsewhere (kept in
    `extra`, the packed weights' dict)."""
    if "bd" not in extra:
        n, width = bs[0].shape[0], sum(b.shape[1] for b in bs)
        bd = bs[0].new_zeros(n * len(bs), width)
        col = 0
        for i, b in enumerate(bs):
            bd[i * n:(i + 1) * n, col:col + b.shape[1]] = b
            col += b.shape[1]
        extra["bd"] = bd
    return extra["bd"]

# Fused-shrink capacity: rank rows per slice under each base weight, the packed path's 16-bit limit on
# N (`lora_ops.PACKED_LIMITS_16BIT`; an fp32 step past it, without the compiled BGMV kernel, takes the
# packed path unfused).
FUSED_MAX_ROWS = 48

# Output widths whose base columns stay bit-identical with rows added under the weight (measured).
FUSED_WIDTH_MULTIPLE = 16


@dataclass
class FusedShrink:
    """A base projection's weight with room under it for adapters' A rows (CPU).

    weight: [H_out + E_max, H_in], rows :H_out the base `nn.Linear` weight itself (shared storage, no
    copy), the rest adapters' A rows written per step by `fill_fused_rows`; bias: [H_out + E_max] with
    zeros past H_out, or None. One F.linear over weight[:H_out + E] then yields the base output and the
    shrink of E / (k x page) pages of adapters in one GEMM. `key` names what the rows hold; `expand`
    holds those adapters' scaled B pages ([E, H_out] block-diagonal, or one [n x page, H_out_i] per
    slice) for the packed path, `expand_t` their transposes ([H_out, E] ...) for oneDNN's matmul
    (`cpu_gemm.linear_unpacked`, fp32 with the onednn backend; else None). Made by `attach_fused_shrink`.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    out: int
    cap_pages: int
    key: tuple | None = None
    expand: list | None = None
    expand_t: list | None = None


def attach_fused_shrink(linear: nn.Linear, slices: Sequence[LoRAWeights],
                        max_rows: int = FUSED_MAX_ROWS) -> FusedShrink | None:
    """Give `linear` (whose output is the slices' outputs side by side) room for `max_rows` rank rows
    per slice under its weight; `lora_linear` finds it on the linear (`fused_shrink_of`).

    The weight parameter is re-pointed at the first H_out rows of the larger buffer: the module keeps
    computing exactly what it did (the extra rows are only read by `lora_linear`). The base columns
    of the wider F.linear are bit-identical to the plain one for output widths that are multiples of
    FUSED_WIDTH_MULTIPLE (fp32, fp16, bf16, 1 to 512 rows, up to 288 extra rows, the default model's
    and Llama-7B/Qwen2 shapes); in fp32 a width that is not a multiple of 4 changed the last bit of
    some base columns at up to 5 rows. So other widths are left unfused: returns None, nothing changed.

    Re-binding the parameter afterwards (`load_state_dict(assign=True)`, `.to(dtype)`) would cut it
    from the buffer; `lora_linear` then raises. The extra rows are host memory outside the model's
    parameters (about 1 MB per layer for the default model in bf16). Raises ValueError when the
    shapes do not match or the slices have no CPU mirrors.
    """
    w0 = slices[0]
    out, h_in = sum(w.B.shape[1] for w in slices), w0.A.shape[2]
    if tuple(linear.weight.shape) != (out, h_in) or any(w.BT is None for w in slices):
        raise ValueError(f"cannot fuse a shrink into a linear of weight {tuple(linear.weight.shape)} for slices of "
                         f"H_in {h_in} and H_out {out} (CPU slot buffers needed)")
    if out % FUSED_WIDTH_MULTIPLE:
        return None
    cap_pages = max(1, max_rows // w0.page)
    extra = cap_pages * len(slices) * w0.page
    weight = linear.weight.new_zeros(out + extra, h_in)
    weight[:out].copy_(linear.weight.detach())
    linear.weight = nn.Parameter(weight[:out], requires_grad=False)
    bias = None
    if linear.bias is not None:
        bias = linear.bias.new_zeros(out + extra)
        bias[:out].copy_(linear.bias.detach())
        linear.bias = nn.Parameter(bias[:out], requires_grad=False)
    linear.lora_fused_shrink = FusedShrink(weight, bias, out, cap_pages)
    return linear.lora_fused_shrink


def fused_shrink_of(linear: nn.Module) -> FusedShrink | None:
    """The room `attach_fused_shrink` gave `linear`, or None."""
    return getattr(linear, "lora_fused_shrink", None)


def fused_layout(meta: LoRAMeta, page: int, k: int, cap_pages: int) -> dict | None:
    """Where every active adapter's shrink columns are in the fused GEMM's output (cached on meta per
    arguments); None when their pages exceed `cap_pages` or there are none. Returned: slots,
    page_ids ([n] virtual pages in column order), cols (E = n x k x page), col_slot ([E] the slot of
    each column), key (the pages as a tuple).
    """
    if meta._fused is None:
        meta._fused = {}
    key = (page, k, cap_pages)
    if key not in meta._fused:
        pages = {s: -(-meta.slot_ranks[s] // page) for s in meta.seg_slots_list}
        layout = None
        if 0 < sum(pages.values()) <= cap_pages:
            slots = sorted(pages)
            page_ids = [p for s in slots for p in range(s, s + pages[s])]
            col_slot = [s for s in slots for _ in range(pages[s] * k * page)]
            layout = {"slots": slots, "page_ids": torch.tensor(page_ids, dtype=torch.int64), "cols": len(col_slot),
                    "col_slot": torch.tensor(col_slot, dtype=torch.int64), "key": tuple(page_ids)}
        meta._fused[key] = layout
    return meta._fused[key]


def fill_fused_rows(fs, slices, layout: dict) -> None:
    """Write the layout's adapters' A rows under the base weight of `fs` (a `FusedShrink`), and their
    scaled B pages for the packed expand, unless they already hold them (same pages, no slot write
    since). Rows past an adapter's rank inside its pages are zero in the slot buffers."""
    key = (layout["key"], tuple(w.version for w in slices))
    if fs.key == key:
        return
    k, page, n = len(slices), slices[0].page, len(layout["key"])
    ext = fs.weight[fs.out:fs.out + layout["cols"]].view(n, k, page, -1)  # [n, k, page, H_in]
    bts = []
    for i, w in enumerate(slices):
        ext[:, i].copy_(w.A.view(-1, page, w.A.shape[2]).index_select(0, layout["page_ids"]))
        bts.append(w.BT.view(-1, page, w.BT.shape[2]).index_select(0, layout["page_ids"]))  # [n, page, H_out_i]
    if k > 1 and n * page <= BLOCK_DIAGONAL_MAX_COLUMNS:  # one expand matmul for all slices
        bd = bts[0].new_zeros(n, k, page, fs.out)
        off = 0
        for i, bt in enumerate(bts):
            bd[:, i, :, off:off + bt.shape[2]] = bt
            off += bt.shape[2]
        fs.expand = [bd.view(-1, fs.out)]
    else:
        fs.expand = [bt.reshape(-1, bt.shape[2]) for bt in bts]
    onednn = cpu_gemm.onednn_unpacked() and fs.weight.dtype == torch.float32
    fs.expand_t = [b.t().contiguous() for b in fs.expand] if onednn else None
    fs.key = key


def add_lora_fused_packed(y: torch.Tensor, v: torch.Tensor, slices, meta: LoRAMeta, layout: dict,
                          fs) -> torch.Tensor:
    """The packed path's expand after a fused shrink: y [T, sum H_out] (the base columns of the fused
    GEMM's output), v [T, E] (its shrink columns, every active adapter's). Rows take only their own
    adapter's columns (masked by assignment, as `add_lora_packed`); rows without an adapter are neither
    read nor written. B comes scaled from the BT mirrors. Returns y."""
    if "rows" not in layout:
        rows = meta.row_order if meta.row_order.numel() < meta.num_tokens else None
        sid = meta.slot_ids.to(torch.int64)
        sid = sid if rows is None else sid[rows]
        layout["rows"] = rows
        layout["mask"] = None if len(layout["slots"]) == 1 else sid[:, None] == layout["col_slot"][None, :]
    rows, mask = layout["rows"], layout["mask"]
    if rows is not None:
        v = v.index_select(0, rows)  # [T_a, E]
    if mask is not None:
        v = torch.where(mask, v, torch.zeros((), dtype=v.dtype))
    k, page, n = len(slices), slices[0].page, len(layout["key"])
    def times(x: torch.Tensor, i: int) -> torch.Tensor:  # x @ fs.expand[i]
        return x @ fs.expand[i] if fs.expand_t is None else cpu_gemm.linear_unpacked(x, fs.expand_t[i])

    if len(fs.expand) == 1 and k > 1:
        deltas = [(0, times(v, 0))]  # block-diagonal: [T_a, sum H_out]
    else:
        vs = v.view(v.shape[0], n, k, page)
        deltas, off = [], 0
        for i, b in enumerate(fs.expand):
            deltas.append((off, times(vs[:, :, i].reshape(v.shape[0], -1), i)))  # [T_a, H_out_i]
            off += b.shape[1]
    for off, delta in deltas:
        _add_at(y, off, delta, rows)
    return y


def fused_linear(x: torch.Tensor, linear: nn.Linear, slices: Sequence[LoRAWeights], meta: LoRAMeta,
                 layout: dict) -> torch.Tensor:
    """linear(x) plus the packed adapters' deltas with the shrink inside the base GEMM: x [T, H_in] ->
    [T, sum H_out] (a view of the wider output). `layout` from `fused_layout`. Raises RuntimeError when the
    linear's weight was re-bound after `attach_fused_shrink`."""
    fs = fused_shrink_of(linear)
    if linear.weight.data_ptr() != fs.weight.data_ptr() or linear.weight.dtype != fs.weight.dtype:
        raise RuntimeError("the linear's weight was re-bound after attach_fused_shrink (load_state_dict with "
                           "assign=True, .to(dtype)?): it no longer shares the buffer with the shrink rows")
    fill_fused_rows(fs, slices, layout)
    n = fs.out + layout["cols"]
    if getattr(linear, "packed_backend", None) in ("onednn", *cpu_gemm.OURS) and cpu_gemm.takes_packed(linear, x):
        # the packed base GEMM beats the fused F.linear by more than the separate shrink costs
        # (kernels/cpu_gemm.py); the shrink rows have no bias (FusedShrink zeroes it)
        y = cpu_gemm.linear(linear, x)  # [T, H_out]
        v = cpu_gemm.linear_unpacked(x, fs.weight[fs.out:n])  # [T, E]
        return add_lora_fused_packed(y, v, slices, meta, layout, fs)
    y_ext = F.linear(x, fs.weight[:n], None if fs.bias is None else fs.bias[:n])  # [T, H_out + E]
    return add_lora_fused_packed(y_ext[:, :fs.out], y_ext[:, fs.out:], slices, meta, layout, fs)

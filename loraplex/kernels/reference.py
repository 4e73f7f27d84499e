"""PyTorch reference of the multi-adapter LoRA ops; also the CPU path of the engine.

Letters: T rows, S physical adapter slots, R max rank, V virtual slots of `page` rank rows (see
`LoRAWeights`), H_in / H_out the projection's in / out features, N sum over active slots of their
rank (the packed path's inner size). Slot ids are virtual slots.

Semantics (Punica, arXiv:2310.18547), for row t with virtual slot s = slot_ids[t] >= 0, r = ranks[s],
A_s = w.a_rows(s, r) [r, H_in] and B_s = w.b_cols(s, r) [H_out, r]:
    shrink:  v[t, :r] = x[t] @ A_s.T
    expand:  y[t, off:off+H_out] += scales[s] * v[t, :r] @ B_s.T
Rows with slot -1 are never written, so they keep exactly the base model's output.
"""

from __future__ import annotations

import torch

from loraplex.kernels import cpu_ext
from loraplex.kernels.metadata import LoRAMeta

# One block-diagonal expand for adjacent slices saves matmul calls but multiplies k x the FLOPs; on a
# 2-core CPU it pays while N (columns per slice) is small.
BLOCK_DIAGONAL_MAX_COLUMNS = 32


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


def _add_at(y: torch.Tensor, off: int, delta: torch.Tensor, rows: torch.Tensor | None) -> None:
    """y[rows, off:off + width] += delta ([len(rows), width], rows distinct); every row of y when rows
    is None. Picked rows are read, added to and written back (`index_put_`), not `index_add_`: on
    CPU, bf16 `index_add_` rewrote the NaN payload of rows it did not touch (0x7FC1 -> 0xFFFF) and took
    51-69 us against 23 us for 60 of 106 rows of 576 columns; the sums are bit-identical."""
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
        _add_at(y, off, (v[:, i * n:(i + 1) * n] @ b).to(y.dtype), rows)  # delta [T_a, H_out]
    return y


def _packed_weights(slices, meta: LoRAMeta, s_idx: torch.Tensor, r_idx: torch.Tensor):
    """The active slots' A rows of every slice, scaled and stacked ([k N, H_in]), and each slice's B
    columns ([N, H_out] each). Cached on the first slice: they change only when the active slots or
    their contents do, so a steady batch reuses them step after step."""
    key = (tuple(meta.seg_slots_list), tuple(meta.slot_ranks[s] for s in meta.seg_slots_list),
           tuple((id(w), w.version) for w in slices))
    w0 = slices[0]
    if w0.packed_cache is None or w0.packed_cache[0] != key:
        a, bs = [], []
        for w in slices:
            rows = s_idx * w.page + r_idx  # [N] rank rows of A viewed as [S x R, H_in]
            a.append(w.A.view(-1, w.A.shape[2])[rows] * w.scales[s_idx].to(w.A.dtype)[:, None])
            bs.append(w.B[rows // w.A.shape[1], :, rows % w.A.shape[1]].contiguous())  # [N, H_out]
        a = torch.cat(a)
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


def add_lora_dense_segments(y: torch.Tensor, x: torch.Tensor, slices, meta: LoRAMeta,
                            offsets: list[int]) -> torch.Tensor:
    """One matmul pair per segment and slice, in x.dtype, straight on the slot buffers (no packing,
    no cache): the CPU path for the few long segments (prefill chunks) of a bgmv step."""
    for slot, start, n in zip(meta.seg_slots_list, meta.seg_starts_list, meta.seg_lens_list, strict=True):
        rows = meta.row_order[start:start + n]
        xs = x.index_select(0, rows)  # [n, H_in]
        for w, off in zip(slices, offsets, strict=True):
            r = w.ranks_list[slot]
            if r:
                delta = (xs @ w.a_rows(slot, r).T) @ (w.b_cols(slot, r).T * w.scales_list[slot])  # [n, H_out]
                _add_at(y, off, delta.to(y.dtype), rows)
    return y


def add_lora_bgmv(y: torch.Tensor, x: torch.Tensor, slices, meta: LoRAMeta,
                  offsets: list[int]) -> torch.Tensor:
    """CPU path for many distinct adapters (BGMV's per-row gather, Punica), on `embedding_bag`.

    Each row reads only its own adapter's weights, straight from the slot buffers' CPU mirrors (no
    copy of them, no FLOPs on other adapters' columns). Shrink: with AT [S, P, H_in, W] viewed as a
    table of rows (physical slot, page, h) of W values, row t's page j is the sum over h of
    x[t, h] * AT[slot_t, page_t + j, h]: one bag of H_in table rows weighted by x[t]. The slices of a
    fused projection share AT (W = k x page), so that one gather shrinks all of them. Expand: row t's
    delta is the sum over its rank rows j of v[t, j] * BT[j-th rank row of its slot] (BT holds
    scale * B.T): one bag of r_t table rows weighted by v[t]. One `embedding_bag` per shrink mirror
    and one per slice, whatever the number of adapters; maths in x.dtype with fp32 accumulation inside
    the op.

    Needs the mirrors (`LoRAWeights.empty` on CPU) and `meta.slot_ranks`. Rows without an adapter
    are neither read nor written. Where the compiled kernel is built (`cpu_ext`), the same maths runs
    there instead, reading the slot buffers' A and BT directly (`add_lora_bgmv_compiled`).
    """
    if meta.slot_ranks is None:
        raise ValueError("the bgmv path needs meta.slot_ranks (build_lora_meta(..., slot_ranks=...))")
    ext = cpu_ext.get() if x.device.type == "cpu" else None
    if ext is not None:
        return add_lora_bgmv_compiled(ext, y, x, slices, meta, offsets)
    if any(w.AT is None for w in slices):
        raise ValueError("the embedding_bag gathers read the AT shrink mirrors, which these slot buffers were "
                         "made without (the compiled CPU kernel was built then): LoRAWeights.empty(..., "
                         "shrink_mirror=True)")
    plan = _bgmv_plan(meta, slices[0])
    rows, n_max = plan["rows"], plan["n_max"]
    xs = x.index_select(0, meta.row_order)  # [T_a, H_in], rows grouped by adapter (see _bgmv_plan)
    s_idx, s_off, s_valid = _bgmv_shrink_index(plan, x.shape[1])
    if n_max == 1:
        xw = xs.reshape(-1)  # [T_a H_in]
    else:
        xw = xs.unsqueeze(1).expand(-1, n_max, -1)  # [T_a, n_max, H_in]
        xw = xw.reshape(-1) if s_valid is None else xw[s_valid].reshape(-1)
    e_idx, e_off = plan["e_idx"], plan["e_off"]
    active = meta.active_slots
    shrunk: dict[int, torch.Tensor] = {}  # AT's data_ptr (each slice holds its own view) -> [T_a n_max W]
    for w, off in zip(slices, offsets, strict=True):
        if w.live.isdisjoint(active):
            continue  # no adapter of this step touches this slice
        at_table, bt_table = w.tables()
        v = shrunk.get(at_table.data_ptr())
        if v is None:  # torch.embedding_bag, not F.embedding_bag: the functional's checks cost ~3 us a call
            v = torch.embedding_bag(at_table, s_idx, s_off, False, 0, False, xw)[0].view(-1)
            shrunk[at_table.data_ptr()] = v
        # this slice's expand weights, one gather: its columns of v, rows back in their own order
        vw = v.index_select(0, _bgmv_expand_weights(plan, at_table.shape[1], w.at_col, w.page))
        delta = torch.embedding_bag(bt_table, e_idx, e_off, False, 0, False, vw)[0]  # [T_a, H_out]
        _add_at(y, off, delta, rows)
    return y


def add_lora_bgmv_compiled(ext, y: torch.Tensor, x: torch.Tensor, slices, meta: LoRAMeta,
                           offsets: list[int]) -> torch.Tensor:
    """`add_lora_bgmv` in the compiled kernel `ext` (`cpu_ext.get()`; semantics and roundings in
    csrc/bgmv_cpu.cpp): one call per projection, rows in adapter order split between PyTorch's threads,
    each row's shrink and expand read from A [V page, H_in] and BT [V page, H_out], the next
    segment's weights read ahead. The AT mirrors are not read. Returns y."""
    if meta._bgmv is None:
        meta._bgmv = {}
    rows = meta._bgmv.get("compiled")
    if rows is None:  # every layer of the step reuses it
        order = meta.row_order.to(torch.int64)  # [T_a] rows grouped by adapter
        rows = (order, meta.slot_ids.to(torch.int64)[order].contiguous())
        meta._bgmv["compiled"] = rows
    order, sid = rows
    used = [(w, off) for w, off in zip(slices, offsets, strict=True) if not w.live.isdisjoint(meta.active_slots)]
    if used:
        flat = [w.flat() for w, _ in used]
        ext.bgmv(y, x, order, sid, [a for a, _ in flat], [bt for _, bt in flat], [w.ranks for w, _ in used],
                 [off for _, off in used], slices[0].page, cpu_ext.vectorized)
    return y


def _bgmv_plan(meta: LoRAMeta, w) -> dict:
    """Per-step gather plan shared by every layer (cached on meta): the rows with an adapter in
    their own order (None when all rows have one), each row's pages, and the expand bags.

    The shrink runs its bags in adapter order (meta.row_order; `pos` [T_a] is each row's place in
    it, and the expand's weights are gathered back in the rows' order, `_bgmv_expand_weights`):
    embedding_bag splits the bags between threads in halves, and with rows in adapter order each core
    reads about half the adapters' tables into its own cache instead of nearly all of them (q/k/v
    shrink of 104 rows over ~45 rank-8 adapters, 30 layers' tables in play: 94-102 -> 69-74 us on a
    2-core CPU)."""
    if meta._bgmv is None:
        meta._bgmv = {}
    if w.page in meta._bgmv:
        return meta._bgmv[w.page]
    slot_ids = meta.slot_ids.to(torch.int64)
    order = meta.row_order.to(torch.int64)  # [T_a] the rows with an adapter, grouped by adapter
    pos = torch.argsort(order)  # [T_a] order[pos]: the same rows in their own order
    rows = order[pos] if order.numel() < meta.num_tokens else None
    sid = slot_ids if rows is None else slot_ids[rows]  # [T_a]
    slot_pages = (torch.tensor(meta.slot_ranks, dtype=torch.int64) + w.page - 1) // w.page  # [V] each slot's pages
    pages = slot_pages[sid]  # [T_a] pages each row's adapter spans
    n_max = int(pages.max())
    cols = torch.arange(n_max * w.page)  # [n_max page]
    e_valid = None if bool((pages == n_max).all()) else cols[None, :] < (pages * w.page)[:, None]
    e_idx = sid[:, None] * w.page + cols[None, :]  # [T_a, n_max page] rank rows of BT viewed [S x R, H_out]
    lengths = pages * w.page
    sid_sorted = slot_ids[order]  # [T_a]
    plan = {"rows": rows, "n_max": n_max, "e_valid": e_valid,
            "pos": pos, "sid_sorted": sid_sorted, "pages_sorted": slot_pages[sid_sorted],
            "e_idx": e_idx.flatten() if e_valid is None else e_idx[e_valid],
            "e_off": torch.cumsum(lengths, 0) - lengths}
    meta._bgmv[w.page] = plan
    return plan


def _bgmv_expand_weights(plan: dict, width: int, col: int, page: int) -> torch.Tensor:
    """[E] positions in the flat shrink output (bags in adapter order, `width` values each) of the
    expand's per-sample weights: for each row in its own order, its valid rank columns col .. col +
    page of each of its pages (cached in the plan per mirror width and column)."""
    key = ("expand", width, col)
    if key not in plan:
        n_max = plan["n_max"]
        bag = plan["pos"][:, None] * n_max + torch.arange(n_max)[None, :]  # [T_a, n_max] bag of (row, page)
        idx = (bag[:, :, None] * width + col + torch.arange(page)).reshape(bag.shape[0], -1)  # [T_a, n_max page]
        plan[key] = idx.flatten() if plan["e_valid"] is None else idx[plan["e_valid"]]
    return plan[key]


def _bgmv_shrink_index(plan: dict, h_in: int):
    """(indices, offsets, valid) of the shrink bags for inputs of width h_in (cached in the plan):
    bag (t, j) for the t-th row in adapter order (meta.row_order) and j < n_max holds table rows
    (virtual page sid_t + j, h) for h < h_in, i.e. rows (physical slot, first page + j, h) of AT; bags
    past a row's own pages are empty (they sum to zero) and valid marks the others (None: all)."""
    key = ("shrink", h_in)
    if key not in plan:
        j = torch.arange(plan["n_max"])
        sid = plan["sid_sorted"]  # [T_a]
        page_row = (sid[:, None] + j[None, :]) * h_in  # [T_a, n_max] (sid_t + j) x H_in
        idx = page_row[:, :, None] + torch.arange(h_in)  # [T_a, n_max, H_in]
        valid = None  # some row spans fewer than n_max pages: [T_a, n_max]
        if plan["e_valid"] is not None:
            valid = j[None, :] < plan["pages_sorted"][:, None]
        lengths = torch.full((idx.shape[0] * plan["n_max"],), h_in) if valid is None else valid.flatten() * h_in
        plan[key] = (idx.flatten() if valid is None else idx[valid].flatten(),
                     torch.cumsum(lengths, 0) - lengths, valid)
    return plan[key]


# Fused shrink (CPU). The shrink x @ A.T of a step's chosen adapters runs inside the base projection's
# GEMM: their A rows sit under the base weight (`FusedShrink`, lora_ops), so F.linear returns the base
# output and those adapters' v together. Extra GEMM columns cost far less than a separate small matmul
# (about 13 us each in bf16 on a 2-core CPU whatever its size) or a gather of H_in table rows per row.
# Columns are laid out by (page, slice, rank row in page) over the step's adapters' pages in slot order.


def fused_plan(meta: LoRAMeta, page: int, k: int, cap_pages: int) -> dict | None:
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
        plan = None
        if 0 < sum(pages.values()) <= cap_pages:
            slots = sorted(pages)
            page_ids = [p for s in slots for p in range(s, s + pages[s])]
            col_slot = [s for s in slots for _ in range(pages[s] * k * page)]
            plan = {"slots": slots, "page_ids": torch.tensor(page_ids, dtype=torch.int64), "cols": len(col_slot),
                    "col_slot": torch.tensor(col_slot, dtype=torch.int64), "key": tuple(page_ids)}
        meta._fused[key] = plan
    return meta._fused[key]


def fill_fused_rows(fs, slices, plan: dict) -> None:
    """Write the plan's adapters' A rows under the base weight of `fs` (a `FusedShrink`), and their
    scaled B pages for the packed expand, unless they already hold them (same pages, no slot write
    since). Rows past an adapter's rank inside its pages are zero in the slot buffers."""
    key = (plan["key"], tuple(w.version for w in slices))
    if fs.key == key:
        return
    k, page, n = len(slices), slices[0].page, len(plan["key"])
    ext = fs.weight[fs.out:fs.out + plan["cols"]].view(n, k, page, -1)  # [n, k, page, H_in]
    bts = []
    for i, w in enumerate(slices):
        ext[:, i].copy_(w.A.view(-1, page, w.A.shape[2]).index_select(0, plan["page_ids"]))
        bts.append(w.BT.view(-1, page, w.BT.shape[2]).index_select(0, plan["page_ids"]))  # [n, page, H_out_i]
    if k > 1 and n * page <= BLOCK_DIAGONAL_MAX_COLUMNS:  # one expand matmul for all slices
        bd = bts[0].new_zeros(n, k, page, fs.out)
        off = 0
        for i, bt in enumerate(bts):
            bd[:, i, :, off:off + bt.shape[2]] = bt
            off += bt.shape[2]
        fs.expand = [bd.view(-1, fs.out)]
    else:
        fs.expand = [bt.reshape(-1, bt.shape[2]) for bt in bts]
    fs.key = key


def add_lora_fused_packed(y: torch.Tensor, v: torch.Tensor, slices, meta: LoRAMeta, plan: dict,
                          fs) -> torch.Tensor:
    """The packed path's expand after a fused shrink: y [T, sum H_out] (the base columns of the fused
    GEMM's output), v [T, E] (its shrink columns, every active adapter's). Rows take only their own
    adapter's columns (masked by assignment, as `add_lora_packed`); rows without an adapter are neither
    read nor written. B comes scaled from the BT mirrors. Returns y."""
    if "rows" not in plan:
        rows = meta.row_order if meta.row_order.numel() < meta.num_tokens else None
        sid = meta.slot_ids.to(torch.int64)
        sid = sid if rows is None else sid[rows]
        plan["rows"] = rows
        plan["mask"] = None if len(plan["slots"]) == 1 else sid[:, None] == plan["col_slot"][None, :]
    rows, mask = plan["rows"], plan["mask"]
    if rows is not None:
        v = v.index_select(0, rows)  # [T_a, E]
    if mask is not None:
        v = torch.where(mask, v, torch.zeros((), dtype=v.dtype))
    k, page, n = len(slices), slices[0].page, len(plan["key"])
    if len(fs.expand) == 1 and k > 1:
        deltas = [(0, v @ fs.expand[0])]  # block-diagonal: [T_a, sum H_out]
    else:
        vs = v.view(v.shape[0], n, k, page)
        deltas, off = [], 0
        for i, b in enumerate(fs.expand):
            deltas.append((off, vs[:, :, i].reshape(v.shape[0], -1) @ b))  # [T_a, H_out_i]
            off += b.shape[1]
    for off, delta in deltas:
        _add_at(y, off, delta, rows)
    return y

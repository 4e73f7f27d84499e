"""CPU path for many distinct adapters in a step: BGMV's per-row gather (Punica), each row reading only
its own adapter, in the compiled kernel (`cpu_ext`) where it is built, else through `embedding_bag`;
long segments (prefill chunks) split off to one dense matmul pair each.

Letters: T rows (T_a those with an adapter), S physical slots, R max rank, V virtual slots of `page` rank
rows, P pages per physical slot, H_in / H_out a projection's in / out features, W the shrink mirror's width.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from loraplex.kernels import cpu_ext
from loraplex.kernels.cpu_packed import _add_at
from loraplex.kernels.metadata import LoRAMeta, build_lora_meta

# With bgmv, segments of at least this many rows (long prefill chunks) take one dense matmul pair each
# reading their adapter once for all their rows (the split point is measured: docs/kernels.md).
LONG_SEGMENT_ROWS = 128


def split_long_segments(meta: LoRAMeta) -> tuple[LoRAMeta | None, LoRAMeta | None]:
    """(meta of the long segments' rows, meta of the other rows), None for a part without rows
    (cached on meta: every layer of the step splits the same way)."""
    if meta._split is None:
        long = {s for s, n in zip(meta.seg_slots_list, meta.seg_lens_list, strict=True) if n >= LONG_SEGMENT_ROWS}
        if not long or len(long) == meta.num_segments:
            meta._split = (meta, None) if long else (None, meta)
        else:
            ids = meta.slot_ids.tolist()
            parts = [[s if s >= 0 and (s in long) == keep else -1 for s in ids] for keep in (True, False)]
            meta._split = tuple(build_lora_meta(p, meta.slot_ids.device, meta.slot_ranks) for p in parts)
    return meta._split


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
                  offsets: list[int], cache: MutableMapping | None = None) -> torch.Tensor:
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
    ext = cpu_ext.get(x.dtype) if x.device.type == "cpu" else None
    if ext is not None:
        return add_lora_bgmv_compiled(ext, y, x, slices, meta, offsets, cache)
    if any(w.AT is None for w in slices):
        raise ValueError("the embedding_bag gathers read the AT shrink mirrors, which these slot buffers were "
                         "made without (the compiled CPU kernel was built then): LoRAWeights.empty(..., "
                         "shrink_mirror=True)")
    layout = _bgmv_layout(meta, slices[0])
    rows, n_max = layout["rows"], layout["n_max"]
    xs = x.index_select(0, meta.row_order)  # [T_a, H_in], rows grouped by adapter (see _bgmv_layout)
    s_idx, s_off, s_valid = _bgmv_shrink_index(layout, x.shape[1])
    if n_max == 1:
        xw = xs.reshape(-1)  # [T_a H_in]
    else:
        xw = xs.unsqueeze(1).expand(-1, n_max, -1)  # [T_a, n_max, H_in]
        xw = xw.reshape(-1) if s_valid is None else xw[s_valid].reshape(-1)
    e_idx, e_off = layout["e_idx"], layout["e_off"]
    active = meta.active_slots
    shrunk: dict[int, torch.Tensor] = {}  # AT's data_ptr (each slice holds its own view) -> [T_a n_max W]
    for w, off in zip(slices, offsets, strict=True):
        if w.live.isdisjoint(active):
            continue  # no adapter of this step touches this slice
        at_table, bt_table = _views(w, "tables", cache)
        v = shrunk.get(at_table.data_ptr())
        if v is None:  # torch.embedding_bag, not F.embedding_bag: the functional's checks cost ~3 us a call
            v = torch.embedding_bag(at_table, s_idx, s_off, False, 0, False, xw)[0].view(-1)
            shrunk[at_table.data_ptr()] = v
        # this slice's expand weights, one gather: its columns of v, rows back in their own order
        vw = v.index_select(0, _bgmv_expand_weights(layout, at_table.shape[1], w.at_col, w.page))
        delta = torch.embedding_bag(bt_table, e_idx, e_off, False, 0, False, vw)[0]  # [T_a, H_out]
        _add_at(y, off, delta, rows)
    return y


def add_lora_bgmv_compiled(ext, y: torch.Tensor, x: torch.Tensor, slices, meta: LoRAMeta,
                           offsets: list[int], cache: MutableMapping | None = None) -> torch.Tensor:
    """`add_lora_bgmv` in the compiled kernel `ext` (`cpu_ext.get(dtype)`; semantics and roundings in
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
        flat = [_views(w, "flat", cache) for w, _ in used]
        ext.bgmv(y, x, order, sid, [a for a, _ in flat], [bt for _, bt in flat], [w.ranks for w, _ in used],
                 [off for _, off in used], slices[0].page, cpu_ext.max_lanes)
    return y


def _views(w, kind: str, cache: MutableMapping | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of w's buffers as the gathers' tables ("tables": AT as rows (physical slot, page, h) of W
    values [S P H_in, W], BT as rank rows [S R, H_out]) or as the compiled kernel reads them ("flat": A
    [S R, H_in] and BT [S R, H_out]); made once per buffer and kept in `cache` (the `CPULoRA`'s)."""
    views = None if cache is None else cache.get(w)
    if views is None:
        views = {}
        if cache is not None:
            cache[w] = views
    if kind not in views:
        if kind == "tables":
            views[kind] = (w.AT.view(-1, w.AT.shape[-1]), w.BT.view(-1, w.BT.shape[-1]))
        else:
            views[kind] = (w.A.view(-1, w.A.shape[2]), w.BT.view(-1, w.BT.shape[-1]))
    return views[kind]


def _bgmv_layout(meta: LoRAMeta, w) -> dict:
    """Per-step gather layout shared by every layer (cached on meta): the rows with an adapter in
    their own order (None when all rows have one), each row's pages, and the expand bags.

    The shrink runs its bags in adapter order (meta.row_order; `pos` [T_a] is each row's place in
    it, and the expand's weights are gathered back in the rows' order, `_bgmv_expand_weights`):
    embedding_bag splits the bags between threads in halves, and with rows in adapter order each core
    reads about half the adapters' tables into its own cache instead of nearly all of them (measured
    in docs/kernels.md)."""
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
    layout = {"rows": rows, "n_max": n_max, "e_valid": e_valid,
            "pos": pos, "sid_sorted": sid_sorted, "pages_sorted": slot_pages[sid_sorted],
            "e_idx": e_idx.flatten() if e_valid is None else e_idx[e_valid],
            "e_off": torch.cumsum(lengths, 0) - lengths}
    meta._bgmv[w.page] = layout
    return layout


def _bgmv_expand_weights(layout: dict, width: int, col: int, page: int) -> torch.Tensor:
    """[E] positions in the flat shrink output (bags in adapter order, `width` values each) of the
    expand's per-sample weights: for each row in its own order, its valid rank columns col .. col +
    page of each of its pages (cached in the layout per mirror width and column)."""
    key = ("expand", width, col)
    if key not in layout:
        n_max = layout["n_max"]
        bag = layout["pos"][:, None] * n_max + torch.arange(n_max)[None, :]  # [T_a, n_max] bag of (row, page)
        idx = (bag[:, :, None] * width + col + torch.arange(page)).reshape(bag.shape[0], -1)  # [T_a, n_max page]
        layout[key] = idx.flatten() if layout["e_valid"] is None else idx[layout["e_valid"]]
    return layout[key]


def _bgmv_shrink_index(layout: dict, h_in: int):
    """(indices, offsets, valid) of the shrink bags for inputs of width h_in (cached in the layout):
    bag (t, j) for the t-th row in adapter order (meta.row_order) and j < n_max holds table rows
    (virtual page sid_t + j, h) for h < h_in, i.e. rows (physical slot, first page + j, h) of AT; bags
    past a row's own pages are empty (they sum to zero) and valid marks the others (None: all)."""
    key = ("shrink", h_in)
    if key not in layout:
        j = torch.arange(layout["n_max"])
        sid = layout["sid_sorted"]  # [T_a]
        page_row = (sid[:, None] + j[None, :]) * h_in  # [T_a, n_max] (sid_t + j) x H_in
        idx = page_row[:, :, None] + torch.arange(h_in)  # [T_a, n_max, H_in]
        valid = None  # some row spans fewer than n_max pages: [T_a, n_max]
        if layout["e_valid"] is not None:
            valid = j[None, :] < layout["pages_sorted"][:, None]
        lengths = torch.full((idx.shape[0] * layout["n_max"],), h_in) if valid is None else valid.flatten() * h_in
        layout[key] = (idx.flatten() if valid is None else idx[valid].flatten(),
                     torch.cumsum(lengths, 0) - lengths, valid)
    return layout[key]

"""Shared builders for the LoRA kernel tests: batches by adapter popularity and a dense fp32 truth.

The truth is a plain per-row loop in fp32, independent of loraplex.kernels.reference.

Slot layouts: by default (page 0) every one of the NUM_SLOTS physical slots holds one adapter, at the
virtual slot of the same number. With a page (`make_slices(..., page=8)`) the NUM_SLOTS x MAX_RANK
rank rows are cut into V = NUM_SLOTS x MAX_RANK / page virtual slots and `paged_layout` packs
adapters of RANKS into them (each takes ceil(rank / page) pages inside one physical slot), leaving
some pages to no adapter; the batch's slot ids are the virtual slots where an adapter starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels.metadata import LoRAMeta, build_lora_meta
from loraplex.kernels.weights import LoRAWeights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RANKS = (4, 8, 16, 64)
MAX_RANK = 64
NUM_SLOTS = 17  # more than the 16 adapters a batch may hold: some slots stay unused
POPULARITIES = ("distinct", "uniform", "zipf", "identical", "skewed")
# (atol, rtol) against the fp32 truth; 16-bit inputs also round y and, in tl.dot tiles, v.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


@dataclass
class Case:
    x: torch.Tensor  # [T, H_in]
    y: torch.Tensor  # [T, sum H_out], the base output before LoRA
    slices: list[LoRAWeights]
    offsets: list[int]
    slot_ids: list[int]
    meta: LoRAMeta


def paged_layout(page: int) -> list[tuple[int, int]]:
    """(virtual slot, capacity in rank rows) of each adapter of a paged layout, in slot order.

    Adapters of nominal ranks RANKS, RANKS, ... are packed first-fit in order into the physical slots,
    each on ceil(rank / page) pages of one physical slot: with page 8, physical slot 0 holds ranks 4, 8,
    16 on pages 0, 1, 2-3 and leaves pages 4-7 to no adapter (the next rank, 64, takes all of slot 1).
    Capacity is the adapter's pages x page; page 0 means MAX_RANK (one adapter per physical slot).
    """
    page = page or MAX_RANK
    per_slot = MAX_RANK // page
    layout, phys, used, k = [], 0, 0, 0
    while phys < NUM_SLOTS:
        pages = -(-RANKS[k % len(RANKS)] // page)
        if used + pages > per_slot:
            phys, used = phys + 1, 0
            continue
        layout.append((phys * per_slot + used, pages * page))
        used += pages
        k += 1
    return layout


def make_slot_ids(popularity: str, num_tokens: int, num_adapters: int, gen: torch.Generator,
                  no_adapter_frac: float = 0.2, slots: list[int] | None = None) -> list[int]:
    """Per-row slot ids (-1 = no adapter) for `num_adapters` adapters placed on scattered slots, unsorted.

    slots: the (virtual) slots adapters occupy, to draw from (default: range(NUM_SLOTS))."""
    n = num_adapters
    if popularity == "distinct":  # a different adapter per row while there are enough
        ids = torch.arange(num_tokens) % n
    elif popularity == "uniform":
        ids = torch.randint(0, n, (num_tokens,), generator=gen)
    elif popularity == "zipf":
        p = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** 1.5
        ids = torch.multinomial(p, num_tokens, replacement=True, generator=gen)
    elif popularity == "identical":
        ids = torch.zeros(num_tokens, dtype=torch.int64)
    elif popularity == "skewed":  # one adapter holds all but a few rows
        ids = torch.zeros(num_tokens, dtype=torch.int64)
        few = max(1, num_tokens // 20) if n > 1 else 0
        ids[:few] = torch.randint(1, max(n, 2), (few,), generator=gen)
    else:
        raise ValueError(popularity)
    if slots is None:
        slot_of = torch.randperm(NUM_SLOTS, generator=gen)[:n]  # adapter k lives in slot slot_of[k]
    else:
        slot_of = torch.tensor(slots)[torch.randperm(len(slots), generator=gen)[:n]]
    ids = slot_of[ids]
    if num_tokens > 1:
        ids[torch.rand(num_tokens, generator=gen) < no_adapter_frac] = -1
    return ids[torch.randperm(num_tokens, generator=gen)].tolist()


def make_slices(h_in: int, h_outs: list[int], dtype: torch.dtype, gen: torch.Generator, padding: str,
                rank_shift: int = 0, page: int = 0) -> list[LoRAWeights]:
    """One LoRAWeights per output width, the slices of one fused projection; slot s of slice i has rank RANKS[(s + i + rank_shift) % 4].

    page: 0 (one adapter per physical slot, slot s = physical slot s) or the rank rows per virtual
    slot: then the k-th adapter of `paged_layout(page)` sits at its virtual slot with rank
    RANKS[(k + i + rank_shift) % 4] in slice i, capped at its capacity (so in a slice it may use fewer
    rows than its pages hold). padding: "zero" (as the engine writes) or "nan": every rank row no
    adapter owns (beyond an adapter's rank, and pages of no adapter) is NaN.
    """
    slices = []
    # with the shared shrink mirror AT (the embedding_bag gathers read it; the compiled kernel does not)
    group = LoRAWeights.empty_group(NUM_SLOTS, MAX_RANK, h_in, h_outs, dtype, DEVICE, page=page, shrink_mirror=True)
    for i, (h_out, w) in enumerate(zip(h_outs, group, strict=True)):
        layout = [(s, MAX_RANK) for s in range(NUM_SLOTS)] if not page else paged_layout(page)
        for k, (s, capacity) in enumerate(layout):
            r = min(capacity, RANKS[(k + i + rank_shift) % len(RANKS)])
            a = torch.randn(r, h_in, generator=gen) / h_in**0.5
            b = torch.randn(h_out, r, generator=gen) / r**0.5
            w.set_slot(s, a.to(dtype), b.to(dtype), scale=0.5 + 1.5 * torch.rand(1, generator=gen).item())
        if padding == "nan":
            fill_padding(w, float("nan"))
        slices.append(w)
    return slices


def owned_rows(w: LoRAWeights) -> torch.Tensor:
    """[S, R] bool: the rank rows some adapter owns (its first `rank` rows from its virtual slot)."""
    owned = torch.zeros(w.A.shape[:2], dtype=torch.bool)
    for s, r in enumerate(w.ranks_list):
        phys, row = w.locate(s)
        owned[phys, row:row + r] = True
    return owned


def fill_padding(w: LoRAWeights, value: float) -> None:
    """Write `value` into every rank row of A and column of B that no adapter owns."""
    free = ~owned_rows(w).to(w.A.device)
    w.A[free] = value
    w.B.transpose(1, 2)[free] = value


def fill_rows(w: LoRAWeights, slot: int, rows: int, value: float) -> None:
    """Write `value` into `rows` rank rows of A (and columns of B) from virtual slot `slot`."""
    w.a_rows(slot, rows).fill_(value)
    w.b_cols(slot, rows).fill_(value)


def make_case(num_tokens: int, popularity: str, num_adapters: int, dtype: torch.dtype, h_in: int,
              h_outs: list[int], padding: str = "nan", seed: int = 0, page: int = 0) -> Case:
    """A batch whose rows without an adapter hold NaN in x and NaN (with a payload: a path that
    rewrites the row, even to the same value, changes its bits), inf and -0.0 in y (never touched).

    page: 0 for one adapter per physical slot, else the paged layout of `make_slices`."""
    gen = torch.Generator().manual_seed(seed)
    layout = paged_layout(page) if page else None
    slot_ids = make_slot_ids(popularity, num_tokens, num_adapters, gen,
                             slots=[s for s, _ in layout] if layout else None)
    slices = make_slices(h_in, h_outs, dtype, gen, padding, page=page)
    x = torch.randn(num_tokens, h_in, generator=gen)
    y = torch.randn(num_tokens, sum(h_outs), generator=gen)
    for t, s in enumerate(slot_ids):
        if s < 0:
            x[t] = float("nan")
            y[t, 0::3], y[t, 1::3], y[t, 2::3] = float("nan"), float("-inf"), -0.0
    if padding == "nan":  # slots outside the batch are never read at all
        unused = [(s, MAX_RANK) for s in range(NUM_SLOTS)] if layout is None else layout
        for s, capacity in unused:
            if s not in slot_ids:
                for w in slices:
                    fill_rows(w, s, capacity, float("nan"))
    offsets = [sum(h_outs[:i]) for i in range(len(h_outs))]
    meta = build_lora_meta(slot_ids, DEVICE, slot_ranks=max_slot_ranks(slices))
    y = y.to(dtype)
    idle = [t for t, s in enumerate(slot_ids) if s < 0]
    if idle:  # quiet NaNs with payload 1 (not what a conversion or an arithmetic op produces)
        ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
        bits = {torch.float32: 0x7FC00001, torch.float16: 0x7E01, torch.bfloat16: 0x7FC1}[dtype]
        y.view(ints)[idle, 0::3] = bits
    return Case(x.to(DEVICE, dtype), y.to(DEVICE), slices, offsets, slot_ids, meta)


def max_slot_ranks(slices: list[LoRAWeights]) -> list[int]:
    return [max(w.ranks_list[s] for w in slices) for s in range(slices[0].num_virtual_slots)]


def dense_reference(case: Case, y_before: torch.Tensor | None = None) -> torch.Tensor:
    """[T, sum H_out] fp32: y_before (default case.y) + every row's own adapter delta, row by row."""
    ref = (case.y if y_before is None else y_before).float().cpu().clone()
    x = case.x.float().cpu()
    for w, off in zip(case.slices, case.offsets, strict=True):
        A = w.A.float().cpu().flatten(0, 1)  # [S x R, H_in]: virtual slot s starts at row s x page
        B = w.B.float().cpu().transpose(1, 2).flatten(0, 1)  # [S x R, H_out], the same rows
        for t, s in enumerate(case.slot_ids):
            r = w.ranks_list[s] if s >= 0 else 0
            if r:
                rows = slice(s * w.page, s * w.page + r)
                ref[t, off:off + B.shape[1]] += w.scales_list[s] * ((x[t] @ A[rows].T) @ B[rows])
    return ref


def assert_matches(out: torch.Tensor, case: Case, y_before: torch.Tensor) -> None:
    """Rows with an adapter match the dense truth within the dtype's tolerance; rows without are
    bit-identical to `y_before`."""
    atol, rtol = TOLERANCES[case.x.dtype]
    ref = dense_reference(case, y_before)
    out, y_before = out.cpu(), y_before.cpu()
    rows = [t for t, s in enumerate(case.slot_ids) if s >= 0]
    idle = [t for t, s in enumerate(case.slot_ids) if s < 0]
    torch.testing.assert_close(out[rows].float(), ref[rows], atol=atol, rtol=rtol)
    assert torch.equal(out[idle].contiguous().view(torch.uint8), y_before[idle].contiguous().view(torch.uint8))

"""The adapter-slot buffers the LoRA ops read: `LoRAWeights` (one projection's slots in one layer) and
`LoRAStack` (the same for every layer in one allocation, what the adapter manager writes into).

Letters: L layers, S physical adapter slots, R max rank, V virtual slots of `page` rank rows, P = R / page
pages per physical slot, H_in / H_out a projection's in / out features, W the shrink mirror's width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from loraplex.kernels import cpu_ext


@dataclass(eq=False)  # identity: the CPU path keys its caches by the buffers (`cpu.CPULoRA`)
class LoRAWeights:
    """Stacked adapter-slot buffers of one projection (one slice), paged by rank (S-LoRA's unified
    paging, arXiv:2311.03285, at the granularity of `page` rank rows).

    A: [S, R, H_in]; B: [S, H_out, R] (PEFT's lora_A / lora_B weight layouts, stacked by physical slot).
    The S x R rank rows are cut into V = S x R / page *virtual slots* of `page` rows each; an adapter
    of rank r sits at a virtual slot v and owns the ceil(r / page) pages from there, inside one
    physical slot: A rows (v x page) .. + r of A viewed as [S x R, H_in], and B columns
    (v x page) % R .. + r of physical slot (v x page) // R. With page == R (the default) a virtual
    slot is a physical slot; with a smaller page a rank-8 adapter takes 8 rows, not R, so S slots of
    max rank R hold S x R / 8 rank-8 adapters. The slot ids of `LoRAMeta` are virtual slots.

    ranks: [V] int32, scales: [V] fp32 on the buffers' device; host copies in `ranks_list` and
    `scales_list`; `live` the virtual slots holding an adapter of rank > 0 here. Rows no adapter owns
    hold zeros. On CPU, `BT` [S, R, H_out] mirrors B transposed and scaled by each adapter's scale, and
    `AT` [S, P, H_in, W] (P = R / page pages per physical slot) mirrors A transposed: page p of slot
    s is AT[s, p, :, at_col:at_col + page], its H_in table rows contiguous so one row's gather streams
    them (cheaper than pages interleaved by h: docs/kernels.md).
    The slices of one fused projection (q, k, v; gate, up) share one AT with W = k x page, their pages
    side by side (`empty_group`), so one gather shrinks all k slices; alone, W = page. These are the
    tables the CPU gather path (`add_lora_bgmv`) reads. The compiled CPU kernel reads A and BT, so
    where it is built AT is not kept (None): no memory for it, no strided writes into it per placement.
    """

    A: torch.Tensor
    B: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    ranks_list: list[int] = field(default_factory=list)
    scales_list: list[float] = field(default_factory=list)
    version: int = 0  # counts slot writes: what a path caches about these buffers is stale once it moves
    page: int = 0  # rank rows per virtual slot; 0 means R
    AT: torch.Tensor | None = field(default=None, repr=False)
    BT: torch.Tensor | None = field(default=None, repr=False)
    at_col: int = 0
    live: set[int] = field(default_factory=set)

    def __post_init__(self):
        if not self.live:
            self.live = {s for s, r in enumerate(self.ranks_list) if r}
        if not self.page:
            self.page = self.A.shape[1]
        if self.A.shape[1] % self.page:
            raise ValueError(f"page {self.page} does not divide the max rank {self.A.shape[1]}")

    @classmethod
    def empty(cls, num_slots: int, max_rank: int, in_features: int, out_features: int,
              dtype: torch.dtype, device: torch.device | str, page: int = 0,
              shrink_mirror: bool | None = None) -> LoRAWeights:
        """Zeroed buffers for `num_slots` physical slots of rank up to `max_rank`, in virtual slots of
        `page` rows (0: one per physical slot). The CPU mirrors are allocated on a CPU device: BT always,
        AT when `shrink_mirror` (None: only where the compiled CPU kernel is not built, `cpu_ext`, since
        only the embedding_bag gathers read it)."""
        return cls.empty_group(num_slots, max_rank, in_features, [out_features], dtype, device, page,
                               shrink_mirror)[0]

    @classmethod
    def empty_group(cls, num_slots: int, max_rank: int, in_features: int, out_features: Sequence[int],
                    dtype: torch.dtype, device: torch.device | str, page: int = 0,
                    shrink_mirror: bool | None = None) -> list[LoRAWeights]:
        """`empty` buffers for the k slices of one fused projection (one per entry of `out_features`),
        sharing one CPU shrink mirror `AT` [S, P, H_in, k x page] when there is one."""
        stacks = LoRAStack.empty_group(1, num_slots, max_rank, in_features, out_features, dtype, device, page,
                                       shrink_mirror)
        return [stack.layers[0] for stack in stacks]

    @property
    def num_virtual_slots(self) -> int:
        """V = S x R / page."""
        return self.A.shape[0] * self.A.shape[1] // self.page

    def locate(self, slot: int) -> tuple[int, int]:
        """(physical slot, first rank row inside it) of virtual slot `slot`."""
        return divmod(slot * self.page, self.A.shape[1])

    def a_rows(self, slot: int, r: int) -> torch.Tensor:
        """[r, H_in] view: rank rows 0..r-1 of the adapter at virtual slot `slot`."""
        phys, row = self.locate(slot)
        return self.A[phys, row:row + r]

    def b_cols(self, slot: int, r: int) -> torch.Tensor:
        """[H_out, r] view: rank columns 0..r-1 of the adapter at virtual slot `slot`."""
        phys, row = self.locate(slot)
        return self.B[phys, :, row:row + r]

    def set_slot(self, slot: int, A: torch.Tensor | None, B: torch.Tensor | None, scale: float) -> None:
        """Write one adapter's weights at virtual slot `slot`: A [r, H_in], B [H_out, r]; None clears it.

        What the new weights leave of the rows the slot's previous adapter wrote is zeroed, so rows
        nobody owns stay zero for the packed path and the kernels. Raises ValueError when the weights
        do not fit the buffers or run past the end of the physical slot.
        """
        self.version += 1  # invalidates weights cached for the packed path
        if not 0 <= slot < self.num_virtual_slots:
            raise ValueError(f"virtual slot {slot} out of range [0, {self.num_virtual_slots})")
        phys, row = self.locate(slot)
        old = self.ranks_list[slot]
        if A is None:
            r, scale = 0, 0.0
        else:
            r = A.shape[0]
            if row + r > self.A.shape[1] or A.shape[1] != self.A.shape[2] or tuple(B.shape) != (self.B.shape[1], r):
                raise ValueError(f"adapter weights A{tuple(A.shape)} B{tuple(B.shape)} do not fit slot "
                                 f"buffers A{tuple(self.A.shape[1:])} B{tuple(self.B.shape[1:])} at rank row {row}")
            self.ranks_list[slot] = max(r, old)  # before the copies: if one fails, a later clear zeroes these rows
            _copy_rows(self, phys, row, A, B, scale, self.page, self.at_col)
        _zero_rows(self, phys, row, old, self.page, self.at_col, keep=r)
        self.ranks[slot] = r
        self.scales[slot] = scale
        self.ranks_list[slot] = r
        self.scales_list[slot] = float(scale)
        (self.live.add if r else self.live.discard)(slot)


def _zero_rows(buf, phys: int, row: int, n: int, page: int, col: int, keep: int = 0) -> None:
    """Zero rank rows row + keep .. row + n - 1 of physical slot `phys` in buf's A, B and CPU mirrors
    (in AT, the pages past those holding the first `keep` rows, which `_copy_rows` just wrote whole);
    `buf` is a `LoRAWeights` (A [S, R, H_in]) or a `LoRAStack` (the same with a leading layer dim).
    A write zeroes only what it leaves of the previous adapter's rows: rewriting a rank-8 slot with
    another rank-8 adapter zeroes nothing (half the copies of a slot swap)."""
    if n <= keep:
        return
    buf.A[..., phys, row + keep:row + n, :].zero_()
    buf.B[..., phys, :, row + keep:row + n].zero_()
    if buf.AT is not None:
        kept = -(-keep // page) * page  # rows of the pages the copy wrote whole
        if n > kept:
            _at_pages(buf.AT[..., phys, :, :, :], row + kept, n - kept, page, col).zero_()
    if buf.BT is not None:
        buf.BT[..., phys, row + keep:row + n, :].zero_()


def _copy_rows(buf, phys: int, row: int, A: torch.Tensor, B: torch.Tensor, scale, page: int, col: int) -> None:
    """Write A [..., r, H_in] and B [..., H_out, r] at rank rows row .. row + r - 1 of physical slot
    `phys` of buf (as `_zero_rows`), and the mirrors: AT from A, BT from B scaled by `scale` (a float,
    or a [L, 1, 1] tensor of per-layer scales). Host-to-CUDA copies are asynchronous on the current
    stream (the manager's side copy stream) when the sources are pinned, as the manager's loads are;
    PyTorch's pinned-memory allocator keeps a source whose tensor is freed alive until its copy is
    done. Elsewhere non_blocking changes nothing."""
    r = A.shape[-2]
    buf.A[..., phys, row:row + r, :].copy_(A, non_blocking=True)
    buf.B[..., phys, :, row:row + r].copy_(B, non_blocking=True)
    if buf.AT is not None:
        _at_pages(buf.AT[..., phys, :, :, :], row, r, page, col).copy_(_as_pages(A, page))
    if buf.BT is not None:
        buf.BT[..., phys, row:row + r, :].copy_((B.float() * scale).transpose(-1, -2))


def _at_pages(at: torch.Tensor, row: int, r: int, page: int, col: int) -> torch.Tensor:
    """[..., n, H_in, page] view of the shrink mirror `at` [..., P, H_in, W] (one physical slot, any
    leading dims): the n = ceil(r / page) pages from rank row `row` (a multiple of page), at columns
    col .. col + page."""
    first = row // page
    return at[..., first:first - (-r // page), :, col:col + page]


def _as_pages(a: torch.Tensor, page: int) -> torch.Tensor:
    """A [..., r, H_in] -> its transpose in pages, [..., n, H_in, page], zero-padded to
    n = ceil(r / page) whole pages."""
    r = a.shape[-2]
    pad = -r % page
    if pad:
        a = torch.cat([a, a.new_zeros(*a.shape[:-2], pad, a.shape[-1])], -2)
    return a.unflatten(-2, (-1, page)).transpose(-1, -2)


@dataclass
class LoRAStack:
    """One projection's slot buffers for all L layers in one allocation, so an adapter is written into
    (or cleared from) every layer's slot with a few tensor copies instead of a few per layer.

    A: [L, S, R, H_in]; B: [L, S, H_out, R]; ranks, scales: [L, V]; on CPU also AT [L, S, P, H_in, W]
    (shared by the slices of one fused projection, this one's pages at columns at_col .. + page) and
    BT [L, S, R, H_out]. `layers[l]` is layer l's `LoRAWeights`, whose tensors are views of these
    (what the kernels read, one layer at a time). `rows[v]` is how many rank rows the last write at
    virtual slot v filled in every layer (the next write there zeroes those past its own rank); write
    a stack's slots through `set_slot` here, not through its layers' own `LoRAWeights.set_slot`.
    """

    A: torch.Tensor
    B: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    AT: torch.Tensor | None
    BT: torch.Tensor | None
    layers: list[LoRAWeights]
    rows: list[int]
    at_col: int = 0

    @classmethod
    def empty(cls, num_layers: int, num_slots: int, max_rank: int, in_features: int, out_features: int,
              dtype: torch.dtype, device: torch.device | str, page: int = 0,
              shrink_mirror: bool | None = None) -> LoRAStack:
        """Zeroed buffers of `num_layers` layers (see `LoRAWeights.empty` for the other arguments)."""
        return cls.empty_group(num_layers, num_slots, max_rank, in_features, [out_features], dtype, device,
                               page, shrink_mirror)[0]

    @classmethod
    def empty_group(cls, num_layers: int, num_slots: int, max_rank: int, in_features: int,
                    out_features: Sequence[int], dtype: torch.dtype, device: torch.device | str,
                    page: int = 0, shrink_mirror: bool | None = None) -> list[LoRAStack]:
        """One stack per slice of a fused projection (k = len(out_features)), sharing one CPU shrink
        mirror AT [L, S, P, H_in, k x page] when there is one (`LoRAWeights.empty`)."""
        page = page or max_rank
        num_virtual = num_slots * max_rank // page
        on_cpu = torch.device(device).type == "cpu"
        if on_cpu and shrink_mirror is None:  # builds or loads the kernel once a process: at engine start
            shrink_mirror = num_slots > 0 and cpu_ext.get(dtype) is None
        k = len(out_features)
        AT = (torch.zeros(num_layers, num_slots, max_rank // page, in_features, k * page, dtype=dtype)
              if on_cpu and shrink_mirror else None)
        stacks = []
        for i, h_out in enumerate(out_features):
            A = torch.zeros(num_layers, num_slots, max_rank, in_features, dtype=dtype, device=device)
            B = torch.zeros(num_layers, num_slots, h_out, max_rank, dtype=dtype, device=device)
            ranks = torch.zeros(num_layers, num_virtual, dtype=torch.int32, device=device)
            scales = torch.zeros(num_layers, num_virtual, dtype=torch.float32, device=device)
            BT = torch.zeros(num_layers, num_slots, max_rank, h_out, dtype=dtype) if on_cpu else None
            layers = [LoRAWeights(A=A[j], B=B[j], ranks=ranks[j], scales=scales[j], ranks_list=[0] * num_virtual,
                                  scales_list=[0.0] * num_virtual, page=page, AT=None if AT is None else AT[j],
                                  BT=None if BT is None else BT[j], at_col=i * page)
                      for j in range(num_layers)]
            stacks.append(cls(A, B, ranks, scales, AT, BT, layers, [0] * num_virtual, i * page))
        return stacks

    def set_slot(self, slot: int, A: torch.Tensor | None, B: torch.Tensor | None, ranks: Sequence[int] = (),
                 scales: Sequence[float] = ()) -> None:
        """Write one adapter at virtual slot `slot` of every layer: A [L, r, H_in], B [L, H_out, r] (zero
        past each layer's own rank), `ranks` and `scales` per layer (0 for a layer it leaves alone);
        A None clears the slot. Zeroes what this write leaves of the rows the previous one filled.
        Raises ValueError when the weights do not fit the buffers or run past the end of the physical
        slot."""
        layer0 = self.layers[0]
        if not 0 <= slot < layer0.num_virtual_slots:
            raise ValueError(f"virtual slot {slot} out of range [0, {layer0.num_virtual_slots})")
        old = self.rows[slot]
        if A is None and not old:
            return  # already clear (e.g. the MLP stacks of a q/k/v/o adapter): nothing to write
        for w in self.layers:
            w.version += 1  # invalidates weights cached for the packed path
        phys, row = layer0.locate(slot)
        num_layers = len(self.layers)
        if A is None:
            r, ranks, scales = 0, [0] * num_layers, [0.0] * num_layers
        else:
            r = A.shape[1]
            if (row + r > self.A.shape[2] or tuple(A.shape) != (num_layers, r, self.A.shape[3])
                    or tuple(B.shape) != (num_layers, self.B.shape[2], r) or len(ranks) != num_layers
                    or len(scales) != num_layers):
                raise ValueError(f"adapter weights A{tuple(A.shape)} B{tuple(B.shape)} with {len(ranks)} ranks do "
                                 f"not fit slot buffers of {num_layers} layers, max rank {self.A.shape[2]}, "
                                 f"H_in {self.A.shape[3]}, H_out {self.B.shape[2]} at rank row {row}")
            self.rows[slot] = max(r, old)  # before the copies: if one fails, a later clear zeroes these rows
            one = len(set(scales)) == 1  # one scaling for every layer: no tensor of them to build
            scale = float(scales[0]) if one else torch.tensor(scales, dtype=torch.float32)[:, None, None]
            _copy_rows(self, phys, row, A, B, scale, layer0.page, self.at_col)
        _zero_rows(self, phys, row, old, layer0.page, self.at_col, keep=r)
        self.rows[slot] = r
        for buffer, values, dtype in ((self.ranks, ranks, torch.int32), (self.scales, scales, torch.float32)):
            if len(set(values)) == 1:
                buffer[:, slot] = values[0]  # a fill, cheaper than building a tensor (rank 0 on a clear)
            else:
                buffer[:, slot] = torch.tensor(values, dtype=dtype)
        for w, rank, scale in zip(self.layers, ranks, scales, strict=True):
            w.ranks_list[slot] = rank
            w.scales_list[slot] = float(scale)
            (w.live.add if rank else w.live.discard)(slot)

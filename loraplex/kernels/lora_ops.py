"""The engine's one entry point for multi-adapter LoRA: `add_lora`.

Letters: T rows, S physical adapter slots, R max rank, V virtual slots (`LoRAWeights`), H_in / H_out
in / out features of one slice, N the sum of the step's active ranks.

Semantics, for each slice i with column offset off_i, and each row t with virtual slot s = slot_ids[t]
>= 0, A_i^s / B_i^s that slot's rank rows / columns:
    y[t, off_i:off_i+H_out_i] += scales_i[s] * (x[t] @ A_i^s[:r_i[s]].T) @ B_i^s[:, :r_i[s]].T
Several slices (q, k, v of a fused qkv projection; gate and up) share one x and one call.

Backends: "triton" (SGMV kernels, CUDA), "segmented" (PyTorch reference, one matmul pair per
segment), "packed" (PyTorch, one matmul pair for all adapters; CPU path for few adapters), "bgmv"
(each row reads only its own adapter, in the compiled CPU kernel `cpu_ext` where it is built, else
through PyTorch `embedding_bag`; CPU path for many adapters, with prefill-sized segments split off to
dense matmul pairs). `LORAPLEX_LORA_BACKEND` or `set_backend` forces one;
"auto" picks Triton on CUDA, and on CPU packed up to N <= 48 (bf16/fp16), else bgmv. Forcing
"triton" on CPU tensors runs the kernels in the Triton interpreter, which needs TRITON_INTERPRET=1 set
before the kernels module is first imported (tests).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels import cpu_ext
from loraplex.kernels.metadata import LoRAMeta, build_lora_meta
from loraplex.kernels.reference import (
    add_lora_bgmv,
    add_lora_dense_segments,
    add_lora_fused_packed,
    add_lora_packed,
    add_lora_segmented,
    fill_fused_rows,
    fused_plan,
)

BACKENDS = ("auto", "triton", "segmented", "packed", "bgmv")
_backend = os.environ.get("LORAPLEX_LORA_BACKEND", "auto")

# CPU path choice, measured on a 2-core AVX512-BF16 CPU (bf16, the default model's q/k/v/o and MLP
# shapes, rank-8 adapters; numbers in docs/kernels.md). The packed path multiplies every row by all N
# active rank columns: its shrink runs inside the base GEMM (`lora_linear`), its expand is one dense
# matmul per projection, so it is cheapest while N is small. bgmv reads only each row's own adapter,
# so its cost does not grow with the number of adapters. With all 30 layers' weights in play (caches
# cold, as in a real step), at 104 rows: 1-4 adapters cost 80-135 us per layer (q/k/v/o) packed
# against 160-200 us with bgmv; 8 adapters 220 against 212, 12 adapters 272 against 249; at 32 rows
# the same crossing. So packed up to N = 48 (six rank-8 adapters). Those bgmv numbers are the
# embedding_bag gathers'; the compiled kernel is cheaper from about four adapters on, but within this
# VM's noise of packed up to six (docs/kernels.md), so the limit stays.
# fp32 keeps the limit measured against the older per-row path (bgmv not re-measured in fp32).
PACKED_LIMITS = {torch.float32: (1024, 160 * 1024)}  # dtype -> (max N, max T x N)
PACKED_LIMITS_16BIT = (48, 1024 * 1024)
# With bgmv, segments of at least this many rows (long prefill chunks) take one dense matmul pair each
# (`add_lora_dense_segments`), reading their adapter once for all their rows. Measured on the paging
# benchmark (prefill chunks of 8-64 rows among ~50 decodes): splitting at 16 rows cost 4.6 s of LoRA
# time against 3.2 s for bgmv on every row, so only longer chunks are split off.
LONG_SEGMENT_ROWS = 128


@dataclass
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
    them (pages interleaved by h cost 165 against 104 us per q/k/v shrink, 30 layers' tables in play).
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
    version: int = 0
    packed_cache: tuple | None = field(default=None, repr=False)
    page: int = 0  # rank rows per virtual slot; 0 means R
    AT: torch.Tensor | None = field(default=None, repr=False)
    BT: torch.Tensor | None = field(default=None, repr=False)
    at_col: int = 0
    live: set[int] = field(default_factory=set)
    fused: FusedShrink | None = field(default=None, repr=False)  # on a projection's first slice
    _tables: tuple | None = field(default=None, repr=False)
    _flat: tuple | None = field(default=None, repr=False)

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

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU mirrors as the gather path's tables (views, made once): AT as rows (physical slot,
        page, h) of W values, [S P H_in, W]; BT as rank rows, [S R, H_out]."""
        if self._tables is None:
            self._tables = (self.AT.view(-1, self.AT.shape[-1]), self.BT.view(-1, self.BT.shape[-1]))
        return self._tables

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A as [S R, H_in] and the BT mirror as [S R, H_out] (views, made once): rank row v x page of
        each is virtual slot v's first, what the compiled CPU kernel reads."""
        if self._flat is None:
            self._flat = (self.A.view(-1, self.A.shape[2]), self.BT.view(-1, self.BT.shape[-1]))
        return self._flat

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
            shrink_mirror = num_slots > 0 and cpu_ext.get() is None
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


# Fused-shrink capacity: rank rows per slice under each base weight, the packed path's 16-bit limit on
# N (an fp32 step past it takes the packed path unfused).
FUSED_MAX_ROWS = PACKED_LIMITS_16BIT[0]
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
    slice) for the packed path. Made by `attach_fused_shrink`.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    out: int
    cap_pages: int
    key: tuple | None = None
    expand: list | None = None


def attach_fused_shrink(linear: nn.Linear, slices: Sequence[LoRAWeights],
                        max_rows: int = FUSED_MAX_ROWS) -> FusedShrink | None:
    """Give `linear` (whose output is the slices' outputs side by side) room for `max_rows` rank rows
    per slice under its weight, and hand it to `lora_linear` through slices[0].fused.

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
    w0.fused = FusedShrink(weight, bias, out, cap_pages)
    return w0.fused


def lora_linear(x: torch.Tensor, linear: nn.Linear, slices: Sequence[LoRAWeights], meta: LoRAMeta) -> torch.Tensor:
    """linear(x) plus every row's adapter delta: x [T, H_in] -> y [T, sum H_out] (the slices' outputs
    side by side, as `add_lora` with default offsets).

    With a `FusedShrink` attached (CPU) and the packed path chosen (few adapters in the step), every
    active adapter's shrink runs inside the base GEMM and y is a view of that wider output. Otherwise
    (CUDA, the bgmv path, forced backends, more pages than the room under the weight) it is
    `add_lora(linear(x), x, slices, meta)`.
    """
    fs = slices[0].fused
    if fs is None or _backend != "auto" or not meta.has_lora:
        return add_lora(linear(x), x, slices, meta)
    if all(w.live.isdisjoint(meta.active_slots) for w in slices):
        return linear(x)  # no adapter of this step targets this projection (q/k/v/o-only adapters on the MLP)
    backend = _pick_backend(x, meta, slices)
    plan = fused_plan(meta, slices[0].page, len(slices), fs.cap_pages) if backend == "packed" else None
    if plan is None:
        return _dispatch(linear(x), x, slices, meta, _offsets(slices), backend)
    if linear.weight.data_ptr() != fs.weight.data_ptr() or linear.weight.dtype != fs.weight.dtype:
        raise RuntimeError("the linear's weight was re-bound after attach_fused_shrink (load_state_dict with "
                           "assign=True, .to(dtype)?): it no longer shares the buffer with the shrink rows")
    fill_fused_rows(fs, slices, plan)
    n = fs.out + plan["cols"]
    y_ext = F.linear(x, fs.weight[:n], None if fs.bias is None else fs.bias[:n])  # [T, H_out + E]
    return add_lora_fused_packed(y_ext[:, :fs.out], y_ext[:, fs.out:], slices, meta, plan, fs)


def _offsets(slices: Sequence[LoRAWeights]) -> list[int]:
    """Each slice's first column when the slices' outputs sit side by side."""
    offsets, off = [], 0
    for w in slices:
        offsets.append(off)
        off += w.B.shape[1]
    return offsets


def set_backend(name: str) -> None:
    """Force a backend for every later `add_lora` call ("auto" restores the choice). ValueError if unknown."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown LoRA backend {name!r}; choose one of {BACKENDS}")
    _backend = name


def _pick_backend(x: torch.Tensor, meta: LoRAMeta, slices: Sequence[LoRAWeights]) -> str:
    if _backend != "auto":
        return _backend
    if x.is_cuda:
        return "triton"
    if meta.slot_ranks is None:
        return "segmented"
    if meta._active_ranks is None:  # every layer of the step asks: count once
        meta._active_ranks = sum(meta.slot_ranks[s] for s in meta.seg_slots_list)
    n = meta._active_ranks
    max_n, max_tn = PACKED_LIMITS.get(x.dtype, PACKED_LIMITS_16BIT)
    if n <= max_n and meta.num_tokens * n <= max_tn:
        return "packed"
    return "bgmv" if all(w.BT is not None for w in slices) else "segmented"


def _split_long_segments(meta: LoRAMeta) -> tuple[LoRAMeta | None, LoRAMeta | None]:
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


def add_lora(y: torch.Tensor, x: torch.Tensor, slices: Sequence[LoRAWeights], meta: LoRAMeta,
             offsets: Sequence[int] | None = None) -> torch.Tensor:
    """Add every row's own adapter delta to y in place (semantics in the module docstring).

    y: [T, sum H_out_i]; x: [T, H_in]; slices: the projection's LoRAWeights, one per output slice;
    offsets: each slice's first column in y (default: consecutive). Returns y. A step without any
    adapter row, or whose adapters all leave this projection alone (rank 0 in every active slot),
    returns at once.
    """
    if not meta.has_lora:
        return y
    if all(w.live.isdisjoint(meta.active_slots) for w in slices):
        return y  # no adapter in this step targets this projection (e.g. q/k/v/o-only adapters on the MLP)
    return _dispatch(y, x, slices, meta, list(offsets) if offsets is not None else _offsets(slices),
                     _pick_backend(x, meta, slices))


def _dispatch(y: torch.Tensor, x: torch.Tensor, slices: Sequence[LoRAWeights], meta: LoRAMeta,
              offsets: list[int], backend: str) -> torch.Tensor:
    """`add_lora` past its early returns, on the backend already picked."""
    if backend == "packed":
        return add_lora_packed(y, x, slices, meta, offsets)
    if backend == "bgmv":
        if any(w.BT is None for w in slices):
            raise ValueError("the bgmv path reads the CPU mirrors of LoRAWeights.empty(device='cpu')")
        # prefill chunks through dense matmuls, the rest gathered per row (forced bgmv: every row)
        long, short = _split_long_segments(meta) if _backend == "auto" else (None, meta)
        if long is not None:
            add_lora_dense_segments(y, x, slices, long, offsets)
        if short is not None:
            add_lora_bgmv(y, x, slices, short, offsets)
        return y
    if backend == "triton":
        from loraplex.kernels.triton_sgmv import add_lora_triton

        return add_lora_triton(y, x, slices, meta, offsets)
    return add_lora_segmented(y, x, slices, meta, offsets)

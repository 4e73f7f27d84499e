"""Per-step segment metadata for multi-adapter LoRA ops.

Letters: T tokens (rows) in the step, G segments (distinct adapter slots among the rows), S adapter
slots, R max rank.

Rows are grouped once per step by a stable sort of the per-row slot map; every layer's LoRA op reuses
the result (Punica's SGMV segments):

    slot_ids   = [ 2, -1,  0,  2,  0]          # per row, -1 = no adapter
    row_order  = [ 2,  4,  0,  3]              # rows with an adapter, stably sorted by slot
    seg_slots  = [ 0,  2]                      # one entry per segment
    seg_starts = [ 0,  2]  seg_lens = [2, 2]   # into row_order
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class LoRAMeta:
    """Segments of one step. Tensors live on the device of the rows; `*_list` are host copies.

    slot_ids: [T] int32, slot of each row or -1. row_order: [N] int64, rows with slot >= 0 sorted
    stably by slot (N <= T). seg_slots, seg_starts, seg_lens: [G] int32. max_seg_len: longest segment.
    slot_ranks: host list of length V (virtual slots, see `LoRAWeights`), the rank of the adapter at
    each virtual slot over all layers (0 elsewhere), used by the packed and bgmv CPU paths. `row_tiles(block_m)` cuts segments into the Triton
    kernels' row tiles, cached per tile height so every layer of the step reuses one copy.
    """

    num_tokens: int
    slot_ids: torch.Tensor
    row_order: torch.Tensor
    seg_slots: torch.Tensor
    seg_starts: torch.Tensor
    seg_lens: torch.Tensor
    max_seg_len: int
    seg_slots_list: list[int]
    seg_starts_list: list[int]
    seg_lens_list: list[int]
    slot_ranks: list[int] | None = None
    slot_ids_list: list[int] | None = None  # host copy of slot_ids (build_lora_meta sets it)
    _packed: dict | None = None
    _bgmv: dict | None = None
    _split: tuple | None = None
    _fused: dict | None = None  # fused-shrink column layouts (see `cpu_packed.fused_layout`)
    _active_ranks: int | None = None  # N, the sum of the active slots' ranks (CPU path choice)
    _row_tiles: dict | None = None

    @property
    def num_segments(self) -> int:
        return len(self.seg_slots_list)

    @cached_property
    def active_slots(self) -> frozenset[int]:
        """The step's slots, for the per-projection "does any adapter here target it?" test."""
        return frozenset(self.seg_slots_list)

    @property
    def has_lora(self) -> bool:
        return bool(self.seg_slots_list)

    def select(self, rows: list[int]) -> LoRAMeta:
        """The metadata of rows [B] of this step (host indices into its T rows), in that order: for layers
        that run on those rows alone (the last layer's MLP on the sampled rows, `LlamaModel.forward`). Built
        from the host copy of the slot ids, so a GPU step does not wait for the device here."""
        return build_lora_meta([self.slot_ids_list[r] for r in rows], self.slot_ids.device, slot_ranks=self.slot_ranks)

    def row_tiles(self, block_m: int) -> torch.Tensor:
        """[num_tiles, 3] int32 (slot, first, end) into row_order: each segment cut into runs of at most
        `block_m` rows, so a kernel grid covers only rows that have an adapter (no per-slot padding).

        With block_m = 2 and segments (slot 0: 3 rows), (slot 2: 1 row):
            row_order  = [r0 r1 r2 | r3]
            tiles      = [(0, 0, 2), (0, 2, 3), (2, 3, 4)]
        """
        if self._row_tiles is None:
            self._row_tiles = {}
        if block_m not in self._row_tiles:
            tiles = [(slot, first, min(first + block_m, start + n))
                     for slot, start, n in zip(self.seg_slots_list, self.seg_starts_list, self.seg_lens_list,
                                               strict=True)
                     for first in range(start, start + n, block_m)]
            self._row_tiles[block_m] = torch.tensor(tiles, dtype=torch.int32,
                                                    device=self.row_order.device).reshape(-1, 3)
        return self._row_tiles[block_m]


def build_lora_meta(slot_ids: list[int] | torch.Tensor, device: torch.device | str = "cpu",
                    slot_ranks: list[int] | None = None) -> LoRAMeta:
    """Group rows by adapter slot.

    slot_ids: [T] per-row slot (-1 = no adapter), a host list or tensor. Returns the `LoRAMeta` on
    `device`. Raises ValueError for a slot id below -1.
    """
    ids = slot_ids.tolist() if isinstance(slot_ids, torch.Tensor) else list(slot_ids)
    if any(s < -1 for s in ids):
        raise ValueError(f"slot ids must be >= -1, got {min(ids)}")
    order = sorted((i for i, s in enumerate(ids) if s >= 0), key=lambda i: ids[i])  # stable
    seg_slots: list[int] = []
    seg_starts: list[int] = []
    seg_lens: list[int] = []
    for pos, row in enumerate(order):
        s = ids[row]
        if seg_slots and seg_slots[-1] == s:
            seg_lens[-1] += 1
        else:
            seg_slots.append(s)
            seg_starts.append(pos)
            seg_lens.append(1)

    def t(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return LoRAMeta(
        num_tokens=len(ids),
        slot_ids=t(ids, torch.int32),
        row_order=t(order, torch.int64),
        seg_slots=t(seg_slots, torch.int32),
        seg_starts=t(seg_starts, torch.int32),
        seg_lens=t(seg_lens, torch.int32),
        max_seg_len=max(seg_lens, default=0),
        seg_slots_list=seg_slots,
        seg_starts_list=seg_starts,
        seg_lens_list=seg_lens,
        slot_ranks=slot_ranks,
        slot_ids_list=ids,
    )

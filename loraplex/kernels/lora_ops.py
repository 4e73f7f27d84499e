"""The engine's one entry point for multi-adapter LoRA: `add_lora`.

Letters: T rows, S adapter slots, R max rank, H_in / H_out in / out features of one slice.

Semantics, for each slice i with column offset off_i, and each row t with s = slot_ids[t] >= 0:
    y[t, off_i:off_i+H_out_i] += scales_i[s] * (x[t] @ A_i[s, :r_i[s]].T) @ B_i[s, :, :r_i[s]].T
Several slices (q, k, v of a fused qkv projection; gate and up) share one x and one call.

Backends: "triton" (SGMV kernels, CUDA), "segmented" (PyTorch reference, one matmul pair per
segment), "packed" (PyTorch, one matmul pair for all adapters; CPU fast path for small T).
`LORAPLEX_LORA_BACKEND` or `set_backend` forces one; "auto" picks Triton on CUDA, and on CPU the
cheaper of packed and segmented. Forcing "triton" on CPU tensors runs the kernels in the Triton
interpreter, which needs TRITON_INTERPRET=1 set before the kernels module is first imported (tests).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from loraplex.kernels.metadata import LoRAMeta
from loraplex.kernels.reference import add_lora_gathered, add_lora_packed, add_lora_segmented

BACKENDS = ("auto", "triton", "segmented", "packed", "gathered")
_backend = os.environ.get("LORAPLEX_LORA_BACKEND", "auto")

# CPU path choice, measured on a 2-core AVX512-BF16 CPU (decode-shaped steps, q/k/v/o/gate/up/down
# of the default model, 30 layers). The packed path multiplies every row by all N active rank
# columns; in bf16 it beat the others everywhere measured (64 rows over 64 rank-8 adapters: packed 45 ms,
# gathered 109 ms, segmented 508 ms per step; T x N = 512K: 430 ms against 922 ms). In fp32 it loses
# past about T x N = 160K or N = 1K (64 rows over 64 rank-32 adapters: packed 616 ms, segmented 556 ms,
# gathered 189 ms), where per-row gathering wins while segments hold a row or two, and one matmul pair
# per segment wins when they hold more (256 rows over 64 adapters: 769 ms against 2,178 ms gathered).
PACKED_LIMITS = {torch.float32: (1024, 160 * 1024)}  # dtype -> (max N, max T x N)
PACKED_LIMITS_16BIT = (4096, 1024 * 1024)


@dataclass
class LoRAWeights:
    """Stacked adapter-slot buffers of one projection (one slice).

    A: [S, R, H_in]; B: [S, H_out, R] (PEFT's lora_A / lora_B weight layouts, stacked by slot);
    ranks: [S] int32, scales: [S] fp32 on the buffers' device; host copies in `ranks_list` and
    `scales_list`. An empty slot has rank 0 and all-zero A and B.
    """

    A: torch.Tensor
    B: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    ranks_list: list[int] = field(default_factory=list)
    scales_list: list[float] = field(default_factory=list)
    version: int = 0
    packed_cache: tuple | None = field(default=None, repr=False)

    @classmethod
    def empty(cls, num_slots: int, max_rank: int, in_features: int, out_features: int,
              dtype: torch.dtype, device: torch.device | str) -> LoRAWeights:
        """Zeroed buffers for `num_slots` slots of rank up to `max_rank`."""
        return cls(
            A=torch.zeros(num_slots, max_rank, in_features, dtype=dtype, device=device),
            B=torch.zeros(num_slots, out_features, max_rank, dtype=dtype, device=device),
            ranks=torch.zeros(num_slots, dtype=torch.int32, device=device),
            scales=torch.zeros(num_slots, dtype=torch.float32, device=device),
            ranks_list=[0] * num_slots,
            scales_list=[0.0] * num_slots,
        )

    def set_slot(self, slot: int, A: torch.Tensor | None, B: torch.Tensor | None, scale: float) -> None:
        """Write one adapter's weights into `slot`: A [r, H_in], B [H_out, r]; None clears the slot.

        The rank padding beyond r is zeroed, so the packed path and the kernels see exact zeros.
        Raises ValueError when r exceeds the buffers' max rank or the shapes do not fit.
        """
        self.version += 1  # invalidates weights cached for the packed path
        self.A[slot].zero_()
        self.B[slot].zero_()
        if A is None:
            r, scale = 0, 0.0
        else:
            r = A.shape[0]
            if r > self.A.shape[1] or A.shape[1] != self.A.shape[2] or tuple(B.shape) != (self.B.shape[1], r):
                raise ValueError(f"adapter weights A{tuple(A.shape)} B{tuple(B.shape)} do not fit slot "
                                 f"buffers A{tuple(self.A.shape[1:])} B{tuple(self.B.shape[1:])}")
            self.A[slot, :r].copy_(A)
            self.B[slot, :, :r].copy_(B)
        self.ranks[slot] = r
        self.scales[slot] = scale
        self.ranks_list[slot] = r
        self.scales_list[slot] = float(scale)


def set_backend(name: str) -> None:
    """Force a backend for every later `add_lora` call ("auto" restores the choice). ValueError if unknown."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown LoRA backend {name!r}; choose one of {BACKENDS}")
    _backend = name


def _pick_backend(x: torch.Tensor, meta: LoRAMeta) -> str:
    if _backend != "auto":
        return _backend
    if x.is_cuda:
        return "triton"
    if meta.slot_ranks is None:
        return "segmented"
    n = sum(meta.slot_ranks[s] for s in meta.seg_slots_list)
    max_n, max_tn = PACKED_LIMITS.get(x.dtype, PACKED_LIMITS_16BIT)
    if n <= max_n and meta.num_tokens * n <= max_tn:
        return "packed"
    return "gathered" if meta.row_order.numel() <= 2 * meta.num_segments else "segmented"


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
    if not any(w.ranks_list[s] for w in slices for s in meta.seg_slots_list):
        return y  # no adapter in this step targets this projection (e.g. q/k/v/o-only adapters on the MLP)
    if offsets is None:
        offsets, off = [], 0
        for w in slices:
            offsets.append(off)
            off += w.B.shape[1]
    backend = _pick_backend(x, meta)
    if backend == "packed":
        return add_lora_packed(y, x, slices, meta, list(offsets))
    if backend == "gathered":
        return add_lora_gathered(y, x, slices, meta, list(offsets))
    if backend == "triton":
        from loraplex.kernels.triton_sgmv import add_lora_triton

        return add_lora_triton(y, x, slices, meta, list(offsets))
    return add_lora_segmented(y, x, slices, meta, list(offsets))

"""The CPU implementation of the multi-adapter LoRA op, one object per process chosen by the dispatch
(`lora_ops`), like vLLM's `PunicaWrapperCPU`: it runs the CPU paths and owns what they keep about the
slot buffers between steps, so the buffers (`LoRAWeights`) hold weights and nothing else.

Kept, keyed by the buffers weakly (buffers that go away take their entries along):
- packed: per projection (its first slice), the packed path's active A rows and B columns, rebuilt when
  the step's active slots or a slot write (`LoRAWeights.version`) changes them;
- views: per slice, the views of its buffers the gathers and the compiled kernel read.
The fused shrink's rows live under the base weight, on the linear (`cpu_packed.FusedShrink`).
"""

from __future__ import annotations

from collections.abc import Sequence
from weakref import WeakKeyDictionary

import torch

from loraplex.kernels.cpu_bgmv import add_lora_bgmv, add_lora_dense_segments, split_long_segments
from loraplex.kernels.cpu_packed import add_lora_packed
from loraplex.kernels.metadata import LoRAMeta
from loraplex.kernels.weights import LoRAWeights


class CPULoRA:
    """Runs the "packed" and "bgmv" paths (see `lora_ops` for which one a step takes)."""

    def __init__(self):
        self.packed: WeakKeyDictionary[LoRAWeights, tuple] = WeakKeyDictionary()
        self.views: WeakKeyDictionary[LoRAWeights, dict] = WeakKeyDictionary()

    def add(self, y: torch.Tensor, x: torch.Tensor, slices: Sequence[LoRAWeights], meta: LoRAMeta,
            offsets: list[int], backend: str, split_long: bool = True) -> torch.Tensor:
        """y [T, sum H_out] += every row's adapter delta on `backend` ("packed" or "bgmv"); with
        split_long, bgmv sends long segments (prefill chunks) through dense matmul pairs. Returns y.
        Raises ValueError for bgmv on buffers without the CPU mirrors."""
        if backend == "packed":
            return add_lora_packed(y, x, slices, meta, offsets, self.packed)
        if any(w.BT is None for w in slices):
            raise ValueError("the bgmv path reads the CPU mirrors of LoRAWeights.empty(device='cpu')")
        long, short = split_long_segments(meta) if split_long else (None, meta)
        if long is not None:
            add_lora_dense_segments(y, x, slices, long, offsets)
        if short is not None:
            add_lora_bgmv(y, x, slices, short, offsets, self.views)
        return y

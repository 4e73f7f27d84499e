"""Multi-adapter LoRA ops: per-step segment metadata, slot buffers, and one dispatching `add_lora`.

Files by concern: `metadata` (the step's segments), `weights` (slot buffers: weights only),
`reference` (the fp32 reference), `cpu` (the CPU implementation, which owns the CPU paths' caches),
`cpu_packed` and `cpu_bgmv` (the CPU paths), `cpu_ext` (the compiled CPU kernel), `cpu_gemm` (base
linears on weights packed once for our AVX2 GEMM, oneDNN or MKL), `cpu_greedy` (greedy tokens from the
lm_head without the logits), `triton_sgmv` (the
CUDA kernels), `lora_ops` (the dispatch). Nothing here imports `engine/` or
`adapters/`.

The Triton names (`add_lora_triton`, `sgmv_shrink`, `sgmv_expand`, `TileConfig`, `TILE_TABLE`,
`pick_tiles`) load on first access, so importing this package needs no Triton and does not fix the
Triton interpreter mode (TRITON_INTERPRET is read when the kernels are defined).
"""

from loraplex.kernels.cpu_gemm import linear as base_linear
from loraplex.kernels.cpu_gemm import pack_linears
from loraplex.kernels.cpu_packed import FusedShrink, add_lora_packed, attach_fused_shrink
from loraplex.kernels.lora_ops import BACKENDS, add_lora, lora_linear, set_backend
from loraplex.kernels.metadata import LoRAMeta, build_lora_meta
from loraplex.kernels.reference import add_lora_segmented, lora_expand_ref, lora_shrink_ref
from loraplex.kernels.weights import LoRAStack, LoRAWeights

_TRITON_NAMES = ("add_lora_triton", "sgmv_shrink", "sgmv_expand", "TileConfig", "TILE_TABLE", "pick_tiles")

__all__ = [
    "BACKENDS",
    "FusedShrink",
    "LoRAMeta",
    "LoRAStack",
    "LoRAWeights",
    "add_lora",
    "add_lora_packed",
    "add_lora_segmented",
    "attach_fused_shrink",
    "base_linear",
    "build_lora_meta",
    "lora_expand_ref",
    "lora_linear",
    "lora_shrink_ref",
    "pack_linears",
    "set_backend",
    *_TRITON_NAMES,
]


def __getattr__(name: str):
    if name in _TRITON_NAMES:
        from loraplex.kernels import triton_sgmv

        return getattr(triton_sgmv, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

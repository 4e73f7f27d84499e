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
"auto" picks Triton on CUDA, and on CPU packed up to N <= 48 (16-bit always, fp32 where the
compiled BGMV kernel runs; fp32 without it up to N <= 1024), else bgmv. Forcing
"triton" on CPU tensors runs the kernels in the Triton interpreter, which needs TRITON_INTERPRET=1 set
before the kernels module is first imported (tests).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from loraplex.kernels import cpu_ext
from loraplex.kernels.cpu import CPULoRA
from loraplex.kernels.cpu_gemm import linear as base_linear
from loraplex.kernels.cpu_packed import fused_layout, fused_linear, fused_shrink_of
from loraplex.kernels.metadata import LoRAMeta
from loraplex.kernels.reference import add_lora_segmented
from loraplex.kernels.weights import LoRAWeights

BACKENDS = ("auto", "triton", "segmented", "packed", "bgmv")

_backend = os.environ.get("LORAPLEX_LORA_BACKEND", "auto")  # a forced path (tests, benchmarks), or the choice
_CPU = CPULoRA()  # the CPU implementation and its caches; CUDA runs the Triton kernels, which keep none

# CPU path choice (measured on a 2-core AVX512-BF16 CPU; the figures are in docs/kernels.md): the
# packed path multiplies every row by all N active rank columns, so it is cheapest while N is small;
# bgmv reads only each row's own adapter, so its cost does not grow with the number of adapters. They
# cross at about six rank-8 adapters in bf16. In fp32 the same limit holds where the compiled BGMV
# kernel runs (an AVX-512 CPU, or AVX2 + FMA for fp32): the vllm preset's 16 rank-8 adapters (N = 128
# at a 64-row decode), 2-core AMD EPYC, 1 thread, took 21.2-22.4 s packed against 18.4-19.2 s with
# bgmv on AVX-512 (docs/kernels.md); on an AVX2-only EPYC a 64-row decode step took 9-11% less with
# bgmv (per-pair and overall medians), 20 interleaved pairs on one engine (docs/performance.md).
# Without the kernel, fp32 bgmv runs on embedding_bag gathers, and keeps the N limit measured against
# that older per-row path; its T x N limit holds either way.
PACKED_LIMITS = {torch.float32: (1024, 160 * 1024)}  # dtype -> (max N, max T x N); with the kernel N <= 48

PACKED_LIMITS_16BIT = (48, 1024 * 1024)


def lora_linear(x: torch.Tensor, linear: nn.Linear, slices: Sequence[LoRAWeights], meta: LoRAMeta) -> torch.Tensor:
    """linear(x) plus every row's adapter delta: x [T, H_in] -> y [T, sum H_out] (the slices' outputs
    side by side, as `add_lora` with default offsets).

    With a `FusedShrink` attached (CPU) and the packed path chosen (few adapters in the step), every
    active adapter's shrink runs inside the base GEMM and y is a view of that wider output. Otherwise
    (CUDA, the bgmv path, forced backends, more pages than the room under the weight) it is
    `add_lora(linear(x), x, slices, meta)`.
    """
    fs = fused_shrink_of(linear)
    if fs is None or _backend != "auto" or not meta.has_lora:
        return add_lora(base_linear(linear, x), x, slices, meta)
    if all(w.live.isdisjoint(meta.active_slots) for w in slices):
        return base_linear(linear, x)  # no adapter of this step targets this projection (q/k/v/o-only adapters on the MLP)
    backend = _pick_backend(x, meta, slices)
    layout = fused_layout(meta, slices[0].page, len(slices), fs.cap_pages) if backend == "packed" else None
    if layout is None:
        return _dispatch(base_linear(linear, x), x, slices, meta, _offsets(slices), backend)
    return fused_linear(x, linear, slices, meta, layout)


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
    if x.dtype in PACKED_LIMITS and cpu_ext.get(x.dtype) is not None:  # the compiled kernel: bgmv past 16-bit's N
        max_n = min(max_n, PACKED_LIMITS_16BIT[0])
    if n <= max_n and meta.num_tokens * n <= max_tn:
        return "packed"
    return "bgmv" if all(w.BT is not None for w in slices) else "segmented"


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
    if backend in ("packed", "bgmv"):  # forced bgmv gathers every row, prefill chunks too
        return _CPU.add(y, x, slices, meta, offsets, backend, split_long=_backend == "auto")
    if backend == "triton":
        from loraplex.kernels.triton_sgmv import add_lora_triton

        return add_lora_triton(y, x, slices, meta, offsets)
    return add_lora_segmented(y, x, slices, meta, offsets)

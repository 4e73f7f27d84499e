"""`LORAPLEX_CPU_ISA=avx2`: run loraplex on its AVX2 code paths on a CPU that also has AVX-512, to measure
the other CPU family (machines lent to a session differ: some have AVX-512 and bf16, some only AVX2).

Held to AVX2, each part takes the path it takes on an AVX2-only CPU:
- our compiled kernels are built without their AVX-512 code (`-DLORAPLEX_NO_AVX512`, a build of its
  own): the GEMM's 6 x 16 tiles, the attention loops' 8-lane clones, BGMV's AVX2 fp32 path, no bf16
  screen of the lm_head;
- PyTorch's own kernels take their AVX2 dispatch (`ATEN_CPU_CAPABILITY=avx2`), oneDNN and MKL their
  AVX2 code (`ONEDNN_MAX_CPU_ISA=AVX2`, `MKL_ENABLE_INSTRUCTIONS=AVX2`), all read when torch loads, so
  this module sets them first (from `loraplex/__init__.py`, unless the environment already chose; a
  process that imported torch first gets a warning); oneDNN's bf16 linears are refused, as there;
- `dtype="auto"` picks fp32, as it does without AVX512-BF16;
- a benchmark's vLLM peer loads vLLM's AVX2 kernels (`vllm._C_AVX2`, `bench/vllm_peer.py`), and every
  report's CPU flags line says the run was held.

The core still runs its AVX2 instructions as that CPU does: a Zen 4 at full 256-bit width, like Haswell
and later or Zen 2 and later, not like Zen 1's half-width units. For benchmarks, not for serving.
Unset, empty or "auto": the CPU's best paths. Any other value raises ValueError.
"""

from __future__ import annotations

import os
import sys

ENV = "LORAPLEX_CPU_ISA"
CHOICES = ("auto", "avx2")
# set before torch loads (each only where the environment has not chosen): PyTorch's dispatch, oneDNN's, MKL's
TORCH_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def cap() -> str | None:
    """"avx2" when `LORAPLEX_CPU_ISA` holds this process to AVX2, else None. Raises ValueError for a value
    other than avx2, auto or empty."""
    value = os.environ.get(ENV, "").strip().lower()
    if value not in ("", *CHOICES):
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: choose one of {', '.join(CHOICES)}")
    return value if value == "avx2" else None


def apply() -> bool:
    """Under `LORAPLEX_CPU_ISA=avx2`, set PyTorch's, oneDNN's and MKL's ISA variables (`TORCH_ENV`) where unset,
    before torch is imported. True if the process is held to AVX2 and torch was not loaded yet (after,
    torch's own kernels would keep their dispatch; ours are still built without AVX-512)."""
    if cap() is None:
        return False
    for name, value in TORCH_ENV.items():
        os.environ.setdefault(name, value)
    return "torch" not in sys.modules


def describe() -> str:
    """A note for benchmark reports' CPU flags line: "" unless held to AVX2, else what is held, with
    PyTorch's dispatch as it is in effect (a process that loaded torch before `apply` keeps its own)."""
    if not cap():
        return ""
    import torch

    held = ", ".join(f"{name}={os.environ.get(name, 'unset')}" for name in TORCH_ENV)
    return f" (held to AVX2: {ENV}=avx2, {held}; PyTorch's kernels: {torch.backends.cpu.get_cpu_capability()})"

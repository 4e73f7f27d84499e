"""fp32 base linears on weights packed once for MKL's GEMM (`csrc/packed_gemm_cpu.cpp`).

Letters: M rows of a call, K in features, N out features.

An sgemm on a plain [N, K] weight repacks that weight into the kernel's blocked layout on every call;
at decode batch sizes that repacking is a large share of the call. `pack_linears` packs each base weight
once (MKL's `cblas_sgemm_pack`), and `linear` runs the calls of 2..`max_rows` rows on the packed copy
(`cblas_sgemm_compute`), the rest through `F.linear`. vLLM's CPU backend prepacks its linear weights for
the same reason (oneDNN's `onednn_mm`). Measured on a 2-core AVX-512 Xeon, fp32, one thread, the
default model's 30 layers of q/k/v, o, gate/up and down weights cold in cache (docs/performance.md):

    rows               1     8     16    32    64        128        256       512
    packed / F.linear  1.0x  1.5x  1.5x  1.5x  1.3-1.4x  0.9-1.25x  1.1-1.2x  0.9-1.07x
    lm_head (49152 x 576): 1.1x at 1 row, 1.55x at 4-64, 1.16x at 128, 0.96x from 192

so decoder linears take the packed path up to 256 rows and the lm_head up to 128. With MKL held to
its AVX2 kernels (`MKL_ENABLE_INSTRUCTIONS=AVX2`, as on a CPU without AVX-512) the decoder linears gain
1.4-1.7x at 2-32 rows and 1.12x at 64, and lose 2-3% at 100-256, so without AVX-512 they stop at 64.
The results are as close to the exact product as F.linear's (tested); for some shapes they are the
same bits, for others MKL blocks K differently on the packed path.

One buffer serving every M is what this MKL (PyTorch 2.13's) does, not something its documentation
promises (PyTorch's own `mkl_linear` uses a buffer only for the M it was packed for), so the tests
check several row counts against F.linear. Within one step, rows without an adapter go through the
packed copy in a base-only step and through F.linear in a step whose adapters take the fused shrink, so
their bits can depend on the step (to fp32 rounding, as with bf16 before).

MKL's packed copy does not record its shape (the module's weight does) and takes about 8 MB plus
1.3-2x the weight's bytes (for the default model: 1.9 GiB next to 0.5 GiB of weights), so packing
happens only where it fits: at most `MEMORY_SHARE` of the memory the machine has available at load
time; otherwise the engine logs that it runs without and uses F.linear throughout. fp32 only (bf16
GEMMs go to oneDNN's AMX/AVX-512 kernels through F.linear). `LORAPLEX_PACKED_GEMM=0` turns it off.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from loraplex.kernels import cpu_ext

logger = logging.getLogger(__name__)

MAX_ROWS = 256  # decoder linears: packed from 2 to this many rows (AVX-512)
MAX_ROWS_AVX2 = 64  # the same without AVX-512
LM_HEAD_MAX_ROWS = 128
MEMORY_SHARE = 0.25  # of MemAvailable at load time
enabled = os.environ.get("LORAPLEX_PACKED_GEMM", "1") != "0"


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (bytes); the free physical pages where that file is absent."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def decoder_max_rows() -> int:
    """The row limit for decoder linears on this CPU: MAX_ROWS with AVX-512, else MAX_ROWS_AVX2."""
    ext = cpu_ext.load()
    return MAX_ROWS if ext is not None and ext.avx512_available() else MAX_ROWS_AVX2


def pack_linears(linears: list[tuple[nn.Linear, int]], *, memory_bytes: int | None = None) -> int:
    """Attach a packed copy of each fp32 CPU weight (`linear.packed_weight`, with its row limit in
    `linear.packed_max_rows`) for `linear` to use. `linears`: (module, max rows) pairs. Returns the bytes
    packed; 0 (and every module left as it was) when turned off, not fp32 on a CPU (the normal case of a
    bf16 engine, not logged), when the compiled library or MKL's packed GEMM is missing, or when the
    packed copies would take more than `MEMORY_SHARE` of `memory_bytes` (default: the machine's
    available memory); those last three are logged."""
    if not enabled or not linears:
        return 0
    if any(m.weight.dtype != torch.float32 or m.weight.device.type != "cpu" for m, _ in linears):
        return 0
    ext = cpu_ext.load()
    if ext is None or not ext.packed_gemm_available():
        logger.info("base linears use F.linear: %s", "the CPU kernels are not built" if ext is None
                    else "this PyTorch's MKL has no packed GEMM")
        return 0
    need = sum(ext.packed_gemm_bytes(*m.weight.shape) for m, _ in linears)
    have = available_memory_bytes() if memory_bytes is None else memory_bytes
    if need > MEMORY_SHARE * have:
        logger.warning("base linears use F.linear, not weights packed for MKL: the packed copies need %.0f MiB, "
                       "more than %d%% of the %.0f MiB available", need / 2**20, MEMORY_SHARE * 100, have / 2**20)
        return 0
    for module, max_rows in linears:
        module.packed_weight = ext.packed_gemm_pack(module.weight.detach())
        module.packed_max_rows = max_rows
        module.packed_of = _identity(module.weight)
    logger.info("packed %d base weights for MKL's GEMM (%.0f MiB)", len(linears), need / 2**20)
    return need


def _identity(weight: torch.Tensor) -> tuple:
    """What the packed copy was made from: the weight's storage, shape and dtype. (Not its version
    counter: the fused LoRA shrink writes adapter rows next to the base rows in the same buffer, which
    bumps the counter the base weight's view shares, without changing the base rows.)"""
    return weight.data_ptr(), tuple(weight.shape), weight.dtype


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """module(x) for x [M, K] (-> [M, N]): on the packed copy when `pack_linears` gave `module` one and
    2 <= M <= its row limit, else the module itself (`F.linear`). A weight re-bound or cast since packing
    (its storage, shape or dtype changed) goes to `F.linear`, as does an x whose K is not the weight's
    (F.linear raises for it): MKL's buffer records no shape of its own. Base weights are frozen; one
    written in place after packing would not be seen."""
    packed = getattr(module, "packed_weight", None)
    if packed is None or x.dim() != 2 or not 2 <= x.shape[0] <= module.packed_max_rows \
            or x.shape[1] != module.in_features or module.packed_of != _identity(module.weight):
        return module(x)
    return cpu_ext.load().packed_gemm_linear(x, packed, module.out_features, module.bias)


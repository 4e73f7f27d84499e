"""Base linears on weights packed once: oneDNN's, loraplex's GEMM for AVX2 or AVX-512 (`csrc/gemm_cpu.cpp`) or
MKL's (`csrc/packed_gemm_cpu.cpp`).

Letters: M rows of a call, K in features, N out features.

A GEMM on a plain [N, K] weight repacks that weight into the kernel's blocked layout on every call; at
decode batch sizes that repacking is a large share of the call. `pack_linears` packs each base weight
once and `linear` runs the calls in its row range on the packed copy, the rest through `F.linear`.
vLLM's CPU backend does the same with oneDNN (`onednn_mm` on a weight reordered at load time). Four
backends, chosen by `LORAPLEX_PACKED_GEMM`: `auto` (the default) takes avx512 for fp32 weights on a CPU
with AVX-512 and avx2 on one with AVX2 + FMA and no AVX-512, where the CPU kernels are built, onednn
otherwise (bf16 weights, no kernels); `onednn`, `avx2`, `avx512` and `mkl` force one (avx2 and avx512 fall
back to onednn where the CPU or build lacks them, said in the log); `0` turns packing off:

- **onednn**: the weight reordered once (`torch.ops.mkldnn._reorder_linear_weight`, laid out for
  M = 64) and each call through `torch.ops.mkldnn._linear_pointwise`, the pair PyTorch's inductor uses
  for a frozen linear; fp32 and bf16; one copy of the weight's bytes. On a 2-core AMD EPYC (Zen 5,
  AVX-512), one thread, where PyTorch's MKL sgemm runs its AVX2 code: fp32 at 8-512 rows 1.8-2.6x
  F.linear (about 190 GFLOP/s against 80), the lm_head 2-3x; at 1-2 rows the small decoder weights
  lose (15-20 against 21-23 GFLOP/s), so fp32 decoder linears start at 2 rows; bf16 1.3-2x at 1-32
  rows, even from 128 (docs/performance.md).
- **avx2** (fp32 only): loraplex's register-blocked GEMM (BLIS's 6 x 16 tiles) on panels packed once.
  On a 2-core AMD EPYC Zen 1 (AVX2 + FMA, no AVX-512), one thread, the default model's 30 layers of
  q/k/v, o, gate/up and down with cold weights, medians of 7: 1 row 73 ms (F.linear 93, oneDNN 110),
  16 rows 126 (oneDNN 191), 64 rows 420-445 against oneDNN's 499-527 (32 against 27 GFLOP/s, the FMA
  peak being 38.5), 256 rows 1.08x oneDNN; with two threads 1 row 38 ms (oneDNN 56, F.linear 79), 16
  rows 71 (oneDNN 112); in the engine, 64-row decode steps 9-10% faster (docs/performance.md). So it
  takes every row count. One copy of the weight's bytes (padded to 16 columns).
- **avx512** (fp32 only): the same GEMM with 8 x 48 tiles of zmm registers, and the next panel's
  prefetch spread over every tile of a row block. On a 2-core AMD EPYC (Zen 4, AVX-512), one thread,
  the default model's 30 layers with cold weights, medians of 7: 1 row 19 ms (F.linear 37, oneDNN 36),
  16 rows 41 (oneDNN 49), 64 rows 124 against oneDNN's 144 (109 against 94.5 GFLOP/s, the FMA peak
  being 116), 512 rows 989 against 1035; the lm_head at 64 rows 33 ms against 37. So it takes every
  row count (docs/performance.md). One copy of the weight's bytes (padded to 48 columns).
- **mkl** (fp32 only): MKL's `cblas_sgemm_pack` / `cblas_sgemm_compute`. On a 2-core AVX-512 Xeon:
  1.5x F.linear at 8-32 rows, 1.3-1.4x at 64, 1.1-1.2x at 256, none at 512; so decoder linears take it
  from 2 to 256 rows (64 without AVX-512, where MKL's AVX2 kernels lose 2-3% at 100-256) and the
  lm_head to 128. Its buffer takes about 8 MB plus 1.3-2x the weight's bytes. One buffer serving every
  M is what this MKL (PyTorch 2.13's) does, not something its documentation promises (PyTorch's own
  `mkl_linear` uses a buffer only for the M it was packed for), so the tests check several row counts.

Either result is as close to the exact product as F.linear's (tested), not always the same bits.
Within one step, rows without an adapter go through the packed copy in a base-only step and, with the
mkl backend, through F.linear in a step whose adapters take the fused shrink, so their bits can depend
on the step (to fp32 rounding, as with bf16 before). With the onednn backend an adapter step runs its
base GEMM on the packed copy too, and the shrink rows and expand pages through oneDNN's matmul on the
plain weights (`linear_unpacked`, from `cpu_packed`).

Packing happens only where it fits: at most `MEMORY_SHARE` of the memory the machine has available at
load time; otherwise the engine logs that it runs without and uses F.linear throughout. A packed copy
does not see a base weight written in place after packing (base weights are frozen).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from loraplex import isa
from loraplex.kernels import cpu_ext

logger = logging.getLogger(__name__)

MAX_ROWS = 256  # mkl backend, decoder linears: packed from 2 to this many rows (AVX-512)
MAX_ROWS_AVX2 = 64  # the same without AVX-512
LM_HEAD_MAX_ROWS = 128  # mkl backend, the lm_head
OURS_MIN_ROWS = 1  # avx2 and avx512: packed from one row (faster than F.linear's GEMV there too)
ONEDNN_LAYOUT_ROWS = 64  # the M oneDNN lays a reordered weight out for (it serves every M)
NO_LIMIT = 1 << 62
MEMORY_SHARE = 0.25  # of MemAvailable at load time
BACKENDS = ("onednn", "avx2", "avx512", "mkl")
OURS = ("avx2", "avx512")  # the backends of csrc/gemm_cpu.cpp, named for the ISA they run
generation = 0  # bumped whenever a module gains or drops a packed copy: what a caller decided from them is stale


def backend_from_env() -> str | None:
    """The backend `LORAPLEX_PACKED_GEMM` names: "auto" (the default; "1", "on", "true", "yes" too),
    "onednn", "avx2", "avx512", "mkl", or None ("0", "off", "none": no packing). Raises ValueError for anything
    else."""
    value = os.environ.get("LORAPLEX_PACKED_GEMM", "auto").strip().lower()
    if value in ("0", "off", "none"):
        return None
    if value in ("", "1", "on", "true", "yes", "auto"):
        return "auto"
    if value not in BACKENDS:
        raise ValueError(f"LORAPLEX_PACKED_GEMM={value!r}: expected auto, {', '.join(BACKENDS)} or 0")
    return value


backend = backend_from_env()


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
    """The mkl backend's row limit for decoder linears on this CPU: MAX_ROWS with AVX-512, else
    MAX_ROWS_AVX2."""
    ext = cpu_ext.load()
    return MAX_ROWS if ext is not None and ext.avx512_available() else MAX_ROWS_AVX2


def row_range(name: str, kind: str, dtype: torch.dtype) -> tuple[int, int]:
    """(min, max) rows of a call that take the packed copy, for backend `name`, a linear of `kind`
    ("decoder", "gate_up" or "lm_head") and `dtype` (the measurements are in the module docstring)."""
    if name == "onednn":
        return (2 if kind != "lm_head" and dtype == torch.float32 else 1), NO_LIMIT
    if name in OURS:
        return OURS_MIN_ROWS, NO_LIMIT
    return 2, (LM_HEAD_MAX_ROWS if kind == "lm_head" else decoder_max_rows())


ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
# oneDNN's bf16 linear needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; elsewhere (an AVX2-only CPU) packing a bf16
# weight raises "bf16 path needs the cpu support ...", so such weights stay on F.linear, said up front.
ONEDNN_BF16 = ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() and not isa.cap()  # held: as on AVX2


def bucket_rows(m: int) -> int:
    """The row count a oneDNN call of m rows is padded to: m up to 16, then the next multiple of 1/8 of
    m's power of two (at most 12.5% more rows; 56 sizes up to 512).

    oneDNN makes one primitive per shape and keeps up to 1024 of them, each holding a buffer of about
    M x K x 4 bytes (measured: 500 shapes of M 10-509 took 200-310 MiB, 1,000 of M 10-1,009 3 GiB), and a
    new shape costs about 1.6 ms to make; a serving engine sees every M from 1 to its token budget, so
    without buckets its memory would grow by GBs and it would remake primitives. vLLM's onednn_mm
    avoids this with a runtime M, which PyTorch's op does not offer."""
    if m <= 16:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def _onednn_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight^T (+ bias) by `_linear_pointwise`, x padded with zero rows to `bucket_rows(M)`."""
    m = x.shape[0]
    rows = bucket_rows(m)
    if rows != m:
        padded = x.new_empty(rows, x.shape[1])
        padded[:m] = x
        padded[m:].zero_()
        x = padded
    y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return y if rows == m else y[:m]


def onednn_unpacked() -> bool:
    """Whether fp32 products on weights that are not packed (the LoRA shrink rows and expand pages, long
    prefill attention) go through oneDNN's matmul: with every backend but mkl and none, where this
    PyTorch has oneDNN."""
    return ONEDNN and backend in ("auto", "onednn", *OURS)


def linear_unpacked(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N], no bias, for a weight that changes between calls (the LoRA
    shrink rows and expand pages of a step): oneDNN's matmul on the plain weight where
    `onednn_unpacked()`, fp32, a contiguous weight and M >= 1 (1.5-1.9x F.linear at 64 rows where MKL
    runs its AVX2 code, docs/performance.md); else F.linear."""
    if (onednn_unpacked() and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and x.dim() == 2 and x.shape[0] >= 1 and weight.is_contiguous()):
        return _onednn_call(x, weight, None)
    return F.linear(x, weight)


def resolve(name: str | None, dtype: torch.dtype) -> str | None:
    """The backend that packs weights of `dtype` for setting `name` ("auto", a backend or None): for fp32
    weights where the CPU kernels are built, auto gives avx512 on a CPU with AVX-512 and avx2 on one with
    AVX2 + FMA only; avx2 and avx512 stay where the CPU has their ISA; every other case of these three
    gives onednn (said in the log when avx2 or avx512 was asked for). The others stay as they are."""
    if name not in ("auto", *OURS):
        return name
    ext = cpu_ext.load() if dtype == torch.float32 else None
    has = {"avx2": ext is not None and ext.avx2_available(), "avx512": ext is not None and ext.avx512_available()}
    if name == "auto":
        return "avx512" if has["avx512"] else "avx2" if has["avx2"] else "onednn"
    if not has[name]:
        logger.info("base linears use onednn, not %s (it takes fp32 weights, the CPU kernels built, %s)", name,
                    "AVX-512" if name == "avx512" else "AVX2 + FMA")
        return "onednn"
    return name


def _refusal(name: str, dtype: torch.dtype) -> str | None:
    """Why backend `name` cannot pack weights of `dtype` here (None: it can)."""
    if name in OURS:
        return None if dtype == torch.float32 else ""
    if name == "mkl":
        if dtype != torch.float32:
            return ""  # bf16 with the mkl backend: F.linear's oneDNN kernels, the normal case, not logged
        ext = cpu_ext.load()
        if ext is None:
            return "the CPU kernels are not built"
        return None if ext.packed_gemm_available() else "this PyTorch's MKL has no packed GEMM"
    if dtype not in (torch.float32, torch.bfloat16):
        return ""
    if not ONEDNN:
        return "this PyTorch has no oneDNN (mkldnn) linear"
    if dtype == torch.bfloat16 and not ONEDNN_BF16:
        return "this CPU has no oneDNN bf16 kernels (they need AVX-512 BW/VL/DQ or AVX-NE-CONVERT)"
    return None


def _glu(name: str, kind: str, module: nn.Linear) -> int:
    """I where `module` is a fused [gate; up] projection (kind "gate_up") that our GEMM packs with its
    panels interleaved, so `silu_mul_linear` can take it (no bias, I a multiple of the panel's width), else 0."""
    if kind != "gate_up" or name not in OURS or module.bias is not None:
        return 0
    inter = module.out_features // 2
    panel = cpu_ext.load().gemm_floats(1, 1, name)  # a [1, 1] weight packs to one panel of NR columns
    return inter if module.out_features % 2 == 0 and inter % panel == 0 else 0


def _pack(name: str, weight: torch.Tensor, glu: int = 0) -> torch.Tensor:
    if name == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_LAYOUT_ROWS)
    if name in OURS:
        return cpu_ext.load().gemm_pack(weight, name, glu)
    return cpu_ext.load().packed_gemm_pack(weight)


def _packed_bytes(name: str, weight: torch.Tensor) -> int:
    if name == "onednn":
        return weight.numel() * weight.element_size()
    if name in OURS:
        return cpu_ext.load().gemm_floats(*weight.shape, name) * 4
    return cpu_ext.load().packed_gemm_bytes(*weight.shape)


def pack_linears(linears: list[tuple[nn.Linear, str]], *, memory_bytes: int | None = None,
                 name: str | None = None) -> int:
    """Attach a packed copy of each CPU weight (`linear.packed_weight`, with `packed_rows`, the (min, max)
    rows that take it, `packed_backend` and `packed_glu`) for `linear` to use. `linears`: (module, kind)
    pairs, kind "decoder", "gate_up" (a decoder linear that is a fused [gate; up] projection: our GEMM
    packs it for `silu_mul_linear` too) or "lm_head". `name`: the backend, default `backend` (from `LORAPLEX_PACKED_GEMM`).
    Returns the bytes packed; 0 (and every module left as it was) when turned off, for a dtype the
    backend does not pack (mkl: all but fp32, the normal case of a bf16 engine, not logged), when the
    backend is missing from this build, when packing raises, or when the packed copies would take more
    than `MEMORY_SHARE` of `memory_bytes` (default: the machine's available memory); those last three
    are logged."""
    name = backend if name is None else name
    if name is None or not linears:
        return 0
    dtypes = {m.weight.dtype for m, _ in linears}
    if len(dtypes) != 1 or any(m.weight.device.type != "cpu" for m, _ in linears):
        return 0
    dtype = dtypes.pop()
    name = resolve(name, dtype)
    why = _refusal(name, dtype)
    if why is not None:
        if why:
            logger.info("base linears use F.linear: %s", why)
        return 0
    need = sum(_packed_bytes(name, m.weight) for m, _ in linears)
    have = available_memory_bytes() if memory_bytes is None else memory_bytes
    if need > MEMORY_SHARE * have:
        logger.warning("base linears use F.linear, not weights packed for %s: the packed copies need %.0f MiB, "
                       "more than %d%% of the %.0f MiB available", name, need / 2**20, MEMORY_SHARE * 100,
                       have / 2**20)
        return 0
    try:
        glus = [_glu(name, kind, m) for m, kind in linears]
        packed = [_pack(name, m.weight.detach(), glu) for (m, _), glu in zip(linears, glus, strict=True)]
    except RuntimeError as exc:  # a oneDNN without a kernel for this shape or ISA
        logger.warning("base linears use F.linear: packing for %s failed (%s)", name, exc)
        return 0
    global generation
    for (module, kind), weight, glu in zip(linears, packed, glus, strict=True):
        module.packed_weight = weight
        module.packed_rows = row_range(name, kind, dtype)
        module.packed_backend = name
        module.packed_glu = glu
        module.packed_of = _identity(module.weight)
    generation += 1
    logger.info("packed %d base weights for %s (%s, %.0f MiB)", len(linears), name, str(dtype).removeprefix("torch."),
                need / 2**20)
    return need


def _identity(weight: torch.Tensor) -> tuple:
    """What the packed copy was made from: the weight's storage, shape and dtype. (Not its version
    counter: the fused LoRA shrink writes adapter rows next to the base rows in the same buffer, which
    bumps the counter the base weight's view shares, without changing the base rows.)"""
    return weight.data_ptr(), tuple(weight.shape), weight.dtype


def packed_current(module: nn.Linear) -> bool:
    """Whether `module` has a packed copy and its weight is still the one packed (storage, shape, dtype)."""
    return getattr(module, "packed_weight", None) is not None and module.packed_of == _identity(module.weight)


def takes_packed(module: nn.Linear, x: torch.Tensor) -> bool:
    """Whether `linear(module, x)` runs on the packed copy: `pack_linears` gave `module` one, x is
    [M, K] in the weight's dtype with M in its row range and K the weight's, and the weight is the one
    packed (its storage, shape and dtype unchanged: a weight re-bound or cast since packing is not)."""
    packed_rows = getattr(module, "packed_rows", None)
    return (packed_rows is not None and x.dim() == 2 and packed_rows[0] <= x.shape[0] <= packed_rows[1]
            and x.shape[1] == module.in_features and x.dtype == module.weight.dtype and packed_current(module))


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """module(x) for x [M, K] (-> [M, N]): on the packed copy where `takes_packed`, else the module
    itself (`F.linear`, which also raises for an x of another width: neither packed copy records its
    shape). Base weights are frozen; one written in place after packing would not be seen. If the packed
    call raises (a oneDNN without a kernel for this row count, say), the module drops its packed copy,
    logs why once, and this and every later call run through F.linear: one failed call must not fail
    every step of that size."""
    if not takes_packed(module, x):
        return module(x)
    try:
        if module.packed_backend == "onednn":
            return _onednn_call(x, module.packed_weight, module.bias)
        if module.packed_backend in OURS:
            return cpu_ext.load().gemm_linear(x, module.packed_weight, module.out_features, module.packed_backend,
                                              module.bias, module.packed_glu)
        return cpu_ext.load().packed_gemm_linear(x, module.packed_weight, module.out_features, module.bias)
    except RuntimeError as exc:
        _drop_packed(module, x, exc)
        return module(x)


def linear_columns(module: nn.Linear, x: torch.Tensor, start: int, stop: int) -> torch.Tensor | None:
    """Output columns [start, stop) of `linear(module, x)`: x [M, K] -> [M, stop - start] (a view of
    columns of a wider product where start or stop is not on a panel's edge), from the slice of our
    packed copy that holds them: its panels of NR columns lie one after another, so panels p0 .. p1 - 1
    are a packed weight of their own. The same bits as those columns of the whole product (each output
    is its own sum over K). None where it does not run: the module is not packed by our GEMM (or is
    packed for a gate/up epilogue), x does not take the packed copy, or 0 <= start < stop <= N fails.
    The model's last layer takes the q columns of the rows it samples and the k/v columns of every row
    so."""
    if not takes_packed(module, x) or module.packed_backend not in OURS or module.packed_glu:
        return None
    ext, isa, k, n = cpu_ext.load(), module.packed_backend, module.in_features, module.out_features
    if not 0 <= start < stop <= n:
        return None
    nr = ext.gemm_floats(1, 1, isa)  # the panel's width: one column pads to one panel
    first, end = start // nr * nr, min(n, -(-stop // nr) * nr)  # the panels' columns [first, end)
    weight = module.packed_weight.narrow(0, first * k, ext.gemm_floats(end - first, k, isa))
    bias = None if module.bias is None else module.bias[first:end]
    try:
        out = ext.gemm_linear(x, weight, end - first, isa, bias, 0)
    except RuntimeError as exc:
        _drop_packed(module, x, exc)
        return None
    return out if (first, end) == (start, stop) else out[:, start - first: stop - first]


def _drop_packed(module: nn.Linear, x: torch.Tensor, exc: RuntimeError) -> None:
    """After a packed call on x raised: log it, and leave `module` to F.linear from now on."""
    logger.warning("a %s call on %d rows failed (%s); this linear uses F.linear from now on",
                   module.packed_backend, x.shape[0], exc)
    global generation
    module.packed_rows = None
    module.packed_weight = None
    generation += 1


def silu_mul_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of a fused [gate; up] projection `module` ([2I, K], no bias) for x [M, K] -> [M, I],
    in one GEMM whose up tiles apply the activation to the gate tiles just stored (`gemm_linear`'s act,
    csrc/gemm_cpu.cpp): the [M, 2I] product is never written or read back. The same bits as `linear`
    followed by the SiLU x up kernel. None where it does not run (the module was not packed for it by
    our GEMM, or x does not take the packed copy; or the call raised, which drops the packed copy as
    `linear` does): the caller then runs the two steps."""
    if not getattr(module, "packed_glu", 0) or not takes_packed(module, x):
        return None
    try:
        return cpu_ext.load().gemm_linear(x, module.packed_weight, module.out_features, module.packed_backend, None,
                                          module.packed_glu, True)
    except RuntimeError as exc:
        _drop_packed(module, x, exc)
        return None

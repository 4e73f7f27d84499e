"""CPU tensors on 2 MB pages, for the paged KV cache, which a decode step streams through.

Why: a 64-row decode step reads every layer's K/V for every row, about 0.5 GB of fp32 scattered over
12 KB KV cache blocks. On 4 KB pages each block spans three pages, the core's stream prefetcher stops
at each page's end, and the translations far outnumber the L2 TLB's entries. On 2 MB pages (Linux's
transparent huge pages, asked for with `madvise(MADV_HUGEPAGE)` before the memory is first touched, as
the kernel's admin-guide/mm/transhuge describes) there are 512 times fewer. On a 2-core AMD EPYC Zen 4,
one thread: a plain read of 30 layers' caches 19.2-20.9 -> 17.1 ms, the decode attention kernel over
them 29.9-30.7 -> 28.3-28.7 ms, about 0.5% of a base-only run of the vllm preset. The packed weights
gained nothing measurable on huge pages (`scripts/gemm-bench --pages`: 108.5 against 107.6 GFLOP/s at
64 rows, 110.0 against 110.0 at 512), so they stay on ordinary ones.

The cost is at load: on a VM whose host backs guest memory on first touch, a 1 GiB cache on huge pages
took 1.5-2.1 s more to allocate (the whole engine in 7.07-8.29 against 5.26-6.70 s, six pairs;
docs/performance.md). `LORAPLEX_HUGE_PAGES=0` turns it off; elsewhere than Linux, where the kernel's
transparent huge pages are `never` or off for this process, or where its PMD page is not 2 MB, the
tensors are ordinary ones (the same values, only the pages differ). The engine takes one mapping for all
layers' K and V (`ModelRunner`), so at most one huge page is partly used.
"""

from __future__ import annotations

import math
import mmap
import os

import torch

HUGE_PAGE = 2 << 20  # bytes: the PMD page of x86-64 and of arm64 with 4 KB pages, the only size taken here
THP = "/sys/kernel/mm/transparent_hugepage"
SETTING = f"{THP}/enabled"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def enabled() -> bool:
    """Whether tensors go on huge pages: Linux with transparent huge pages `always` or `madvise` for 2 MB
    pages (the global setting, and the 2 MB size's own where the kernel has one, 6.8 and later), not
    disabled for this process (`PR_SET_THP_DISABLE`, which some container runtimes set: `THP_enabled: 0`
    in /proc/self/status), and `LORAPLEX_HUGE_PAGES` not 0."""
    if os.environ.get("LORAPLEX_HUGE_PAGES", "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    setting, size = _read(SETTING), _read(f"{THP}/hpage_pmd_size")
    if setting is None or "[never]" in setting or size is None or size.strip() != str(HUGE_PAGE):
        return False
    own = _read(f"{THP}/hugepages-{HUGE_PAGE >> 10}kB/enabled")  # always, inherit, madvise or never
    if own is not None and "[never]" in own:
        return False
    status = _read("/proc/self/status") or ""
    return "THP_enabled:\t0" not in status.replace(" ", "\t")


def zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor of `shape` and `dtype`, contiguous, on 2 MB pages where `enabled()` (its
    memory an anonymous mapping aligned to 2 MB and advised before the first touch, so that the page
    faults that fill it take huge pages), else `torch.zeros`. Tensors under one huge page take
    `torch.zeros` too. The mapping lives as long as the tensor (and its views)."""
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not enabled():
        return torch.zeros(shape, dtype=dtype)
    return _mapped(shape, dtype, nbytes)


def copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU `tensor` on huge pages (`zeros`, then the values), or `tensor` itself
    where it would stay on ordinary pages (under one huge page, or not `enabled()`)."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or nbytes < HUGE_PAGE or not enabled():
        return tensor
    out = _mapped(tuple(tensor.shape), tensor.dtype, nbytes)
    out.copy_(tensor)
    return out


def _mapped(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """`zeros` on huge pages (`nbytes`: the tensor's size in bytes), once the caller has checked the size
    and `enabled()`."""
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive while any view lives
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, span)
    except OSError:  # a kernel without THP for anonymous memory: ordinary pages, the same tensor
        pass
    out = raw[start:start + nbytes].view(dtype).view(shape)
    out.zero_()  # the first touch: each fault takes a huge page (the mapping was zero already)
    return out

"""CPU tensors on 2 MB pages (`kernels/huge_pages.py`): the same values as ordinary tensors, on huge pages
where the kernel's transparent huge pages allow it, off with LORAPLEX_HUGE_PAGES=0; and the engine's
KV cache takes them, all layers in one mapping."""

from __future__ import annotations

import contextlib
import gc
import os
from types import SimpleNamespace

import pytest
import torch

from loraplex.kernels import huge_pages

MB = 1 << 20


def huge_bytes(t: torch.Tensor) -> int:
    """Bytes of 2 MB pages (AnonHugePages) in the mapping of /proc/self/smaps that holds t's first byte."""
    addr, inside, found = t.data_ptr(), False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                found = int(line.split()[1]) * 1024
    return found


def fallbacks() -> int:
    """The kernel's count of page faults that wanted a huge page and took 4 KB ones (/proc/vmstat)."""
    with open("/proc/vmstat") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("thp_fault_fallback "))


@contextlib.contextmanager
def huge_pages_at_hand():
    """Skips the test where the kernel had no free huge page for a fault inside the block (a fragmented
    or memory-limited machine): then a tensor on 4 KB pages is the kernel's answer, not our bug."""
    before = fallbacks()
    yield
    if fallbacks() > before:
        pytest.skip("the kernel had no free 2 MB page at hand (thp_fault_fallback rose)")


needs_thp = pytest.mark.skipif(not huge_pages.enabled(), reason="the kernel's transparent huge pages are off here")


@needs_thp
def test_zeros_is_zero_contiguous_and_on_huge_pages():
    with huge_pages_at_hand():
        t = huge_pages.zeros((3 * MB // 4 + 5, 2), torch.float32)  # 6 MB and 40 bytes: four 2 MB pages
    assert t.shape == (3 * MB // 4 + 5, 2) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not t.any()
    assert huge_bytes(t) == 4 * huge_pages.HUGE_PAGE
    t[-1, -1] = 7.0
    assert t.sum().item() == 7.0


@needs_thp
def test_the_mapping_lives_as_long_as_a_view():
    t = huge_pages.zeros((MB,), torch.float32)
    t.fill_(3.0)
    view = t[MB // 2:]
    del t
    gc.collect()
    assert view.numel() == MB // 2 and bool((view == 3.0).all())


@needs_thp
def test_copy_keeps_values_and_dtype():
    src = torch.randn(1024, 1024).to(torch.bfloat16)  # 2 MB
    with huge_pages_at_hand():
        out = huge_pages.copy(src)
    assert out is not src and out.dtype == torch.bfloat16 and torch.equal(out, src)
    assert huge_bytes(out) == huge_pages.HUGE_PAGE


def test_small_tensors_and_off_switch_take_ordinary_pages(monkeypatch):
    small = torch.randn(100, 100)
    assert huge_pages.copy(small) is small  # under one huge page: not worth a mapping of its own
    z = huge_pages.zeros((10, 10), torch.int64)
    assert z.dtype == torch.int64 and not z.any()
    monkeypatch.setenv("LORAPLEX_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    big = torch.randn(2 * MB)
    assert huge_pages.copy(big) is big
    z = huge_pages.zeros((2 * MB,), torch.float32)
    assert not z.any()
    # with `always`, or PyTorch's own THP_MEM_ALLOC_ENABLE, any large allocation may take huge pages
    if "[madvise]" in (huge_pages._read(huge_pages.SETTING) or "") and not os.environ.get("THP_MEM_ALLOC_ENABLE"):
        assert huge_bytes(z) == 0


def test_a_process_with_thp_disabled_takes_ordinary_pages(monkeypatch):
    status = "Name:\tpython\nTHP_enabled:\t0\n"
    real = huge_pages._read
    monkeypatch.setattr(huge_pages, "_read", lambda path: status if path == "/proc/self/status" else real(path))
    assert not huge_pages.enabled()


@needs_thp
def test_the_kv_cache_is_one_mapping_on_huge_pages():
    from loraplex.engine.block_manager import BlockManager
    from loraplex.engine.model_runner import ModelRunner

    cfg = SimpleNamespace(num_key_value_heads=3, head_dim=64, num_hidden_layers=3)
    with huge_pages_at_hand():  # 3 layers x (K, V) x 256 blocks x 16 slots x 3 x 64 fp32: 18 MB
        runner = ModelRunner(SimpleNamespace(cfg=cfg), BlockManager(256, 16), torch.float32, torch.device("cpu"))
    caches = [t for kv in runner.kv_caches for t in kv]
    assert len(caches) == 6
    for t in caches:
        assert t.shape == (4096, 3, 64) and t.is_contiguous() and not t.any()
        assert huge_bytes(t) == 9 * huge_pages.HUGE_PAGE  # every tensor in the one 18 MB mapping
    starts = [t.data_ptr() for t in caches]
    assert starts == [starts[0] + i * 4096 * 3 * 64 * 4 for i in range(6)]  # layer by layer, K then V
    caches[1][5, 2, 7] = 1.0  # layer 0's V: no other cache sees it
    assert [int(t.count_nonzero()) for t in caches] == [0, 1, 0, 0, 0, 0]

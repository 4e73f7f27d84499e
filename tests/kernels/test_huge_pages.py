"""CPU tensors on 2 MB pages (`kernels/huge_pages.py`): the same values as ordinary tensors, on huge pages
where the kernel's transparent huge pages allow it, off with LORAPLEX_HUGE_PAGES=0; and the engine's
KV cache takes them."""

from __future__ import annotations

import gc
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


needs_thp = pytest.mark.skipif(not huge_pages.enabled(), reason="the kernel's transparent huge pages are off here")


@needs_thp
def test_zeros_is_zero_contiguous_and_on_huge_pages():
    t = huge_pages.zeros((3 * MB // 4 + 5, 2), torch.float32)  # 6 MB and 40 bytes: four 2 MB pages
    assert t.shape == (3 * MB // 4 + 5, 2) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not t.any()
    assert huge_bytes(t) >= 2 * MB  # the kernel may leave the odd page to 4 KB ones, not all of them
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
    out = huge_pages.copy(src)
    assert out is not src and out.dtype == torch.bfloat16 and torch.equal(out, src)
    assert huge_bytes(out) >= 2 * MB


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
    with open(huge_pages.SETTING) as f:
        if "[madvise]" in f.read():  # (with `always`, every large mapping may take huge pages)
            assert huge_bytes(z) == 0


@needs_thp
def test_the_kv_cache_takes_huge_pages():
    from loraplex.engine.block_manager import BlockManager
    from loraplex.engine.model_runner import ModelRunner

    cfg = SimpleNamespace(num_key_value_heads=3, head_dim=64, num_hidden_layers=2)
    runner = ModelRunner(SimpleNamespace(cfg=cfg), BlockManager(256, 16), torch.float32, torch.device("cpu"))
    for k, v in runner.kv_caches:  # 256 blocks x 16 slots x 3 x 64 fp32: 3 MB each
        assert k.shape == v.shape == (4096, 3, 64) and not k.any() and not v.any()
        assert huge_bytes(k) >= 2 * MB and huge_bytes(v) >= 2 * MB
    assert k.data_ptr() != v.data_ptr()


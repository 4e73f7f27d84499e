"""The CPU extension's kernels run without the GIL: under `loraplex serve` the engine thread shares its
process with the server's event loop, which must go on reading requests and writing SSE events while a
kernel computes (`kernels/csrc/module.cpp`).

How it is told: a second Python thread counts while the test thread calls a kernel in a loop, with the
interpreter's switch interval raised to 10 s, so that the test thread never hands the GIL over by itself
between calls. A kernel that keeps the GIL leaves the count where it was, exactly; one that lets it go
lets the counter run."""

from __future__ import annotations

import gc
import sys
import threading
import time

import pytest
import torch

from loraplex.engine.model import RotaryEmbedding
from loraplex.kernels import cpu_gemm
from loraplex.kernels.cpu_greedy import norms_rounded_up
from tests.helpers import built_cpu_ext


def _counts_during(fn, seconds: float = 2.0, batch: int = 8) -> int:
    """How many times a second Python thread counted while `fn` computed, called in batches until it has
    counted or `seconds` have passed. Freeing a result tensor lets the GIL go for a moment (whatever made
    it): counts then are not `fn`'s, so each batch's results are freed outside the counted window; the
    garbage collector is off meanwhile (a finalizer it runs may let the GIL go too)."""
    count, stop = 0, False

    def counter() -> None:
        nonlocal count
        while not stop:
            time.sleep(0.0005)  # lets the GIL go; it needs it back to count
            count += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    thread = threading.Thread(target=counter, daemon=True)
    thread.start()
    gc.collect()
    gc.disable()
    try:
        time.sleep(0.01)
        fn()  # first call: allocations, lazy set-up
        counted, end = 0, time.perf_counter() + seconds
        while counted == 0 and time.perf_counter() < end:
            before = count
            results = [fn() for _ in range(batch)]
            counted += count - before
            del results
        return counted
    finally:
        gc.enable()
        stop = True
        thread.join()
        sys.setswitchinterval(old)


def _isa() -> str:
    """Our GEMM's ISA on this CPU (what the engine's base linears take for fp32 weights)."""
    isa = cpu_gemm.resolve("auto", torch.float32)
    if isa not in cpu_gemm.OURS:
        pytest.skip("our GEMM needs AVX2 + FMA or AVX-512")
    return isa


def _case(name: str):
    """The kernel `name` on inputs that keep it busy for a millisecond or more."""
    ext, gen = built_cpu_ext(), torch.Generator().manual_seed(0)
    if name == "add_rms_norm":
        x, r, w = torch.randn(512, 2048, generator=gen), torch.randn(512, 2048, generator=gen), torch.ones(2048)
        return lambda: ext.add_rms_norm(x, r, w, 1e-5)
    if name == "silu_mul":
        gate_up = torch.randn(512, 4096, generator=gen)
        return lambda: ext.silu_mul(gate_up)
    if name == "rope_inplace":
        rope, positions = RotaryEmbedding(64, 4096, 10000.0), torch.arange(2048)
        x, cos, sin = torch.randn(2048, 12 * 64, generator=gen), rope.cos[positions], rope.sin[positions]
        return lambda: ext.rope_inplace(x, cos, sin, 12, 64)
    x, weight = torch.randn(256, 1024, generator=gen), torch.randn(1024, 1024, generator=gen)
    if name == "gemm_linear":
        isa = _isa()
        packed = ext.gemm_pack(weight, isa)
        return lambda: ext.gemm_linear(x, packed, 1024, isa)
    if name == "packed_gemm_linear":
        if not ext.packed_gemm_available():
            pytest.skip("this PyTorch's MKL has no packed GEMM")
        packed = ext.packed_gemm_pack(weight)
        return lambda: ext.packed_gemm_linear(x, packed, 1024)
    if name == "greedy_head":
        if not (ext.avx512_available() and ext.avx512_bf16_available()):
            pytest.skip("the lm_head's bf16 screen needs AVX-512 with bf16")
        head = torch.randn(8192, 576, generator=gen) * 0.05
        packed, norms, rows = ext.greedy_head_pack(head), norms_rounded_up(head), torch.randn(64, 576, generator=gen)
        return lambda: ext.greedy_head(rows, packed, norms, head)
    if name == "decoder_layer":  # a 256-token prompt through a layer of 384 hidden, 4 + 2 heads of 64, I = 768
        isa, rows, hidden, inter = _isa(), 256, 384, 768
        qkv, o = ext.gemm_pack(torch.randn(512, hidden, generator=gen) * 0.05, isa), \
            ext.gemm_pack(torch.randn(hidden, 256, generator=gen) * 0.05, isa)
        gate_up = ext.gemm_pack(torch.randn(2 * inter, hidden, generator=gen) * 0.05, isa, inter)
        down = ext.gemm_pack(torch.randn(hidden, inter, generator=gen) * 0.05, isa)
        rope, positions = RotaryEmbedding(64, 4096, 10000.0), torch.arange(rows)
        caches = [torch.zeros(rows, 2, 64) for _ in range(2)]
        tables = torch.arange(rows // 16).view(1, -1)
        tiles = torch.tensor([(i, 16, 0, i + 1) for i in range(0, rows, 16)])
        h, norm = torch.randn(rows, hidden, generator=gen), torch.ones(hidden)
        return lambda: ext.decoder_layer(torch.randn(rows, hidden), h, qkv, None, o, gate_up, down, isa, inter,
                                         rope.cos[positions], rope.sin[positions], 4, 2, 64, *caches, tables, tiles,
                                         16, positions, norm, 1e-5, norm, 1e-5)
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["add_rms_norm", "silu_mul", "rope_inplace", "gemm_linear", "packed_gemm_linear",
                                  "greedy_head", "decoder_layer"])
def test_kernel_lets_other_python_threads_run(name):
    fn = _case(name)
    assert _counts_during(fn) > 0, f"{name} keeps the GIL while it computes"


def test_the_probe_tells_a_call_that_keeps_the_gil():
    """The probe itself: a loop of pure Python calls never lets the counter run, for the whole 2 s."""
    assert _counts_during(lambda: sum(range(1000))) == 0

"""Base linears on packed weights (`kernels/cpu_gemm.py`), every backend (oneDNN's reordered weights,
loraplex's GEMM for AVX2 and for AVX-512, MKL's packed GEMM): as close to the fp64 product as F.linear is, the row range that
takes the packed copy, and the cases where nothing is packed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels import cpu_ext, cpu_gemm

ext = cpu_ext.load()
pytestmark = pytest.mark.skipif(ext is None or not ext.packed_gemm_available() or not torch.backends.mkldnn.is_available(),
                                reason="the CPU kernels are not built, or this PyTorch has no MKL packed GEMM or oneDNN")


def _random_linear(n: int, k: int, bias: bool, gen: torch.Generator) -> nn.Linear:
    """An fp32 [n, k] linear with weights of unit-variance outputs and, if asked, a N(0, 1) bias."""
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    return lin


AVX2 = ext is not None and ext.avx2_available()
AVX512 = ext is not None and ext.avx512_available()
HAS = {"avx2": AVX2, "avx512": AVX512}
NR = {"avx2": 16, "avx512": 48}  # the columns of a panel (csrc/gemm_cpu.cpp)
needs_avx2 = pytest.mark.skipif(not AVX2, reason="this CPU has no AVX2 + FMA")
needs_avx512 = pytest.mark.skipif(not AVX512, reason="this CPU has no AVX-512")
NEEDS = {"avx2": needs_avx2, "avx512": needs_avx512}
EACH_BACKEND = [pytest.param(name, marks=NEEDS[name]) if name in NEEDS else name for name in cpu_gemm.BACKENDS]
EACH_ISA = [pytest.param(isa, marks=NEEDS[isa]) for isa in cpu_gemm.OURS]


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 64, 100, 512])
@pytest.mark.parametrize(("n", "k", "bias"), [(960, 576, False), (576, 1536, False), (48, 40, True), (1000, 72, True)])
@pytest.mark.parametrize(("name", "dtype"), [("onednn", torch.float32), ("onednn", torch.bfloat16),
                                             ("avx2", torch.float32), ("avx512", torch.float32)])  # ours: fp32 only
def test_packed_linear_is_within_the_rounding_bound(name, dtype, rows, n, k, bias):
    """Against the product in fp64, element by element, within the bound of a K-term fp32 dot product in
    any order, gamma_K x sum |x_i w_i| with gamma_K = K u / (1 - K u), u = 2^-24 (Higham, Accuracy and
    Stability of Numerical Algorithms, 2nd ed., section 3.1), plus half a bf16 ulp of the result for a
    bf16 output. (oneDNN sums K in another order than MKL: measured 1-4x F.linear's largest error here.)
    Our rows cover tile heights 1, 2, 4, 5 and 6 (avx2: 6 per tile) or 1, 2, 4, 5 and 8 (avx512: 8 per
    tile), a last panel of 8 of 16 (avx2) or 40 of 48 (avx512) columns (N = 1000) and row blocks (512 rows of K = 1536 go in 13 blocks of up to 42 rows on avx2, up to 40 on avx512)."""
    if dtype == torch.bfloat16 and not cpu_gemm.ONEDNN_BF16:
        pytest.skip("this CPU has no oneDNN bf16 kernels (test_bf16_is_packed_by_onednn_only checks the refusal)")
    if name in HAS and not HAS[name]:
        pytest.skip(f"this CPU has no {name}")
    gen = torch.Generator().manual_seed(rows + n)
    lin = _random_linear(n, k, bias, gen)
    lin = lin.to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    packed_n = n if name == "onednn" else -(-n // NR[name]) * NR[name]
    assert cpu_gemm.pack_linears([(lin, "lm_head")], memory_bytes=1 << 40, name=name) == packed_n * k * lin.weight.element_size()
    assert lin.packed_backend == name
    assert cpu_gemm.takes_packed(lin, x) and lin.packed_rows == (1, cpu_gemm.NO_LIMIT)
    with torch.no_grad():
        got = cpu_gemm.linear(lin, x)
        ours = F.linear(x, lin.weight, lin.bias)
        exact = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
        magnitude = F.linear(x.double().abs(), lin.weight.double().abs(),
                             None if lin.bias is None else lin.bias.double().abs())
    u = 2.0**-24
    bound = (k + 1) * u / (1 - (k + 1) * u) * magnitude  # K products and the bias
    if dtype == torch.bfloat16:
        bound += 2.0**-8 * exact.abs()  # u of bf16
    assert ((got.double() - exact).abs() <= bound).all()
    assert ((ours.double() - exact).abs() <= bound).all()  # the bound holds for F.linear too
    assert got.shape == (rows, n) and got.dtype == dtype


@pytest.mark.parametrize("rows", [16, 64, 100, 256])
@pytest.mark.parametrize(("n", "k", "bias"), [(960, 576, False), (576, 1536, False), (48, 40, True)])
def test_packed_linear_is_as_exact_as_f_linear(rows, n, k, bias):
    """Against the product in fp64: no further off than F.linear (MKL blocks K its own way on the packed
    path, so the two round differently for some shapes; they agree bit for bit on others)."""
    gen = torch.Generator().manual_seed(rows + n)
    lin = _random_linear(n, k, bias, gen)
    x = torch.randn(rows, k, generator=gen)
    packed = ext.packed_gemm_pack(lin.weight.detach())
    with torch.no_grad():
        got = ext.packed_gemm_linear(x, packed, n, lin.bias)
        ours = F.linear(x, lin.weight, lin.bias)
        exact = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    err, f_err = (got.double() - exact).abs().max().item(), (ours.double() - exact).abs().max().item()
    assert err <= 2 * f_err + 1e-7, (err, f_err)
    assert got.shape == (rows, n) and got.dtype == torch.float32


@pytest.mark.parametrize("isa", EACH_ISA)
@pytest.mark.parametrize("threads", [1, 2])
def test_our_gemm_threads_strided_rows_and_empty_calls_agree_with_f_linear(isa, threads):
    """1000 columns are 63 (avx2) or 21 (avx512) panels, enough for two threads to split from one row on
    (a task takes at least 16 tiles) on avx2; K = 12000 takes row blocks of one tile, 13 rows three of
    them (avx2) or two (avx512), and N = 40 is narrower than one panel. 1-70 rows take every tile height
    and prefetch spread (avx512: 1-9 tiles per block, 1-3 prefetched lines per k)."""
    gen = torch.Generator().manual_seed(11)
    nr = NR[isa]
    w, bias = torch.randn(1000, 64, generator=gen), torch.randn(1000, generator=gen)
    packed = ext.gemm_pack(w, isa)
    assert packed.shape == (-(-1000 // nr) * nr * 64,) and packed.dtype == torch.float32
    long_w = torch.randn(40, 12000, generator=gen) / 100
    long_packed = ext.gemm_pack(long_w, isa)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 3, 6, 7, 8, 9, 11, 13, 70):
            x = torch.randn(rows, 64, generator=gen)
            torch.testing.assert_close(ext.gemm_linear(x, packed, 1000, isa), F.linear(x, w), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ext.gemm_linear(x, packed, 1000, isa, bias), F.linear(x, w, bias),
                                       rtol=1e-5, atol=1e-5)
        x = torch.randn(13, 12000, generator=gen)
        torch.testing.assert_close(ext.gemm_linear(x, long_packed, 40, isa), F.linear(x, long_w), rtol=1e-4,
                                   atol=1e-4)
        wide = torch.randn(20, 100, generator=gen)
        x = wide[:, 10:74]  # rows of 64 with a stride of 100, read in place
        torch.testing.assert_close(ext.gemm_linear(x, packed, 1000, isa), F.linear(x, w), rtol=1e-5, atol=1e-5)
        cols = torch.randn(64, 20, generator=gen).t()  # column-major rows: copied first
        torch.testing.assert_close(ext.gemm_linear(cols, packed, 1000, isa), F.linear(cols, w), rtol=1e-5,
                                   atol=1e-5)
        assert ext.gemm_linear(torch.empty(0, 64), packed, 1000, isa).shape == (0, 1000)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", EACH_ISA)
def test_our_gemm_refuses_a_packed_weight_of_another_shape_a_view_or_another_dtype(isa):
    nr = NR[isa]
    packed = ext.gemm_pack(torch.randn(32, 16), isa)
    # whole panels of NR columns: 33 columns take three of 16 (avx2), one of 48 (avx512)
    assert ext.gemm_floats(32, 16, isa) == packed.numel() == -(-32 // nr) * nr * 16
    assert ext.gemm_floats(33, 5, isa) == ext.gemm_pack(torch.randn(33, 5), isa).numel() == -(-33 // nr) * nr * 5
    want = 49152 * 576
    with pytest.raises(RuntimeError, match=f"packed has {packed.numel()} floats, an \\[49152, 576\\] weight packs "
                                           f"to {want} for {isa}"):
        ext.gemm_linear(torch.randn(4, 576), packed, 49152, isa)
    with pytest.raises(RuntimeError, match="not 64-byte aligned"):
        ext.gemm_linear(torch.randn(4, 16), torch.cat([torch.zeros(1), packed])[1:packed.numel() + 1], 32, isa)
    with pytest.raises(RuntimeError, match="2-D fp32"):
        ext.gemm_linear(torch.randn(4, 16, dtype=torch.bfloat16), packed, 32, isa)
    with pytest.raises(RuntimeError, match="2-D fp32"):
        ext.gemm_pack(torch.randn(32, 16, dtype=torch.float64), isa)
    with pytest.raises(RuntimeError, match='isa must be "avx2" or "avx512", got "sse"'):
        ext.gemm_linear(torch.randn(4, 16), packed, 32, "sse")


@pytest.mark.parametrize("isa", EACH_ISA)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_gate_up_weight_packed_interleaved_gives_the_plain_product_and_the_fused_silu_mul_bits(isa, threads):
    """gemm_pack(w, isa, glu=I) interleaves the gate and up panels; gemm_linear on it with glu gives the
    same [M, 2I] bits as the plain packing, and with act gives [M, I] equal, bit for bit, to silu_mul of
    that product (the kernel the unfused MLP runs). I = 2 and 16 panels; rows 1-70 take every tile height
    and row blocks of several tiles; two threads split the panels in gate/up pairs."""
    gen = torch.Generator().manual_seed(5)
    nr = NR[isa]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for inter, k in ((2 * nr, 40), (16 * nr, 96)):
            w = torch.randn(2 * inter, k, generator=gen) / k**0.5
            plain, glu = ext.gemm_pack(w, isa), ext.gemm_pack(w, isa, inter)
            assert glu.shape == plain.shape and not torch.equal(glu, plain)
            for rows in (1, 5, 8, 9, 13, 70):
                x = torch.randn(rows, k, generator=gen) * 3  # gates past +-6: both branches of silu
                product = ext.gemm_linear(x, plain, 2 * inter, isa)
                torch.testing.assert_close(product, F.linear(x, w), rtol=1e-5, atol=1e-5)
                assert torch.equal(ext.gemm_linear(x, glu, 2 * inter, isa, None, inter), product)
                fused = ext.gemm_linear(x, glu, 2 * inter, isa, None, inter, True)
                assert fused.shape == (rows, inter) and torch.equal(fused, ext.silu_mul(product))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", EACH_ISA)
def test_glu_packing_and_calls_refuse_what_does_not_fit(isa):
    nr = NR[isa]
    with pytest.raises(RuntimeError, match=f"glu = I needs a \\[2I, K\\] weight with I a multiple of {nr}"):
        ext.gemm_pack(torch.randn(2 * nr + 2, 8), isa, nr + 1)
    with pytest.raises(RuntimeError, match="glu = I needs"):
        ext.gemm_pack(torch.randn(3 * nr, 8), isa, nr)
    packed = ext.gemm_pack(torch.randn(2 * nr, 8), isa, nr)
    with pytest.raises(RuntimeError, match="act needs a weight packed with glu"):
        ext.gemm_linear(torch.randn(3, 8), packed, 2 * nr, isa, None, 0, True)
    with pytest.raises(RuntimeError, match="no bias with glu"):
        ext.gemm_linear(torch.randn(3, 8), packed, 2 * nr, isa, torch.randn(2 * nr), nr)
    with pytest.raises(RuntimeError, match=f"glu = {nr - 1} does not fit"):
        ext.gemm_linear(torch.randn(3, 8), packed, 2 * nr, isa, None, nr - 1)


@pytest.mark.parametrize("name", EACH_BACKEND)
def test_the_mlp_takes_the_fused_gate_up_where_our_gemm_packed_it(monkeypatch, name):
    """pack_linears packs a "gate_up" linear interleaved for our GEMM only (not with a bias, nor for I off
    the panel width); `linear` on it still gives [gate, up] in order, and `silu_mul_linear` gives
    silu(gate) * up, or None where it does not run (then the caller runs the two steps)."""
    gen = torch.Generator().manual_seed(2)
    nr = 48  # a multiple of both panels' widths
    lin, odd, biased = _random_linear(2 * nr, 24, False, gen), _random_linear(2 * 40, 24, False, gen), \
        _random_linear(2 * nr, 24, True, gen)
    monkeypatch.setattr(cpu_gemm, "backend", name)
    assert cpu_gemm.pack_linears([(lin, "gate_up"), (odd, "gate_up"), (biased, "gate_up")], memory_bytes=1 << 40)
    ours = name in cpu_gemm.OURS
    assert (lin.packed_glu, odd.packed_glu, biased.packed_glu) == ((nr if ours else 0), 0, 0)
    assert lin.packed_rows == cpu_gemm.row_range(name, "decoder", torch.float32)
    x = torch.randn(10, 24, generator=gen)
    torch.testing.assert_close(cpu_gemm.linear(lin, x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
    fused = cpu_gemm.silu_mul_linear(lin, x)
    if ours:
        gate, up = F.linear(x, lin.weight).split(nr, dim=-1)
        torch.testing.assert_close(fused, F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    else:
        assert fused is None
    assert cpu_gemm.silu_mul_linear(odd, x) is None and cpu_gemm.silu_mul_linear(biased, x) is None
    assert cpu_gemm.silu_mul_linear(lin, x.double()) is None  # x that does not take the packed copy


@pytest.mark.skipif(ext is None or AVX512, reason="needs a CPU without AVX-512 (the kernels built)")
def test_avx512_is_refused_where_the_cpu_lacks_it():
    packed = ext.gemm_pack(torch.randn(48, 16), "avx512")  # packing is plain PyTorch: any CPU
    with pytest.raises(RuntimeError, match="this CPU has no AVX-512"):
        ext.gemm_linear(torch.randn(4, 16), packed, 48, "avx512")


def test_auto_takes_our_gemm_for_fp32_with_the_widest_isa_the_cpu_has():
    want = "avx512" if AVX512 else "avx2" if AVX2 else "onednn"
    assert cpu_gemm.resolve("auto", torch.float32) == want
    assert cpu_gemm.resolve("auto", torch.bfloat16) == "onednn"
    for isa in cpu_gemm.OURS:
        assert cpu_gemm.resolve(isa, torch.float32) == (isa if HAS[isa] else "onednn")
        assert cpu_gemm.resolve(isa, torch.bfloat16) == "onednn"
    assert [cpu_gemm.resolve(name, torch.float32) for name in ("onednn", "mkl", None)] == ["onednn", "mkl", None]


def test_one_row_with_a_bias_leaves_the_bias_alone():
    lin = nn.Linear(16, 8)
    bias = lin.bias.detach().clone()
    packed = ext.packed_gemm_pack(lin.weight.detach())
    x = torch.randn(1, 16)
    with torch.no_grad():
        torch.testing.assert_close(ext.packed_gemm_linear(x, packed, 8, lin.bias), lin(x), rtol=0, atol=1e-5)
    assert torch.equal(lin.bias.detach(), bias)


@pytest.mark.parametrize("name", EACH_BACKEND)
def test_a_weight_rebound_or_cast_or_an_x_of_another_width_goes_to_f_linear(name):
    gen = torch.Generator().manual_seed(3)
    lin = nn.Linear(32, 24, bias=False)
    assert cpu_gemm.pack_linears([(lin, "decoder")], memory_bytes=1 << 40, name=name)
    lin.packed_weight = cpu_gemm._pack(name, torch.randn(24, 32, generator=gen))  # a stand-in: shows which path ran
    x = torch.randn(4, 32, generator=gen)
    assert not torch.allclose(cpu_gemm.linear(lin, x), lin(x))
    lin.weight = nn.Parameter(lin.weight.detach().clone())  # re-bound (as load_state_dict(assign=True) does)
    torch.testing.assert_close(cpu_gemm.linear(lin, x), lin(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError):
        cpu_gemm.linear(lin, torch.randn(4, 16))  # F.linear's own shape error, not a silent wrong product


def test_few_rows_and_strided_rows_agree_with_f_linear():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(300, 64, generator=gen)
    packed = ext.packed_gemm_pack(w)
    for rows in (1, 2, 5, 8):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(ext.packed_gemm_linear(x, packed, 300), F.linear(x, w), rtol=0, atol=1e-5)
    wide = torch.randn(20, 100, generator=gen)
    x = wide[:, 10:74]  # rows of 64 with a stride of 100
    torch.testing.assert_close(ext.packed_gemm_linear(x, packed, 300), F.linear(x, w), rtol=0, atol=1e-5)
    assert ext.packed_gemm_linear(torch.empty(0, 64), packed, 300).shape == (0, 300)


def test_a_buffer_of_another_shape_or_dtype_is_refused():
    packed = ext.packed_gemm_pack(torch.randn(32, 16))
    with pytest.raises(RuntimeError, match="too small for an \\[49152, 576\\] weight"):
        ext.packed_gemm_linear(torch.randn(4, 576), packed, 49152)
    with pytest.raises(RuntimeError, match="fp32"):
        ext.packed_gemm_linear(torch.randn(4, 16, dtype=torch.bfloat16), packed, 32)
    with pytest.raises(RuntimeError, match="2-D fp32"):
        ext.packed_gemm_pack(torch.randn(32, 16, dtype=torch.float64))


@pytest.mark.parametrize("name", EACH_BACKEND)
def test_linear_takes_the_packed_copy_only_in_its_row_range(name):
    """The packed copy here is of another weight, so each result shows which path ran."""
    gen = torch.Generator().manual_seed(2)
    lin = nn.Linear(32, 24, bias=False)
    other = torch.randn(24, 32, generator=gen)
    bytes_ = {"onednn": 24 * 32 * 4, "avx2": 32 * 32 * 4, "avx512": 48 * 32 * 4, "mkl": ext.packed_gemm_bytes(24, 32)}[name]
    assert cpu_gemm.pack_linears([(lin, "decoder")], memory_bytes=1 << 40, name=name) == bytes_
    assert lin.packed_rows == cpu_gemm.row_range(name, "decoder", torch.float32)
    lin.packed_weight = cpu_gemm._pack(name, other)
    lin.packed_rows = (2, 8)
    for rows, weight in ((1, lin.weight), (2, other), (8, other), (9, lin.weight)):
        x = torch.randn(rows, 32, generator=gen)
        torch.testing.assert_close(cpu_gemm.linear(lin, x), F.linear(x, weight), rtol=0, atol=1e-5)


def test_row_ranges():
    assert cpu_gemm.row_range("onednn", "decoder", torch.float32) == (2, cpu_gemm.NO_LIMIT)
    assert cpu_gemm.row_range("onednn", "decoder", torch.bfloat16) == (1, cpu_gemm.NO_LIMIT)
    assert cpu_gemm.row_range("onednn", "lm_head", torch.float32) == (1, cpu_gemm.NO_LIMIT)
    for isa in cpu_gemm.OURS:
        assert cpu_gemm.row_range(isa, "decoder", torch.float32) == (1, cpu_gemm.NO_LIMIT)
        assert cpu_gemm.row_range(isa, "lm_head", torch.float32) == (1, cpu_gemm.NO_LIMIT)
    assert cpu_gemm.row_range("mkl", "decoder", torch.float32) == (2, 256 if ext.avx512_available() else 64)
    assert cpu_gemm.row_range("mkl", "lm_head", torch.float32) == (2, cpu_gemm.LM_HEAD_MAX_ROWS)


@pytest.mark.parametrize(("value", "want"), [(None, "auto"), ("1", "auto"), ("Auto", "auto"), ("mkl", "mkl"),
                                             ("ONEDNN", "onednn"), ("avx2", "avx2"), ("AVX512", "avx512"),
                                             ("0", None)])
def test_the_backend_comes_from_the_environment(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("LORAPLEX_PACKED_GEMM", raising=False)
    else:
        monkeypatch.setenv("LORAPLEX_PACKED_GEMM", value)
    assert cpu_gemm.backend_from_env() == want


def test_an_unknown_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("LORAPLEX_PACKED_GEMM", "openblas")
    with pytest.raises(ValueError, match="LORAPLEX_PACKED_GEMM='openblas': expected auto, onednn, avx2, avx512, mkl or 0"):
        cpu_gemm.backend_from_env()


@pytest.mark.parametrize("name", EACH_BACKEND)
def test_nothing_is_packed_without_room(caplog, name):
    lin = nn.Linear(64, 64, bias=False)
    assert cpu_gemm.pack_linears([(lin, "decoder")], memory_bytes=64 * 64 * 4, name=name) == 0
    assert not hasattr(lin, "packed_weight")
    assert f"not weights packed for {name}" in caplog.text and "more than 25% of" in caplog.text


def test_bf16_is_packed_by_onednn_only():
    """MKL refuses bf16; avx2, avx512 and auto hand it to oneDNN, which packs it where the CPU has its bf16
    kernels."""
    half = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    assert cpu_gemm.pack_linears([(half, "decoder")], memory_bytes=1 << 40, name="mkl") == 0
    assert not hasattr(half, "packed_weight")
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert torch.equal(cpu_gemm.linear(half, x), half(x))
    if not cpu_gemm.ONEDNN_BF16:  # an AVX2-only CPU: refused up front, F.linear stays
        for name in ("onednn", "avx2", "avx512", "auto"):  # ours and auto hand bf16 to onednn
            assert cpu_gemm.pack_linears([(half, "decoder")], memory_bytes=1 << 40, name=name) == 0
            assert not hasattr(half, "packed_weight") and not cpu_gemm.takes_packed(half, x)
        assert torch.equal(cpu_gemm.linear(half, x), half(x))
        return
    assert cpu_gemm.pack_linears([(half, "decoder")], memory_bytes=1 << 40, name="avx2") == 64 * 64 * 2
    assert half.packed_backend == "onednn"
    assert cpu_gemm.takes_packed(half, x) and not cpu_gemm.takes_packed(half, x.float())


def test_the_engine_packs_its_base_linears_and_the_switch_turns_it_off(monkeypatch):
    """(Available memory is stood in for: the packed copies of these shapes need 0.5-2 GiB, which a
    small runner may not have free; the refusal itself is tested above.)"""
    from loraplex.engine.llm_engine import LLMEngine

    monkeypatch.setattr("loraplex.engine.llm_engine.available_memory_bytes", lambda: 1 << 40)
    for setting in ("auto", *cpu_gemm.BACKENDS):
        monkeypatch.setattr(cpu_gemm, "backend", setting)
        name = cpu_gemm.resolve(setting, torch.float32)
        engine = LLMEngine("smollm2-135m-shapes", load_format="dummy", dtype="float32", max_loras=1)
        layer = engine.model.layers[0]
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert lin.packed_backend == name and lin.packed_rows == cpu_gemm.row_range(name, "decoder", torch.float32)
            # only the gate/up projection is packed for the fused SiLU x up, and only by our GEMM
            glu = layer.mlp.inter if lin is layer.mlp.gate_up_proj and name in cpu_gemm.OURS else 0
            assert lin.packed_glu == glu
        assert engine.model.lm_head.packed_rows == cpu_gemm.row_range(name, "lm_head", torch.float32)
    monkeypatch.setattr(cpu_gemm, "backend", None)
    off = LLMEngine("smollm2-135m-shapes", load_format="dummy", dtype="float32", max_loras=1)
    assert not hasattr(off.model.layers[0].self_attn.qkv_proj, "packed_weight")


def test_linear_unpacked_is_onednn_for_fp32_and_f_linear_otherwise(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "backend", "onednn")
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(16, 96, generator=gen), torch.randn(40, 96, generator=gen)
    exact = x.double() @ w.double().T
    got = cpu_gemm.linear_unpacked(x, w)
    assert got.shape == (16, 40) and (got.double() - exact).abs().max().item() < 1e-4
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(cpu_gemm.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a),
                        raising=False)
    cpu_gemm.linear_unpacked(x, w)
    assert calls == [1]
    wide = torch.randn(40, 200, generator=gen)[:, :96]  # a strided weight: F.linear
    assert torch.equal(cpu_gemm.linear_unpacked(x, wide), F.linear(x, wide))
    assert torch.equal(cpu_gemm.linear_unpacked(x.bfloat16(), w.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))
    assert cpu_gemm.linear_unpacked(x[:0], w).shape == (0, 40)
    monkeypatch.setattr(cpu_gemm, "backend", "mkl")
    assert torch.equal(cpu_gemm.linear_unpacked(x, w), F.linear(x, w))
    assert calls == [1]


def test_onednn_calls_are_padded_to_row_buckets(monkeypatch):
    """Every M goes to oneDNN as one of a bounded set of sizes (its primitives are per shape); the
    padding rows never reach the result."""
    sizes = {cpu_gemm.bucket_rows(m) for m in range(1, 513)}
    assert len(sizes) == 56 and all(m <= cpu_gemm.bucket_rows(m) <= m * 1.125 for m in range(1, 2049))
    assert [cpu_gemm.bucket_rows(m) for m in (16, 17, 33, 64, 65, 100, 511, 512)] == [16, 18, 36, 64, 72, 104, 512, 512]
    seen = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(cpu_gemm.torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: seen.append(x.shape[0]) or real(x, *a),
                        raising=False)
    gen = torch.Generator().manual_seed(7)
    lin = nn.Linear(48, 40)
    assert cpu_gemm.pack_linears([(lin, "decoder")], memory_bytes=1 << 40, name="onednn")
    x = torch.randn(65, 48, generator=gen)
    with torch.no_grad():
        got = cpu_gemm.linear(lin, x)
        torch.testing.assert_close(got, lin(x), rtol=0, atol=1e-5)
    assert seen == [72] and got.shape == (65, 40)


@pytest.mark.parametrize("isa", EACH_ISA)
def test_a_failing_fused_gate_up_call_drops_the_packed_copy_as_linear_does(monkeypatch, caplog, isa):
    gen = torch.Generator().manual_seed(3)
    lin = _random_linear(2 * 48, 16, False, gen)
    assert cpu_gemm.pack_linears([(lin, "gate_up")], memory_bytes=1 << 40, name=isa) and lin.packed_glu == 48

    class Broken:
        def __getattr__(self, name):
            return getattr(ext, name)

        def gemm_linear(self, *args):
            raise RuntimeError("no kernel")

    monkeypatch.setattr(cpu_gemm.cpu_ext, "load", Broken)
    x = torch.randn(4, 16, generator=gen)
    with caplog.at_level("WARNING", logger="loraplex.kernels.cpu_gemm"):
        assert cpu_gemm.silu_mul_linear(lin, x) is None
        assert cpu_gemm.silu_mul_linear(lin, x) is None  # no second try, no second warning
    assert not cpu_gemm.takes_packed(lin, x) and lin.packed_weight is None
    assert [r.getMessage() for r in caplog.records] == [
        f"a {isa} call on 4 rows failed (no kernel); this linear uses F.linear from now on"]


def test_a_failing_packed_call_falls_back_to_f_linear_for_good(monkeypatch, caplog):
    lin = nn.Linear(32, 24)
    assert cpu_gemm.pack_linears([(lin, "decoder")], memory_bytes=1 << 40, name="onednn")

    def broken(*args):
        raise RuntimeError("could not create a primitive")

    monkeypatch.setattr(cpu_gemm, "_onednn_call", broken)
    x = torch.randn(4, 32)
    with torch.no_grad(), caplog.at_level("WARNING", logger="loraplex.kernels.cpu_gemm"):
        assert torch.equal(cpu_gemm.linear(lin, x), lin(x))
        assert torch.equal(cpu_gemm.linear(lin, x), lin(x))  # no second try, no second warning
    assert not cpu_gemm.takes_packed(lin, x) and lin.packed_weight is None
    assert [r.getMessage() for r in caplog.records] == [
        "a onednn call on 4 rows failed (could not create a primitive); this linear uses F.linear from now on"]


@pytest.mark.parametrize("name", EACH_BACKEND)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_columns_gives_those_columns_of_the_whole_product_bit_for_bit(monkeypatch, name, bias):
    """`linear_columns`: columns [start, stop) of `linear` from the slice of our packed panels that holds
    them, the same bits, on a panel's edge or not (the model's last layer takes the q columns of its
    sampled rows and the k/v columns of every row so); None for an empty or out-of-range span, an x that
    does not take the packed copy (another dtype), a gate/up weight packed for the epilogue, or where
    our GEMM did not pack the weight."""
    gen = torch.Generator().manual_seed(5)
    monkeypatch.setattr(cpu_gemm, "backend", name)
    lin = _random_linear(960 + 20, 576, bias, gen)  # N off the panel width: a padded last panel
    glu = _random_linear(2 * 48, 576, False, gen)
    assert cpu_gemm.pack_linears([(lin, "decoder"), (glu, "gate_up")], memory_bytes=1 << 40)
    x = torch.randn(37, 576, generator=gen)
    whole = cpu_gemm.linear(lin, x)
    if name not in cpu_gemm.OURS:
        assert cpu_gemm.linear_columns(lin, x, 0, 576) is None
        return
    nr = NR[name]
    spans = [(0, 576), (576, 980), (nr, 3 * nr), (0, 980), (1, 576), (0, nr + 1), (nr - 1, nr + 1), (900, 979),
             (5, 6)]
    for start, stop in spans:
        cols = cpu_gemm.linear_columns(lin, x, start, stop)
        assert cols.shape == (37, stop - start) and torch.equal(cols, whole[:, start:stop]), (start, stop)
    for start, stop in [(576, 576), (0, 981), (-1, 5)]:
        assert cpu_gemm.linear_columns(lin, x, start, stop) is None, (start, stop)
    assert cpu_gemm.linear_columns(lin, x.double(), 0, 576) is None
    assert glu.packed_glu == 48 and cpu_gemm.linear_columns(glu, x, 0, 48) is None
